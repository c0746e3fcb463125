"""The start-up check of a memory limit for transformers' continuous batching on vattn memory:
`probe_room` builds the cache once, through a probe loop of transformers' own, and refuses a limit
that leaves no room for one request beyond the trash blocks, naming the smallest that serves one.
Used by `hf_cb.enable(memory_limit=...)` and by `vattn serve --engine transformers` at start
(`vattn.integrations.hf_serve`), one check for both; `request_blocks` is transformers' own count of
the blocks a request takes (the serving contract's `Room` reads it too)."""
from __future__ import annotations

import copy
import threading
import time
from typing import Any, Callable

from vattn.budget import Budget
from vattn.errors import InvalidConfigError
from vattn.integrations.hf_cb.caches import TRASH_SECTORS

CACHE_WAIT_S = 120.0  # how long a new batching loop may take to build its cache before a request goes unchecked
_PROBE = "vattn-serve-probe"  # a request id no request has: asks transformers' allocators what a request needs


def request_blocks(cache: Any) -> Callable[[int, int], int]:
    """(p, m) -> the pool blocks transformers takes for a request of a p-token prompt and m
    new tokens (it stores p + m - 1 of them: the last one is never fed back)."""
    allocators = getattr(cache, "cache_allocators", None)
    if allocators is not None:  # 5.18+: blocks for the tokens stored, whole sectors per attention group
        groups = list(allocators.values())
        return lambda p, m: sum(-(-a.needs_new_blocks(_PROBE, 0, p + m - 1) // a.blocks_per_sector) for a in groups)
    # 5.17: its scheduler takes (p + 1) // block_size + 1 blocks for a prompt of p tokens (in chunks too), then one
    # more each time the stored tokens fill them
    bs = cache.block_size
    return lambda p, m: cache.blocks_needed(max((p + 1) // bs + 1, -(-(p + m - 1) // bs)), 0)


PROBE_BYTES = 16 << 20  # the least (virtual) cache of the start-up probe: beside the limit, room for one request


def _budget_limit(budget: Budget) -> int | None:
    return getattr(budget.stats(), "budget_limit", budget.limit)


def probe_room(model: Any, cb_config: Any, handle: Any, memory_limit: int | None, budget: Budget | None,
               flags: tuple[str, str] = ("memory_limit", "the budget's limit")) -> None:
    """Refuse (InvalidConfigError) a memory limit, or a budget's limit, that leaves no room for
    one request beyond the trash blocks, with the smallest limit that serves one (a prompt
    token and a new one); `flags` name the limit and the budget's in the message (`vattn
    serve`'s flags, `hf_cb.enable`'s arguments). The cache is built once for this, by a probe
    loop of transformers' (the model's own generation config), sized PROBE_BYTES beyond the
    limit (virtual: nothing is mapped but the trash); then taken down."""
    budget_limit = None if budget is None else _budget_limit(budget)
    if memory_limit is None and budget_limit is None:
        return
    handle.memory_limit, handle.probe_bytes = None, max(PROBE_BYTES, memory_limit or 0, budget_limit or 0)
    probe = model.init_continuous_batching(generation_config=copy.deepcopy(model.generation_config),
                                           continuous_batching_config=cb_config)
    cache, refused = None, True
    try:
        probe.start()
        deadline = time.monotonic() + CACHE_WAIT_S
        while probe.batch_processor is None and probe.is_running() and time.monotonic() < deadline:
            time.sleep(0.005)
        cache = getattr(probe.batch_processor, "cache", None)
        if getattr(cache, "vattn_pool", None) is None:
            raise InvalidConfigError("vattn could not build transformers' continuous-batching cache to check the "
                                     f"memory limit: {probe.background_thread_status.fatal_error}")
        pool = cache.vattn_pool
        need = TRASH_SECTORS + request_blocks(cache)(1, 1)
        smallest = _smallest_limit(pool, need)
        for name, limit in ((flags[1], budget_limit), (flags[0], memory_limit)):
            if limit is not None and limit < smallest:
                block = pool.stats().block_bytes
                raise InvalidConfigError(
                    f"{name} of {limit} bytes leaves no room for a request: transformers' cache keeps "
                    f"{TRASH_SECTORS} trash blocks of {block} bytes always mapped, and a request of one prompt "
                    f"token and one new token needs {need - TRASH_SECTORS} more (on pages of "
                    f"{pool.stats().group_bytes} bytes); the smallest limit that serves one request is {smallest} "
                    f"bytes: raise {name} to at least that (more serves more at once)")
        refused = False
    finally:
        handle.memory_limit, handle.probe_bytes = memory_limit, None
        probe.stop(block=False, hard_stop=True)  # its loop takes a second or so to end: the pool closes after it
        pool = getattr(cache, "vattn_pool", None)
        if refused:  # the process ends now: a loop still in a forward at the interpreter's exit aborts it
            _close_after(probe, pool)
        else:
            threading.Thread(target=_close_after, args=(probe, pool), name="vattn-serve-probe", daemon=True).start()


def _close_after(probe: Any, pool: Any) -> None:
    thread = getattr(probe, "_generation_thread", None)
    if thread is not None:
        thread.join(timeout=30)
    if pool is not None:
        pool.close()


def _smallest_limit(pool: Any, blocks: int) -> int:
    """The fewest bytes of pages under which `pool` can ever hold `blocks` blocks at once
    (its `max_blocks`, page-aware), found by setting limits on it."""
    group = pool.stats().group_bytes
    pages = 1
    while True:
        pool.set_limit(pages * group)
        if pool.max_blocks() >= blocks or pages * group >= pool.stats().num_blocks * pool.stats().block_bytes:
            return pages * group
        pages += 1


__all__ = ["CACHE_WAIT_S", "PROBE_BYTES", "probe_room", "request_blocks"]
