"""`ElasticPool`: elastic physical memory under a server's own paged KV cache.

The server keeps its block table and its paged kernels. vattn reserves the block
tensors once (virtual memory: they never move) and decides which physical pages back
the blocks in use:

```
 buffer b (e.g. K of layer l): num_blocks blocks of block_bytes, reserved once
 |<- block 0 ->|<- block 1 ->|<- block 2 ->|<- block 3 ->| ...
 [   page 0    |    page 1   |    page 2   |   page 3    ]   pages: mapped on demand
 (a block may be smaller than a page or span several; page p of every buffer is one
  "page group", mapped and unmapped together in one backend call)
```

- `alloc(n)` picks free blocks *page-aware*: first blocks in pages that are mapped and
  partly used, then blocks in mapped pages nothing uses (cached), then the lowest
  unmapped blocks, whose pages it maps in one batched call. It returns None when the
  memory is short (free blocks, the pool's limit, the shared `Budget`): a scheduling
  miss, and nothing changed.
- `free(ids)` records a fence (a CUDA event on the current stream: call it after the
  kernels that read the blocks were enqueued) and keeps the pages mapped (deferred
  reclamation). A page is unmapped only when no block on it is in use, only after the
  fences of the blocks freed on it, and only when memory is wanted: `trim()`,
  `set_limit()` below the mapped bytes, another pool of the same `Budget` short of
  memory, or this pool's own alloc over its limit.
- `zero_new=True` clears the pages mapped with new memory (page groups the pool creates:
  the device's, which may hold another process's data) before `alloc` returns them, so
  that memory the pool did not hold before reads zeros, as a `torch.zeros` cache does.
  A page given a group moved from the pool's own cached pages keeps its data (this pool's,
  as a reused block does). Nothing is done where new memory reads zeros (the host backend).
- `pin(ids, ...)`: blocks that must stay mapped (a server's null, padding or trash blocks):
  a `take` that raises when memory cannot back them.
- One lock guards the books; backend calls are made under it. A budget's reclaim
  callback runs without the requesting pool's lock (see `vattn.budget`).
"""
from __future__ import annotations

import functools
import heapq
import math
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from vattn.budget import Budget
from vattn.checks import as_int
from vattn.config import CUDA_DRIVERS, MAX_PAGE_SIZE, parse_dtype
from vattn.errors import (
    ClosedError,
    InvalidConfigError,
    InvalidRequestError,
    OutOfPhysicalMemoryError,
    UnknownBlockError,  # (re-exported: it was defined here)
)
from vattn.vmem import make_backend
from vattn.vmem.base import Backend

SYNC_MODES = ("stream", "device")
_PLANNED = object()  # a page booked as mapped while an alloc is being planned


@dataclass(frozen=True)
class PoolConfig:
    """What an `ElasticPool` was asked for. Sizes in bytes.

    `num_buffers` tensors of `[num_blocks, *block_shape]` `dtype` (for example K and V
    of every layer: `num_buffers=2 * num_layers`, `block_shape=(block_size, heads,
    head_dim)`; or one flat byte buffer: `block_shape=(block_bytes,)`, `dtype=uint8`).
    `limit`: the initial memory limit (None: none but the device's). `sync`: what an
    unmap waits for: "stream" (the fences `free` recorded on the current stream) or
    "device" (also every stream of the device: for servers that read the cache on
    streams of their own, e.g. transformers' continuous batching). `grow`: page groups
    created at least at a time (the extra ones stay spare until used, trimmed, or wanted
    by the limit or the budget); default: up to 8, at most 16 MiB. `zero_new`: clear the
    pages mapped with new memory before `alloc` returns them (see the module docstring).
    """

    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype = torch.float16
    num_buffers: int = 1
    device: str = "cpu"
    page_size: int | None = None
    limit: int | None = None
    sync: str = "stream"
    cuda_driver: str = "auto"
    grow: int | None = None
    zero_new: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_blocks", _positive("num_blocks", self.num_blocks))
        object.__setattr__(self, "num_buffers", _positive("num_buffers", self.num_buffers))
        shape = self.block_shape
        if not isinstance(shape, (tuple, list, torch.Size)):
            shape = (shape,)
        if not shape:
            raise InvalidConfigError("block_shape must have at least one dimension, got ()")
        object.__setattr__(self, "block_shape", tuple(_positive("block_shape", d) for d in shape))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        device = str(self.device) if isinstance(self.device, torch.device) else self.device
        if not isinstance(device, str):
            raise InvalidConfigError(f"device must be a string like 'cpu' or 'cuda:0', got {self.device!r}")
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise InvalidConfigError(f"bad device {device!r}: {e}") from None
        if dev.type not in ("cpu", "cuda") or (dev.type == "cpu" and dev.index not in (None, 0)):
            raise InvalidConfigError(f"device must be 'cpu' (host backend) or 'cuda[:N]', got {device!r}")
        object.__setattr__(self, "device", device)
        if self.page_size is not None:
            object.__setattr__(self, "page_size", _positive("page_size", self.page_size))
            if self.page_size > MAX_PAGE_SIZE:
                raise InvalidConfigError(f"page_size={self.page_size} is over {MAX_PAGE_SIZE >> 20} MiB")
        if self.limit is not None:
            object.__setattr__(self, "limit", _limit(self.limit))
        if self.sync not in SYNC_MODES:
            raise InvalidConfigError(f"sync must be one of {SYNC_MODES}, got {self.sync!r}")
        if self.cuda_driver not in CUDA_DRIVERS:
            raise InvalidConfigError(f"cuda_driver must be one of {CUDA_DRIVERS}, got {self.cuda_driver!r}")
        if self.grow is not None:
            object.__setattr__(self, "grow", _positive("grow", self.grow))
        if not isinstance(self.zero_new, bool):
            raise InvalidConfigError(f"zero_new must be True or False, got {self.zero_new!r}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one buffer."""
        return math.prod(self.block_shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class PoolStats:
    """Memory figures of one pool, in bytes (all buffers) and counts."""

    num_blocks: int
    block_bytes: int  # one block in every buffer
    page_size: int
    group_bytes: int  # one page in every buffer: the unit that is mapped
    num_used_blocks: int
    num_warm_blocks: int  # free blocks whose pages are all mapped (no mapping needed)
    num_mapped_pages: int
    num_cached_pages: int  # mapped, no block in use on them: what trim() gives back (with the spare ones)
    num_spare_pages: int  # created ahead, not mapped: handed out before creating more
    mapped_bytes: int
    used_bytes: int  # blocks in use
    peak_mapped_bytes: int
    limit: int | None
    available_blocks: int  # blocks alloc can give now, other pools' cached pages counted (see available_blocks())

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks

    @property
    def cached_bytes(self) -> int:
        return self.num_cached_pages * self.group_bytes

    @property
    def held_bytes(self) -> int:
        """Physical bytes the pool holds (mapped and spare): what the limit bounds."""
        return (self.num_mapped_pages + self.num_spare_pages) * self.group_bytes


class _Books:
    """The pool's books and page movement, plain Python. Holds no reference to the
    `ElasticPool` (its finalizer) and none to torch tensors. Every free block is *warm* (all its pages
    mapped; in `warm[first page]`) or *cold* (in `cold`, a lazy min-heap of block ids)."""

    def __init__(self, config: PoolConfig, backend: Backend, bases: list[int], page_size: int,
                 budget: Budget | None, grow: int, device_sync: Callable[[], None] | None = None,
                 zero_pages: Callable[[list[int]], None] | None = None) -> None:
        self.config = config
        self.device_sync = device_sync  # sync="device": wait for every stream before an unmap
        self.zero_pages = zero_pages  # zero_new: clears the pages mapped with new memory
        self.grow = grow  # groups created at least per creation (the rest kept spare)
        self.backend = backend
        self.bases = bases
        self.P = page_size
        self.B = config.block_bytes
        self.N = config.num_blocks
        self.M = -(-self.N * self.B // self.P)  # pages per buffer
        self.G = page_size * config.num_buffers  # bytes of one page group
        # Most pages one block can span (a bound when blocks straddle page boundaries)
        self.span_max = self.B // self.P if self.B % self.P == 0 else (self.P + self.B - 2) // self.P + 1
        self.limit: int | None = config.limit
        self.budget = budget

        self.used = bytearray(self.N)
        self.num_used = 0
        self.users = [0] * self.M  # blocks in use on each page
        self.groups: list[Any] = [None] * self.M  # the physical group mapped at each page (None: unmapped)
        self.num_mapped = 0
        self.miss = [self.pages_of(b)[1] - self.pages_of(b)[0] + 1 for b in range(self.N)]  # unmapped pages of each block
        self.warm: dict[int, dict[int, None]] = {}  # first page -> warm free blocks starting there
        self.num_warm = 0
        self.busy_warm: set[int] = set()  # pages with blocks in use and warm free blocks starting there
        self.idle_warm: set[int] = set()  # pages with no block in use and warm free blocks
        self.cold = list(range(self.N))  # heap (lazy: stale entries are skipped when popped)
        self.cached: set[int] = set()  # mapped pages with no block in use
        self.fences: dict[int, Any] = {}  # page -> fence of the last free of a block on it
        self.spare: list[Any] = []  # created, unmapped, no page: handed out before creating more
        self.unreleased: list[Any] = []  # unmapped groups whose release failed (retried at close)
        self.peak_mapped = 0
        self.closed = False
        self.lock = threading.Lock()
        self.token = budget.register(self.reclaim_for_budget, self.cached_bytes) if budget is not None else None

    # ---------------------------------------------------------------- geometry ----
    def pages_of(self, b: int) -> tuple[int, int]:
        """First and last page of block b."""
        return b * self.B // self.P, ((b + 1) * self.B - 1) // self.P

    def blocks_on(self, p: int) -> range:
        return range(p * self.P // self.B, min(self.N, ((p + 1) * self.P - 1) // self.B + 1))

    @property
    def num_held(self) -> int:
        """Groups the pool holds: mapped and spare (what the limit bounds)."""
        return self.num_mapped + len(self.spare)

    @property
    def limit_pages(self) -> int | None:
        return None if self.limit is None else self.limit // self.G

    # ------------------------------------------------------------ book moves ----
    def _touch(self, p: int) -> None:
        if p in self.warm:
            (self.busy_warm if self.users[p] else self.idle_warm).add(p)
            (self.idle_warm if self.users[p] else self.busy_warm).discard(p)
        else:
            self.busy_warm.discard(p)
            self.idle_warm.discard(p)

    def _add_warm(self, b: int) -> None:
        f = b * self.B // self.P
        self.warm.setdefault(f, {})[b] = None
        self.num_warm += 1
        self._touch(f)

    def _drop_warm(self, b: int) -> None:
        f = b * self.B // self.P
        d = self.warm[f]
        del d[b]
        if not d:
            del self.warm[f]
        self.num_warm -= 1
        self._touch(f)

    def _book_map(self, p: int, group: Any) -> None:
        self.groups[p] = group
        self.num_mapped += 1
        if not self.users[p]:
            self.cached.add(p)
        for b in self.blocks_on(p):
            self.miss[b] -= 1
            if not self.miss[b] and not self.used[b]:
                self._add_warm(b)

    def _book_unmap(self, p: int) -> Any:
        group, self.groups[p] = self.groups[p], None
        self.num_mapped -= 1
        self.cached.discard(p)
        self.fences.pop(p, None)
        for b in self.blocks_on(p):
            if not self.miss[b] and not self.used[b]:
                self._drop_warm(b)
                heapq.heappush(self.cold, b)
            self.miss[b] += 1
        if len(self.cold) > 4 * self.N + 64:  # too many stale entries: rebuild (sorted = a heap)
            self.cold = [b for b in range(self.N) if not self.used[b] and self.miss[b]]
        return group

    def _use(self, b: int) -> None:
        self._drop_warm(b)  # all its pages are (booked as) mapped
        self.used[b] = 1
        self.num_used += 1
        first, last = self.pages_of(b)
        for p in range(first, last + 1):
            self.users[p] += 1
            if self.users[p] == 1:
                self.cached.discard(p)
                self._touch(p)

    def _unuse(self, b: int, fence: Any = None) -> None:
        self.used[b] = 0
        self.num_used -= 1
        first, last = self.pages_of(b)
        for p in range(first, last + 1):
            self.users[p] -= 1
            if fence is not None:
                self.fences[p] = fence
            if not self.users[p]:
                self.cached.add(p)
                self._touch(p)
        self._add_warm(b)

    def _pick(self) -> int | None:
        """The next free block to hand out: packed into partly used pages first."""
        for pages in (self.busy_warm, self.idle_warm):
            if pages:
                return next(iter(self.warm[next(iter(pages))]))
        while self.cold:
            b = heapq.heappop(self.cold)
            if not self.used[b] and self.miss[b]:
                return b
        return None

    # -------------------------------------------------------------- alloc/free ----
    def alloc(self, n: int | None, ids: list[int] | None) -> tuple[list[int] | None, int]:
        """Lock held. Returns (block ids or None, bytes the shared budget could not give)."""
        self.check_open()
        count = n if ids is None else len(ids)
        if count > self.N - self.num_used:
            return None, 0
        picked: list[int] = []
        planned: list[int] = []  # pages to map
        new: list[int] = []  # the planned pages given new memory
        try:
            for i in range(count):
                b = self._pick() if ids is None else ids[i]
                first, last = self.pages_of(b)
                for p in range(first, last + 1):
                    if self.groups[p] is None:
                        self._book_map(p, _PLANNED)
                        planned.append(p)
                self._use(b)
                picked.append(b)
            ok, need, new = self._back(planned)
            if ok and new and self.zero_pages is not None:
                self.zero_pages(new)
        except BaseException:
            self._undo(picked, planned)
            if new:  # mapped but maybe not cleared: never hand that memory out
                try:
                    self._release(self._unmap(new))
                except Exception:
                    pass
            raise
        if not ok:
            self._undo(picked, planned)
            return None, need
        self.peak_mapped = max(self.peak_mapped, self.num_mapped)
        return picked, 0

    def _back(self, planned: list[int]) -> tuple[bool, int, list[int]]:
        """Give physical groups to the planned pages: spare groups first, then the pool's own
        cached pages (moved), then new ones, created `grow` at a time within the limit and
        the budget (the extra ones stay spare). (False, bytes the budget could not give, [])
        when memory is short; then nothing was mapped and no new group is held. Else (True,
        0, the pages given memory never mapped before: spare or created groups)."""
        k = len(planned)
        if not k:
            return True, 0, []
        lp = self.limit_pages
        cached = sorted(self.cached, reverse=True)  # the pool's own free memory, highest pages first
        s = min(k, len(self.spare))
        c = min(k - s, len(cached))
        n = k - s - c  # groups to create
        held = self.num_mapped - k + len(self.spare)  # groups held before this call
        # groups to let go to stay within the limit: what is held after must fit
        drop = 0 if lp is None else max(0, held + n - lp)
        if drop > (len(self.spare) - s) + (len(cached) - c):
            return False, 0, []  # the pool's own limit: a miss
        drop_spare = min(drop, len(self.spare) - s)
        drop_cached = drop - drop_spare
        extra = 0  # created beyond need, kept spare: fewer, larger creations
        if n:
            extra = max(0, self.grow - n)
            if lp is not None:
                extra = max(0, min(extra, lp - (held + n - drop)))
        taken = 0
        if n and self.budget is not None:
            if extra and self.budget.try_take((n + extra) * self.G):
                taken = (n + extra) * self.G
            elif self.budget.try_take(n * self.G):
                taken, extra = n * self.G, 0
            else:
                return False, n * self.G, []  # the budget is asked to make this much free
        unmapped: list[Any] = []
        created: list[Any] = []
        try:
            unmapped = self._unmap(cached[:c + drop_cached])
            if n:
                try:
                    created = self.backend.create(n + extra, self.config.num_buffers, self.P)
                except OutOfPhysicalMemoryError:
                    if not extra:
                        raise
                    if self.budget is not None:  # the chunk did not fit; what is needed may
                        self.budget.give(extra * self.G)
                        taken -= extra * self.G
                    extra = 0
                    created = self.backend.create(n, self.config.num_buffers, self.P)
            spare = self.spare[len(self.spare) - s:]
            groups = spare + unmapped[:c] + created[:n]
            self.backend.map(self.bases, [p * self.P for p in planned], groups, self.P)
        except BaseException as e:
            # Nothing of the map happened (it is all or nothing): give back what this call holds.
            if not created and taken:
                self.budget.give(taken)
            for groups in (created, unmapped):
                try:
                    self._release(groups)
                except Exception:
                    pass  # kept in `unreleased`, retried at close
            if isinstance(e, OutOfPhysicalMemoryError):
                return False, 0, []  # the device refused new pages now: a shortage, not an error
            raise
        del self.spare[len(self.spare) - s:]
        for p, g in zip(planned, groups):
            self.groups[p] = g
        self.spare.extend(created[n:])
        let_go = unmapped[c:]
        if drop_spare:
            let_go += self.spare[-drop_spare:]
            del self.spare[-drop_spare:]
        try:
            self._release(let_go)  # over the limit
        except Exception:
            pass
        return True, 0, planned[:s] + planned[s + c:]

    def _undo(self, picked: list[int], planned: list[int]) -> None:
        for b in reversed(picked):
            self._unuse(b)
        for p in reversed(planned):
            if self.groups[p] is _PLANNED:
                self._book_unmap(p)

    def free(self, ids: list[int]) -> None:
        self.check_open()
        for b in ids:
            if not self.used[b]:
                raise UnknownBlockError(f"block {b} is not allocated (double free?)")
        fence = self.backend.fence()  # nothing changed if this raises
        for b in ids:
            self._unuse(b, fence)
        lp = self.limit_pages
        if lp is not None and self.num_held > lp and (self.cached or self.spare):  # over the limit: give back now
            try:
                self.give_back(self.num_held - lp)
            except Exception as e:  # the blocks are freed; the pages stay cached until trim() or an alloc
                warnings.warn(f"vattn: giving back pages over the pool's limit failed ({e}); "
                              "they stay mapped until trim()", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------ giving back ----
    def _wait(self, pages: Iterable[int]) -> None:
        """Block until no kernel that may read `pages` runs (their fences; the device)."""
        seen: set[int] = set()
        for p in pages:
            f = self.fences.get(p)
            if f is not None and id(f) not in seen:
                seen.add(id(f))
                self.backend.wait(f)
        if self.device_sync is not None:
            self.device_sync()

    def _unmap(self, pages: list[int]) -> list[Any]:
        """Unmap cached pages (one call, after their fences); returns their groups."""
        if not pages:
            return []
        self._wait(pages)
        self.backend.unmap(self.bases, [p * self.P for p in pages], self.P)
        return [self._book_unmap(p) for p in pages]  # books change only after the unmap worked

    def _release(self, groups: list[Any]) -> None:
        """Release unmapped groups and give their bytes back to the budget."""
        if not groups:
            return
        try:
            self.backend.release(groups)
        except Exception:
            self.unreleased.extend(groups)  # still memory: keep it counted, retry at close
            raise
        if self.budget is not None:
            self.budget.give(len(groups) * self.G)

    def give_back(self, count: int | None = None) -> int:
        """Release up to `count` groups the pool holds but no block uses (None: all): spare
        groups first, then cached pages (unmapped after their fences). Returns groups given back."""
        n = len(self.spare) if count is None else min(max(0, count), len(self.spare))
        spare = self.spare[len(self.spare) - n:]
        del self.spare[len(self.spare) - n:]
        try:
            self._release(spare)
        except Exception:
            pass  # kept in `unreleased`
        pages = sorted(self.cached, reverse=True)
        if count is not None:
            pages = pages[:max(0, count - n)]
        if pages:
            self._release(self._unmap(pages))
        return n + len(pages)

    def reclaim_for_budget(self, nbytes: int) -> int:
        """The budget's callback: another pool is short of `nbytes`."""
        with self.lock:
            if self.closed:
                return 0
            try:
                return self.give_back(-(-nbytes // self.G)) * self.G
            except Exception:
                return 0

    def cached_bytes(self) -> int:
        """The budget's estimate of what `reclaim_for_budget` could give (read without the lock)."""
        return 0 if self.closed else (len(self.cached) + len(self.spare)) * self.G

    def set_limit(self, limit: int | None) -> None:
        self.check_open()
        self.limit = limit
        lp = self.limit_pages
        if lp is not None and self.num_held > lp:
            self.give_back(self.num_held - lp)

    # ---------------------------------------------------------------- figures ----
    def available_blocks(self) -> int:
        """Blocks alloc can give now, counting the cached pages other pools of the budget
        would give back (exact when blocks and pages divide one another, no free block is
        partly mapped and nothing changes in between; a lower bound otherwise)."""
        new = None  # groups that may be created
        if self.limit is not None:
            new = max(0, self.limit_pages - self.num_held)
        if self.budget is not None and (b := self.budget.stats()).limit is not None:
            more = max(0, b.limit - b.used + self.budget.reclaimable(self.token)) // self.G
            new = more if new is None else min(new, more)
        room = self.M - self.num_mapped if new is None else min(self.M - self.num_mapped, len(self.spare) + new)
        if self.P % self.B == 0:
            fresh = room * (self.P // self.B)
        else:
            fresh = room // self.span_max
        return min(self.N - self.num_used, self.num_warm + fresh)

    def stats(self) -> PoolStats:
        return PoolStats(
            num_blocks=self.N, block_bytes=self.B * self.config.num_buffers, page_size=self.P, group_bytes=self.G,
            num_used_blocks=self.num_used, num_warm_blocks=self.num_warm, num_mapped_pages=self.num_mapped,
            num_cached_pages=len(self.cached), num_spare_pages=len(self.spare), mapped_bytes=self.num_mapped * self.G,
            used_bytes=self.num_used * self.B * self.config.num_buffers, peak_mapped_bytes=self.peak_mapped * self.G,
            limit=self.limit, available_blocks=self.available_blocks())

    def check_invariants(self) -> None:
        """Assert the books are consistent (tests, debugging). Lock held."""
        users = [0] * self.M
        for b in range(self.N):
            first, last = self.pages_of(b)
            miss = sum(self.groups[p] is None for p in range(first, last + 1))
            assert self.miss[b] == miss, (b, self.miss[b], miss)
            if self.used[b]:
                assert miss == 0, f"block {b} in use on an unmapped page"
                for p in range(first, last + 1):
                    users[p] += 1
            elif miss == 0:
                assert b in self.warm.get(first, ()), f"warm block {b} not booked"
            else:
                assert b in self.cold, f"cold block {b} not in the heap"
        assert users == self.users
        assert self.num_used == sum(self.used)
        mapped = {p for p in range(self.M) if self.groups[p] is not None}
        assert _PLANNED not in self.groups
        assert len(mapped) == self.num_mapped
        assert self.cached == {p for p in mapped if not users[p]}
        assert self.num_warm == sum(len(d) for d in self.warm.values())
        assert self.busy_warm == {p for p in self.warm if users[p]} and self.idle_warm == {p for p in self.warm if not users[p]}
        held = [self.groups[p] for p in mapped] + self.spare + self.unreleased
        assert len({id(g) for g in held}) == len(held), "a group is in two places"

    # ---------------------------------------------------------------- closing ----
    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("this pool was closed; create a new vattn.ElasticPool")

    def close(self) -> None:
        """Unmap and release every page (after the device finished), leave the budget."""
        errors: list[Exception] = []
        with self.lock:
            if self.closed:
                return
            self.closed = True
            mapped = [p for p in range(self.M) if self.groups[p] is not None]
            try:
                self._wait(mapped)
                fence = self.backend.fence()
                if fence is not None:
                    self.backend.wait(fence)
            except Exception as e:
                errors.append(e)
            for _ in range(2):  # once more if the unmap failed (a transient error)
                try:
                    self.backend.unmap(self.bases, [p * self.P for p in mapped], self.P)
                    break
                except Exception as e:
                    errors.append(e)
            groups = [self.groups[p] for p in mapped] + self.spare + self.unreleased
            self.groups = [None] * self.M
            self.spare, self.unreleased = [], []
            self.num_mapped = 0
            self.cached.clear()
            try:
                self.backend.release(groups)
            except Exception as e:
                errors.append(e)
            if self.budget is not None:
                self.budget.give(len(groups) * self.G)
                self.budget.unregister(self.token)
        if errors:
            raise errors[0]


class ElasticPool:
    """Block tensors in reserved virtual memory; physical pages only under blocks in use.

    ```
    pool = vattn.ElasticPool(num_blocks=4096, block_shape=(16, 8, 128), dtype="float16",
                             num_buffers=2 * num_layers, device="cuda", limit=8 << 30)
    k0, v0 = pool.buffer(0), pool.buffer(1)   # [num_blocks, 16, 8, 128]: the server's paged K/V
    ids = pool.alloc(3)                       # [7, 8, 9], or None: memory is short, schedule less
    ...                                       # the server's kernels read k0[ids], v0[ids]
    pool.free(ids)                            # after enqueuing the last kernels that read them
    pool.set_limit(4 << 30); pool.trim()      # give memory back now
    ```
    Use as a context manager or call `close()`; the tensors must not be used after it.
    """

    def __init__(self, num_blocks: int, block_shape: int | Sequence[int], dtype: torch.dtype | str = torch.float16,
                 num_buffers: int = 1, *, device: str | torch.device = "cpu", page_size: int | None = None,
                 limit: int | None = None, budget: Budget | None = None, sync: str = "stream",
                 cuda_driver: str = "auto", grow: int | None = None, zero_new: bool = False,
                 backend: Backend | None = None) -> None:
        """See `PoolConfig` for the arguments. `backend`: a ready `vattn.vmem.Backend` instead of
        the one `device` names (tests)."""
        self.config = c = PoolConfig(num_blocks, block_shape, dtype, num_buffers, device, page_size, limit, sync,
                                     cuda_driver, grow, zero_new)
        if budget is not None and not isinstance(budget, Budget):
            raise InvalidConfigError(f"budget must be a vattn.Budget or None, got {budget!r}")
        self.backend = backend if backend is not None else make_backend(torch.device(c.device), c.cuda_driver)
        try:
            page = c.page_size if c.page_size is not None else self.backend.default_page_size
            self.backend.check_page_size(page)
            self.page_size = page
            buffer_bytes = -(-c.num_blocks * c.block_bytes // page) * page
            self._range = self.backend.reserve(buffer_bytes * c.num_buffers, page)
        except BaseException:
            if backend is None:
                self.backend.close()
            raise
        self.buffer_bytes = buffer_bytes
        bases = [self._range.addr + i * buffer_bytes for i in range(c.num_buffers)]
        shape = (c.num_blocks, *c.block_shape)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        self._buffers = [self.backend.tensor(self._range, i * buffer_bytes, shape, strides, c.dtype)
                         for i in range(c.num_buffers)]
        self._bytes: list[torch.Tensor] = []  # each buffer's reserved bytes, uint8 (zero_new)
        group = page * c.num_buffers
        grow = c.grow if c.grow is not None else max(1, min(8, (16 << 20) // group))
        dev = self.backend.device
        sync = (lambda: torch.cuda.synchronize(dev)) if c.sync == "device" and dev.type == "cuda" else None
        zero = functools.partial(_zero_new_pages, weakref.ref(self)) if c.zero_new and \
            not self.backend.new_pages_zeroed else None
        self._books = _Books(c, self.backend, bases, page, budget, grow, sync, zero)
        self._finalizer = weakref.finalize(self, _close, self._books, self.backend)

    # ----------------------------------------------------------------- tensors ----
    def buffer(self, index: int) -> torch.Tensor:
        """Buffer `index` as a `[num_blocks, *block_shape]` tensor (block i is row i)."""
        try:
            i = as_int(index, "index", InvalidRequestError)
        except InvalidRequestError:
            i = -1
        if not 0 <= i < self.config.num_buffers:
            raise InvalidRequestError(f"buffer index must be an int in [0, {self.config.num_buffers}), got {index!r}")
        if not self._buffers:
            raise ClosedError("this pool was closed; create a new vattn.ElasticPool")
        return self._buffers[i]

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers)

    # ------------------------------------------------------------------ blocks ----
    def alloc(self, n: int) -> list[int] | None:
        """`n` free block ids, their pages mapped; None (nothing changed) when the free
        blocks, the limit or the budget cannot give `n` now: a scheduling miss."""
        n = as_int(n, "n", InvalidRequestError)
        if n < 0:
            raise InvalidRequestError(f"n must be >= 0, got {n}")
        return self._alloc(n, None)

    def take(self, ids: Iterable[int]) -> list[int] | None:
        """Allocate these free blocks (a server that picks its own ids); None when memory is short."""
        return self._alloc(None, self._ids(ids))

    def pin(self, ids: Iterable[int], what: str, hint: str, *, zero: bool = False,
            error: type[Exception] = OutOfPhysicalMemoryError) -> list[int]:
        """Take blocks that must stay mapped (a server's null, padding or trash blocks, or
        every block when it cannot run on elastic memory), or raise `error` ("no memory for
        `what` ...; `hint`") when memory cannot back them now (nothing changed then). `zero`:
        clear them too, whatever `zero_new` says (blocks read as padding must read zeros).
        They are blocks in use like any other: they stay mapped until the caller frees them."""
        ids = self._ids(ids)
        if self.take(ids) is None:
            books = self._books
            pages = {p for b in ids for p in range(books.pages_of(b)[0], books.pages_of(b)[1] + 1)}
            under = "" if books.limit is None else f" under a limit of {books.limit} bytes"
            raise error(f"no memory for {what} ({len(pages)} page group(s) of {books.G} bytes{under}); {hint}")
        if zero:
            self._zero_blocks(ids)
        return ids

    def _alloc(self, n: int | None, ids: list[int] | None) -> list[int] | None:
        books = self._books
        for attempt in range(2):
            with books.lock:
                if ids is not None:
                    books.check_open()
                    for b in ids:
                        if books.used[b]:
                            raise UnknownBlockError(f"block {b} is already allocated")
                if n == 0 or ids == []:
                    books.check_open()
                    return []
                got, need = books.alloc(n, ids)
            if got is not None or not need or attempt or books.budget is None:
                return got
            books.budget.reclaim(need, requester=books.token)  # our lock is not held here
        return None

    def free(self, ids: Iterable[int]) -> None:
        """Return blocks. Their pages stay mapped (cached) until memory is wanted; a fence
        recorded now orders any later unmap after the kernels enqueued so far."""
        ids = self._ids(ids)
        with self._books.lock:
            self._books.free(ids)

    def _ids(self, ids: Iterable[int]) -> list[int]:
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise InvalidRequestError(f"ids must be a list of block ids, got {ids!r}")
        out = [as_int(b, "a block id", InvalidRequestError) for b in ids]
        n = self.config.num_blocks
        for b in out:
            if not 0 <= b < n:
                raise UnknownBlockError(f"block id {b} is out of range [0, {n})")
        if len(set(out)) != len(out):
            raise UnknownBlockError(f"block ids {out} name a block twice")
        return out

    # ------------------------------------------------------------------ memory ----
    def set_limit(self, limit: int | None) -> None:
        """Change the limit on mapped bytes at run time (None: none). New blocks that
        need memory beyond it are refused; cached pages above it are given back now; pages
        under blocks in use stay until the blocks are freed (then they are given back)."""
        limit = _limit(limit) if limit is not None else None
        with self._books.lock:
            self._books.set_limit(limit)

    @property
    def limit(self) -> int | None:
        return self._books.limit

    def trim(self) -> int:
        """Give back every cached and spare page now (waits for the fences). Returns bytes given back."""
        with self._books.lock:
            self._books.check_open()
            return self._books.give_back() * self._books.G

    def available_blocks(self) -> int:
        """Blocks `alloc` can give now, counting the cached pages other pools of the same
        budget would give back: the count a scheduler checks before it admits work."""
        with self._books.lock:
            self._books.check_open()
            return self._books.available_blocks()

    @property
    def num_free_blocks(self) -> int:
        return self._books.N - self._books.num_used

    def stats(self) -> PoolStats:
        with self._books.lock:
            self._books.check_open()
            return self._books.stats()

    def check_invariants(self) -> None:
        """Assert the books are consistent (tests and debugging)."""
        with self._books.lock:
            self._books.check_invariants()

    # ---------------------------------------------------------------- clearing ----
    def _zero_blocks(self, ids: list[int]) -> None:
        if ids:
            idx = torch.tensor(ids, dtype=torch.int64, device=self._buffers[0].device)
            for buf in self._buffers:
                buf.index_fill_(0, idx, 0)
            self._cleared()

    def _cleared(self) -> None:
        """With sync="device" (other streams read the blocks) wait for the clearing, which
        was enqueued on the current stream, before the caller sees the blocks."""
        dev = self.backend.device
        if self.config.sync == "device" and dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    # ----------------------------------------------------------------- closing ----
    def close(self) -> None:
        """Release all physical memory and leave the budget. Idempotent."""
        self._finalizer()
        self._buffers, self._bytes = [], []
        self._range = None  # the address space goes when the last tensor view goes

    def __enter__(self) -> ElasticPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"ElasticPool(num_blocks={c.num_blocks}, block_shape={c.block_shape}, dtype={c.dtype}, "
                f"num_buffers={c.num_buffers}, device={c.device}, page_size={self.page_size}, limit={self.limit})")


def _zero_new_pages(ref: weakref.ref, pages: list[int]) -> None:
    """zero_new: clear the pages an alloc just mapped with new memory (the books' lock is
    held: no other alloc hands out a block on them before they are clear)."""
    pool = ref()
    if pool is None:
        return
    if not pool._bytes:
        pool._bytes = [pool.backend.tensor(pool._range, i * pool.buffer_bytes, (pool.buffer_bytes,), (1,), torch.uint8)
                       for i in range(pool.config.num_buffers)]
    pool.backend.zero(pool._bytes, pages, pool.page_size)
    pool._cleared()


def _close(books: _Books, backend: Backend) -> None:
    try:
        books.close()
    finally:
        backend.close()


def _positive(name: str, value: object) -> int:
    return as_int(value, name, InvalidConfigError, low=1, what="a positive int")


def _limit(value: object) -> int:
    return as_int(value, "limit", InvalidConfigError, low=0, what=">= 0 bytes or None")


__all__ = ["ElasticPool", "PoolConfig", "PoolStats", "UnknownBlockError", "SYNC_MODES"]
