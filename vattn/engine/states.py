"""Recurrent-state layers on vattn memory: Mamba2 (Bamba, Falcon-H1, Mamba2) and gated
delta-net (Qwen3-Next) layers keep a fixed-size state per request, not K/V. The states are
a layer kind of the cache's allocator (`KVCache(state_bytes=...)`: a row of whole pages per
slot, mapped at its first step, moved with the slot by fork and swap, snapshots at prefix
blocks' ends in rows after the slots'); this module is what touches the model:

```
 the cache's state rows [max_batch_size + num_snapshots, row_bytes] (`KVCache.state_rows`)
 |<- row s: conv l0 | ssm l0 | conv l2 | ssm l2 | pad ->|   slot s's states; a snapshot row alike
```
`state_specs` finds the state layers' tensors (shapes and dtypes as transformers' own
`DynamicCache` keeps them, by one short forward), `StateViews` carves per-layer views
`[rows, *shape]` out of the rows, and `install` makes each state module (the mixer) run on
its slots' views through `_SlotCache`, a stand-in for the few `Cache` calls the mixers make:
the batch's decodes in one call on their states gathered by slot, every other request (a
prompt or a chunk of one) alone on its slot's views.

Prefix caching (`vattn.prefix_cache.PrefixCache`, the state kind's part of a block): the step
that plans an iteration gives the boundaries the prefix cache wants a snapshot row each
(`KVCache.snapshots.planned`); a request's run of a state layer is split at those boundaries
(the attention layers run the chunk whole) and each layer copies its states into the row
there, so a snapshot is exact at a block boundary whatever the chunking.
"""
from __future__ import annotations

import functools
import inspect
import math
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from vattn.attention import get_forward_context
from vattn.engine.loader import cache_keyword

_ALIGN = 64  # bytes: every state view starts aligned
# snapshot rows of recurrent states a prefix cache may keep, per slot (memory only under the
# snapshots kept; see vattn.prefix_cache.PrefixCache)
SNAPSHOTS_PER_SLOT = 2


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of one layer, for a batch of one."""

    layer: int
    kind: str  # "conv" | "recurrent"
    index: int  # transformers' state_idx
    shape: tuple[int, ...]  # without the batch dimension
    dtype: torch.dtype
    offset: int  # bytes into the slot's row

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def state_specs(model: Any) -> list[StateSpec]:
    """The states transformers' `DynamicCache` keeps for `model`, read after one 3-token
    forward (with the model's own attention) of a batch of one."""
    from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]], device=device), use_cache=True,
              **{cache_keyword(model.forward): cache})
    specs: list[StateSpec] = []
    offset = 0
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        for kind, states in (("conv", layer.conv_states), ("recurrent", layer.recurrent_states)):
            for j, t in states.items():
                if t is None:
                    continue
                spec = StateSpec(i, kind, j, tuple(t.shape[1:]), t.dtype, offset)
                specs.append(spec)
                offset += -(-spec.nbytes // _ALIGN) * _ALIGN
    if not specs:  # the engine would run the state layers without their states: other tokens than generate's
        import transformers

        from vattn.errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"vattn found no recurrent state of {type(model).__name__} in transformers {transformers.__version__}'s "
            "cache after a forward, so it cannot keep them; run it with transformers' generate")
    return specs


def state_bytes(specs: list[StateSpec]) -> int:
    """Bytes of one slot's states (the cache's `state_bytes`); 0 without state layers."""
    return max((s.offset + s.nbytes for s in specs), default=0)


class StateViews:
    """The state layers' tensors in the cache's state rows: per (kind, layer, index) a view
    `[rows, *shape]` (row s: slot s; the snapshot rows after the slots'), and the copies of a
    layer's states into a snapshot row."""

    def __init__(self, cache: Any, specs: list[StateSpec]) -> None:
        self.cache = cache
        raw = cache.state_rows()  # [rows, row_bytes] uint8
        self.raw = raw
        self.views: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, layer, index) -> [rows, *shape]
        for s in specs:
            flat = raw[:, s.offset:s.offset + s.nbytes].view(s.dtype)  # [rows, elems]
            self.views[(s.kind, s.layer, s.index)] = flat.unflatten(1, s.shape)
        self._layer_bytes: dict[int, list[tuple[int, int]]] = {}  # layer -> (offset, nbytes) of its states
        for s in specs:
            self._layer_bytes.setdefault(s.layer, []).append((s.offset, s.nbytes))
        self._planned: tuple[Any, dict[int, dict[int, int]]] = (None, {})

    def planned(self, meta: Any) -> dict[int, dict[int, int]]:
        """{slot: {boundary: snapshot row}} of the iteration `meta` describes (read once per forward)."""
        if self._planned[0] is not meta:
            self._planned = (meta, self.cache.snapshots.planned())
        return self._planned[1]

    def snapshot_layer(self, slot: int, layer: int, row: int) -> None:
        """Copy `layer`'s states of `slot` into snapshot `row` (the state has just reached
        the row's boundary)."""
        raw = self.raw
        for off, n in self._layer_bytes[layer]:
            raw[row, off:off + n].copy_(raw[slot, off:off + n])

    def view(self, kind: str, layer: int, index: int, slot: int) -> torch.Tensor:
        """`[1, *shape]`: slot's state, a view into its row (written in place)."""
        return self.views[(kind, layer, index)][slot:slot + 1]


def bind(model: Any, cache: Any, specs: list[StateSpec]) -> Callable[[], None]:
    """Run `model`'s state layers on `cache`'s state rows (`install`); returns the function
    that undoes it (nothing to undo without state layers)."""
    if not specs:
        return lambda: None
    from vattn.integrations.hf import state_mixers

    return install(state_mixers(model), StateViews(cache, specs))


class _SlotCache:
    """The `Cache` calls a mixer makes, for one request: its slot's views. `fresh`: the
    request has no tokens yet, so there is no previous state (transformers' None)."""

    def __init__(self, states: StateViews, slot: int, fresh: bool) -> None:
        self.states, self.slot, self.fresh = states, slot, fresh

    def _kept(self, kind: str, layer_idx: int, state_idx: int) -> torch.Tensor:
        return self.states.view(kind, layer_idx, state_idx, self.slot)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self._kept("conv", layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self._kept("recurrent", layer_idx, state_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    # transformers 5.17-5.2x's mixers ask `cache_params.has_previous_state(i)` and read
    # `cache_params.layers[i].conv_states[j]`, `.recurrent_states[j]`, `.record_past`
    def has_previous_state(self, layer_idx: int | None = None) -> bool:
        return not self.fresh

    @property
    def layers(self) -> _Layers:
        return _Layers(self)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                          **kwargs: Any) -> torch.Tensor:
        """conv_states `[B, C, T]`: keeps the last K columns (transformers' LinearAttentionLayer
        rule) and returns what the causal convolution must see."""
        kept = self._kept("conv", layer_idx, state_idx)  # [B, C, K]
        k = kept.shape[-1]
        if self.fresh:
            full = conv_states
            if full.shape[-1] < k:
                full = torch.nn.functional.pad(full, (k - full.shape[-1], 0), value=0)
        else:
            full = torch.cat([kept, conv_states.to(kept.dtype)], dim=-1)
        kept.copy_(full[..., -k:])
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs: Any) -> torch.Tensor:
        kept = self._kept("recurrent", layer_idx, state_idx)
        kept.copy_(recurrent_states)
        return kept


class _Layers:
    """`cache_params.layers[i]` of the older cache API: layer i's state views of a `_SlotCache`."""

    def __init__(self, cache: _SlotCache) -> None:
        self.cache = cache

    def __getitem__(self, layer_idx: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(conv_states=_States(self.cache, "conv", layer_idx),
                                     recurrent_states=_States(self.cache, "recurrent", layer_idx), record_past=False)


class _States:
    """`conv_states[j]` / `recurrent_states[j]` of one layer: the kept views."""

    def __init__(self, cache: _SlotCache, kind: str, layer_idx: int) -> None:
        self.cache, self.kind, self.layer_idx = cache, kind, layer_idx

    def __getitem__(self, state_idx: int) -> torch.Tensor:
        return self.cache._kept(self.kind, self.layer_idx, state_idx)


def cache_argument(module: torch.nn.Module) -> str:
    """The name a state module's forward takes its cache by: `cache` (transformers 5.24) or
    `cache_params` (5.17-5.23); a cache passed by the other name would be ignored, and every
    decode would run without its state."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params or "cache_params" not in params else "cache_params"


def install(modules: list[torch.nn.Module], states: StateViews) -> Callable[[], None]:
    """Make each state module run on its slots' states: the batch's decodes (one token on a
    state) in one call on their states gathered by slot, every other request (a prompt or a
    chunk of one) alone on its slot's views; the packed batch is split by the forward
    context's metadata. Returns the function that undoes it."""
    for module in modules:
        original, arg = module.forward, cache_argument(module)

        def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, _original: Any = original,
                    _arg: str = arg, **kwargs: Any) -> torch.Tensor:
            meta = get_forward_context().metadata
            for name in ("cache", "cache_params", "position_ids", "attention_mask"):
                kwargs.pop(name, None)
            run = functools.partial(_call_with_cache, _original, _arg, attention_mask=None, **kwargs)
            return _run_packed(run, self.layer_idx, states, hidden_states, meta)

        module.forward = types.MethodType(forward, module)

    def uninstall() -> None:
        for m in modules:
            m.__dict__.pop("forward", None)

    return uninstall


def _call_with_cache(original: Callable[..., torch.Tensor], arg: str, hidden_states: torch.Tensor, *,
                     cache: _SlotCache, **kwargs: Any) -> torch.Tensor:
    return original(hidden_states, **{arg: cache}, **kwargs)


def _run_packed(run: Callable[..., torch.Tensor], layer: int, states: StateViews, hidden_states: torch.Tensor,
                meta: Any) -> torch.Tensor:
    """hidden_states `[1, T, H]` packed as `meta` says -> the mixer's output `[1, T, H]`."""
    cu = meta.cu_query_lens
    planned = states.planned(meta)  # slot -> {boundary: snapshot row}: run alone, split there
    decodes = [i for i, (slot, start, n) in enumerate(zip(meta.slots, meta.starts, meta.query_lens))
               if n == 1 and start > 0 and slot not in planned]
    pieces: list[torch.Tensor | None] = [None] * len(meta.slots)
    if len(decodes) > 1:
        rows = torch.tensor([cu[i] for i in decodes], device=hidden_states.device)
        slots = torch.tensor([meta.slots[i] for i in decodes], device=hidden_states.device)
        cache = _GatheredCache(states, layer, slots)
        out = run(hidden_states[0, rows].unsqueeze(1), cache=cache)  # [B, 1, H]
        cache.scatter()
        for k, i in enumerate(decodes):
            pieces[i] = out[k:k + 1]
    for i, (slot, start) in enumerate(zip(meta.slots, meta.starts)):
        if pieces[i] is not None:
            continue
        snaps = planned.get(slot)
        if not snaps:
            pieces[i] = run(hidden_states[:, cu[i]:cu[i + 1]], cache=_SlotCache(states, slot, start == 0))
            continue
        outs, done = [], start  # the request's run, split at the boundaries it snapshots
        for end in [*sorted(snaps), start + cu[i + 1] - cu[i]]:
            if end > done:
                rows = slice(cu[i] + done - start, cu[i] + end - start)
                outs.append(run(hidden_states[:, rows], cache=_SlotCache(states, slot, done == 0)))
                done = end
            if end in snaps:
                states.snapshot_layer(slot, layer, snaps[end])
        pieces[i] = torch.cat(outs, dim=1)
    return torch.cat(pieces, dim=1)  # [1, T, H]


class _GatheredCache(_SlotCache):
    """The `Cache` calls of a batch of decodes: their slots' states of one layer, gathered
    (`[B, *shape]` copies: the mixers update them in place), written back by `scatter`."""

    def __init__(self, states: StateViews, layer: int, slots: torch.Tensor) -> None:
        super().__init__(states, -1, False)
        self.slots = slots
        self.gathered = {key: t[slots] for key, t in states.views.items() if key[1] == layer}

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.gathered[("conv", layer_idx, state_idx)]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.gathered[("recurrent", layer_idx, state_idx)]

    def _kept(self, kind: str, layer_idx: int, state_idx: int) -> torch.Tensor:
        return self.gathered[(kind, layer_idx, state_idx)]

    def scatter(self) -> None:
        for key, t in self.gathered.items():
            self.states.views[key][self.slots] = t
