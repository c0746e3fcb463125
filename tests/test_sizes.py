"""Size bounds of the code (issue 39): no module of `vattn/` over 600 lines, no class over
400, no function over 60 (decorators excluded, nested functions and classes counted in the
one that holds them). A module, class or function that outgrows them holds more than one
job: split it by job (a part the class owns, composition over mixins; a named helper; an
APIRouter per concern) rather than raise the bound."""
from __future__ import annotations

import ast
from pathlib import Path

import vattn

MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60
ROOT = Path(vattn.__file__).parent


def _modules() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT.parent))


def test_the_walk_sees_the_package():
    names = {_name(p) for p in _modules()}
    assert {"vattn/__init__.py", "vattn/pool/books.py", "vattn/cache.py"} <= names


def test_no_module_over_the_bound():
    over = []
    for path in _modules():
        n = len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES:
            over.append(f"{_name(path)}: {n} lines")
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by job): " + "; ".join(over)


def test_no_class_over_the_bound():
    over = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1  # decorators excluded
                if n > MAX_CLASS_LINES:
                    over.append(f"{_name(path)}:{node.lineno} {node.name}: {n} lines")
    assert not over, (f"classes over {MAX_CLASS_LINES} lines (give a job to a part the class owns): "
                      + "; ".join(over))


def test_no_function_over_the_bound():
    over = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # decorators excluded
                if n > MAX_FUNCTION_LINES:
                    over.append(f"{_name(path)}:{node.lineno} {node.name}: {n} lines")
    assert not over, (f"functions over {MAX_FUNCTION_LINES} lines (extract named helpers by job): "
                      + "; ".join(over))
