"""vLLM's scheduler side: its `BlockPool` on an `ElasticPool` whose backend records page
operations (`PageOps`) for the workers instead of mapping memory (`SchedulerKV`)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from vattn.errors import InvalidConfigError, OutOfPhysicalMemoryError
from vattn.idle import IdleTrim
from vattn.integrations.vllm.layout import BlockLayout, reserve_groups
from vattn.pool import ElasticPool, PoolStats
from vattn.vmem.base import Backend

logger = logging.getLogger("vattn.vllm")

ALLOC_RETRY_S = 2.0  # how long blocks counted as free may wait on a shared budget's members
REFUSED_RETRY_S = 1.0  # after a worker could not fill its reserve, ask again this much later
NULL_BLOCK = 0  # vLLM's null block: padding and skipped blocks read it; always mapped


# -------------------------------------------------------------- the page log ----
@dataclass
class PageOps:
    """A batch of page operations, numbered; applied in order by every worker.

    `ops`: ("create", [group ids]) · ("map", [pages], [group ids]) · ("zero", [pages]: just
    mapped with new memory, see `ElasticPool(zero_new=True)`) · ("unmap", [pages]) ·
    ("release", [group ids]). `seq` counts batches from 1; `key` is the block layout's."""

    seq: int
    key: tuple
    ops: list[tuple] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for op in self.ops:
            out[op[0]] = out.get(op[0], 0) + len(op[1])
        return out


class _Range:
    addr = 0

    def __init__(self, size: int) -> None:
        self.size = size


class RecordingBackend(Backend):
    """The scheduler's backend: no memory; it writes the page operations the elastic
    pool makes into a log (page indices and group ids) for the workers to replay."""

    def __init__(self, page: int) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self.granularity = page
        self.default_page_size = page
        self.page = page
        self.log: list[tuple] = []
        self._next = 0
        # Page groups every worker holds created and ready (None: not counted, the device is
        # trusted). Each create the books record uses them up; the books' limit keeps within.
        self.ready: int | None = None
        # a shared budget's responder records from its own thread (under the pool's lock, so in
        # order); the scheduler's drain must not swap the log between its read and its append
        self._log_lock = threading.Lock()

    def _record(self, op: tuple) -> None:
        with self._log_lock:
            self.log.append(op)

    def reserve(self, nbytes: int, alignment: int) -> _Range:
        return _Range(nbytes)

    def tensor(self, rng: Any, offset: int, shape: Sequence[int], strides: Sequence[int],
               dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(tuple(shape), tuple(strides), dtype=dtype, device="meta")

    def _create(self, n: int, num_buffers: int, page_size: int) -> list:
        if self.ready is not None:
            if n > self.ready:  # a safety net: the books' limit is held + ready
                raise OutOfPhysicalMemoryError(f"the workers hold {self.ready} page groups ready, not {n}")
            self.ready -= n
        ids = list(range(self._next, self._next + n))
        self._next += n
        self._record(("create", ids))
        return ids

    def _release(self, groups: list) -> None:
        self._record(("release", list(groups)))

    def _map(self, bases, offsets, groups, page_size) -> None:
        self._record(("map", [o // page_size for o in offsets], list(groups)))

    def _unmap(self, bases, offsets, page_size) -> None:
        self._record(("unmap", [o // page_size for o in offsets]))

    def zero(self, views, pages, page_size) -> None:
        self._record(("zero", sorted(pages)))  # each worker clears them unless its new memory reads zeros

    def drain(self) -> list[tuple]:
        with self._log_lock:
            log, self.log = self.log, []
        return log


def _new_books(g: BlockLayout, limit: int | None, budget: Any = None) -> tuple[ElasticPool, RecordingBackend]:
    """The scheduler's books and their first operations (block 0 mapped). Deterministic:
    a worker builds the same books to know the state its allocation starts in. Pages
    mapped with new memory are cleared (`zero_new`: a "zero" operation for the workers)."""
    rec = RecordingBackend(g.page_size)
    pool = ElasticPool(g.num_blocks, (g.block_bytes,), torch.uint8, len(g.regions), device="cpu",
                       page_size=g.page_size, limit=limit, grow=1, zero_new=True, backend=rec, budget=budget,
                       scratch=False)  # books only: each worker backs its own free pages with scratch
    try:
        pool.pin([NULL_BLOCK], "the null block", f"VATTN_VLLM_LIMIT={limit} is too small", error=InvalidConfigError)
    except InvalidConfigError:
        pool.close()
        raise
    return pool, rec


# --------------------------------------------------------------- scheduler side ----
class SchedulerKV:
    """vattn under one vLLM `BlockPool` (the scheduler's side). vLLM's free queue keeps
    only the free blocks that must stay mapped (prefix-cached, watched); the others are
    free blocks of the elastic pool, which hands them out page-aware."""

    def __init__(self, block_pool: Any, g: BlockLayout, limit: int | None = None, *,
                 worker_regions: Sequence[int] | None = None, reserve: int | None = None,
                 budget: Any = None) -> None:
        """`limit`: bytes of pages each worker may hold. `worker_regions`: the number of
        regions of every worker (pipeline stages differ; default: this layout's). `reserve`:
        page groups the workers hold ready (None: the device is trusted and never asked).
        `budget`: a `vattn.Budget` shared with other processes (`VATTN_BUDGET`), or None."""
        if block_pool.num_gpu_blocks != g.num_blocks:
            raise InvalidConfigError(f"the block pool has {block_pool.num_gpu_blocks} blocks, the KV cache "
                                     f"configuration {g.num_blocks}")
        self.block_pool = block_pool
        self.layout = g
        self.budget = budget  # a shared vattn.Budget (VATTN_BUDGET), or None
        self.pool, self.recorder = _new_books(g, limit, budget)
        self.recorder.drain()  # the workers start in this state (see WorkerKV)
        self.seq = 0
        self.idle = IdleTrim()  # the idle policy (vattn.idle); its delay is VATTN_VLLM_IDLE_TRIM_S's, read at each call
        # A limit in bytes per worker is a number of page groups per stage; the smallest binds.
        self.worker_group_bytes = g.page_size * max(worker_regions or [len(g.regions)])
        self.limit = limit
        self.recorder.ready = reserve
        self.target = reserve_groups()  # what the next top-up asks each worker to hold ready
        self.retry_at = 0.0
        self.short = False  # the last schedule saw less than a page group (or a block) free
        self.misses = 0  # allocations vLLM found short (`note_miss`) since the last `want_reserve`
        self.num_misses = 0  # ... in all
        self.num_refusals = 0
        self._sync_cap()
        q = block_pool.free_block_queue
        for b in q.popleft_n(q.num_free_blocks):  # every block is cold and free: the pool's now
            assert b.ref_cnt == 0 and b.block_hash is None, b

    # ---------------------------------------------------------- BlockPool hooks ----
    def num_free_blocks(self) -> int:
        """Blocks `get_new_blocks` can give now: vLLM's mapped free blocks and what the
        elastic pool can back under its limit (and the workers' confirmed reserve)."""
        n = self.block_pool.free_block_queue.num_free_blocks + self.pool.available_blocks()
        # less than one page group free, or less than one block where a block is larger than a page
        # (before issue 41 this compared with a page only: never short once one big block was free)
        g = self.layout
        self.short = n * g.block_bytes < max(g.page_size, g.block_bytes)
        return n

    def note_miss(self) -> None:
        """vLLM found fewer free blocks than a request needed (`allocate_slots` returned
        None: it waits or preempts). The next top-up grows the reserve, whatever the block
        and page sizes: a request that needs more blocks than the reserve covers is a miss
        every step until the reserve grows, and with nothing running nothing else frees."""
        self.misses += 1
        self.num_misses += 1

    def num_unused_blocks(self) -> int:
        """Free blocks whatever the memory (for `reset_prefix_cache`'s "nothing in use")."""
        return self.block_pool.free_block_queue.num_free_blocks + self.pool.num_free_blocks

    def take(self, n: int) -> list:
        """`n` blocks for `get_new_blocks`: the elastic pool's first (packed into mapped
        pages, then fresh pages under the limit), then vLLM's free queue (evicting prefix
        -cached blocks in its LRU order, as stock vLLM does)."""
        bp = self.block_pool
        k = min(n, self.pool.available_blocks())
        ids = self.pool.alloc(k) if k else []
        # available_blocks is a lower bound of alloc and the recording backend never refuses:
        # only a shared budget can miss (a member reused pages it had published as cached)
        deadline, delay = time.monotonic() + ALLOC_RETRY_S, 0.001
        while ids is None and self.budget is not None and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(2 * delay, 0.1)
            ids = self.pool.alloc(k)
        if ids is None:
            ids = []  # vLLM's free queue may still have them; else the ValueError below
        assert self.budget is not None or len(ids) == k, "vattn: the pool refused blocks it counted as available"
        rest = n - len(ids)
        if rest > bp.free_block_queue.num_free_blocks:
            if ids:
                self.pool.free(ids)
            raise ValueError(f"Cannot get {n} free blocks from the pool (vattn: memory is short)")
        blocks = [bp.blocks[i] for i in ids]
        for b in blocks:
            assert b.ref_cnt == 0 and b.block_hash is None and b.prev_free_block is None, b
        return blocks + (bp.free_block_queue.popleft_n(rest) if rest else [])

    def release(self, blocks: list) -> None:
        """`free_blocks`' blocks to reuse first (no hash): those no watcher reads go back to
        the elastic pool (their pages stay mapped until memory is wanted); the others go to
        the front of vLLM's queue, as in stock vLLM."""
        mine, keep = self._split(blocks)
        if mine:
            self.pool.free([b.block_id for b in mine])
        self.block_pool.free_block_queue.prepend_n(keep)

    def _split(self, blocks: Iterable) -> tuple[list, list]:
        watched = self.block_pool._reuse_watchers
        mine, keep = [], []
        for b in blocks:
            (keep if b.block_hash is not None or b.block_id in watched or b.block_id == NULL_BLOCK
             else mine).append(b)
        return mine, keep

    # --------------------------------------------------------------- memory ----
    def reclaim(self) -> int:
        """Move free blocks vLLM holds without a reason (their hash was evicted or reset)
        from its queue to the elastic pool. Returns how many."""
        q = self.block_pool.free_block_queue
        mine, _ = self._split(_queue(q))
        for b in mine:
            q.remove(b)
        if mine:
            self.pool.free([b.block_id for b in mine])
        return len(mine)

    def trim(self, evict_prefix_cache: bool = True) -> int:
        """Give back every page no block holds (after evicting the free prefix-cached
        blocks, unless `evict_prefix_cache` is False). Returns bytes given back; the
        operations go to the workers with the next `drain`."""
        bp = self.block_pool
        if evict_prefix_cache:
            for b in list(_queue(bp.free_block_queue)):
                if b.block_hash is not None and b.block_id not in bp._reuse_watchers:
                    bp._maybe_evict_cached_block(b)
        self.reclaim()
        nbytes = self.pool.trim()
        self._sync_cap()
        return nbytes

    def set_limit(self, limit: int | None) -> None:
        """Change the bytes of pages the workers may hold; cached pages over it go back
        with the next batch of operations (used ones when their blocks are freed): the
        next step's, or, while the engine is idle, the next `on_idle`'s (the module's
        `set_limit(engine_core, limit)` sends them at once)."""
        self.reclaim()
        self.limit = limit
        self._sync_cap()

    # ------------------------------------------------------ the workers' reserve ----
    @property
    def reserve(self) -> int | None:
        """Page groups every worker holds created and ready (None: not counted)."""
        return self.recorder.ready

    def _held(self) -> int:
        st = self.pool.stats()
        return st.num_mapped_pages + st.num_spare_pages

    def limit_groups(self) -> int | None:
        """Page groups the limit allows each worker (the stage with the most regions binds)."""
        return None if self.limit is None else self.limit // self.worker_group_bytes

    def _sync_cap(self) -> None:
        """The books' limit: the user's, and no more groups than the workers hold (what the
        books hold and the confirmed reserve), so that no worker is ever asked to create."""
        caps = [c for c in (self.limit_groups(), None if self.reserve is None else self._held() + self.reserve)
                if c is not None]
        limit = min(caps) * self.pool.stats().group_bytes if caps else None
        if limit != self.pool.limit:
            self.pool.set_limit(limit)

    def want_reserve(self, waiting: bool, now: float | None = None) -> int | None:
        """The reserve to ask the workers for before the next schedule, or None (enough, or
        a refusal is being waited out). The request doubles (up to what the limit allows)
        when the last schedule missed: vLLM found fewer free blocks than a request needed
        (`note_miss`), or requests wait and less than a page group (or a block) was free."""
        if self.reserve is None:
            return None
        missed, self.misses = self.misses > 0, 0
        now = time.monotonic() if now is None else now
        if now < self.retry_at:
            return None
        held = self._held()
        room = self.layout.num_pages - held
        lg = self.limit_groups()
        if lg is not None:
            room = min(room, lg - held)
        grow = (missed or (waiting and self.short)) and self.reserve < room
        if grow:
            self.target = min(2 * self.target, max(room, 1))
        want = max(0, min(self.target, room))
        if self.reserve >= max(1, want // 2) and not grow:
            return None
        return want if want != self.reserve else None

    def confirm(self, ready: Sequence[int], asked: int, now: float | None = None) -> None:
        """The workers' answer to a top-up: each holds `ready[i]` groups; the least counts."""
        got = min(ready) if ready else 0
        self.recorder.ready = got
        self._sync_cap()
        if got < asked:
            self.num_refusals += 1
            self.retry_at = (time.monotonic() if now is None else now) + REFUSED_RETRY_S
            logger.warning("vattn: the device refused KV pages: the workers hold %s of %d page groups asked for "
                           "ready; requests wait or are preempted until memory frees (asked again in %.0f s)",
                           list(ready), asked, REFUSED_RETRY_S)
        else:
            self.retry_at = 0.0

    def release_reserve(self) -> None:
        """The idle trim: the workers give their reserve back too (the next step asks anew)."""
        if self.reserve is not None:
            self.recorder.ready = 0
            self.target = reserve_groups()
            self._sync_cap()

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def drain(self) -> PageOps | None:
        """The operations since the last drain, as the next numbered batch (None: none)."""
        ops = self.recorder.drain()
        if not ops:
            return None
        self.seq += 1
        return PageOps(self.seq, self.layout.key, ops)

    def check_invariants(self) -> None:
        """Every block vLLM uses, caches or watches is in use in the elastic pool (mapped)."""
        bp = self.block_pool
        self.pool.check_invariants()
        in_queue = {b.block_id for b in _queue(bp.free_block_queue)}
        used = self.pool._books.used
        for b in bp.blocks:
            if b.block_id == NULL_BLOCK or b.ref_cnt > 0 or b.block_hash is not None or b.block_id in in_queue:
                assert used[b.block_id], f"block {b.block_id} is held by vLLM but free in vattn"
            else:
                assert not used[b.block_id], f"block {b.block_id} is free in vLLM but held in vattn"


def _queue(q: Any) -> Iterable:
    """The blocks of a `FreeKVCacheBlockQueue`, front to back."""
    b = q.fake_free_list_head.next_free_block
    while b is not None and b is not q.fake_free_list_tail:
        nxt = b.next_free_block
        yield b
        b = nxt
