"""Public names of a package loaded on first use (PEP 562 module `__getattr__`).

`vattn` and `vattn.engine` export classes whose modules import torch, transformers and the
engine; importing the package itself (to reach `vattn._C`, the torch-free books or the
scheduler) must not. Each package names where its exports live; the first
`vattn.LLM` (or `from vattn import LLM`) imports that module and keeps the value.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Any, Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The `__getattr__` and `__dir__` of `package`, whose names in `exports` (name -> the
    module that defines it) are imported on first use. Any other attribute that names a
    submodule (`vattn.engine`, `vattn.vmem`) is imported too, as an eager package root made
    them reachable after a bare `import vattn`."""
    module = sys.modules[package]

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif _is_submodule(package, name):
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(module, name, value)  # later reads are plain attribute reads
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(exports))

    return __getattr__, __dir__


def _is_submodule(package: str, name: str) -> bool:
    # dunders are probes (copy, pickle, inspect): answered without a look at the disk
    return name.isidentifier() and not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None
