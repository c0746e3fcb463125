"""The host tier: one store of host memory per cache (`KVCache.host`), under one byte budget,
for the prefix cache's offloaded blocks and for swapped-out requests.

```
HostStore (offload_bytes)
 |- blocks   prefix blocks by key, least recently used first -> evicted: handed to the sink
 '- leases   swapped-out requests' host copies, and blocks the tiers read ahead from disk for a
             waiting request (never evicted; given back with their handle, or when taken)
```
Without a limit (no `offload_bytes`) the store holds no prefix blocks and swapping takes
what it needs, as host memory allows. The store knows nothing of the tiers below it: the
blocks it evicts (and, at close, those it holds) go to a `Sink` its owner gave it (the
tiers' disk writer, `vattn.offload.tiers`), or nowhere.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol, Sequence

import torch

from vattn.errors import InvalidConfigError, OutOfPhysicalMemoryError
from vattn.offload.copier import Copier


EMPTY_BYTES = 64  # what a block of holes only (a sliding window gave every page back) counts


@dataclass(frozen=True)
class BlockLayout:
    """What one prefix block of a cache holds: per K/V layer kind (the kinds of a pin
    handle, in order) its pages of every buffer, `(buffers, bytes a buffer)`, and with
    recurrent states the snapshot of their states at its end (`state_bytes`, 0: none)."""

    kinds: tuple[tuple[int, int], ...]
    state_bytes: int = 0

    def kind_bytes(self, k: int) -> int:
        buffers, nbytes = self.kinds[k]
        return buffers * nbytes

    @property
    def state_flag(self) -> int:
        """The flag bit of a held snapshot (after one bit per kind)."""
        return 1 << len(self.kinds)

    @property
    def full_flags(self) -> int:
        """Every kind held (and the snapshot, with states)."""
        return (1 << len(self.kinds)) - 1 | (self.state_flag if self.state_bytes else 0)

    def nbytes(self, flags: int) -> int:
        """Bytes of a block holding what `flags` says."""
        n = sum(self.kind_bytes(k) for k in range(len(self.kinds)) if flags >> k & 1)
        return n + (self.state_bytes if flags & self.state_flag else 0)

    def kind_flags(self, holes: Sequence[bool]) -> int:
        """The flags of a block holding every K/V kind but those with `holes` (no snapshot)."""
        return sum(1 << k for k, hole in enumerate(holes) if not hole)

    def valid(self, flags: int) -> bool:
        """Whether `flags` names parts this layout has (none: a block of holes only)."""
        return flags & ~self.full_flags == 0


@dataclass(eq=False)
class HostBlock:
    """A prefix block in host memory: per K/V kind `[buffers, bytes a buffer]` uint8 (None
    where the block's pages were not all held: a sliding window had given some back), and
    the `[state_bytes]` snapshot of the recurrent states at its end, or None."""

    kinds: list[torch.Tensor | None]
    state: torch.Tensor | None = None
    ready: Any = None  # the CUDA event the copies into it finish at (None: done)
    on_disk: bool = field(default=False)  # the disk tier holds it as it is
    from_disk: bool = field(default=False)  # read from disk, not restored since (a hit counts as the disk's)

    @property
    def nbytes(self) -> int:
        """The bytes it holds (a block of holes only counts EMPTY_BYTES: its key and books)."""
        n = sum(t.numel() for t in self.kinds if t is not None)
        n += self.state.numel() if self.state is not None else 0
        return n or EMPTY_BYTES

    def flags(self, layout: BlockLayout) -> int:
        """Bit k: kind k held; `layout.state_flag`: the snapshot held."""
        bits = sum(1 << k for k, t in enumerate(self.kinds) if t is not None)
        return bits | (layout.state_flag if self.state is not None else 0)


class Sink(Protocol):
    """Where a host store's victims go (the tiers below it)."""

    def put(self, key: bytes, block: HostBlock) -> None:
        """Take a block the store let go of (O(1): the engine's thread calls it)."""

    def close(self, blocks: Iterable[tuple[bytes, HostBlock]]) -> None:
        """The store closed: `blocks` (those it held that the tiers below lack) and those
        handed over so far are dealt with, within a bound."""

    @property
    def disk_bytes(self) -> int:
        """Bytes the tiers below hold."""


class HostStore:
    """One cache's host memory for prefix blocks and swapped-out requests (see the module
    docstring). Called by one thread at a time (the cache's user, the engine's lock)."""

    def __init__(self, copier: Copier) -> None:
        self.copier = copier
        self.limit: int | None = None  # offload_bytes; None: no prefix blocks, swap unbounded
        self.layout: BlockLayout | None = None
        self.sink: Sink | None = None  # where evicted blocks go (None: dropped)
        self.blocks: OrderedDict[bytes, HostBlock] = OrderedDict()  # least recently used first
        self.block_bytes = 0
        self.leased = 0  # bytes of swapped-out requests' copies
        self.num_evicted = 0  # blocks pushed out of host memory (to disk, or dropped)

    @property
    def nbytes(self) -> int:
        """Bytes held: prefix blocks and swapped-out requests."""
        return self.block_bytes + self.leased

    @property
    def holds_blocks(self) -> bool:
        return self.limit is not None and self.layout is not None

    def configure(self, limit: int, layout: BlockLayout | None = None, sink: Sink | None = None) -> None:
        """Take at most `limit` bytes (offload_bytes); with `layout`, hold prefix blocks of
        that layout, those evicted handed to `sink` when there is one. InvalidConfigError when
        `limit` holds no block or is more than the host has available now."""
        if layout is not None and limit < layout.nbytes(layout.full_flags):
            raise InvalidConfigError(
                f"offload_bytes={limit} holds no prefix block ({layout.nbytes(layout.full_flags)} bytes each); give "
                "at least that, or no offload_bytes")
        available = host_available()
        if available is not None and limit > available:
            raise InvalidConfigError(
                f"offload_bytes={limit} is more than the host has available now ({available} bytes); give less")
        self.limit, self.layout, self.sink = limit, layout, sink
        self._make_room(0)

    # ----------------------------------------------------------- swapped-out ----
    def take(self, nbytes: int) -> None:
        """Book `nbytes` for a swapped-out request (blocks are evicted to make room), or raise
        OutOfPhysicalMemoryError and change nothing (no block evicted): the request does not
        fit offload_bytes beside other requests' copies."""
        if nbytes < 0:
            raise ValueError(f"a swapped-out request takes >= 0 bytes, got {nbytes}")
        if not self._make_room(nbytes):
            if nbytes > self.limit:
                why = f"more than offload_bytes={self.limit}"
            else:
                why = (f"offload_bytes={self.limit} has {self.limit - self.leased} bytes left beside the "
                       f"{self.leased} bytes other swapped-out requests hold")
            raise OutOfPhysicalMemoryError(
                f"the host store has no room for a swapped-out request of {nbytes} bytes ({why}); raise "
                "offload_bytes, or preempt by recomputing")
        self.leased += nbytes

    def give(self, nbytes: int) -> None:
        """A swapped-out request's copy is gone (its handle was dropped)."""
        self.leased -= nbytes

    # ---------------------------------------------------------------- blocks ----
    def put(self, key: bytes, block: HostBlock) -> bool:
        """Keep `block` under `key` (most recently used), evicting others; False (not kept)
        when it does not fit."""
        if not self.holds_blocks:
            return False
        if not self._fits(block.nbytes):  # (checked first: the block held under `key` stays)
            return False
        old = self.blocks.pop(key, None)
        if old is not None:
            self.block_bytes -= old.nbytes
        if not self._make_room(block.nbytes):
            return False
        self.blocks[key] = block
        self.block_bytes += block.nbytes
        return True

    def get(self, key: bytes) -> HostBlock | None:
        """The block under `key` in host memory (now the most recently used), or None."""
        block = self.blocks.get(key)
        if block is not None:
            self.blocks.move_to_end(key)
        return block

    def add_state(self, key: bytes, state: torch.Tensor, ready: Any) -> bool:
        """The snapshot at the end of the block under `key`, copied now (`ready`: the event
        of that copy); False when the block is not in host memory or it does not fit."""
        block = self.blocks.get(key)
        if block is None or block.state is not None:
            return False
        before = block.nbytes
        if not self._make_room(state.numel(), keep=key):
            return False
        block.state, block.on_disk = state, False
        block.ready = ready if ready is not None else block.ready
        self.block_bytes += block.nbytes - before
        return True

    def peek(self, key: bytes) -> HostBlock | None:
        """The block under `key` in host memory (not counted as a use), or None."""
        return self.blocks.get(key)

    def _fits(self, nbytes: int, keep: bytes | None = None) -> bool:
        """Whether `nbytes` more fit the limit once every block but `keep` is evicted
        (swapped-out requests' copies are not evictable)."""
        kept = self.blocks[keep].nbytes if keep in self.blocks else 0
        return self.limit is None or self.leased + kept + nbytes <= self.limit

    def _make_room(self, nbytes: int, keep: bytes | None = None) -> bool:
        """Evict blocks, least recently used first, until `nbytes` more fit the limit; False,
        with nothing evicted, when they cannot fit even then."""
        if self.limit is None:
            return True
        if not self._fits(nbytes, keep):
            return False
        while self.nbytes + nbytes > self.limit:
            victim = next((k for k in self.blocks if k != keep), None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _evict(self, key: bytes) -> None:
        block = self.blocks.pop(key)
        self.block_bytes -= block.nbytes
        self.num_evicted += 1
        if self.sink is not None and not block.on_disk:
            self.sink.put(key, block)

    def close(self) -> None:
        """Hand the blocks the tiers below do not hold to the sink (they survive a restart
        there), then close it."""
        blocks, self.blocks, self.block_bytes = self.blocks, OrderedDict(), 0
        if self.sink is None:
            return
        self.sink.close([(key, block) for key, block in blocks.items() if not block.on_disk])


def host_available() -> int | None:
    """Bytes of memory the host has available now (`MemAvailable`), or None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


__all__ = ["EMPTY_BYTES", "BlockLayout", "HostBlock", "HostStore", "Sink", "host_available"]
