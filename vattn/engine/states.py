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
prompt.

Prefix caching (`HybridPrefixCache`): a cached prefix block may also keep a snapshot of
every state layer's state at the block's end, in a second pool of blocks of the slot's size:

```
 snapshot pool [num_snapshots, slot_bytes]: one block per snapshot, pinned with its K/V block
 prompt   [ b0 ][ b1 ][ b2 ][ b3 ][ b4 ][ b5 ][ b. ]
 snapshot             ^ shared                  ^ last whole block of the prompt
 a hit on [b0, b2] maps their K/V pages and copies b2's snapshot into the slot; the rest is computed
```
A snapshot costs the whole state (`slot_bytes`) however short the block, so not every block
keeps one: a request snapshots (1) the end of its prompt's last whole block and (2) the end
of the cached K/V chain its lookup found past its longest snapshot (where it parts from an
earlier prompt: the boundary later prompts with that prefix share). A hit is the longest
cached chain whose last block has a snapshot. Snapshots are exact at block boundaries whatever
the chunking: a request's run of a state layer is split at a boundary it snapshots (the
attention layers run the chunk whole). Snapshots are evicted least recently used when their
pool is full or memory is short (a slot's states come first), and with their K/V block.
"""
from __future__ import annotations

import functools
import inspect
import math
import types
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from vattn.attention import get_forward_context
from vattn.errors import InvalidRequestError, OutOfPhysicalMemoryError, UnsupportedModelError
from vattn.pool import ElasticPool
from vattn.prefix_cache import PrefixCache, token_array
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
        self.device = torch.device(device)
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
        self._layer_bytes: dict[int, list[tuple[int, int]]] = {}  # layer -> (offset, nbytes) of its states
        for s in specs:
            self._layer_bytes.setdefault(s.layer, []).append((s.offset, s.nbytes))
        # snapshots at block boundaries (`enable_snapshots`; see the module docstring)
        self.snapshots: ElasticPool | None = None
        self._free_snapshots: list[int] = []
        self.wants: dict[int, set[int]] = {}  # slot -> token counts to snapshot its states at
        self.planned: dict[int, dict[int, int]] = {}  # slot -> {boundary: snapshot block} this forward
        self.taken: dict[int, dict[int, int]] = {}  # slot -> {boundary: snapshot block} not cached yet
        self.reclaim: Callable[[], bool] | None = None  # frees one cached snapshot; False: none left

    def enable_snapshots(self, num_snapshots: int, page_size: int | None, budget: Any = None) -> None:
        """A second pool of `num_snapshots` blocks of `slot_bytes` (virtual: memory only under
        the snapshots kept) for states at block boundaries."""
        page = page_size if page_size is not None else self.backend.default_page_size
        self.snapshots = ElasticPool(num_snapshots, (self.slot_bytes,), torch.uint8, device=str(self.device),
                                     page_size=page, budget=budget, backend=make_backend(self.device))
        self._free_snapshots = list(range(num_snapshots - 1, -1, -1))

    def _take(self, pool: ElasticPool, block: int) -> bool:
        """Map `block` of `pool`, reclaiming cached snapshots while memory is short."""
        while pool.take([block]) is None:
            if self.reclaim is None or not self.reclaim():
                return False
        return True

    def open(self, slot: int, tokens: int = 0) -> None:
        """Map `slot`'s block (a request starts in it)."""
        if not self._take(self.pool, slot):
            raise OutOfPhysicalMemoryError(f"no memory for the recurrent states of slot {slot} "
                                           f"({self.slot_bytes} bytes); raise the budget or lower max_batch_size")
        self.tokens[slot] = tokens

    def close_slot(self, slot: int) -> None:
        """Give `slot`'s block back (its request ended or left the slot), and the snapshots
        it took that no cached block kept."""
        self.wants.pop(slot, None)
        for snaps in (self.planned.pop(slot, {}), self.taken.pop(slot, {})):
            for block in snaps.values():
                self.free_snapshot(block)
        if self.tokens.pop(slot, None) is not None:
            self.pool.free([slot])

    # ------------------------------------------------------------- snapshots ----
    def new_snapshot(self) -> int | None:
        """A mapped snapshot block, or None (no block free, or no memory even after
        reclaiming every cached snapshot)."""
        if self.snapshots is None:
            return None
        while not self._free_snapshots:
            if self.reclaim is None or not self.reclaim():
                return None
        block = self._free_snapshots.pop()
        if not self._take(self.snapshots, block):
            self._free_snapshots.append(block)
            return None
        return block

    def free_snapshot(self, block: int) -> None:
        assert self.snapshots is not None
        self.snapshots.free([block])
        self._free_snapshots.append(block)

    def plan(self, ranges: list[tuple[int, int, int]]) -> None:
        """Before a forward: `ranges` (slot, start, num_new_tokens). Each wanted boundary in
        (start, start + num_new_tokens] gets a snapshot block the state layers write."""
        for slot, start, n in ranges:
            want = self.wants.get(slot)
            for b in sorted(want or ()):
                if start < b <= start + n:
                    want.discard(b)
                    block = self.new_snapshot()
                    if block is not None:
                        self.planned.setdefault(slot, {})[b] = block

    def commit(self) -> None:
        """After a forward that ran: the planned snapshots hold their states."""
        for slot, snaps in self.planned.items():
            self.taken.setdefault(slot, {}).update(snaps)
        self.planned.clear()

    def snapshot_layer(self, slot: int, layer: int, block: int) -> None:
        """Copy `layer`'s states of `slot` into snapshot `block` (the state has just reached
        the block's boundary)."""
        assert self.snapshots is not None
        raw, snap = self.pool.buffer(0), self.snapshots.buffer(0)
        for off, n in self._layer_bytes[layer]:
            snap[block, off:off + n].copy_(raw[slot, off:off + n])

    def snapshot_now(self, slot: int) -> int | None:
        """A snapshot of `slot`'s states as they are, or None (no snapshot block)."""
        block = self.new_snapshot()
        if block is not None:
            self.snapshots.buffer(0)[block].copy_(self.pool.buffer(0)[slot])
        return block

    def restore(self, slot: int, block: int, tokens: int) -> None:
        """`slot`'s states become snapshot `block`'s, taken after `tokens` tokens."""
        assert self.snapshots is not None
        self.pool.buffer(0)[slot].copy_(self.snapshots.buffer(0)[block])
        self.tokens[slot] = tokens

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
        if self.snapshots is not None:
            self.snapshots.close()
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
    planned = states.planned  # slot -> {boundary: snapshot block}: run alone, split there
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


class HybridPrefixCache(PrefixCache):
    """Prefix caching for a model with recurrent states: a hit needs the state at the end of
    its last block, kept as a snapshot in `states` (see the module docstring). Blocks whose
    K/V is cached but that keep no snapshot are no hit; they mark where a prompt parts from
    an earlier one, the boundary a request then snapshots."""

    def __init__(self, cache: Any, states: RecurrentStates, num_snapshots: int, page_size: int | None,
                 salt: bytes | str = b"", budget: Any = None) -> None:
        super().__init__(cache, salt=salt)
        self.states = states
        states.enable_snapshots(num_snapshots, page_size, budget=budget)
        states.reclaim = self._evict_one
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # block key -> snapshot block, LRU first

    def map_prefix(self, reqid: int, token_ids: Sequence[int]) -> int:
        """Map the longest cached prefix of `token_ids` whose last block keeps a snapshot,
        restore the snapshot into `reqid`'s states, and ask for the snapshots this request
        should take (see the class docstring). Returns the tokens mapped (0: a miss)."""
        ids = token_array(token_ids)
        keys, handles = self.lookup(ids)
        self.num_query_tokens += len(ids)
        u, t = self.block_pages, self.block_tokens
        chain = len(handles) // u  # leading blocks with cached K/V
        n = 0
        hit = self._longest_snapshot(keys, chain)
        if hit:
            n = self.cache.map_pinned(reqid, handles[:hit * u])
            self.forget_evicted(keys[:hit], n)
            if n < hit * t:  # K/V pages were evicted meanwhile: the longest snapshot within what is mapped
                hit = self._longest_snapshot(keys, n // t)
                if hit * t < n:
                    self.cache.truncate_pinned(reqid, hit * t)
                n = hit * t
            if hit:
                self.snapshots.move_to_end(keys[hit - 1])
                self.states.restore(reqid, self.snapshots[keys[hit - 1]], n)
        self.num_hit_tokens += n
        want = {len(ids) // t * t, chain * t} if chain > hit else {len(ids) // t * t}
        want = {b for b in want if b > n}
        if want:
            self.states.wants[reqid] = want
        return n

    def _longest_snapshot(self, keys: Sequence[bytes], blocks: int) -> int:
        """The most leading blocks of `keys[:blocks]` whose last keeps a snapshot (0: none)."""
        return next((i for i in range(blocks, 0, -1) if keys[i - 1] in self.snapshots), 0)

    def forget_evicted(self, keys: Sequence[bytes], num_mapped: int) -> None:
        super().forget_evicted(keys, num_mapped)
        for key in keys[num_mapped // self.block_tokens:]:
            self._drop(key)

    def insert(self, reqid: int, token_ids: Sequence[int]) -> None:
        """Pin the K/V of the whole blocks of `token_ids` (`PrefixCache.insert`) and keep the
        snapshots `reqid` took at their boundaries (and one of its states now, when they end
        on a boundary)."""
        super().insert(reqid, token_ids)
        t = self.block_tokens
        whole = len(token_ids) // t * t
        taken = self.states.taken.get(reqid, {})
        if whole and whole == len(token_ids) and self.states.tokens.get(reqid) == whole and whole not in taken:
            block = self.states.snapshot_now(reqid)
            if block is not None:
                taken = self.states.taken.setdefault(reqid, {})
                taken[whole] = block
        mine = [b for b in taken if 0 < b <= whole]
        if mine:
            keys = self.block_hashes(token_array(token_ids)[:whole])
            for b in mine:
                block, key = taken.pop(b), keys[b // t - 1]
                if key in self.snapshots or key not in self.entries:  # kept already, or its K/V was not pinned
                    self.states.free_snapshot(block)
                else:
                    self.snapshots[key] = block
                if key in self.snapshots:
                    self.snapshots.move_to_end(key)
        for key in [k for k in self.snapshots if k not in self.entries]:  # `insert` forgot evicted blocks
            self._drop(key)

    def _drop(self, key: bytes) -> None:
        block = self.snapshots.pop(key, None)
        if block is not None:
            self.states.free_snapshot(block)

    def trim(self) -> int:
        """Free the snapshots whose K/V block was evicted (after `KVCache.trim()`: all of
        them) and give the state pools' unused memory back. Returns bytes given back."""
        while self._evict_dead():
            pass
        assert self.states.snapshots is not None
        return self.states.snapshots.trim() + self.states.pool.trim()

    def _evict_dead(self) -> bool:
        """Free one snapshot whose K/V block was evicted; False: none."""
        for key in list(self.snapshots):
            handles = self.entries.get(key)
            if handles is None or not self.pinned(handles):
                self.entries.pop(key, None)
                self._drop(key)
                return True
        return False

    def _evict_one(self) -> bool:
        """Free one snapshot: one whose K/V block was evicted, else the least recently used."""
        if self._evict_dead():
            return True
        if not self.snapshots:
            return False
        self._drop(next(iter(self.snapshots)))
        return True
