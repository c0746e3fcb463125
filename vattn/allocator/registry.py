"""Which manager runs each kind of spec (vLLM v1's `spec_manager_map`): a new layer kind is
its spec and manager classes and one line here. A spec type that names a `mapping` (a
module's name: `LatentSpec.mapping`) has a model mapping that finds its layers in a model and
runs them on the cache (`vattn.engine.mappings`). Plain Python."""
from __future__ import annotations

from vattn.allocator.kinds import (
    ChunkedLocal, ChunkSpec, FullAttention, KindManager, KindSpec, SlidingWindow, WindowSpec)
from vattn.allocator.latent import LatentSpec
from vattn.allocator.states import RecurrentState, StateSpec

MANAGERS: dict[type[KindSpec], type[KindManager]] = {
    KindSpec: FullAttention,
    WindowSpec: SlidingWindow,
    ChunkSpec: ChunkedLocal,
    StateSpec: RecurrentState,
    LatentSpec: FullAttention,  # (its layout differs: K and V of other widths, `Latent.kv_widths`)
}


def mapping_modules() -> list[str]:
    """The modules of the model mappings the registered spec types name (`mapping`), in
    `MANAGERS`' order: what `vattn.engine.mappings.model_mappings` imports."""
    return [m for m in (getattr(spec, "mapping", None) for spec in MANAGERS) if m]


def manager_for(spec: KindSpec) -> type[KindManager]:
    """The manager class of `spec`'s kind (ValueError for a spec no manager runs)."""
    cls = MANAGERS.get(type(spec))
    if cls is None:
        raise ValueError(f"no layer kind manager runs a {type(spec).__name__}: add one to "
                         "vattn.allocator.registry.MANAGERS")
    return cls


__all__ = ["MANAGERS", "manager_for", "mapping_modules"]
