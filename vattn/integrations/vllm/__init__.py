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
  handed out (evicted) only after the memory under the limit is used. Under EngineCore the
  count also covers only the page groups the workers hold created (the reserve,
  `before_schedule`), so a device that refuses pages is a wait too; the reserve doubles
  after each schedule in which vLLM's `allocate_slots` found too few free blocks
  (`watch_misses`), whatever the block and page sizes. On a shared budget the workers keep
  no reserve and create in `execute_model`, where a refusal ends the engine: there the
  budget's limit must fit the GPU.
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

Here: the hooks the patch calls and this process's state (`_started`, `_workers`); the
parts are `layout` (the settings, `BlockLayout`), `scheduler` (`SchedulerKV`, `PageOps`),
`worker` (`WorkerKV`) and `startup` (the start-up checks), their names re-exported here.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from vattn.budget.shared import POLL_S
from vattn.errors import InvalidConfigError, OpsOutOfOrderError, UnsupportedLayoutError  # (re-exported)
from vattn.idle import MAX_DELAY
from vattn.integrations import _env
# The parts, re-exported: `vattn.integrations.vllm.X` keeps working for every name below
from vattn.integrations.vllm.layout import (  # noqa: F401
    DEFAULT_IDLE_TRIM_S, DEFAULT_PAGE_SIZE, DEFAULT_RESERVE, BlockLayout, TooFewBlocksError, align_num_blocks,
    block_layout, enabled, idle_trim_s, memory_limit, page_run_blocks, page_size, reserve_groups, settings)
from vattn.integrations.vllm.scheduler import (  # noqa: F401
    ALLOC_RETRY_S, NULL_BLOCK, REFUSED_RETRY_S, PageOps, RecordingBackend, SchedulerKV)
from vattn.integrations.vllm.startup import Workers, agreed_workers, check_settings
from vattn.integrations.vllm.worker import WorkerKV

logger = logging.getLogger("vattn.vllm")


# ------------------------------------------------------------ scheduler's hooks ----
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
    skv.idle.note_busy()
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
def hello_rpc(worker: Any) -> dict[str, Any]:
    """`collective_rpc` target at start: this worker's settings and layout."""
    w = worker_kv()
    return {"settings": settings(), "key": None if w is None else w.layout.key,
            "regions": 0 if w is None else len(w.layout.regions)}


def start(engine_core: Any, kv_cache_configs: Sequence[Any] = (), vllm_config: Any = None) -> None:
    """EngineCore's hook (`_initialize_kv_caches(vllm_config)`), once its workers allocated
    their KV caches and before the scheduler exists: refuse what vattn cannot back (KV
    connectors, sleep mode, a cache too small for one whole-page run a layer), check that
    every worker has the scheduler's `VATTN_VLLM*` settings and one block layout (each
    pipeline stage keeps its own regions), or raise InvalidConfigError with both values.

    `vllm_config` is the configuration `_initialize_kv_caches` was given: the patch passes
    it, because an `EngineCore` built without `__init__` (`object.__new__`, as vLLM's own
    tests do) has no `vllm_config` attribute. None (a patch of an earlier vattn): the
    engine's attribute, if any."""
    global _started
    _started = None
    if vllm_config is None:
        vllm_config = getattr(engine_core, "vllm_config", None)
    answers = engine_core.model_executor.collective_rpc(hello_rpc)
    check_settings(answers, settings())
    if not enabled():
        return
    _started = agreed_workers(vllm_config, answers)
    refuse_too_few_blocks(kv_cache_configs)
    if _started.key is not None and len(set(_started.regions)) > 1:
        logger.info("vattn: pipeline stages with %s KV regions share one set of books", list(_started.regions))


def refuse_too_few_blocks(kv_cache_configs: Sequence[Any]) -> None:
    """Raise InvalidConfigError when a worker's KV cache has fewer blocks than one
    whole-page run a layer (`TooFewBlocksError`; the message names what works): rounding
    down to whole pages leaves none, and rounding up would promise memory vLLM did not
    measure. Other layouts vattn does not back keep vLLM's memory (a warning), as before."""
    for cfg in kv_cache_configs:
        try:
            block_layout(cfg)
        except TooFewBlocksError as e:
            raise InvalidConfigError(f"vattn cannot back this vLLM engine's KV cache: {e}") from None
        except UnsupportedLayoutError:
            continue


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
    waiting = bool(len(getattr(sched, "waiting", ())))
    if not watch_misses(sched, skv) and waiting and not len(getattr(sched, "running", ())):
        skv.note_miss()  # no manager to watch: requests wait and none runs, so memory holds them
    want = skv.want_reserve(waiting=waiting)
    if want is None:
        return
    ready = engine_core.model_executor.collective_rpc(reserve_rpc, args=(skv.drain(), want))
    skv.confirm(ready if isinstance(ready, list) else [ready], want)


def watch_misses(scheduler: Any, skv: SchedulerKV) -> bool:
    """Tell `skv` of every allocation vLLM finds short (`KVCacheManager.allocate_slots`
    returns None only when the free blocks, `get_num_free_blocks`, are fewer than the
    request needs: then it waits or preempts). Installed once, on the scheduler's own
    manager object (the class is not touched). Without it the books could not know what a
    waiting request needs: they counted themselves short only below one page's worth of
    free blocks, and a request needing more than the reserve waited forever (issue 41: 64
    KiB pages, 256 KiB blocks, a reserve of one block). Returns whether it is installed."""
    kvm = getattr(scheduler, "kv_cache_manager", None)
    alloc = getattr(kvm, "allocate_slots", None)
    if alloc is None:
        return False
    if getattr(alloc, "_vattn_watch", None) is skv:
        return True
    inner = getattr(alloc, "_vattn_inner", alloc)  # a new SchedulerKV (a new engine) on the same manager

    def allocate_slots(*args: Any, **kwargs: Any) -> Any:
        blocks = inner(*args, **kwargs)
        if blocks is None:
            skv.note_miss()
        return blocks

    allocate_slots._vattn_watch = skv  # type: ignore[attr-defined]
    allocate_slots._vattn_inner = inner  # type: ignore[attr-defined]
    try:
        kvm.allocate_slots = allocate_slots
    except AttributeError:  # a manager with __slots__: the page criterion alone
        return False
    return True


def on_idle(engine_core: Any) -> None:
    """EngineCore's hook, called while it has no work: send page operations recorded
    since the last step (a `SchedulerKV.set_limit`) to the workers at once; after
    `VATTN_VLLM_IDLE_TRIM_S` of idleness give memory back, and send the operations now."""
    skv = _scheduler_kv(getattr(engine_core, "scheduler", None))
    if skv is None:
        return
    if skv.recorder.log:  # nothing else would carry them: no step follows while idle
        _send(engine_core, skv)
    idle = skv.idle
    idle.delay = idle_trim_s()
    idle.note_idle()
    if not idle.due():
        return
    idle.note_trimmed()
    seconds = idle.clock() - idle.idle_since
    nbytes = skv.trim()
    if skv.reserve is not None:  # the reserve goes back too
        engine_core.model_executor.collective_rpc(reserve_rpc, args=(skv.drain(), 0))
        skv.release_reserve()
        logger.info("vattn: idle for %.0f s, gave back %.1f MiB of KV memory and the reserve",
                    seconds, nbytes / 2**20)
    elif _send(engine_core, skv) is not None:
        logger.info("vattn: idle for %.0f s, gave back %.1f MiB of KV memory", seconds, nbytes / 2**20)


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
    skv.idle.delay = idle_trim_s()
    left = skv.idle.seconds_left()
    if left is None:
        return poll
    wait = min(left + 0.01, MAX_DELAY)
    return wait if poll is None else min(wait, poll)



# --------------------------------------------------------------- worker's hooks ----
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
    "BlockLayout", "PageOps", "RecordingBackend", "SchedulerKV", "TooFewBlocksError", "WorkerKV", "Workers",
    "UnsupportedLayoutError",
    "OpsOutOfOrderError", "attach", "align_num_blocks", "apply", "apply_rpc", "before_schedule", "enabled",
    "block_layout", "hello_rpc", "idle_wakeup", "kv_cache_buffer", "on_idle", "reserve_rpc", "set_limit", "settings",
    "start", "take_ops", "watch_misses", "worker_kv",
]
