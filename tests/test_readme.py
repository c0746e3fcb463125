"""The README's Python examples run as written."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code, capsys):
    import vattn

    try:
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    finally:
        vattn.close()
    assert capsys.readouterr().out.strip()  # each example prints what it shows


def test_readme_has_examples():
    assert len(BLOCKS) >= 2
