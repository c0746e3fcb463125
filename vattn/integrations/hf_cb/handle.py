"""The handle `enable` returns (`ElasticCB`): one model's elastic KV memory settings, its pools
(one per cache transformers builds), the idle policy's thread and its part on a shared budget."""
from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch

from vattn.budget import Budget
from vattn.errors import ClosedError
from vattn.idle import IdleTrim
from vattn.integrations.hf_cb.caches import evict_cached_blocks, paused
from vattn.pool import ElasticPool, PoolStats

logger = logging.getLogger("vattn.hf_cb")


class ElasticCB:
    """What `enable` returns: the settings of one model's elastic KV memory and its pools
    (one per `PagedAttentionCache` transformers builds; the last one is `pool`)."""

    def __init__(self, model: Any, memory_limit: int | None, budget: Budget | None, page_size: int | None,
                 idle_trim_s: float | None = None, unregister: Callable[[Any], None] | None = None) -> None:
        """`unregister(model)`: the registry's undo for `disable` (`hf_cb.disable(model)`, or
        `hf_cb.disable_all()` for None), passed in so this module does not import the registry."""
        self._model = weakref.ref(model) if model is not None else None
        self.memory_limit = memory_limit
        self.probe_bytes: int | None = None  # while a start-up probe sizes the cache (hf_cb.probe.probe_room)
        self.budget = budget
        self.page_size = page_size
        self._unregister = unregister
        self._pools: list[weakref.ref] = []
        self._managers: list[weakref.ref] = []  # the ContinuousBatchingManagers that built the caches
        self.num_caches = 0  # PagedAttentionCaches built on vattn memory so far
        self.num_idle_trims = 0  # times the idle policy gave memory back
        # the idle policy (vattn.idle): idle from the last block handed out or given back
        self.idle = IdleTrim(idle_trim_s, name="vattn-hf-idle-trim")
        self.idle.note_idle()
        self._budget_token: int | None = None  # this handle's part on the budget (see _budget_reclaim)

    @property
    def idle_trim_s(self) -> float | None:
        """The idle policy's delay (None: never)."""
        return self.idle.delay

    @property
    def pools(self) -> list[ElasticPool]:
        """The live pools (closed ones and collected ones left out)."""
        live = [p for r in self._pools if (p := r()) is not None and p._buffers]
        return live

    @property
    def pool(self) -> ElasticPool | None:
        """The pool of the newest live cache, or None."""
        pools = self.pools
        return pools[-1] if pools else None

    def stats(self) -> PoolStats | None:
        return self.pool.stats() if self.pool is not None else None

    def trim(self, manager: Any = None) -> int:
        """Give back every cached page of every live pool now. Returns bytes given back.

        Blocks transformers keeps for prefix sharing (finished requests' complete blocks,
        `allow_block_sharing=True`, the default) hold their memory until transformers evicts
        them under memory pressure; `trim` evicts them first, through `manager` (a
        `ContinuousBatchingManager`) or else every manager that built a live cache of this
        handle: while its loop is stopped, or inside a pause of the running loop
        (`caches.paused`: 5.18+'s `pause()`, 5.17's `LoopPause`)."""
        for m in [manager] if manager is not None else self.managers:
            cache = getattr(getattr(m, "batch_processor", None), "cache", None)
            if cache is None or getattr(cache, "vattn_pool", None) is None:
                continue
            try:
                if not m.is_running():
                    evict_cached_blocks(cache)
                else:
                    with paused(m):
                        evict_cached_blocks(cache)
            except RuntimeError:  # the loop stopped in between: the pause refuses; nothing to evict now
                if m.is_running():  # anything else (a CUDA error...) is the caller's to see
                    raise
        return sum(p.trim() for p in self.pools)

    @property
    def managers(self) -> list[Any]:
        """The live ContinuousBatchingManagers whose caches are on this handle's memory."""
        return [m for r in self._managers if (m := r()) is not None]

    def busy(self) -> bool:
        """Whether a manager of this handle has requests in flight."""
        for m in self.managers:
            scheduler = getattr(getattr(m, "batch_processor", None), "scheduler", None)
            if scheduler is not None and scheduler.has_pending_requests():
                return True
        return False

    def touch(self) -> None:
        """A block was handed out or given back (the caches' call): idle from now."""
        self.idle.touch()

    def _idle_trim(self) -> None:
        """The idle policy's call (`idle_trim_s`): once no block was handed out or given back for
        that long and no request is in flight, trim (prefix-sharing blocks evicted) once per idle
        period; declined (called again) while a request is in flight."""
        if not self.pools or self.busy():
            return
        try:
            self.trim()
            self.num_idle_trims += 1
        except ClosedError:  # a pool closed in between: the next period looks again
            pass
        except Exception:  # a real failure (CUDA...): say so; the next idle period tries again
            logger.warning("vattn: the idle trim of a continuous-batching cache failed", exc_info=True)
        self.idle.note_trimmed()  # after the trim: the blocks it gave back are no new activity

    def _start_idle(self) -> None:
        """Run the idle policy's thread when `idle_trim_s` is set and a pool exists (once)."""
        if self.idle.delay is not None and self._pools:
            self.idle.start(self._idle_trim)

    def _set_idle_trim_s(self, idle_trim_s: float | None) -> None:
        """A new idle policy: the thread stops when it is None, starts (or goes on with the
        new delay) otherwise."""
        self.idle.delay = idle_trim_s
        if idle_trim_s is None:
            self.idle.stop()
        else:
            self._start_idle()

    def close(self) -> None:
        """Stop the idle policy's thread and leave the budget (live pools stay on it)."""
        self.idle.stop()
        if self._budget_token is not None:
            self.budget.unregister(self._budget_token)
            self._budget_token = None

    def _budget_reclaim(self, nbytes: int) -> int:
        """The budget's call when another model is short, after the pools gave their free
        pages: a handle with no request in flight evicts the blocks transformers keeps for
        prefix sharing and gives back every page, as the idle policy does (a busy one keeps
        them: its loop would have to pause). Returns bytes given back; never raises."""
        if self.busy():
            return 0
        try:
            return self.trim()
        except Exception:
            return 0

    def _budget_cached(self) -> int:
        """What `_budget_reclaim` gives now beyond the pools' own cached pages (which they
        report themselves), exactly: while no request is in flight, every block in use but
        the trash is one transformers keeps for prefix sharing, and the trim gives back the
        pages under them, all but those that hold a trash block too. Pages, not blocks: a
        page may hold several blocks, or a trash block beside data ones (5.17's trash blocks
        come last, and a GPU's 2 MiB page holds many). Nothing while busy (the reclaim then
        gives nothing). Read without locks (a pool calls it under its own)."""
        if self.busy():
            return 0
        return sum(p.unpinned_bytes_in_use() for p in self.pools)  # (the trash blocks are pinned)

    def set_limit(self, limit: int | None) -> None:
        """A new limit on the mapped bytes of this model's caches (this one and later ones)."""
        self.memory_limit = limit
        for p in self.pools:
            p.set_limit(limit)

    def disable(self) -> None:
        """Later caches of this model use transformers' own memory again (live ones stay)."""
        if self._unregister is None:  # not in the registry (built directly)
            self.close()
        elif self._model is None:
            self._unregister(None)
        elif (model := self._model()) is not None:
            self._unregister(model)

    def new_pool(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, num_buffers: int,
                 device: torch.device | str) -> ElasticPool:
        """A pool for one cache of this handle, on its settings (the caches' call)."""
        pool = ElasticPool(num_blocks, block_shape, dtype, num_buffers, device=torch.device(device),
                           page_size=self.page_size, limit=self.memory_limit, budget=self.budget, sync="device",
                           zero_new=True)
        self._pools = [r for r in self._pools if r() is not None] + [weakref.ref(pool)]
        self.num_caches += 1
        if self.budget is not None and self._budget_token is None:  # after the pool: asked after its free pages
            self._budget_token = self.budget.register(self._budget_reclaim, self._budget_cached)
        self._start_idle()
        return pool

    def track(self, manager: Any) -> None:
        """The ContinuousBatchingManager that built a cache of this handle (the caches' call)."""
        if manager is not None and all(r() is not manager for r in self._managers):
            self._managers = [r for r in self._managers if r() is not None] + [weakref.ref(manager)]
