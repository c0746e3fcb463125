"""The README's and docs/'s Python examples run as written, and their links lead somewhere.

An example whose first line is a comment starting `# GPU` needs CUDA: it carries the `gpu`
marker (it skips without CUDA, like every GPU test), and runs on the host too with its device
and dtype swapped (`on_the_host`), so its logic is checked on every machine."""
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


def _is_gpu(code: str) -> bool:
    return code.startswith("# GPU")


def on_the_host(code: str) -> str:
    """A GPU example moved to the host: CUDA becomes the CPU, float16 float32 (the host
    backend and PyTorch's CPU kernels; flash-attn is not installed there, so its fallback runs)."""
    host = code.replace('device="cuda"', 'device="cpu"').replace('dtype="float16"', 'dtype="float32"')
    host = host.replace("torch.float16", "torch.float32")
    assert "cuda" not in host.replace("# GPU", ""), "a CUDA name this swap does not know"
    return host


def _run(page: Path, code: str) -> None:
    import vattn

    try:
        exec(compile(code, str(page), "exec"), {"__name__": "readme"})
    finally:
        vattn.close()


@pytest.mark.parametrize("page,code", [
    pytest.param(p, c, id=f"{_name(p)}:{i}", marks=[pytest.mark.gpu] if _is_gpu(c) else [])
    for i, (p, c) in enumerate(BLOCKS)])
def test_readme_example_runs(page, code, capsys):
    _run(page, code)
    assert capsys.readouterr().out.strip()  # each example prints what it shows


@pytest.mark.parametrize("page,code", [pytest.param(p, c, id=f"{_name(p)}:{i}") for i, (p, c) in enumerate(BLOCKS)
                                       if _is_gpu(c)])
def test_gpu_example_runs_on_the_host(page, code, capsys):
    _run(page, on_the_host(code))
    assert capsys.readouterr().out.strip()


def test_readme_has_examples():
    """The slot API on the host and on a GPU with its kernel, and the engine."""
    readme = [code for page, code in BLOCKS if page == README]
    assert len(readme) >= 3 and any(_is_gpu(c) for c in readme) and not _is_gpu(readme[0])
    gpu = next(c for c in readme if _is_gpu(c))
    assert 'device="cuda"' in gpu and "flash_attn_with_kvcache(" in gpu and "scaled_dot_product_attention" in gpu


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
