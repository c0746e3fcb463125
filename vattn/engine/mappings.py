"""Model mappings: for each layer kind whose layers need more than vattn's attention hook
(multi-head latent attention: another cache layout and attention over what the cache
returns), the module that maps a transformers model onto it. A registered spec type names it
(`mapping`, `vattn.allocator.registry.mapping_modules`); `check_model` and the model runner
iterate them and name no kind. A mapping module has:

```
LABEL                              what its layers are, in messages ("latent attention")
find(model) -> list                its layers' modules in `model` (empty: the model has none)
problem(model, engine) -> str|None why they cannot run (`engine`: vattn's engine on one rank)
layer_kinds(model, found, windows) the per-layer entries of `CacheConfig.layer_windows` (by the
                                   model's layer index) with its layers' kind in them
install(found) -> undo             runs its layers on the current forward's cache views
```
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Protocol, cast

from vattn.allocator.registry import mapping_modules


class ModelMapping(Protocol):
    """What a model mapping module has (the table above)."""

    LABEL: str

    def find(self, model: Any) -> list[Any]: ...

    def problem(self, model: Any, engine: bool) -> str | None: ...

    def layer_kinds(self, model: Any, found: list[Any], windows: tuple[Any, ...]) -> tuple[Any, ...]: ...

    def install(self, found: list[Any]) -> Callable[[], None]: ...


def model_mappings() -> list[ModelMapping]:
    """The model mapping modules of the registered layer kinds (imported on first use: they
    import torch and transformers' pieces)."""
    return [cast(ModelMapping, importlib.import_module(name)) for name in mapping_modules()]


__all__ = ["ModelMapping", "model_mappings"]
