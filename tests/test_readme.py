"""The README's and docs/'s Python examples run as written, and their links lead somewhere."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
PAGES = [*DOCS, REPO / "patches" / "README.md"]  # every page whose links are checked
BLOCKS = [(page, code) for page in DOCS for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)]


def _name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


@pytest.mark.parametrize("page,code", BLOCKS, ids=[f"{_name(p)}:{i}" for i, (p, _) in enumerate(BLOCKS)])
def test_readme_example_runs(page, code, capsys):
    import vattn

    try:
        exec(compile(code, str(page), "exec"), {"__name__": "readme"})
    finally:
        vattn.close()
    assert capsys.readouterr().out.strip()  # each example prints what it shows


def test_readme_has_examples():
    assert sum(page == README for page, _ in BLOCKS) >= 2


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings inside code
    return {_anchor(m) for m in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_doc_links_resolve(page):
    """Every relative link (and its #anchor) names a file of the repository and a heading in it."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {_name(dest)}")
    assert not broken, f"{_name(page)} has broken links: {broken}"


def test_headline_figures_match_the_gpu_page():
    """The README's figures table is the H100 run's (docs/gpu.md): one table, two places."""
    def table(page: Path) -> list[str]:
        lines = page.read_text().splitlines()
        start = lines.index(next(line for line in lines if line.startswith("| figure | host (CI) | H100 |")))
        end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
        return lines[start:end]

    assert table(README) == table(REPO / "docs" / "gpu.md")


def test_readme_commands_are_ci():
    """`.ci/run` runs exactly the README's test command."""
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"```bash\n{ci}\n```" in README.read_text()
