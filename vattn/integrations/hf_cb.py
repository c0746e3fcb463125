"""transformers' continuous batching on vattn memory (elastic KV memory, no model change).

transformers 5.23 runs continuous batching (`model.generate_batch`,
`init_continuous_batching`, `transformers serve --continuous-batching`) on a
`PagedAttentionCache`: one flat `uint8` tensor of `2 + num_sectors` sectors (the first
two are trash sectors for padding tokens), handed out sector by sector to its cache
allocators by a `CachePool`. This module backs that tensor with an `ElasticPool`:

```
 cache_tensor (virtual, reserved once, never moves)
 [ trash | trash | sector 2 | sector 3 | ... | sector num_sectors + 1 ]
   always mapped   mapped when the CachePool hands the sector to an allocator,
                   given back to the pool when all its blocks are free again
```

```
cb = vattn.integrations.hf_cb.enable(model, memory_limit=2 << 30)
out = model.generate_batch(prompts, generation_config=gen)   # unchanged call
cb.stats(); cb.trim(); cb.set_limit(1 << 30); cb.disable()
```

The hook, smallest that works: `continuous_api.PagedAttentionCache` (the name
`ContinuousBatchingManager` builds its cache with) becomes a subclass that, for a model
that was enabled, (1) lets transformers' own `__init__` run unchanged except that the
single `torch.zeros(...)` of the cache tensor returns the pool's virtual tensor, and
(2) swaps the `CachePool` for a subclass whose sector calls go through the pool.
Nothing else of transformers changes: its allocators, block tables, attention and
scheduler run as they are. When memory is short (the limit, a shared `Budget`),
`CachePool.num_free_sectors` reports fewer free sectors, so transformers' scheduler
waits, offloads or soft-resets requests as it does when its own cache is full.

Supported: transformers 5.23 (`SUPPORTED_VERSIONS`); the hook checks the exact names it
relies on and raises `InvalidConfigError` on any other version (5.17, for example, keeps
per-layer K/V tensors and a `BlockManager`, a different design).
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import threading
import weakref
from typing import Any

import torch

from vattn.budget import Budget
from vattn.errors import InvalidConfigError, OutOfPhysicalMemoryError
from vattn.pool import ElasticPool, PoolStats

SUPPORTED_VERSIONS = ("5.23",)  # major.minor whose continuous-batching code this hook was written against
TRASH_SECTORS = 2

_lock = threading.RLock()
_handles: dict[int, tuple[weakref.ref, ElasticCB]] = {}  # id(text config) -> (ref to it, handle)
_installed: dict[str, Any] = {}  # what install() replaced
_intercept = threading.local()  # the cache being built on this thread, and its pool
_default: ElasticCB | None = None  # enable_all(): the handle of every model not enabled one by one


# --------------------------------------------------------------- version guard ----
def _modules() -> tuple[Any, Any, Any]:
    try:
        import transformers
        from transformers.generation.continuous_batching import cache as cache_mod
        from transformers.generation.continuous_batching import continuous_api
    except ImportError as e:
        raise InvalidConfigError(f"vattn.integrations.hf_cb needs transformers {SUPPORTED_VERSIONS}: {e}") from None
    return transformers, cache_mod, continuous_api


def check_transformers() -> str:
    """Raise InvalidConfigError unless the installed transformers is one this hook knows,
    with the names it relies on. Returns the version."""
    transformers, cache_mod, api = _modules()
    version = transformers.__version__
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VERSIONS:
        raise InvalidConfigError(
            f"vattn.integrations.hf_cb supports transformers {', '.join(SUPPORTED_VERSIONS)} (continuous batching on "
            f"one flat cache tensor handed out by sectors through CachePool); this is transformers {version}. "
            "Install a supported version, or use vattn's own engine (vattn.LLM)")
    base = _installed.get("base", getattr(api, "PagedAttentionCache", None))
    problems = []
    if base is None or base is not getattr(cache_mod, "PagedAttentionCache", None):
        problems.append("continuous_api.PagedAttentionCache is not cache.PagedAttentionCache")
    pool_cls = getattr(cache_mod, "CachePool", None)
    for name in ("allocate_sector", "try_to_free_sectors", "free_blocks", "reset", "num_free_sectors"):
        if pool_cls is None or not hasattr(pool_cls, name):
            problems.append(f"CachePool.{name} is missing")
    for name in ("evict_cached_blocks", "free_all_requests", "reset"):
        if base is not None and not hasattr(base, name):
            problems.append(f"PagedAttentionCache.{name} is missing")
    if base is not None:
        params = list(inspect.signature(base.__init__).parameters)
        if params[:5] != ["self", "config", "continuous_batching_config", "device", "distributed_helper"]:
            problems.append(f"PagedAttentionCache.__init__ takes {params}")
        try:
            src = inspect.getsource(base.__init__)
        except (OSError, TypeError):
            src = None
        if src is not None:
            for needle in ("self.cache_tensor = torch.zeros(", "self.pool = CachePool(self.num_sectors",
                           "register_cache_tensor(self.bytes_per_sector, non_trash_bytes, self.cache_tensor, self.pool)"):
                if needle not in src:
                    problems.append(f"PagedAttentionCache.__init__ no longer has `{needle}`")
    if problems:
        raise InvalidConfigError(f"transformers {version} changed what vattn.integrations.hf_cb hooks: "
                                 + "; ".join(problems))
    return version


# ------------------------------------------------------------------ the handle ----
class ElasticCB:
    """What `enable` returns: the settings of one model's elastic KV memory and its pools
    (one per `PagedAttentionCache` transformers builds; the last one is `pool`)."""

    def __init__(self, model: Any, memory_limit: int | None, budget: Budget | None, page_size: int | None) -> None:
        self._model = weakref.ref(model) if model is not None else None
        self.memory_limit = memory_limit
        self.budget = budget
        self.page_size = page_size
        self._pools: list[weakref.ref] = []
        self.num_caches = 0  # PagedAttentionCaches built on vattn memory so far

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
        `allow_block_sharing=True`, the default) hold their sectors until transformers evicts
        them under memory pressure. Pass the `ContinuousBatchingManager` to evict them first
        (inside `manager.pause()` while its loop runs)."""
        if manager is not None:
            cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
            if cache is not None:
                paused = manager.pause() if manager.is_running() else contextlib.nullcontext()
                with paused:
                    cache.evict_cached_blocks()
                    cache.pool.try_to_free_sectors()
        return sum(p.trim() for p in self.pools)

    def set_limit(self, limit: int | None) -> None:
        """A new limit on the mapped bytes of this model's caches (this one and later ones)."""
        self.memory_limit = limit
        for p in self.pools:
            p.set_limit(limit)

    def disable(self) -> None:
        """Later caches of this model use transformers' own memory again (live ones stay)."""
        if self._model is None:
            disable_all()
            return
        model = self._model()
        if model is not None:
            disable(model)

    def _new_pool(self, num_blocks: int, sector_bytes: int, device: torch.device | str) -> ElasticPool:
        pool = ElasticPool(num_blocks, (sector_bytes,), torch.uint8, 1, device=torch.device(device),
                           page_size=self.page_size, limit=self.memory_limit, budget=self.budget, sync="device")
        self._pools = [r for r in self._pools if r() is not None] + [weakref.ref(pool)]
        self.num_caches += 1
        return pool


def enable(model: Any, *, memory_limit: int | None = None, budget: Budget | None = None,
           page_size: int | None = None) -> ElasticCB:
    """Run `model`'s continuous batching on vattn memory from its next cache on.

    `memory_limit`: bytes of KV pages the model may have mapped (None: no limit but the
    device's and the budget's). `budget`: a `vattn.Budget` shared with other models.
    `page_size`: the pool's page (default: the backend's: 2 MiB on CUDA, 64 KiB on the
    host). Returns the model's `ElasticCB` handle (the same one if already enabled,
    with the new settings)."""
    check_transformers()
    if budget is not None and not isinstance(budget, Budget):
        raise InvalidConfigError(f"budget must be a vattn.Budget or None, got {budget!r}")
    get_text_config = getattr(getattr(model, "config", None), "get_text_config", None)
    if get_text_config is None or not hasattr(model, "generate_batch"):
        raise InvalidConfigError(f"{type(model).__name__} is not a transformers model with continuous batching")
    config = get_text_config()
    if config is not get_text_config():
        raise InvalidConfigError(f"{type(model.config).__name__}.get_text_config() returns a new object each call; "
                                 "vattn cannot tell this model's caches apart")
    if memory_limit is not None:
        if isinstance(memory_limit, bool) or not isinstance(memory_limit, int) or memory_limit < 0:
            raise InvalidConfigError(f"memory_limit must be >= 0 bytes or None, got {memory_limit!r}")
    with _lock:
        install()
        entry = _handles.get(id(config))
        handle = entry[1] if entry is not None and entry[0]() is config else None
        if handle is None:
            handle = ElasticCB(model, memory_limit, budget, page_size)
            ref = weakref.ref(config, lambda _r, key=id(config): _forget(key))
            _handles[id(config)] = (ref, handle)
        else:
            handle.memory_limit, handle.budget, handle.page_size = memory_limit, budget, page_size
        return handle


def enable_all(*, memory_limit: int | None = None, budget: Budget | None = None,
               page_size: int | None = None) -> ElasticCB:
    """Run the continuous batching of every model of this process on vattn memory (the
    models `enable` was not called for share this one handle and its settings): for a
    server that loads its models itself, like `transformers serve`. Undo with
    `disable_all()`."""
    global _default
    check_transformers()
    if budget is not None and not isinstance(budget, Budget):
        raise InvalidConfigError(f"budget must be a vattn.Budget or None, got {budget!r}")
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, int)
                                     or memory_limit < 0):
        raise InvalidConfigError(f"memory_limit must be >= 0 bytes or None, got {memory_limit!r}")
    with _lock:
        install()
        _default = ElasticCB(None, memory_limit, budget, page_size)
        return _default


def disable_all() -> None:
    """Undo `enable_all` (models enabled one by one stay enabled)."""
    global _default
    with _lock:
        _default = None
        if not _handles:
            uninstall()


def disable(model: Any) -> None:
    """Later caches of `model` use transformers' own memory again (idempotent)."""
    config = model.config.get_text_config()
    with _lock:
        entry = _handles.get(id(config))
        if entry is not None and entry[0]() is config:
            del _handles[id(config)]
        if not _handles and _default is None:
            uninstall()


def _forget(key: int) -> None:
    with _lock:
        _handles.pop(key, None)


def _handle_for(config: Any) -> ElasticCB | None:
    with _lock:
        entry = _handles.get(id(config))
        return entry[1] if entry is not None and entry[0]() is config else _default


# ------------------------------------------------------------------- serving ----
SERVING_PACKAGES = ("fastapi", "uvicorn", "openai", "pydantic", "typer")


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, memory_limit: int | None = None,
          page_size: int | None = None, device: str = "auto", num_blocks: int | None = None,
          max_batch_tokens: int | None = None, log_level: str = "warning", non_blocking: bool = False) -> Any:
    """`transformers serve` with continuous batching on vattn memory, for a local checkpoint
    (offline): the OpenAI-compatible endpoints `/v1/chat/completions`, `/v1/completions`,
    `/v1/models`, `/health`. Blocks until the server stops, unless `non_blocking` (then it
    returns transformers' `Serve` object: `kill_server()` stops it). The memory limit is in
    bytes of KV pages; `num_blocks` sizes transformers' (virtual) cache."""
    missing = [m for m in SERVING_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise InvalidConfigError(f"vattn serve runs `transformers serve`, which needs {', '.join(missing)}: "
                                 "pip install 'transformers[serving]'")
    if not os.path.isdir(model) or not os.path.isfile(os.path.join(model, "config.json")):
        raise InvalidConfigError(f"--model must be a local checkpoint directory with a config.json, got {model!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint: never reach the Hub
    handle = enable_all(memory_limit=memory_limit, page_size=page_size)
    from transformers.cli.serve import Serve

    try:
        server = Serve(force_model=os.path.abspath(model), continuous_batching=True, host=host, port=port,
                       device=device, cb_num_blocks=num_blocks, cb_max_batch_tokens=max_batch_tokens,
                       log_level=log_level, non_blocking=non_blocking)
    except BaseException:
        disable_all()
        raise
    server.vattn = handle
    if not non_blocking:
        disable_all()
    return server


def main(argv: list[str] | None = None) -> None:
    """`python -m vattn.integrations.hf_cb --model DIR [--port N] [--memory-limit BYTES]`."""
    import argparse

    ap = argparse.ArgumentParser(prog="vattn serve", description=serve.__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local checkpoint directory (config, weights, tokenizer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--memory-limit", type=int, default=None, help="bytes of KV pages (default: no limit)")
    ap.add_argument("--page-size", type=int, default=None, help="vattn page bytes (default: the backend's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-blocks", type=int, default=None, help="transformers' cache size in blocks (virtual)")
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--log-level", default="warning")
    a = ap.parse_args(argv)
    serve(a.model, host=a.host, port=a.port, memory_limit=a.memory_limit, page_size=a.page_size, device=a.device,
          num_blocks=a.num_blocks, max_batch_tokens=a.max_batch_tokens, log_level=a.log_level)


# ------------------------------------------------------------------ the hook ----
def install() -> None:
    """Put the vattn-aware PagedAttentionCache where ContinuousBatchingManager finds it
    (idempotent; inert for models that were not enabled)."""
    with _lock:
        if _installed:
            return
        _, cache_mod, api = _modules()
        base = api.PagedAttentionCache
        cls = _make_classes(cache_mod, base)
        _installed.update(base=base, api=api, cls=cls)
        api.PagedAttentionCache = cls


def uninstall() -> None:
    with _lock:
        if _installed:
            _installed["api"].PagedAttentionCache = _installed["base"]
            _installed.clear()


class _TorchProxy:
    """Stands for `torch` in transformers' cache module while a vattn cache is built:
    the one `torch.zeros` of the cache tensor returns the pool's virtual tensor; every
    other name (and every call on another thread) is torch's own."""

    def __getattr__(self, name: str) -> Any:
        if name == "zeros":
            return _zeros
        return getattr(torch, name)


def _zeros(*size: Any, **kwargs: Any) -> torch.Tensor:
    build = getattr(_intercept, "build", None)
    if build is None or build.get("tensor") is not None or kwargs.get("dtype") is not torch.uint8 or len(size) != 1:
        return torch.zeros(*size, **kwargs)
    cache = build["cache"]
    nbytes = int(size[0])
    sector = cache.bytes_per_sector
    if nbytes != (cache.num_sectors + TRASH_SECTORS) * sector:  # not the cache tensor (checked after __init__)
        return torch.zeros(*size, **kwargs)
    pool = build["handle"]._new_pool(cache.num_sectors + TRASH_SECTORS, sector, kwargs.get("device", cache.device))
    build["pool"] = pool
    trash = pool.take(list(range(TRASH_SECTORS)))  # padding tokens read and write here: always mapped
    if trash is None:
        pool.close()
        raise OutOfPhysicalMemoryError(f"no memory for the {TRASH_SECTORS} trash sectors ({TRASH_SECTORS * sector} "
                                       "bytes) of the continuous-batching cache; raise memory_limit or the budget")
    tensor = pool.buffer(0).view(-1)  # [(num_sectors + 2) * sector] uint8
    tensor[:TRASH_SECTORS * sector].zero_()  # the read trash must read zeros (device memory is not cleared)
    build["tensor"] = tensor
    return tensor


def _make_classes(cache_mod: Any, base: type) -> type:
    base_pool = cache_mod.CachePool

    class VattnCachePool(base_pool):
        """transformers' CachePool whose sectors come from an ElasticPool: mapped when handed
        to an allocator, given back to the pool as soon as all their blocks are free."""

        def __init__(self, num_sectors: int, num_allocators: int, elastic: ElasticPool,
                     num_reserved_sectors: int = TRASH_SECTORS) -> None:
            self.elastic = elastic
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
            got = self.elastic.alloc(1)
            if got is None:
                raise OutOfPhysicalMemoryError(
                    "vattn could not back a cache sector transformers' scheduler had counted as free (another model "
                    "of the same budget took the memory in between); raise memory_limit or the budget")
            sector = got[0]
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
            super().free_blocks(index, block_ids)
            self.try_to_free_sectors()  # a sector with no block in use goes back now, not at the next schedule

    class PagedAttentionCache(base):
        """transformers' PagedAttentionCache, on vattn memory when its model was enabled."""

        def __init__(self, config: Any, continuous_batching_config: Any, device: Any, distributed_helper: Any,
                     *args: Any, **kwargs: Any) -> None:
            handle = _handle_for(config)
            if handle is None:  # not enabled: transformers' own memory
                super().__init__(config, continuous_batching_config, device, distributed_helper, *args, **kwargs)
                return
            if getattr(distributed_helper, "tp_size", 1) > 1:
                raise InvalidConfigError("vattn.integrations.hf_cb does not support tensor parallelism yet")
            build = {"cache": self, "handle": handle, "tensor": None, "pool": None}
            with _lock:  # one vattn cache is built at a time; other threads see torch itself
                saved = cache_mod.torch
                _intercept.build = build
                cache_mod.torch = _TorchProxy()
                try:
                    super().__init__(config, continuous_batching_config, device, distributed_helper, *args, **kwargs)
                except BaseException:
                    if build["pool"] is not None:
                        build["pool"].close()
                    raise
                finally:
                    cache_mod.torch = saved
                    _intercept.build = None
            pool = build["pool"]
            if build["tensor"] is None or self.cache_tensor is not build["tensor"]:
                raise InvalidConfigError("transformers did not build its cache tensor where vattn expected")
            old = self.pool
            new = VattnCachePool(old.num_sectors, old.num_allocators, pool, old.num_reserved_sectors)
            for i, bps in enumerate(old.blocks_per_sector):
                new.set_blocks_per_sector(i, bps)
            for allocator in self.cache_allocators.values():
                if allocator.pool is not old:
                    pool.close()
                    raise InvalidConfigError("a transformers cache allocator does not use the cache's CachePool")
                allocator.pool = new
            self.pool = new
            self.vattn_pool = pool

    PagedAttentionCache.__qualname__ = base.__qualname__
    PagedAttentionCache.__module__ = __name__
    VattnCachePool.__module__ = __name__
    return PagedAttentionCache


__all__ = ["SUPPORTED_VERSIONS", "ElasticCB", "enable", "disable", "enable_all", "disable_all", "check_transformers",
           "install", "uninstall", "serve", "main"]


if __name__ == "__main__":
    main()
