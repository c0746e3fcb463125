"""The layers, checked by running the imports in a fresh interpreter that refuses the layers above.

- The books (`vattn.allocator`, every module under it and every vattn module it imports) and
  the scheduler (`vattn.engine.scheduler`, `vattn.engine.sequence`) are plain Python: they
  import with torch, transformers and the integrations refused, the books also without the engine.
- `import vattn` is light: the public names are listed but load on first use; `vattn.report`
  (tables, percentiles) is as light.
- `vattn._C` and the vmem backends load without the engine, the cache and the pool.
The books are discovered (what importing them loads), not listed, so a split of the allocator
into several modules is checked without editing this file.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import vattn
from tests.conftest import REPO


# Run first in the child: an import hook that refuses the packages named in argv[1] (and their
# submodules) with an error naming the import, and `load(name)`, which imports a module and,
# when it is a package, every module under it.
_PRELUDE = """
import importlib, importlib.abc, json, pkgutil, sys

BLOCKED = tuple(sys.argv[1].split(","))

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{name} is refused here: this layer must not import it")
        return None

sys.meta_path.insert(0, Refuse())

def load(name):
    module = importlib.import_module(name)
    for info in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
        importlib.import_module(info.name)

def vattn_modules():
    return {k: getattr(m, "__file__", None) for k, m in sys.modules.items() if k == "vattn" or k.startswith("vattn.")}
"""

ABOVE_THE_BOOKS = ["torch", "transformers", "vattn.engine", "vattn.integrations"]
ABOVE_THE_SCHEDULER = ["torch", "transformers", "vattn.integrations"]


def _run(blocked: list[str], body: str) -> dict:
    """Run `body` after the prelude in a fresh interpreter with `blocked` refused; it prints one
    JSON object, returned here."""
    p = subprocess.run([sys.executable, "-c", _PRELUDE + body, ",".join(blocked)], capture_output=True,
                       text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


def _loaded_by(modules: list[str], blocked: list[str]) -> dict[str, str | None]:
    """The vattn modules (name -> file) that importing `modules` loads, with `blocked` refused."""
    body = "".join(f"load({m!r})\n" for m in modules) + "print(json.dumps(vattn_modules()))\n"
    return _run(blocked, body)


def test_books_import_without_torch_or_the_engine():
    loaded = _loaded_by(["vattn.allocator"], ABOVE_THE_BOOKS)
    assert "vattn.allocator" in loaded
    assert not [m for m in loaded if m.startswith(("vattn.engine", "vattn.integrations"))]


def test_scheduler_imports_without_torch():
    loaded = _loaded_by(["vattn.engine.scheduler", "vattn.engine.sequence"], ABOVE_THE_SCHEDULER)
    assert {"vattn.engine.scheduler", "vattn.engine.sequence"} <= set(loaded)
    assert "vattn.engine.llm" not in loaded and "vattn.engine.model_runner" not in loaded


@pytest.mark.parametrize("modules,blocked", [
    (["vattn.allocator"], ABOVE_THE_BOOKS),
    (["vattn.pool.books"], ABOVE_THE_BOOKS),  # the elastic pool's books, on the same page layer
    (["vattn.engine.scheduler", "vattn.engine.sequence"], ABOVE_THE_SCHEDULER),
], ids=["books", "pool-books", "scheduler"])
def test_plain_modules_import_no_torch_anywhere(modules, blocked):
    """What running the imports cannot see: an `import torch` inside a function of a plain
    module (it would run at call time). Every module the import loaded is read."""
    for name, file in _loaded_by(modules, blocked).items():
        if file is None or not file.endswith(".py"):
            continue
        tree = ast.parse(Path(file).read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        assert not {n for n in names if n.split(".")[0] == "torch"}, f"{name} ({file}) imports torch"


def test_import_vattn_is_light():
    """`import vattn` loads none of the modules behind its public names; `dir(vattn)` lists them
    without loading them; the errors are there at once; the tables (vattn.report) need nothing more."""
    got = _run(ABOVE_THE_BOOKS, """
import vattn, vattn.errors, vattn.report
before = set(vattn_modules())
listed = dir(vattn)
print(json.dumps(dict(before=sorted(before), after=sorted(vattn_modules()), listed=listed, all=vattn.__all__,
                      exports=sorted(set(vattn._EXPORTS.values())), errors=vattn.VattnError is vattn.errors.VattnError)))
""")
    assert got["before"] == got["after"], "dir(vattn) imported modules"
    assert set(got["all"]) <= set(got["listed"])
    assert not set(got["exports"]) & set(got["before"]), "import vattn loaded a lazy export's module"
    assert got["errors"]


def test_backends_load_without_the_engine():
    """vattn._C and every vmem backend module import without the engine, the cache or the pool."""
    loaded = _loaded_by(["vattn._C", "vattn.vmem"], ["vattn.engine", "vattn.integrations", "vattn.cache",
                                                     "vattn.pool"])
    assert {"vattn._C", "vattn.vmem.host", "vattn.vmem.cuda"} <= set(loaded)


def test_public_names_resolve():
    """Each name of `__all__` is importable from the root and is the object its module defines;
    the same for `vattn.engine`."""
    import vattn.engine

    for package in (vattn, vattn.engine):
        assert set(package.__all__) <= set(dir(package))
        for name in package.__all__:
            value = getattr(package, name)
            home = package._EXPORTS.get(name) if hasattr(package, "_EXPORTS") else None
            if home is not None:
                assert value is getattr(sys.modules[home], name)
    exec(f"from vattn import {', '.join(vattn.__all__)}", {})
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        vattn.no_such_name  # noqa: B018
    assert vattn.vmem.make_backend is sys.modules["vattn.vmem"].make_backend  # submodules stay reachable
