"""vLLM v1 on vattn memory: everything `patches/vllm-<version>.patch` calls.

The patch keeps vLLM's block tables, prefix caching, scheduler and kernels. It changes
where the KV cache's *physical* memory comes from: the one backing allocation of the KV
cache becomes reserved virtual memory, and physical pages are mapped under the blocks in
use only. `gpu_memory_utilization` still sizes the allocation (the block-id space), but
it is now a limit: memory grows with load and goes back when the engine is idle.

Two processes, one set of books
-------------------------------
In vLLM v1 the scheduler (EngineCore: `BlockPool`) and the workers (the KV tensors) are
different processes (one process with multiprocessing off; the code path is the same).

```
 EngineCore (scheduler)                              worker (one per GPU)
 BlockPool ── SchedulerKV: an ElasticPool            WorkerKV: the backing allocation,
   get_new_blocks → take()   over a RecordingBackend   reserved virtual, never moves
   free_blocks    → release()  (no memory: it          apply(ops): create / map / unmap /
   get_num_free_blocks         records page ops)        release, in order, before the
   schedule() ── SchedulerOutput.vattn_ops ───────────▶ forward of that step
   idle       ── collective_rpc(apply_rpc, ops) ─────▶ (the same, when no step follows)
```

- **Who decides.** The scheduler alone: `SchedulerKV` holds an `ElasticPool` whose
  backend records what it would do (page-aware placement, the limit, what to give back)
  as page operations numbered in sequence. The pool's block ids are vLLM's block ids.
- **Who maps, when.** Every `schedule()` drains the log into `SchedulerOutput.vattn_ops`;
  each worker applies it at the top of `Worker.execute_model`, before the forward that
  writes the new blocks (and before vLLM zeroes or copies blocks for that step). With
  tensor or pipeline parallelism every worker applies the same page operations to its
  own shard. A worker checks the sequence numbers: a lost or repeated batch is an error,
  never a silent divergence.
- **The fence.** A block is freed by the scheduler after the output of a step that read
  it came back, but with async scheduling or a batch queue later steps that still read it
  may already be enqueued. Every such step was enqueued on the worker before the
  scheduler output carrying the unmap reached it (one worker runs its messages in order),
  so the worker waits for the whole device (`torch.cuda.synchronize`, every stream)
  before its first unmap of a batch. Unmaps happen only when memory is wanted (the limit,
  a trim), so that wait is rare; maps never wait.
- **Which blocks may lose their pages.** A vLLM block keeps its pages while it is in use
  (`ref_cnt > 0`), while it holds a prefix-cache hash (a cached block that a later
  request may hit), while a reuse watcher reads it (`unpin_blocks`), and block 0 (the
  null block, which padding reads) always. Only a free block with none of these goes
  back to the elastic pool, and a page is unmapped only when no block on it is held.
- **Idle.** When the engine has had no work for `VATTN_VLLM_IDLE_TRIM_S` seconds
  (default 30; 0: at once; negative: never), EngineCore evicts the prefix-cache blocks
  nobody uses, gives back every page no block holds, and sends the operations to the
  workers with `collective_rpc` (no step follows to carry them). Operations recorded
  while idle otherwise (`set_limit`) are sent the same way at once.
- **Short of memory** (the limit, `VATTN_VLLM_LIMIT` bytes per worker or `set_limit`):
  `get_num_free_blocks` counts what can be backed now, so `allocate_slots` returns None
  and vLLM preempts or waits, as when its own pool is full. Cached prefix blocks are
  handed out (evicted) only after the memory under the limit is used. The count looks at
  the limit only: if the device refuses pages the limit allows (another process took the
  memory an idle trim gave back), the worker's `create` raises inside `execute_model` and
  the engine dies. Sharing a GPU, give each process a limit whose sum fits it.
- **Several servers on one GPU** (`VATTN_BUDGET=NAME`, optional `VATTN_BUDGET_LIMIT`):
  the scheduler's books draw from the budget NAME shared with the other servers of the
  GPU (`vattn.Budget.shared`; the first visible GPU's, one worker's bytes: with tensor
  parallelism every worker maps the same pages). Its count includes what the others
  would give back; asked by a short member, its budget responder gives back pages no
  block holds, and `idle_wakeup` brings the idle loop round every `POLL_S` to send those
  operations to the workers: the budget counts them free when the scheduler records them,
  the workers unmap them within about `POLL_S` (or with the next step). Its limit, or
  this engine's own (`vattn budget set-limit NAME BYTES --pid <EngineCore pid>`), can
  change at run time from any process, with multiprocessing on. The workers then keep no
  reserve of created pages: the budget is what keeps the other processes from the memory
  the scheduler counts, so its limit must fit what the GPU can give the KV caches.

Environment: `VATTN_VLLM=0` turns it off (stock vLLM, for A/B runs), `VATTN_VLLM_PAGE_SIZE`
(bytes; default 2 MiB, the CUDA granularity), `VATTN_VLLM_LIMIT`, `VATTN_VLLM_IDLE_TRIM_S`,
`VATTN_BUDGET`, `VATTN_BUDGET_LIMIT`. The scheduler and the workers read the same
variables (workers inherit the environment; only the scheduler joins the budget).

Layouts: the KV cache's block-compact layouts (`LBNHC`/NHD, `LBHNC`/HND, `BLNHC`,
`BLHNC`), attention layers only. Anything else (Mamba raw buffers, HiSparse host pools,
non-block-compact layouts) is detected by the scheduler and by each worker from the
`KVCacheConfig` (the same one, with the same environment), and vLLM then runs on its own
memory with a warning. Every batch carries the layout's `BlockLayout.key`; a worker refuses a
batch for another layout. A worker on vattn memory under a scheduler that fell back gets
no batches at all, which is not detected (it needs different `VATTN_VLLM*` variables in
the two processes).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from vattn.budget_shared import POLL_S
from vattn.errors import (  # OpsOutOfOrderError and UnsupportedLayoutError are this module's (re-exported)
    InvalidConfigError, OpsOutOfOrderError, OutOfPhysicalMemoryError, UnsupportedLayoutError)
from vattn.integrations import _env
from vattn.pool import ElasticPool, PoolStats
from vattn.vmem import make_backend
from vattn.vmem.base import Backend

logger = logging.getLogger("vattn.vllm")

DEFAULT_PAGE_SIZE = 2 << 20  # the CUDA granularity on stock drivers
DEFAULT_IDLE_TRIM_S = 30.0
ALLOC_RETRY_S = 2.0  # how long blocks counted as free may wait on a shared budget's members
DEFAULT_RESERVE = 4  # page groups each worker creates ahead of the scheduler (see "Refused pages")
REFUSED_RETRY_S = 1.0  # after a worker could not fill its reserve, ask again this much later
NULL_BLOCK = 0  # vLLM's null block: padding and skipped blocks read it; always mapped


# ------------------------------------------------------------------ configuration ----
def enabled() -> bool:
    """False when `VATTN_VLLM=0` (stock vLLM memory)."""
    return _env.flag("VATTN_VLLM")


def page_size() -> int:
    """Bytes of one page (per region); `VATTN_VLLM_PAGE_SIZE`, default 2 MiB."""
    return _env.number("VATTN_VLLM_PAGE_SIZE", int, DEFAULT_PAGE_SIZE, low=1, what="an integer number of bytes")


def memory_limit() -> int | None:
    """`VATTN_VLLM_LIMIT`: bytes of KV pages each worker may hold (None: the whole cache)."""
    return _env.number("VATTN_VLLM_LIMIT", int, None, low=0, what="an integer number of bytes")


def idle_trim_s() -> float | None:
    """Seconds of idleness before memory goes back; None: never."""
    return _env.idle_trim_s("VATTN_VLLM_IDLE_TRIM_S", DEFAULT_IDLE_TRIM_S)


def reserve_groups() -> int:
    """`VATTN_VLLM_RESERVE`: page groups each worker keeps created ahead (default 4; the
    scheduler doubles what it asks for while requests wait on memory)."""
    return _env.number("VATTN_VLLM_RESERVE", int, DEFAULT_RESERVE, low=1, what="an integer number of page groups")


def settings() -> dict[str, Any]:
    """The settings the scheduler and every worker must agree on (`start` compares them)."""
    return {"VATTN_VLLM": enabled(), "VATTN_VLLM_PAGE_SIZE": page_size(), "VATTN_VLLM_LIMIT": memory_limit(),
            "VATTN_VLLM_RESERVE": reserve_groups()}


# ------------------------------------------------------------------- block layout ----
@dataclass(frozen=True)
class BlockLayout:
    """Where each block's bytes are in the KV cache's backing allocation.

    Block `b` occupies `[region + b * block_bytes, region + (b + 1) * block_bytes)` in every
    region (a layer's K/V pages with a layer-outer layout, the whole cache with a
    block-outer one). Page `p` of every region is mapped and unmapped together (one page
    group of the elastic pool). Regions start on page boundaries and do not overlap.
    """

    num_blocks: int
    block_bytes: int
    page_size: int
    regions: tuple[int, ...]  # byte offsets into the backing allocation
    size: int  # bytes of the backing allocation vLLM asked for

    @property
    def num_pages(self) -> int:
        return -(-self.num_blocks * self.block_bytes // self.page_size)

    @property
    def reserved_bytes(self) -> int:
        """Address space to reserve: the allocation, and every region's last page whole."""
        end = max(self.size, max(self.regions) + self.num_pages * self.page_size)
        return -(-end // self.page_size) * self.page_size

    @property
    def key(self) -> tuple:
        """What the scheduler's page operations mean: which blocks lie on page `p` (the
        blocks, their bytes, the page). The regions are each worker's own: pipeline stages
        with other layer counts map page `p` in each of their own regions."""
        return (self.num_blocks, self.block_bytes, self.page_size)


def _layer_spec(kv_cache_config: Any, layer: str) -> Any:
    for group in kv_cache_config.kv_cache_groups:
        if layer in group.layer_names:
            spec = group.kv_cache_spec
            specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
            return specs[layer] if isinstance(specs, dict) else spec
    raise UnsupportedLayoutError(f"layer {layer!r} is in no KV cache group")


def block_layout(kv_cache_config: Any, page: int | None = None) -> BlockLayout:
    """The `BlockLayout` of a vLLM `KVCacheConfig` (read by duck typing: `num_blocks`,
    `kv_cache_tensors` with `size, layers, layer_stride, block_stride, offset`, and
    `kv_cache_groups` with `layer_names, kv_cache_spec.page_size_bytes`).

    Raises `UnsupportedLayoutError` when the blocks are not contiguous runs laid out
    regularly (then vLLM keeps its own memory)."""
    P = page_size() if page is None else page
    tensors = list(kv_cache_config.kv_cache_tensors)
    N = int(kv_cache_config.num_blocks)
    if not tensors:
        raise UnsupportedLayoutError("the model has no KV cache tensors")
    if len({t.size for t in tensors}) != 1:
        raise UnsupportedLayoutError("KV cache tensors of different sizes (more than one backing allocation)")
    size = tensors[0].size
    strides, regions = set(), set()
    for t in tensors:
        if getattr(t, "host_resident", False):
            raise UnsupportedLayoutError("host-resident KV cache tensors (HiSparse)")
        specs = [_layer_spec(kv_cache_config, name) for name in t.layers]
        if not all(getattr(s, "has_layer_views", True) for s in specs):
            raise UnsupportedLayoutError("layers without per-layer views (e.g. Mamba state) lay out their own bytes")
        pages = [s.page_size_bytes for s in specs]
        L, ls, bs, off = len(t.layers), t.layer_stride, t.block_stride, getattr(t, "offset", 0)
        pg = max(pages)
        if off + (L - 1) * ls + pg <= bs:  # block-outer: block b is [b * bs, (b + 1) * bs) of the whole allocation
            strides.add(bs)
            regions.add(0)
        elif pg <= bs and (L == 1 or ls >= N * bs):  # layer-outer, block-compact: a region per layer
            strides.add(bs)
            regions.update(off + i * ls for i in range(L))
        else:
            raise UnsupportedLayoutError(
                f"layout with layer_stride={ls}, block_stride={bs}, page={pg} is not block-compact; "
                "use VLLM_KV_CACHE_LAYOUT=NHD (LBNHC) or HND (LBHNC)")
    if len(strides) != 1:
        raise UnsupportedLayoutError(f"block strides differ between KV cache tensors: {sorted(strides)}")
    B = strides.pop()
    g = BlockLayout(N, B, P, tuple(sorted(regions)), size)
    span = g.num_pages * P
    for a, b in zip(g.regions, g.regions[1:]):
        if a % P or b - a < span:
            raise UnsupportedLayoutError(
                f"regions at {a} and {b} share a page of {P} bytes: the number of blocks ({N}) times the block "
                f"stride ({B}) must be a multiple of the page size (the patch aligns num_blocks for this)")
    if g.regions[-1] % P:
        raise UnsupportedLayoutError(f"a region at {g.regions[-1]} does not start on a page of {P} bytes")
    return g


def align_num_blocks(num_blocks: int, kv_cache_groups: Sequence[Any], block_outermost: bool,
                     block_stride: Any = None) -> int:
    """vLLM's planning hook: with a layer-outer layout, layer `l`'s blocks start at
    `l * num_blocks * stride`; round `num_blocks` down so that this is a whole number of
    pages (at most one page per layer is lost; at least one page's worth is kept).
    `block_stride(spec)`: vLLM's padded per-layer block stride (default: the page size)."""
    if not enabled() or block_outermost or num_blocks <= 1:
        return num_blocks
    P = page_size()
    m = 1
    for group in kv_cache_groups:
        for name in group.layer_names:
            spec = group.kv_cache_spec
            specs = getattr(spec, "kv_cache_specs", None)
            spec = specs[name] if isinstance(specs, dict) else spec
            s = block_stride(spec) if block_stride is not None else spec.page_size_bytes
            m = math.lcm(m, P // math.gcd(P, s))
    return max(m, num_blocks - num_blocks % m)


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
                       page_size=g.page_size, limit=limit, grow=1, zero_new=True, backend=rec, budget=budget)
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
        self.idle_since: float | None = None
        self.trimmed = False
        # A limit in bytes per worker is a number of page groups per stage; the smallest binds.
        self.worker_group_bytes = g.page_size * max(worker_regions or [len(g.regions)])
        self.limit = limit
        self.recorder.ready = reserve
        self.target = reserve_groups()  # what the next top-up asks each worker to hold ready
        self.retry_at = 0.0
        self.short = False  # the last schedule saw less than a page group free
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
        self.short = n * self.layout.block_bytes < self.layout.page_size
        return n

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
        a refusal is being waited out). While requests wait and the last schedule found
        less than a page group free, the request doubles (up to what the limit allows)."""
        if self.reserve is None:
            return None
        now = time.monotonic() if now is None else now
        if now < self.retry_at:
            return None
        held = self._held()
        room = self.layout.num_pages - held
        lg = self.limit_groups()
        if lg is not None:
            room = min(room, lg - held)
        grow = waiting and self.short and self.reserve < room
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


@dataclass(frozen=True)
class Workers:
    """What the workers said at start (`start`): their layout key (None: they keep vLLM's
    memory) and each one's number of regions (pipeline stages differ)."""

    key: tuple | None
    regions: tuple[int, ...]


_started: Workers | None = None  # set by `start` in EngineCore, read by `attach` (same process)


def attach(block_pool: Any, kv_cache_config: Any) -> SchedulerKV | None:
    """The scheduler's hook (`KVCacheCoordinator.__init__`): put `block_pool` on vattn
    memory. None (stock vLLM) when `VATTN_VLLM=0` or the layout is not supported; the
    workers reach the same decision from the same configuration, and under EngineCore
    `start` has checked that they did. Under EngineCore the workers keep a reserve of
    created pages and the scheduler hands out only what it covers (`before_schedule`)."""
    block_pool.vattn = None
    if not enabled():
        return None
    try:
        g = block_layout(kv_cache_config)
    except UnsupportedLayoutError as e:
        logger.warning("vattn: vLLM keeps its own KV memory: %s", e)
        return None
    w = _started
    if w is not None and w.key is None:
        return None  # the workers keep vLLM's memory (start checked that all of them do)
    if w is not None and w.key != g.key:
        raise InvalidConfigError(f"vattn: the scheduler's KV layout {g.key} (blocks, block bytes, page) differs "
                                 f"from its workers' {w.key}")
    budget = _env.budget()
    # On a shared budget the workers keep no reserve: the budget is what keeps the other
    # processes from the memory this scheduler counts (its limit must fit the GPU)
    block_pool.vattn = SchedulerKV(block_pool, g, memory_limit(), worker_regions=w.regions if w else None,
                                   reserve=0 if w and budget is None else None, budget=budget)
    logger.info("vattn: KV cache of %d blocks on elastic memory (%d regions, %d-byte pages, limit %s)",
                g.num_blocks, len(g.regions), g.page_size, memory_limit())
    return block_pool.vattn


def _scheduler_kv(scheduler: Any) -> SchedulerKV | None:
    kv = getattr(scheduler, "kv_cache_manager", scheduler)
    return getattr(getattr(kv, "block_pool", None), "vattn", None)


def take_ops(scheduler: Any) -> PageOps | None:
    """`Scheduler.schedule()`'s hook: this step's page operations (None when vattn is off
    or nothing changed). The engine is busy: the idle clock restarts."""
    skv = _scheduler_kv(scheduler)
    if skv is None:
        return None
    skv.idle_since, skv.trimmed = None, False
    return skv.drain()


def _send(engine_core: Any, skv: SchedulerKV) -> PageOps | None:
    """Send the operations recorded since the last step to the workers now (no step
    follows to carry them): the same `collective_rpc` as the idle trim."""
    ops = skv.drain()
    if ops is not None:
        engine_core.model_executor.collective_rpc(apply_rpc, args=(ops,))
    return ops


def set_limit(engine_core: Any, limit: int | None) -> None:
    """Change the bytes of KV pages each worker may hold, at run time, and send the page
    operations this makes (cached pages over the new limit unmapped) to the workers now.

    In-process only: `engine_core` is vLLM's `EngineCore` object, and this must run on the
    thread that drives it (with `VLLM_ENABLE_V1_MULTIPROCESSING=0`,
    `llm.llm_engine.engine_core.engine_core`, between `generate` calls). With the default
    multiprocess engine the scheduler is in another process: set `VATTN_VLLM_LIMIT` at
    start, or run it on a shared budget (`VATTN_BUDGET=NAME`) and change its limit from
    any process: `vattn budget set-limit NAME BYTES [--pid <EngineCore pid>]`."""
    skv = _scheduler_kv(getattr(engine_core, "scheduler", None))
    if skv is None:
        raise InvalidConfigError("this vLLM engine's KV cache is not on vattn memory")
    skv.set_limit(limit)
    _send(engine_core, skv)


# ------------------------------------------------------------------ start-up ----
def _unsupported(vllm_config: Any) -> str | None:
    """Why vattn cannot back this engine's KV cache, or None."""
    kv_transfer = getattr(vllm_config, "kv_transfer_config", None)
    if kv_transfer is not None:
        name = getattr(kv_transfer, "kv_connector", None) or "a KV connector"
        return (f"the KV connector {name} (--kv-transfer-config) registers or copies the whole KV buffer, "
                "and vattn maps it page by page")
    if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
        return ("sleep mode (--enable-sleep-mode) frees and restores the KV buffer through vLLM's cumem "
                "allocator, which does not see vattn's pages; VATTN_VLLM_IDLE_TRIM_S gives memory back when idle")
    return None


def hello_rpc(worker: Any) -> dict[str, Any]:
    """`collective_rpc` target at start: this worker's settings and layout."""
    w = worker_kv()
    return {"settings": settings(), "key": None if w is None else w.layout.key,
            "regions": 0 if w is None else len(w.layout.regions)}


def start(engine_core: Any, kv_cache_configs: Sequence[Any] = ()) -> None:
    """EngineCore's hook, once its workers allocated their KV caches and before the
    scheduler exists: refuse what vattn cannot back (KV connectors, sleep mode), check that
    every worker has the scheduler's `VATTN_VLLM*` settings and one block layout (each
    pipeline stage keeps its own regions), or raise InvalidConfigError with both values."""
    global _started
    _started = None
    answers = engine_core.model_executor.collective_rpc(hello_rpc)
    mine = settings()
    for rank, a in enumerate(answers):
        for name, value in mine.items():
            if a["settings"].get(name) != value:
                raise InvalidConfigError(
                    f"vattn: {name} is {value!r} in the scheduler (EngineCore) and {a['settings'].get(name)!r} in "
                    f"worker {rank}: give every vLLM process the same VATTN_VLLM* environment")
    if not enabled():
        return
    why = _unsupported(engine_core.vllm_config)
    if why is not None:
        raise InvalidConfigError(f"vattn cannot back this vLLM engine's KV cache: {why}. Run it without "
                                 "VATTN_VLLM=1 (stock memory), or without that feature")
    keys = {a["key"] for a in answers}
    if len(keys) > 1:
        detail = ", ".join(f"worker {r}: {a['key']}" for r, a in enumerate(answers))
        raise InvalidConfigError(
            "vattn: the workers lay out KV blocks differently (blocks, block bytes, page): " + detail + ". "
            "Pipeline stages with other layer counts need a layer-outer layout (VLLM_KV_CACHE_LAYOUT=NHD or HND), "
            "where a block has the same bytes in every stage; or run without VATTN_VLLM=1")
    _started = Workers(keys.pop() if keys else None, tuple(a["regions"] for a in answers))
    if _started.key is not None and len(set(_started.regions)) > 1:
        logger.info("vattn: pipeline stages with %s KV regions share one set of books", list(_started.regions))


def before_schedule(engine_core: Any) -> None:
    """EngineCore's hook before each `schedule()`: when the workers' reserve of created
    pages runs low, send the operations recorded since the last step with a request to
    hold `want_reserve()` groups ready, and take the least any worker holds as confirmed.
    A device that refuses is a shortage: `get_num_free_blocks` counts only confirmed
    pages, so vLLM queues or preempts, and the request is repeated later."""
    sched = getattr(engine_core, "scheduler", None)
    skv = _scheduler_kv(sched)
    if skv is None or skv.reserve is None:
        return
    want = skv.want_reserve(waiting=bool(len(getattr(sched, "waiting", ()))))
    if want is None:
        return
    ready = engine_core.model_executor.collective_rpc(reserve_rpc, args=(skv.drain(), want))
    skv.confirm(ready if isinstance(ready, list) else [ready], want)


def on_idle(engine_core: Any) -> None:
    """EngineCore's hook, called while it has no work: send page operations recorded
    since the last step (a `SchedulerKV.set_limit`) to the workers at once; after
    `VATTN_VLLM_IDLE_TRIM_S` of idleness give memory back, and send the operations now."""
    skv = _scheduler_kv(getattr(engine_core, "scheduler", None))
    if skv is None:
        return
    if skv.recorder.log:  # nothing else would carry them: no step follows while idle
        _send(engine_core, skv)
    delay = idle_trim_s()
    if delay is None or skv.trimmed:
        return
    now = time.monotonic()
    if skv.idle_since is None:
        skv.idle_since = now
    if now - skv.idle_since < delay:
        return
    skv.trimmed = True
    nbytes = skv.trim()
    if skv.reserve is not None:  # the reserve goes back too
        engine_core.model_executor.collective_rpc(reserve_rpc, args=(skv.drain(), 0))
        skv.release_reserve()
        logger.info("vattn: idle for %.0f s, gave back %.1f MiB of KV memory and the reserve",
                    now - skv.idle_since, nbytes / 2**20)
    elif _send(engine_core, skv) is not None:
        logger.info("vattn: idle for %.0f s, gave back %.1f MiB of KV memory", now - skv.idle_since, nbytes / 2**20)


def idle_wakeup(engine_core: Any) -> float | None:
    """EngineCore's input-queue timeout while idle: the seconds left until the idle trim
    (0 when page operations wait to be sent; None: block as vLLM does)."""
    skv = _scheduler_kv(getattr(engine_core, "scheduler", None))
    if skv is None:
        return None
    if skv.recorder.log:
        return 0.0
    # on a shared budget the responder may give pages back at any time: look every POLL_S
    poll = POLL_S if skv.budget is not None else None
    delay = idle_trim_s()
    if delay is None or skv.trimmed or skv.idle_since is None:
        return poll
    wait = max(0.0, delay - (time.monotonic() - skv.idle_since)) + 0.01
    return wait if poll is None else min(wait, poll)


# ------------------------------------------------------------------ worker side ----
class WorkerKV:
    """A worker's KV cache backing allocation on vattn memory: reserved once (the KV
    views never move), pages mapped and unmapped by the scheduler's operations."""

    def __init__(self, kv_cache_config: Any, size: int, device: torch.device | str,
                 backend: Backend | None = None) -> None:
        self.device = torch.device(device)
        self.layout = g = block_layout(kv_cache_config)
        if size > g.reserved_bytes:
            raise UnsupportedLayoutError(f"an allocation of {size} bytes is larger than the KV cache's reservation "
                                         f"of {g.reserved_bytes} bytes")
        self.backend = backend if backend is not None else make_backend(self.device)
        self._own_backend = backend is None
        self.backend.check_page_size(g.page_size)
        self._range = self.backend.reserve(g.reserved_bytes, g.page_size)
        self.whole = self.backend.tensor(self._range, 0, (g.reserved_bytes,), (1,), torch.int8)
        self.tensor = self.whole[:size]
        self.bases = [self._range.addr + r for r in g.regions]
        self.groups: dict[int, Any] = {}  # scheduler's group id -> this worker's physical group
        self.mapped: dict[int, int] = {}  # page -> group id
        self.spare: list[Any] = []  # created ahead for the scheduler's next creates (`reserve`)
        # each region's bytes, for the "zero" operations (skipped where new memory reads zeros: the host)
        self.regions = [self.whole[r:r + g.num_pages * g.page_size] for r in g.regions]
        self.seq = 0
        self.closed = False
        pool, rec = _new_books(g, memory_limit())
        initial = rec.drain()  # the state the scheduler's books start in
        pool.close()
        self._apply(initial)

    def apply(self, ops: PageOps | None) -> None:
        """Apply the next batch of the scheduler's page operations (in order)."""
        if ops is None:
            return
        if self.closed:
            raise OpsOutOfOrderError("page operations for a closed vattn KV cache")
        if ops.key != self.layout.key:
            raise OpsOutOfOrderError(f"page operations for block layout (geometry) {ops.key}, this worker has "
                                     f"{self.layout.key}")
        if ops.seq != self.seq + 1:
            raise OpsOutOfOrderError(f"page operations batch {ops.seq} after batch {self.seq}")
        self._apply(ops.ops)
        self.seq = ops.seq

    def _apply(self, ops: list[tuple]) -> None:
        P, synced = self.layout.page_size, False
        for op in ops:
            kind = op[0]
            if kind == "create":  # from the reserve; the device only when none was confirmed
                made = [self.spare.pop() for _ in range(min(len(op[1]), len(self.spare)))]
                if len(made) < len(op[1]):
                    made += self.backend.create(len(op[1]) - len(made), len(self.bases), P)
                self.groups.update(zip(op[1], made))
            elif kind == "map":
                pages, ids = op[1], op[2]
                self.backend.map(self.bases, [p * P for p in pages], [self.groups[i] for i in ids], P)
                self.mapped.update(zip(pages, ids))
            elif kind == "zero":
                if not self.backend.new_pages_zeroed:
                    self.backend.zero(self.regions, op[1], P)
            elif kind == "unmap":
                if not synced:  # the fence: nothing enqueued before this batch reads these pages after
                    self.synchronize()
                    synced = True
                self.backend.unmap(self.bases, [p * P for p in op[1]], P)
                for p in op[1]:
                    del self.mapped[p]
            elif kind == "release":
                self.backend.release([self.groups.pop(i) for i in op[1]])
            else:
                raise OpsOutOfOrderError(f"unknown page operation {kind!r}")

    def reserve(self, target: int) -> int:
        """Hold `target` page groups created and ready (release any beyond it); returns how
        many it holds: fewer when the device refused (another process, PyTorch's caching
        allocator took the memory), which is not an error: the scheduler waits."""
        P, extra = self.layout.page_size, len(self.spare) - max(0, target)
        if extra > 0:
            self.backend.release([self.spare.pop() for _ in range(extra)])
        need = target - len(self.spare)
        try:
            if need > 0:
                self.spare += self.backend.create(need, len(self.bases), P)
        except OutOfPhysicalMemoryError:
            for _ in range(need):  # one at a time: what the device still has
                try:
                    self.spare += self.backend.create(1, len(self.bases), P)
                except OutOfPhysicalMemoryError:
                    break
        return len(self.spare)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def mapped_bytes(self) -> int:
        return len(self.mapped) * self.layout.page_size * len(self.bases)

    def is_mapped(self, block: int) -> bool:
        """Whether every page of `block` is mapped here."""
        g = self.layout
        first, last = block * g.block_bytes // g.page_size, ((block + 1) * g.block_bytes - 1) // g.page_size
        return all(p in self.mapped for p in range(first, last + 1))

    def close(self) -> None:
        """Unmap and release every page (after the device finished). Views must not be used after."""
        if self.closed:
            return
        self.closed = True
        self.synchronize()
        P = self.layout.page_size
        try:
            self.backend.unmap(self.bases, [p * P for p in self.mapped], P)
            self.mapped.clear()
            self.backend.release(list(self.groups.values()) + self.spare)
            self.groups.clear()
            self.spare.clear()
        finally:
            if self._own_backend:
                self.backend.close()
            self.whole = self.tensor = self._range = None  # the address space goes with the last view
            self.regions = []


_workers: dict[str, WorkerKV] = {}  # device -> this process's KV cache on vattn memory


def kv_cache_buffer(kv_cache_config: Any, size: int, device: torch.device | str) -> torch.Tensor | None:
    """The worker's hook (`allocate_kv_cache`): the KV cache's backing allocation as a
    virtual `int8` tensor of `size` bytes with the null block's pages mapped, or None
    (vLLM allocates its own) when vattn is off or the layout is not supported. A new
    allocation on a device replaces the previous one (vLLM's profiling cache)."""
    if not enabled():
        return None
    dev = torch.device(device)
    if dev.type not in ("cuda", "cpu"):
        return None
    try:
        w = WorkerKV(kv_cache_config, size, dev)
    except UnsupportedLayoutError as e:
        logger.warning("vattn: vLLM keeps its own KV memory: %s", e)
        return None
    old = _workers.pop(str(dev), None)
    if old is not None:
        old.close()
    _workers[str(dev)] = w
    return w.tensor


def worker_kv(device: torch.device | str | None = None) -> WorkerKV | None:
    """This process's `WorkerKV` (the only one when `device` is None)."""
    if device is None:
        return next(iter(_workers.values()), None) if len(_workers) == 1 else None
    return _workers.get(str(torch.device(device)))


def apply(scheduler_output: Any) -> None:
    """The worker's hook (top of `Worker.execute_model`): map and unmap what the scheduler
    decided for this step, before the forward."""
    _apply_here(getattr(scheduler_output, "vattn_ops", None))


def apply_rpc(worker: Any, ops: PageOps) -> None:
    """`collective_rpc` target for the operations sent while idle (idle trim, `set_limit`)."""
    _apply_here(ops)


def reserve_rpc(worker: Any, ops: PageOps | None, target: int) -> int:
    """`collective_rpc` target of `before_schedule` and the idle trim: apply `ops`, then
    hold `target` page groups ready; returns how many this worker holds."""
    _apply_here(ops)
    w = worker_kv()
    if w is None:
        raise OpsOutOfOrderError("the scheduler asked for a vattn reserve but this worker's KV cache is not on "
                                 "vattn memory (is VATTN_VLLM the same for the scheduler and the workers?)")
    return w.reserve(target)


def _apply_here(ops: PageOps | None) -> None:
    if ops is None:
        return
    w = worker_kv()
    if w is None:
        raise OpsOutOfOrderError("the scheduler sent vattn page operations but this worker's KV cache is not "
                                 "on vattn memory (is VATTN_VLLM the same for the scheduler and the workers?)")
    w.apply(ops)


def reset_worker() -> None:
    """Close every `WorkerKV` of this process (tests; a worker shutting down)."""
    while _workers:
        _workers.popitem()[1].close()


__all__ = [
    "BlockLayout", "PageOps", "RecordingBackend", "SchedulerKV", "WorkerKV", "Workers", "UnsupportedLayoutError",
    "OpsOutOfOrderError", "attach", "align_num_blocks", "apply", "apply_rpc", "before_schedule", "enabled",
    "block_layout", "hello_rpc", "idle_wakeup", "kv_cache_buffer", "on_idle", "reserve_rpc", "set_limit", "settings",
    "start", "take_ops", "worker_kv",
]
