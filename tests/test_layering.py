"""The books are plain Python: the allocator and the scheduler import no torch."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "vattn"


@pytest.mark.parametrize("module", ["allocator.py", "engine/scheduler.py", "engine/sequence.py"])
def test_books_import_no_torch(module):
    tree = ast.parse((ROOT / module).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    runtime = {n for n in names if n.split(".")[0] == "torch"}
    assert not runtime, f"{module} imports {runtime}"
    # vattn modules it imports at run time must be torch-free too (type-only imports aside)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vattn"):
            assert node.module in ("vattn.errors", "vattn.checks", "vattn.engine.sequence",
                                   "vattn.engine.sampling_params"), node.module
