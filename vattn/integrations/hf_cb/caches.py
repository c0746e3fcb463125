"""The hook's classes: transformers' `PagedAttentionCache` (and 5.18+'s `CachePool`) on an
`ElasticPool`, one mixin per class over transformers' own, built for the design installed
(`make_classes`), and the stand-ins that hand transformers the pool's tensors and blocks."""
from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from vattn.errors import InvalidConfigError, OutOfPhysicalMemoryError, UnsupportedModelError
from vattn.pool import ElasticPool

TRASH_SECTORS = 2
ALLOC_RETRY_S = 2.0  # how long a block transformers counted as free may wait for memory before it is an error

# hf_cb's one lock: the registry of enabled models, the hook's installation, the build of a cache (which
# swaps `torch` in transformers' cache module) and `vattn serve`'s build of its classes
_lock = threading.RLock()
_intercept = threading.local()  # the cache being built on this thread, and its pool


class CacheOwner(Protocol):
    """What a cache calls on the handle whose memory it is on (`handle.ElasticCB`): the
    caches are written against this, so they do not import the handle (which imports them)."""

    def new_pool(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, num_buffers: int,
                 device: Any) -> ElasticPool:
        """A pool for one cache, on the owner's settings (limit, budget, page size)."""

    def touch(self) -> None:
        """A block was handed out or given back (the idle policy's clock restarts)."""

    def track(self, manager: Any) -> None:
        """The ContinuousBatchingManager that built a cache (None: not found)."""


def _check_layer_kinds(config: Any) -> None:
    """Refuse a cache for a model with layers that are not attention (`vattn serve` enables
    every model it loads and sees its config only here)."""
    from vattn.integrations.hf import SUPPORTED_LAYER_KINDS, layer_kinds

    other = sorted(set(layer_kinds(config)) - set(SUPPORTED_LAYER_KINDS))
    if other:
        raise UnsupportedModelError(
            f"vattn cannot back the continuous-batching cache of a {type(config).__name__} model: it has {other} "
            "layers, whose per-request state (Mamba, linear attention, ...) the paged cache does not keep; serve "
            "an attention-only model")

class _TorchProxy:
    """Stands for `torch` in transformers' cache module while a vattn cache is built: the
    allocation of the cache tensors (`torch.zeros` of the flat tensor on "sectors",
    `torch.empty` of each layer's K and V on "blocks") returns the pool's virtual tensors;
    every other name (and every call on another thread) is torch's own."""

    def __getattr__(self, name: str) -> Any:
        if name == "zeros":
            return _zeros
        if name == "empty":
            return _empty
        return getattr(torch, name)


def _building() -> dict | None:
    return getattr(_intercept, "build", None)


def _zeros(*size: Any, **kwargs: Any) -> torch.Tensor:
    """"sectors": the one flat uint8 cache tensor of `num_sectors + 2` sectors."""
    build = _building()
    if build is None or build["kind"] != "sectors" or build["pool"] is not None \
            or kwargs.get("dtype") is not torch.uint8 or len(size) != 1:
        return torch.zeros(*size, **kwargs)
    cache = build["cache"]
    nbytes = int(size[0])
    sector = cache.bytes_per_sector
    if nbytes != (cache.num_sectors + TRASH_SECTORS) * sector:  # not the cache tensor (checked after __init__)
        return torch.zeros(*size, **kwargs)
    pool = _new_cache_pool(build, cache.num_sectors, (sector,), torch.uint8, 1, kwargs.get("device", cache.device))
    tensor = pool.buffer(0).view(-1)  # [(num_sectors + 2) * sector] uint8
    build["tensors"].append(tensor)
    return tensor


def _empty(*size: Any, **kwargs: Any) -> torch.Tensor:
    """"blocks": the K and V tensors of every layer of a group, `[(num_blocks + 2) * block_size,
    heads, head_dim]` each, asked for in turn: buffer i of one pool of `num_blocks + 2` blocks."""
    build = _building()
    if build is None or build["kind"] != "blocks" or len(size) != 1:
        return torch.empty(*size, **kwargs)
    cache = build["cache"]
    shape = getattr(cache, "cache_shape", None)
    if shape is None or tuple(size[0]) != tuple(shape) or kwargs.get("dtype") is not cache.dtype:
        return torch.empty(*size, **kwargs)
    if build["pool"] is None:
        groups, _ = build["cache_mod"].group_layers_by_attn_type(cache.config)
        _new_cache_pool(build, cache.num_blocks, (cache.block_size, cache.num_key_value_heads, cache.head_dim),
                        cache.dtype, 2 * len(groups[0]), kwargs.get("device", cache.device))
    pool, i = build["pool"], len(build["tensors"])
    if i >= pool.config.num_buffers:
        raise InvalidConfigError("transformers asked for more cache tensors than vattn counted")
    tensor = pool.buffer(i).view(shape)
    build["tensors"].append(tensor)
    return tensor


def _new_cache_pool(build: dict, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, num_buffers: int,
                    device: Any) -> ElasticPool:
    """The pool of a cache being built: `num_blocks` data blocks then the two trash blocks
    transformers keeps for padding tokens, mapped at once and for good, cleared (the read
    trash must read zeros; 5.18+ put them first). When memory cannot back them,
    OutOfPhysicalMemoryError (the cache's constructor then closes the pool)."""
    pool = build["handle"].new_pool(num_blocks + TRASH_SECTORS, block_shape, dtype, num_buffers, device)
    build["pool"] = pool
    trash = list(range(TRASH_SECTORS)) if build["kind"] == "sectors" else [num_blocks, num_blocks + 1]
    pool.pin(trash, f"the {TRASH_SECTORS} trash blocks of the continuous-batching cache",
             "raise memory_limit or the budget", zero=True)
    return pool


def evict_cached_blocks(cache: Any) -> None:
    """Drop the prefix-sharing blocks no request uses (their memory becomes free), with
    transformers' own code. The generation loop must be stopped or paused (`paused`)."""
    if hasattr(cache, "evict_cached_blocks"):  # sectors
        cache.evict_cached_blocks()
        cache.pool.try_to_free_sectors()
    else:  # blocks: asking for every free block uninitializes every initialized one
        bm = cache._block_manager
        if bm._init_block_ids:
            bm.has_enough_free_blocks(len(bm._uninit_block_ids) + len(bm._init_block_ids))


class LoopPause:
    """("blocks", 5.17) A stand-in for 5.18+'s `ContinuousBatchingManager.pause()`, which
    5.17 lacks: `with LoopPause.of(manager)():` runs its body while the generation loop is
    parked between two iterations (`_generation_loop_body`), where transformers' loop thread
    holds no reference into its BlockManager: `trim` evicts the prefix-sharing blocks there,
    as 5.18+ does inside `pause()`. Without it a running 5.17 server could not give them back
    to another model of its budget, while its books counted them as reclaimable.

    ```
    loop thread:  body | body | park ............ | body ...
    caller:              ask --wake--> parked: evict, unmap; leave -> loop resumes
    ```
    `install` puts a function in front of the manager's `_generation_loop_body` (transformers'
    `_run_generation_loop` calls it through `self`, each iteration) that parks first when a
    pause was asked for; the ask wakes an idle loop through `_has_new_requests` (which it
    waits on for 0.1 s at most otherwise). Several threads may hold the pause at once; the
    loop resumes when the last one leaves. Like 5.18+'s, asking raises RuntimeError when no
    loop runs or when it stops before it parked, and waits as long as the loop's current
    iteration takes."""

    def __init__(self, manager: Any) -> None:
        self._manager = weakref.ref(manager)  # the manager holds this object: no strong reference back
        self._cond = threading.Condition()
        self._asked = 0  # threads that asked for the pause and have not left it
        self._parked = False

    @classmethod
    def install(cls, manager: Any) -> LoopPause:
        """The pause of `manager`, installed once."""
        pause = manager.__dict__.get("vattn_pause")
        if pause is None:
            pause = cls(manager)
            body, ref = type(manager)._generation_loop_body, weakref.ref(manager)

            def loop_body(*args: Any, **kwargs: Any) -> Any:  # refers to the manager weakly: no cycle
                pause.park()
                return body(ref(), *args, **kwargs)

            manager.vattn_pause = pause
            manager._generation_loop_body = loop_body
        return pause

    @staticmethod
    def of(manager: Any) -> LoopPause | None:
        return getattr(manager, "vattn_pause", None)

    def park(self) -> None:
        """The loop thread, before each iteration: wait here while a pause is held."""
        if not self._asked:  # read without the lock: an ask seen one iteration late is still served
            return
        with self._cond:
            if self._asked:
                self._parked = True
                self._cond.notify_all()
                self._cond.wait_for(lambda: not self._asked)
                self._parked = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        manager = self._manager()
        if manager is None or not manager.is_running():
            raise RuntimeError("Cannot pause generation while no generation loop is running.")
        if threading.current_thread() is getattr(manager, "_generation_thread", None):
            raise RuntimeError("the generation loop cannot pause itself")
        with self._cond:
            self._asked += 1
        try:
            manager._has_new_requests.set()  # an idle loop waits on it: the next iteration parks now
            with self._cond:
                while not self._parked:
                    if not manager.is_running():
                        raise RuntimeError("The generation loop stopped before it paused.")
                    self._cond.wait(0.05)
            yield
        finally:
            with self._cond:
                self._asked -= 1
                self._cond.notify_all()


def paused(manager: Any) -> contextlib.AbstractContextManager:
    """A context in which `manager`'s running generation loop is paused: its own `pause()`
    (5.18+), or the `LoopPause` vattn installed on it (5.17). RuntimeError when it cannot
    pause (no loop running, or a 5.17 manager whose cache vattn did not build)."""
    if hasattr(manager, "pause"):
        return manager.pause()
    pause = LoopPause.of(manager)
    if pause is None:
        raise RuntimeError(f"{type(manager).__name__} has no pause and vattn installed none on it")
    return pause()


def _calling_manager(manager_cls: type | None) -> Any:
    """The ContinuousBatchingManager building the cache (a caller's `self`), or None: lets
    `trim` and the idle policy evict its prefix-sharing blocks and see its requests."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None or manager_cls is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, manager_cls):
            return candidate
        frame = frame.f_back
    return None



def _alloc_one(pool: ElasticPool, handle: CacheOwner, what: str) -> int:
    """One block of `pool` for transformers, which counted it as free a moment ago. The
    count can be wrong only if the memory went in between (another model of the budget, or
    the device refusing new pages under outside pressure): retry for up to
    `ALLOC_RETRY_S` (the others give back, pressure passes) before a clear error, since
    transformers' loop cannot take a miss here."""
    handle.touch()
    deadline = time.monotonic() + ALLOC_RETRY_S
    delay = 0.001
    while (got := pool.alloc(1)) is None and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(2 * delay, 0.1)
    if got is None:
        raise OutOfPhysicalMemoryError(
            f"vattn could not back a cache {what} transformers' scheduler had counted as free (another model of the "
            f"same budget took the memory in between, or the device refused new pages; {pool.num_free_blocks} free "
            f"{what}s, {pool.available_blocks()} backable now); raise memory_limit or the budget")
    return got[0]


class _FreeBlocks:
    """Stands for the free-block deque of 5.17's `BlockManager` (`_uninit_block_ids`, which
    it only ever `popleft`s, `append`s, `extend`s and counts): the pool's free blocks.
    Its length is the free blocks that memory can back now, so transformers' scheduler
    sees a full cache when the limit or the budget is reached; `popleft` maps a block
    (page-aware), `append`/`extend` give blocks back to the pool (pages stay cached)."""

    def __init__(self, pool: ElasticPool, handle: CacheOwner) -> None:
        self.pool = pool
        self.handle = handle

    def __len__(self) -> int:
        return self.pool.available_blocks()  # never more than the free blocks

    def popleft(self) -> int:
        return _alloc_one(self.pool, self.handle, "block")

    def append(self, block: int) -> None:
        self.handle.touch()
        self.pool.free([block])

    def extend(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        if blocks:
            self.handle.touch()
            self.pool.free(blocks)


class _SectorPool:
    """("sectors") Mixed in over transformers' CachePool: sectors come from an ElasticPool, mapped
    when handed to an allocator, given back to the pool as soon as all their blocks are free."""

    def __init__(self, num_sectors: int, num_allocators: int, elastic: ElasticPool, handle: CacheOwner,
                 num_reserved_sectors: int = TRASH_SECTORS) -> None:
        self.elastic = elastic
        self.handle = handle
        self._held: set[int] = set()  # data sectors handed to allocators
        self._pos: dict[int, int] = {}  # free sector -> its index in free_sectors
        super().__init__(num_sectors, num_allocators, num_reserved_sectors)

    def reset(self) -> None:
        super().reset()
        self._pos = {s: i for i, s in enumerate(self.free_sectors)}
        if self._held:
            self.elastic.free(sorted(self._held))
            self._held.clear()

    @property
    def num_free_sectors(self) -> int:
        # What transformers' scheduler sees: the free sectors that memory can back now
        return min(len(self.free_sectors), self.elastic.available_blocks())

    def allocate_sector(self, index: int) -> None:
        sector = _alloc_one(self.elastic, self.handle, "sector")
        i, last = self._pos.pop(sector), self.free_sectors[-1]  # move it last: the base class pops the last one
        self.free_sectors[i], self.free_sectors[-1] = last, sector
        if last != sector:
            self._pos[last] = i
        super().allocate_sector(index)
        self._held.add(sector)

    def try_to_free_sectors(self) -> None:
        before = len(self.free_sectors)
        super().try_to_free_sectors()
        freed = self.free_sectors[before:]
        if freed:
            self._pos.update((s, before + k) for k, s in enumerate(freed))
            self._held.difference_update(freed)
            self.elastic.free(freed)

    def free_blocks(self, index: int, block_ids: list[int]) -> None:
        self.handle.touch()
        super().free_blocks(index, block_ids)
        self.try_to_free_sectors()  # a sector with no block in use goes back now, not at the next schedule


class _ElasticCache:
    """Mixed in over transformers' PagedAttentionCache: on vattn memory when its model was
    enabled. `make_classes` sets the class attributes: `vattn_kind` (the design),
    `vattn_cache_mod`, `vattn_api` (transformers' modules), `vattn_pool_cls` (the CachePool
    on an ElasticPool), `vattn_handle_for` (config -> its `CacheOwner`, an ElasticCB, or None)
    and `vattn_base`."""

    vattn_kind: str
    vattn_cache_mod: Any
    vattn_api: Any
    vattn_pool_cls: type

    def __init__(self, config: Any, continuous_batching_config: Any, device: Any, distributed_helper: Any,
                 *args: Any, **kwargs: Any) -> None:
        handle = self.vattn_handle_for(config)
        if handle is None:  # not enabled: transformers' own memory
            super().__init__(config, continuous_batching_config, device, distributed_helper, *args, **kwargs)
            return
        if getattr(distributed_helper, "tp_size", 1) > 1:
            raise InvalidConfigError("vattn.integrations.hf_cb does not support tensor parallelism yet")
        _check_layer_kinds(config)
        kind, cache_mod = self.vattn_kind, self.vattn_cache_mod
        build = {"kind": kind, "cache": self, "handle": handle, "tensors": [], "pool": None, "cache_mod": cache_mod}
        with _lock:  # one vattn cache is built at a time; other threads see torch itself
            saved = cache_mod.torch
            saved_handler = getattr(cache_mod, "PagedAttentionMemoryHandler", None)
            limit = _limit_of(handle)
            if limit is not None and _sizes_from_memory(saved_handler):
                cache_mod.PagedAttentionMemoryHandler = _limited_handler(saved_handler, limit, _on_host(device))
            _intercept.build = build
            cache_mod.torch = _TorchProxy()
            try:
                super().__init__(config, continuous_batching_config, device, distributed_helper, *args, **kwargs)
                pool = build["pool"]
                if kind == "sectors":
                    expected = [self.cache_tensor]
                    self._adopt_sectors(pool, handle)
                else:
                    expected = [t for kv in zip(self.key_cache, self.value_cache) for t in kv]
                    self._adopt_blocks(pool, handle)
                if pool is None or len(expected) != len(build["tensors"]) or \
                        any(a is not b for a, b in zip(expected, build["tensors"])):
                    raise InvalidConfigError("transformers did not build its cache tensors where vattn expected")
            except BaseException:
                if build["pool"] is not None:
                    build["pool"].close()
                raise
            finally:
                cache_mod.torch = saved
                if saved_handler is not None:
                    cache_mod.PagedAttentionMemoryHandler = saved_handler
                _intercept.build = None
        self.vattn_pool = pool
        manager = _calling_manager(getattr(self.vattn_api, "ContinuousBatchingManager", None))
        if manager is not None and kind == "blocks":  # 5.17's loop cannot pause: vattn's stand-in
            LoopPause.install(manager)
        handle.track(manager)

    def _adopt_sectors(self, pool: ElasticPool | None, handle: CacheOwner) -> None:
        """Swap the CachePool for one whose sector calls go through `pool`."""
        old = self.pool
        if pool is None:
            return
        new = self.vattn_pool_cls(old.num_sectors, old.num_allocators, pool, handle, old.num_reserved_sectors)
        for i, bps in enumerate(old.blocks_per_sector):
            new.set_blocks_per_sector(i, bps)
        for allocator in self.cache_allocators.values():
            if allocator.pool is not old:
                raise InvalidConfigError("a transformers cache allocator does not use the cache's CachePool")
            allocator.pool = new
        self.pool = new

    def _adopt_blocks(self, pool: ElasticPool | None, handle: CacheOwner) -> None:
        """Swap the BlockManager's free-block deque for the pool's free blocks."""
        bm = self._block_manager
        if pool is None:
            return
        if len(bm._uninit_block_ids) != bm.num_blocks or bm.num_blocks + TRASH_SECTORS != pool.config.num_blocks:
            raise InvalidConfigError("transformers' BlockManager does not start with every block free")
        bm._uninit_block_ids = _FreeBlocks(pool, handle)


# transformers' batch buffers (IO tensors, activation peaks, attention masks: its own
# estimate, PagedAttentionMemoryHandler.compute_memory_footprint less the cache) when the
# cache is sized from a memory limit: max_batch_tokens is halved from transformers' default
# (8192) until they fit, down to BATCH_TOKENS_MIN. See docs/servers.md ("What bounds the
# server's memory").
BATCH_BUFFER_BYTES = 256 << 20
BATCH_TOKENS_MIN = 64


def _limit_of(handle: Any) -> int | None:
    """The bytes of KV pages `handle` may ever have mapped: its memory limit, else its
    budget's limit (None: neither, transformers sizes the cache from free memory)."""
    probe = getattr(handle, "probe_bytes", None)  # a start-up probe of the room (hf_cb.probe.probe_room)
    if probe is not None:
        return probe
    limits = [getattr(handle, "memory_limit", None)]
    budget = getattr(handle, "budget", None)
    if budget is not None:
        limits.append(getattr(budget.stats(), "budget_limit", getattr(budget, "limit", None)))
    limits = [x for x in limits if isinstance(x, int)]
    return min(limits) if limits else None


def _sizes_from_memory(handler: Any) -> bool:
    """Whether `handler` is transformers' 5.18+ memory handler (sectors from free memory)."""
    return handler is not None and all(hasattr(handler, n) for n in (
        "infer_max_batch_tokens_and_num_sectors", "compute_memory_footprint", "num_sectors_from_config"))


def _on_host(device: Any) -> bool:
    try:
        return torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        return False


def _limited_handler(base: type, limit: int, cap_batch: bool) -> type:
    """transformers' PagedAttentionMemoryHandler sizing from `limit`, not from the host's
    (or device's) free memory: the cache (virtual: vattn maps only what is used) holds the
    limit's worth of sectors beyond the trash, as the limit can never back more, unless
    `num_blocks` is given. With `cap_batch` (a cache on the host), `max_batch_tokens`,
    unless given, is the largest of 8192, 4096, ... (>= BATCH_TOKENS_MIN) whose batch
    buffers (what grows with it, by transformers' own estimate: IO tensors, activation peak,
    attention masks) fit in BATCH_BUFFER_BYTES; on a device, transformers' default (8192)."""

    class LimitedMemoryHandler(base):  # type: ignore[misc, valid-type]
        def infer_max_batch_tokens_and_num_sectors(self) -> tuple[int, int]:
            num_sectors = self.num_sectors_from_config()
            if num_sectors is None:
                num_sectors = max(1, -(-limit // self.bytes_per_sector))
            m = self.cb_config.max_batch_tokens
            if m is None:
                m = getattr(self, "_default_max_batch_tokens", 8192)
                fixed = self.compute_memory_footprint(0, num_sectors)
                while cap_batch and m > BATCH_TOKENS_MIN and \
                        self.compute_memory_footprint(m, num_sectors) - fixed > BATCH_BUFFER_BYTES:
                    m //= 2
            return m, num_sectors

    LimitedMemoryHandler.__name__ = LimitedMemoryHandler.__qualname__ = base.__name__
    return LimitedMemoryHandler


def make_classes(cache_mod: Any, api: Any, base: type, kind: str,
                 handle_for: Callable[[Any], CacheOwner | None]) -> type:
    """transformers' `base` PagedAttentionCache (of `api`, built in `cache_mod`) on vattn memory
    for design `kind`, for the models `handle_for(config)` returns a handle for."""
    pool_cls = type("VattnCachePool", (_SectorPool, getattr(cache_mod, "CachePool", object)),
                    {"__module__": __name__, "__doc__": _SectorPool.__doc__})
    return type(base.__name__, (_ElasticCache, base), {
        "__module__": __name__, "__qualname__": base.__qualname__, "__doc__": _ElasticCache.__doc__,
        "vattn_kind": kind, "vattn_cache_mod": cache_mod, "vattn_api": api, "vattn_pool_cls": pool_cls,
        "vattn_handle_for": staticmethod(handle_for), "vattn_base": base})
