"""Recurrent states in vattn memory: Mamba2 (Bamba, Falcon-H1, Mamba2) and gated delta-net
(Qwen3-Next) layers keep a fixed-size state per request, not K/V.

```
 one ElasticPool buffer [num_slots, slot_bytes]: block s is slot s's states, whole pages
 |<- slot 0: conv l0 | ssm l0 | conv l2 | ssm l2 | pad ->|<- slot 1 ...
   mapped when the request gets its slot (alloc, fork, swap in), freed with it
```

`RecurrentStates` carves per-layer views `[num_slots, *shape]` out of the pool (shapes and
dtypes as transformers' own `DynamicCache` keeps them, found by one short forward), and
`install` makes each state module (the mixer) run request by request on its slot's views
through `_SlotCache`, a stand-in for the few `Cache` calls the mixers make. `StateSlots`
wraps the KV cache for the scheduler: alloc, free, fork (a copy of the state at the prompt's
end), swap out and in (a host copy) move the state with the slot.

A state is only right at the tokens it has seen: `tokens[slot]` counts them. A fork from a
sibling that has moved past the prompt raises, and the scheduler then computes that sample's
prompt; prefix caching is refused (no state is kept per prefix).
"""
from __future__ import annotations

import functools
import inspect
import math
import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from vattn.attention import get_forward_context
from vattn.errors import InvalidRequestError, OutOfPhysicalMemoryError, UnsupportedModelError
from vattn.pool import ElasticPool
from vattn.vmem import make_backend

_ALIGN = 64  # bytes: every state view starts aligned


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of one layer, for a batch of one."""

    layer: int
    kind: str  # "conv" | "recurrent"
    index: int  # transformers' state_idx
    shape: tuple[int, ...]  # without the batch dimension
    dtype: torch.dtype
    offset: int  # bytes into the slot's block

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def state_specs(model: Any) -> list[StateSpec]:
    """The states transformers' `DynamicCache` keeps for `model`, read after one 3-token
    forward (with the model's own attention) of a batch of one."""
    from transformers.cache_utils import DynamicCache, LinearAttentionCacheLayerMixin

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    # transformers 5.24 calls it `cache` (`past_key_values`, `cache_params`: deprecated names)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]], device=device), use_cache=True, **{name: cache})
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
    return specs


class RecurrentStates:
    """Every slot's recurrent states in one vattn pool: block s (whole pages) is slot s."""

    def __init__(self, specs: list[StateSpec], num_slots: int, device: torch.device, page_size: int | None,
                 budget: Any = None) -> None:
        if not specs:
            raise UnsupportedModelError("the model's cache keeps no recurrent state: nothing to put in vattn memory")
        self.specs = specs
        end = max(s.offset + s.nbytes for s in specs)
        self.backend = make_backend(torch.device(device))
        try:
            page = page_size if page_size is not None else self.backend.default_page_size
            self.slot_bytes = -(-end // page) * page  # one page group (or several) per slot
            self.pool = ElasticPool(num_slots, (self.slot_bytes,), torch.uint8, device=str(device), page_size=page,
                                    budget=budget, backend=self.backend)
        except BaseException:  # a pool that was not built does not close a backend it was given
            self.backend.close()
            raise
        raw = self.pool.buffer(0)  # [num_slots, slot_bytes]
        self.views: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, layer, index) -> [num_slots, *shape]
        for s in specs:
            flat = raw[:, s.offset:s.offset + s.nbytes].view(s.dtype)  # [num_slots, elems]
            self.views[(s.kind, s.layer, s.index)] = flat.unflatten(1, s.shape)
        self.tokens: dict[int, int] = {}  # slot -> tokens its states have seen

    def open(self, slot: int, tokens: int = 0) -> None:
        """Map `slot`'s block (a request starts in it)."""
        if self.pool.take([slot]) is None:
            raise OutOfPhysicalMemoryError(f"no memory for the recurrent states of slot {slot} "
                                           f"({self.slot_bytes} bytes); raise the budget or lower max_batch_size")
        self.tokens[slot] = tokens

    def close_slot(self, slot: int) -> None:
        """Give `slot`'s block back (its request ended or left the slot)."""
        if self.tokens.pop(slot, None) is not None:
            self.pool.free([slot])

    def copy(self, src: int, dst: int) -> None:
        raw = self.pool.buffer(0)
        raw[dst].copy_(raw[src])
        self.tokens[dst] = self.tokens[src]

    def save(self, slot: int) -> torch.Tensor:
        """A host copy of `slot`'s states."""
        return self.pool.buffer(0)[slot].to("cpu", copy=True)

    def load(self, slot: int, saved: torch.Tensor, tokens: int) -> None:
        self.pool.buffer(0)[slot].copy_(saved)
        self.tokens[slot] = tokens

    def view(self, kind: str, layer: int, index: int, slot: int) -> torch.Tensor:
        """`[1, *shape]`: slot's state, a view into the pool (written in place)."""
        return self.views[(kind, layer, index)][slot:slot + 1]

    def close(self) -> None:
        self.tokens.clear()
        self.views.clear()
        self.pool.close()  # (and the backend: the pool owns it once built)


class _SlotCache:
    """The `Cache` calls a mixer makes, for one request: its slot's views. `fresh`: the
    request has no tokens yet, so there is no previous state (transformers' None)."""

    def __init__(self, states: RecurrentStates, slot: int, fresh: bool) -> None:
        self.states, self.slot, self.fresh = states, slot, fresh

    def _kept(self, kind: str, layer_idx: int, state_idx: int) -> torch.Tensor:
        return self.states.view(kind, layer_idx, state_idx, self.slot)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self._kept("conv", layer_idx, state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.fresh else self._kept("recurrent", layer_idx, state_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

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


def install(modules: list[torch.nn.Module], states: RecurrentStates) -> Callable[[], None]:
    """Make each state module run on its slots' states: the batch's decodes (one token on a
    state) in one call on their states gathered by slot, every other request (a prompt or a
    chunk of one) alone on its slot's views; the packed batch is split by the forward
    context's metadata. Returns the function that undoes it."""
    for module in modules:
        original = module.forward

        def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, _original: Any = original,
                    **kwargs: Any) -> torch.Tensor:
            meta = get_forward_context().metadata
            for name in ("cache", "cache_params", "position_ids", "attention_mask"):
                kwargs.pop(name, None)
            run = functools.partial(_original, attention_mask=None, **kwargs)
            return _run_packed(run, self.layer_idx, states, hidden_states, meta)

        module.forward = types.MethodType(forward, module)

    def uninstall() -> None:
        for m in modules:
            m.__dict__.pop("forward", None)

    return uninstall


def _run_packed(run: Callable[..., torch.Tensor], layer: int, states: RecurrentStates, hidden_states: torch.Tensor,
                meta: Any) -> torch.Tensor:
    """hidden_states `[1, T, H]` packed as `meta` says -> the mixer's output `[1, T, H]`."""
    cu = meta.cu_query_lens
    decodes = [i for i, (start, n) in enumerate(zip(meta.starts, meta.query_lens)) if n == 1 and start > 0]
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
        if pieces[i] is None:
            pieces[i] = run(hidden_states[:, cu[i]:cu[i + 1]], cache=_SlotCache(states, slot, start == 0))
    return torch.cat(pieces, dim=1)  # [1, T, H]


class _GatheredCache(_SlotCache):
    """The `Cache` calls of a batch of decodes: their slots' states of one layer, gathered
    (`[B, *shape]` copies: the mixers update them in place), written back by `scatter`."""

    def __init__(self, states: RecurrentStates, layer: int, slots: torch.Tensor) -> None:
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


class StateSlots:
    """The scheduler's cache (`KVSlots`) for a model with recurrent states: the KV cache's
    slots, each with its states moved along (see the module docstring)."""

    fork_exact = True  # the scheduler forks only from a sibling whose state is at the prompt's end

    def __init__(self, kv: Any, states: RecurrentStates) -> None:
        self.kv, self.states = kv, states

    @property
    def num_free_reqids(self) -> int:
        return min(self.kv.num_free_reqids, self.states.pool.available_blocks())

    def alloc_reqid(self) -> int:
        slot = self.kv.alloc_reqid()
        try:
            self.states.open(slot)
        except BaseException:
            self.kv.free_reqid(slot)
            raise
        return slot

    def free_reqid(self, reqid: int) -> None:
        self.kv.free_reqid(reqid)
        self.states.close_slot(reqid)

    def step(self, seq_lens: Mapping[int, int]) -> Any:
        return self.kv.step(seq_lens)

    def fork(self, reqid: int, num_tokens: int) -> int:
        seen = self.states.tokens.get(reqid)
        if seen != num_tokens:
            raise InvalidRequestError(f"slot {reqid}'s recurrent state has seen {seen} tokens, not the {num_tokens} "
                                      "of the prompt: it cannot be forked there (the sample computes its prompt)")
        slot = self.kv.fork(reqid, num_tokens)
        try:
            self.states.open(slot)
        except BaseException:
            self.kv.free_reqid(slot)
            raise
        self.states.copy(reqid, slot)
        return slot

    def swap_out(self, reqid: int, num_tokens: int) -> _StateSwap:
        seen = self.states.tokens.get(reqid)
        if seen != num_tokens:
            raise InvalidRequestError(f"slot {reqid}'s recurrent state has seen {seen} tokens, not {num_tokens}")
        saved = self.states.save(reqid)
        handle = _StateSwap(self.kv.swap_out(reqid, num_tokens), saved, num_tokens)
        self.states.close_slot(reqid)
        return handle

    def swap_in(self, handle: _StateSwap) -> int:
        slot = self.kv.swap_in(handle.kv)
        try:
            self.states.open(slot)
        except BaseException:
            self.kv.free_reqid(slot)
            raise
        self.states.load(slot, handle.saved, handle.num_tokens)
        return slot


@dataclass
class _StateSwap:
    kv: Any  # the KV cache's swap handle
    saved: torch.Tensor  # [slot_bytes] uint8 on the host
    num_tokens: int
