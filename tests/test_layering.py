"""The books are plain Python: the allocator, the page layer and the scheduler import no torch."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "vattn"


BOOKS = ["allocator/__init__.py", "allocator/books.py", "allocator/core.py", "allocator/mapper.py",
         "allocator/plan.py", "allocator/premap.py", "allocator/sharing.py", "allocator/swap.py", "pages.py",
         "block_books.py", "engine/scheduler.py", "engine/sequence.py"]
# vattn modules the books may import at run time: the books themselves (checked here) and these
TORCH_FREE = {"vattn." + m.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for m in BOOKS} | {
    "vattn.errors", "vattn.checks", "vattn.engine.sampling_params"}


@pytest.mark.parametrize("module", BOOKS)
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
            assert node.module in TORCH_FREE, node.module
