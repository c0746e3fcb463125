"""transformers' continuous batching on vattn memory (elastic KV memory, no model change).

```
cb = vattn.integrations.hf_cb.enable(model, memory_limit=2 << 30)   # or budget=vattn.Budget(...)
out = model.generate_batch(prompts, generation_config=gen)         # unchanged call
cb.stats(); cb.trim(); cb.set_limit(1 << 30); cb.disable()
```

transformers runs continuous batching (`model.generate_batch`, `init_continuous_batching`,
`transformers serve --continuous-batching`) on a `PagedAttentionCache`. Its memory design
changed between releases; this module knows two (`DESIGNS`), and backs the cache's
tensors with one `ElasticPool` in both:

- "sectors" (5.18 to 5.24): one flat `uint8` tensor of `2 + num_sectors` sectors (the
  first two are trash sectors for padding tokens), handed out sector by sector to the
  cache allocators by a `CachePool`. The tensor is the pool's single buffer, a sector one
  pool block; `CachePool` becomes a subclass whose sector calls go through the pool
  (mapped when handed out, given back when all its blocks are free).
- "blocks" (5.17): per-layer K and V tensors `[(num_blocks + 2) * block_size, heads,
  head_dim]` of one layer group (the last two blocks are the trash), and a
  `BlockManager` whose free blocks are a deque. The tensors are the pool's buffers (K and
  V of each layer, block i of all of them one pool block); the deque becomes the pool's
  free blocks (`_FreeBlocks`: `popleft` maps a block, `append` gives it back).

```
 cache tensor(s) (virtual, reserved once, never move)
 [ block | block | ... | trash | trash ]     (sectors: the trash sectors come first)
   mapped when transformers hands the block out, given back to the pool when free;
   the trash stays mapped
```

Pages mapped with new memory are cleared before transformers gets them
(`ElasticPool(zero_new=True)`: on a GPU; the host's new pages read zeros), as its
`torch.zeros` cache started at zero, and the trash blocks, which padding tokens read, are
cleared when taken.

5.24 runs its generation loop in the caller's inference mode (`torch.inference_mode()`
around `generate_batch` reaches the loop's thread): the cache, and so the pool's tensors,
are then built in inference mode, as transformers' own `torch.zeros` would be. vattn writes
to them (clearing the trash and new pages) only while transformers builds the cache or
hands out memory, on that thread; `trim` and the idle policy only unmap.

The hook, smallest that works: `continuous_api.PagedAttentionCache` (the name
`ContinuousBatchingManager` builds its cache with) becomes a subclass that, for a model
that was enabled, (1) lets transformers' own `__init__` run unchanged except that the
allocation of the cache tensors (`torch.zeros` / `torch.empty` in its module) returns the
pool's virtual tensors, and (2) swaps the one object that hands out memory (`CachePool`,
or the `BlockManager`'s free-block deque). Nothing else of transformers changes: its
allocators, block tables, attention and scheduler run as they are. When memory is short
(the limit, a shared `Budget`), the free count transformers' scheduler reads reports only
what memory can back, so it waits, offloads or soft-resets requests as it does when its
own cache is full.

Limit: memory given back (`trim`, the idle policy) can be taken by another process, and
the free count transformers reads looks only at `memory_limit` and the budget, not at
the device. If the device then refuses pages for a block transformers counted as free,
the allocation waits `ALLOC_RETRY_S` (2 s) and raises `OutOfPhysicalMemoryError` inside
transformers' generation loop, which stops and fails the requests in flight (`vattn serve`
then starts a new loop: `vattn.integrations.hf_serve`). Sharing a GPU, give each process a
`memory_limit` (and the servers theirs) whose sum fits it.

Supported: `SUPPORTED_VERSIONS` (each verified with tests/integrations/test_hf_cb.py and
tests/integrations/test_serve.py, see tests/integrations/test_hf_cb_versions.py). The hook
checks the exact names, signatures and source lines it relies on and raises
`InvalidConfigError` when they changed.
A release newer than these is recognised by that same check, not by its version string:
when it keeps one design's hook points, vattn warns that it is unverified and runs; an
older release, or a newer one with a changed cache, gets `InvalidConfigError`.
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import re
import sys
import threading
import time
import warnings
import weakref
from typing import Any, Iterable

import torch

from vattn.budget import Budget
from vattn.errors import ClosedError, InvalidConfigError, OutOfPhysicalMemoryError, UnsupportedModelError
from vattn.integrations import _env
from vattn.pool import ElasticPool, PoolStats

logger = logging.getLogger("vattn.hf_cb")

# transformers major.minor -> the design of its continuous-batching cache, each verified with
# tests/integrations/test_hf_cb.py and tests/integrations/test_serve.py (tests/integrations/test_hf_cb_versions.py
# runs them on each); pyproject's extras stop below the next one
DESIGNS = {"5.17": "blocks", "5.18": "sectors", "5.19": "sectors", "5.20": "sectors", "5.21": "sectors", "5.22": "sectors",
           "5.23": "sectors", "5.24": "sectors"}
SUPPORTED_VERSIONS = tuple(DESIGNS)
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
        raise InvalidConfigError(f"vattn.integrations.hf_cb needs transformers {', '.join(SUPPORTED_VERSIONS)}: "
                                 f"{e}") from None
    return transformers, cache_mod, continuous_api


def _minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string ("5.24.0", "5.25.0.dev0"), or None."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def verified_requirement() -> str:
    """The pip requirement of the releases this hook was verified on, `transformers>=5.17,<5.25`:
    what the `hf`, `serve` and `test` extras ask for."""
    first, last = min(map(_minor, DESIGNS)), max(map(_minor, DESIGNS))
    return f"transformers>={first[0]}.{first[1]},<{last[0]}.{last[1] + 1}"


def design() -> str:
    """The cache design of the installed transformers: "sectors" or "blocks" (see the module
    docstring). A verified release (`DESIGNS`) has its own; a newer one is recognised by its
    code: when it keeps every name, signature and allocation line one design's hook relies
    on (`check_transformers`), that design, with a warning that the release is unverified.
    InvalidConfigError otherwise (an older release, or a newer one whose cache changed)."""
    transformers, cache_mod, api = _modules()
    version = transformers.__version__
    found = DESIGNS.get(".".join(version.split(".")[:2]))
    if found is not None:
        return found
    newest = max(DESIGNS, key=_minor)
    newer = (_minor(version) or (0, 0)) > _minor(newest)
    problems: dict[str, list[str]] = {}
    if newer:  # an older release predates what vattn knows: never guessed
        for kind in dict.fromkeys([DESIGNS[newest], *DESIGNS.values()]):  # the newest release's design first
            problems[kind] = _hook_problems(kind, cache_mod, api, strict=True)
            if not problems[kind]:
                releases = [v for v, k in DESIGNS.items() if k == kind]
                span = releases[0] if len(releases) == 1 else f"{releases[0]} to {releases[-1]}"
                warnings.warn(
                    f"vattn.integrations.hf_cb: transformers {version} is newer than the releases it was verified on "
                    f"({SUPPORTED_VERSIONS[0]} to {newest}), and its continuous-batching cache keeps the {kind!r} "
                    f"design of {span} (the classes, methods, signatures and allocation "
                    f"lines vattn hooks): vattn runs on it, unverified. If it misbehaves: pip install "
                    f"'{verified_requirement()}'", UserWarning, stacklevel=2)
                return kind
    raise InvalidConfigError(
        f"vattn.integrations.hf_cb supports transformers {', '.join(SUPPORTED_VERSIONS)} (the continuous-batching "
        f"cache designs it was verified on); this is transformers {version}"
        + (f", whose cache differs from {newest}'s: {', '.join(problems[DESIGNS[newest]])}" if newer else "")
        + f". Install a supported version (pip install '{verified_requirement()}'), or use vattn's own engine "
        "(vattn.LLM)")


def _source(fn: Any) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _hook_problems(kind: str, cache_mod: Any, api: Any, strict: bool = False) -> list[str]:
    """What of the names, signatures and source lines the hook of design `kind` relies on
    the loaded transformers lacks (empty: the hook fits it). Source that cannot be read
    passes on a verified release, not when `strict` (an unverified one is recognised by it)."""

    def source(what: str, obj: Any) -> str | None:
        src = _source(obj)
        if src is None and strict:
            problems.append(f"the source of {what} cannot be read")
        return src

    base = _installed.get("base", getattr(api, "PagedAttentionCache", None))
    problems = []
    if base is None or base is not getattr(cache_mod, "PagedAttentionCache", None):
        problems.append("continuous_api.PagedAttentionCache is not cache.PagedAttentionCache")
    if kind == "sectors":
        pool_cls = getattr(cache_mod, "CachePool", None)
        missing = [name for name in ("allocate_sector", "try_to_free_sectors", "free_blocks", "reset",
                                     "num_free_sectors", "set_blocks_per_sector") if not hasattr(pool_cls, name)]
        problems += [f"CachePool.{name} is missing" for name in missing]
        if pool_cls is not None and not missing:  # what VattnCachePool builds on: a free list, the last one handed out
            if list(inspect.signature(pool_cls.__init__).parameters) != \
                    ["self", "num_sectors", "num_allocators", "num_reserved_sectors"]:
                problems.append("CachePool.__init__ takes other arguments")
            for name, needle in (("reset", "self.free_sectors = "), ("allocate_sector", "self.free_sectors.pop()"),
                                 ("try_to_free_sectors", "self.free_sectors.append(")):
                src = source(f"CachePool.{name}", getattr(pool_cls, name))
                if src is not None and needle not in src:
                    problems.append(f"CachePool.{name} no longer has `{needle}`")
        methods, first = ("evict_cached_blocks", "free_all_requests", "reset"), []
        needles = ("self.cache_tensor = torch.zeros(", "self.pool = CachePool(self.num_sectors",
                   "register_cache_tensor(self.bytes_per_sector, non_trash_bytes, self.cache_tensor, self.pool)")
    else:
        manager = getattr(cache_mod, "BlockManager", None)
        for name in ("get_free_blocks", "has_enough_free_blocks", "num_free_blocks"):
            if manager is None or not hasattr(manager, name):
                problems.append(f"BlockManager.{name} is missing")
        if not callable(getattr(cache_mod, "group_layers_by_attn_type", None)):
            problems.append("cache.group_layers_by_attn_type is missing")
        src = source("BlockManager's module", sys.modules.get(manager.__module__)) if manager is not None else None
        if src is not None:  # the free-block deque is only ever popleft/append/extend/len: what _FreeBlocks stands in for
            ops = set(re.findall(r"_uninit_block_ids(?:\.(\w+)|(\[))", src))
            bad = sorted({a or b for a, b in ops} - {"popleft", "append", "extend"})
            if bad or "self._uninit_block_ids = deque(range(num_blocks))" not in src:
                problems.append(f"BlockManager uses its free-block deque in new ways ({bad})")
        methods, first = ("free_all_requests", "get_num_free_blocks"), ["tp_plan", "dtype"]
        needles = ("torch.empty(self.cache_shape, dtype=self.dtype, device=self.device)",
                   "self._block_manager = BlockManager(num_blocks",
                   "block_based_shape = (num_blocks + 2, self.block_size, self.num_key_value_heads, self.head_dim)")
    for name in methods:
        if base is not None and not hasattr(base, name):
            problems.append(f"PagedAttentionCache.{name} is missing")
    if base is not None:
        params = list(inspect.signature(base.__init__).parameters)
        want = ["self", "config", "continuous_batching_config", "device", "distributed_helper", *first]
        if params[:len(want)] != want:
            problems.append(f"PagedAttentionCache.__init__ takes {params}")
        src = source("PagedAttentionCache.__init__", base.__init__)
        for needle in needles if src is not None else ():
            if needle not in src:
                problems.append(f"PagedAttentionCache.__init__ no longer has `{needle}`")
    return problems


def check_transformers() -> str:
    """Raise InvalidConfigError unless the installed transformers is one this hook knows
    (`design`), with the names it relies on. Returns the version."""
    transformers, cache_mod, api = _modules()
    problems = _hook_problems(design(), cache_mod, api)
    if problems:
        raise InvalidConfigError(f"transformers {transformers.__version__} changed what vattn.integrations.hf_cb "
                                 "hooks: " + "; ".join(problems))
    return transformers.__version__


def memory_problem() -> str | None:
    """Why transformers' continuous batching cannot size its cache on this machine, or None.

    transformers sizes the cache from the free memory of the accelerator (CUDA, XPU, MPS)
    or, without one, of the host as psutil reports it. Without psutil, transformers
    5.17-5.20 take the host to have 0 bytes (5.21+ fall back on the NUMA nodes' memory,
    where /sys has it): every request then fails with a MemoryError ("Memory footprint ...
    is more than available memory 0") on its generation thread, also on vattn memory (its
    `PagedAttentionCache.__init__` runs transformers' sizing). This asks transformers' own
    sizing function, only when psutil is missing."""
    if importlib.util.find_spec("psutil") is not None:
        return None
    import transformers
    from transformers.generation.continuous_batching import cache as cache_mod

    breakdown = getattr(cache_mod, "get_device_and_memory_breakdown", None)
    if breakdown is None:  # pragma: no cover - a transformers that sizes its cache otherwise
        return None
    cb_logger = getattr(cache_mod, "logger", None)  # it logs an error for the missing psutil: this is a question
    disabled = getattr(cb_logger, "disabled", False)
    if cb_logger is not None:
        cb_logger.disabled = True
    try:
        device, total, _, _ = breakdown()
    finally:
        if cb_logger is not None:
            cb_logger.disabled = disabled
    if total > 0:
        return None
    return (f"transformers {transformers.__version__}'s continuous batching finds no free memory on the {device} "
            "without psutil (it sizes its cache with it, and every request would fail with a MemoryError): "
            "pip install psutil")


# ------------------------------------------------------------------ the handle ----
class ElasticCB:
    """What `enable` returns: the settings of one model's elastic KV memory and its pools
    (one per `PagedAttentionCache` transformers builds; the last one is `pool`)."""

    def __init__(self, model: Any, memory_limit: int | None, budget: Budget | None, page_size: int | None,
                 idle_trim_s: float | None = None) -> None:
        self._model = weakref.ref(model) if model is not None else None
        self.memory_limit = memory_limit
        self.budget = budget
        self.page_size = page_size
        self.idle_trim_s = idle_trim_s
        self._pools: list[weakref.ref] = []
        self._managers: list[weakref.ref] = []  # the ContinuousBatchingManagers that built the caches
        self.num_caches = 0  # PagedAttentionCaches built on vattn memory so far
        self.num_idle_trims = 0  # times the idle policy gave memory back
        self.last_activity = time.monotonic()  # the last block handed out or given back
        self._idle_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._budget_token: int | None = None  # this handle's part on the budget (see _budget_reclaim)

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
        handle: inside `manager.pause()` while its loop runs (5.18+), or while the loop is
        stopped (5.17 cannot pause its loop: there they stay until it stops)."""
        for m in [manager] if manager is not None else self.managers:
            cache = getattr(getattr(m, "batch_processor", None), "cache", None)
            if cache is None or getattr(cache, "vattn_pool", None) is None:
                continue
            try:
                if not m.is_running():
                    _evict_cached_blocks(cache)
                elif hasattr(m, "pause"):
                    with m.pause():
                        _evict_cached_blocks(cache)
            except RuntimeError:  # the loop stopped in between: pause() refuses; nothing to evict now
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

    def _touch(self) -> None:
        self.last_activity = time.monotonic()

    def _idle_loop(self, stop: threading.Event) -> None:
        """The idle policy (`idle_trim_s`): once no block was handed out or given back for that
        long and no request is in flight, trim (prefix-sharing blocks evicted) once per idle period."""
        done_for = None
        while True:
            delay = self.idle_trim_s
            if delay is None or stop.wait(max(0.02, min(1.0, delay / 4))):
                return
            last = self.last_activity
            if done_for == last or time.monotonic() - last < delay or not self.pools or self.busy():
                continue
            try:
                self.trim()
                self.num_idle_trims += 1
            except ClosedError:  # a pool closed in between: the next period looks again
                pass
            except Exception:  # a real failure (CUDA...): say so; the next idle period tries again
                logger.warning("vattn: the idle trim of a continuous-batching cache failed", exc_info=True)
            done_for = self.last_activity  # the blocks the trim itself gave back are no new activity

    def _start_idle(self) -> None:
        """Run the idle policy's thread when `idle_trim_s` is set and a pool exists (once)."""
        if self.idle_trim_s is None or not self._pools:
            return
        if self._idle_thread is not None and self._idle_thread.is_alive() and not self._stop.is_set():
            return
        self._stop = threading.Event()  # the old thread, if any, keeps its own (set) event and ends
        self._idle_thread = threading.Thread(target=self._idle_loop, args=(self._stop,), name="vattn-hf-idle-trim",
                                             daemon=True)
        self._idle_thread.start()

    def _set_idle_trim_s(self, idle_trim_s: float | None) -> None:
        """A new idle policy: the thread stops when it is None, starts (or goes on with the
        new delay) otherwise."""
        self.idle_trim_s = idle_trim_s
        if idle_trim_s is None:
            self._stop.set()
        else:
            self._start_idle()

    def close(self) -> None:
        """Stop the idle policy's thread and leave the budget (live pools stay on it)."""
        self._stop.set()
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
        """What `_budget_reclaim` could give now beyond the pools' free pages (an estimate,
        read without locks: a pool calls it under its own): the blocks in use but the trash
        ones, while no request is in flight."""
        if self.busy():
            return 0
        total = 0
        for p in self.pools:
            c = p.config
            total += max(0, c.num_blocks - p.num_free_blocks - TRASH_SECTORS) * c.block_bytes * c.num_buffers
        return total

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

    def _new_pool(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, num_buffers: int,
                  device: torch.device | str) -> ElasticPool:
        pool = ElasticPool(num_blocks, block_shape, dtype, num_buffers, device=torch.device(device),
                           page_size=self.page_size, limit=self.memory_limit, budget=self.budget, sync="device",
                           zero_new=True)
        self._pools = [r for r in self._pools if r() is not None] + [weakref.ref(pool)]
        self.num_caches += 1
        if self.budget is not None and self._budget_token is None:  # after the pool: asked after its free pages
            self._budget_token = self.budget.register(self._budget_reclaim, self._budget_cached)
        self._start_idle()
        return pool

    def _track(self, manager: Any) -> None:
        if manager is not None and all(r() is not manager for r in self._managers):
            self._managers = [r for r in self._managers if r() is not None] + [weakref.ref(manager)]


def _check_settings(memory_limit: Any, budget: Any, idle_trim_s: Any) -> float | None:
    if budget is not None and not isinstance(budget, Budget):
        raise InvalidConfigError(f"budget must be a vattn.Budget or None, got {budget!r}")
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, int)
                                     or memory_limit < 0):
        raise InvalidConfigError(f"memory_limit must be >= 0 bytes or None, got {memory_limit!r}")
    return _env.idle_delay(idle_trim_s)


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


def _check_memory() -> None:
    problem = memory_problem()
    if problem:  # fail here, not on transformers' generation thread with "available memory 0"
        raise InvalidConfigError(problem)


def enable(model: Any, *, memory_limit: int | None = None, budget: Budget | None = None,
           page_size: int | None = None, idle_trim_s: float | None = None) -> ElasticCB:
    """Run `model`'s continuous batching on vattn memory from its next cache on.

    `memory_limit`: bytes of KV pages the model may have mapped (None: no limit but the
    device's and the budget's). `budget`: a `vattn.Budget` shared with other models.
    `page_size`: the pool's page (default: the backend's: 2 MiB on CUDA, 64 KiB on the
    host). `idle_trim_s`: the idle policy: once no block was handed out or given back for
    that many seconds and no request is in flight, `trim()` (prefix-sharing blocks
    evicted) from a background thread (None or negative: only explicit `trim`; the
    integrations' idle-trim rule, `vattn.integrations._env`). Returns the model's
    `ElasticCB` handle (the same one if already enabled, with the new settings)."""
    check_transformers()
    idle_trim_s = _check_settings(memory_limit, budget, idle_trim_s)
    _check_memory()
    get_text_config = getattr(getattr(model, "config", None), "get_text_config", None)
    if get_text_config is None or not hasattr(model, "generate_batch"):
        raise InvalidConfigError(f"{type(model).__name__} is not a transformers model with continuous batching")
    from vattn.integrations.hf import check_model

    check_model(model, probe=False)  # transformers' batching would run it, but with no state for its SSM layers
    config = get_text_config()
    if config is not get_text_config():
        raise InvalidConfigError(f"{type(model.config).__name__}.get_text_config() returns a new object each call; "
                                 "vattn cannot tell this model's caches apart")
    with _lock:
        install()
        entry = _handles.get(id(config))
        handle = entry[1] if entry is not None and entry[0]() is config else None
        if handle is None:
            handle = ElasticCB(model, memory_limit, budget, page_size, idle_trim_s)
            ref = weakref.ref(config, lambda _r, key=id(config), h=handle: _forget(key, h))
            _handles[id(config)] = (ref, handle)
        else:
            if budget is not handle.budget and handle._budget_token is not None:  # its part moves with it
                handle.budget.unregister(handle._budget_token)
                handle._budget_token = None
            handle.memory_limit, handle.budget, handle.page_size = memory_limit, budget, page_size
            handle._set_idle_trim_s(idle_trim_s)
        return handle


def enable_all(*, memory_limit: int | None = None, budget: Budget | None = None,
               page_size: int | None = None, idle_trim_s: float | None = None) -> ElasticCB:
    """Run the continuous batching of every model of this process on vattn memory (the
    models `enable` was not called for share this one handle and its settings, see
    `enable`): for a server that loads its models itself, like `transformers serve`. Undo
    with `disable_all()`."""
    global _default
    check_transformers()
    idle_trim_s = _check_settings(memory_limit, budget, idle_trim_s)
    _check_memory()
    with _lock:
        install()
        if _default is not None:
            _default.close()
        _default = ElasticCB(None, memory_limit, budget, page_size, idle_trim_s)
        return _default


def disable_all() -> None:
    """Undo `enable_all` (models enabled one by one stay enabled)."""
    global _default
    with _lock:
        if _default is not None:
            _default.close()
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
            entry[1].close()
        if not _handles and _default is None:
            uninstall()


def _forget(key: int, handle: ElasticCB) -> None:
    handle.close()
    with _lock:
        _handles.pop(key, None)


def _handle_for(config: Any) -> ElasticCB | None:
    with _lock:
        entry = _handles.get(id(config))
        return entry[1] if entry is not None and entry[0]() is config else _default


# ------------------------------------------------------------------ the hook ----
def install() -> None:
    """Put the vattn-aware PagedAttentionCache where ContinuousBatchingManager finds it
    (idempotent; inert for models that were not enabled)."""
    with _lock:
        if _installed:
            return
        _, cache_mod, api = _modules()
        base = api.PagedAttentionCache
        cls = _make_classes(cache_mod, base, design())
        _installed.update(base=base, api=api, cls=cls, cache_mod=cache_mod)
        api.PagedAttentionCache = cls


def uninstall() -> None:
    with _lock:
        if _installed:
            _installed["api"].PagedAttentionCache = _installed["base"]
            _installed.clear()


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
        groups, _ = _installed["cache_mod"].group_layers_by_attn_type(cache.config)
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
    pool = build["handle"]._new_pool(num_blocks + TRASH_SECTORS, block_shape, dtype, num_buffers, device)
    build["pool"] = pool
    trash = list(range(TRASH_SECTORS)) if build["kind"] == "sectors" else [num_blocks, num_blocks + 1]
    pool.pin(trash, f"the {TRASH_SECTORS} trash blocks of the continuous-batching cache",
             "raise memory_limit or the budget", zero=True)
    return pool


def _evict_cached_blocks(cache: Any) -> None:
    """Drop the prefix-sharing blocks no request uses (their memory becomes free), with
    transformers' own code. The generation loop must not run meanwhile."""
    if hasattr(cache, "evict_cached_blocks"):  # sectors
        cache.evict_cached_blocks()
        cache.pool.try_to_free_sectors()
    else:  # blocks: asking for every free block uninitializes every initialized one
        bm = cache._block_manager
        if bm._init_block_ids:
            bm.has_enough_free_blocks(len(bm._uninit_block_ids) + len(bm._init_block_ids))


def _calling_manager() -> Any:
    """The ContinuousBatchingManager building the cache (a caller's `self`), or None: lets
    `trim` and the idle policy evict its prefix-sharing blocks and see its requests."""
    manager_cls = getattr(_installed.get("api"), "ContinuousBatchingManager", None)
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None or manager_cls is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, manager_cls):
            return candidate
        frame = frame.f_back
    return None


ALLOC_RETRY_S = 2.0  # how long a block transformers counted as free may wait for memory before it is an error


def _alloc_one(pool: ElasticPool, handle: ElasticCB, what: str) -> int:
    """One block of `pool` for transformers, which counted it as free a moment ago. The
    count can be wrong only if the memory went in between (another model of the budget, or
    the device refusing new pages under outside pressure): retry for up to
    `ALLOC_RETRY_S` (the others give back, pressure passes) before a clear error, since
    transformers' loop cannot take a miss here."""
    handle._touch()
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

    def __init__(self, pool: ElasticPool, handle: ElasticCB) -> None:
        self.pool = pool
        self.handle = handle

    def __len__(self) -> int:
        return self.pool.available_blocks()  # never more than the free blocks

    def popleft(self) -> int:
        return _alloc_one(self.pool, self.handle, "block")

    def append(self, block: int) -> None:
        self.handle._touch()
        self.pool.free([block])

    def extend(self, blocks: Iterable[int]) -> None:
        blocks = list(blocks)
        if blocks:
            self.handle._touch()
            self.pool.free(blocks)


def _make_classes(cache_mod: Any, base: type, kind: str) -> type:
    base_pool = getattr(cache_mod, "CachePool", object)

    class VattnCachePool(base_pool):
        """("sectors") transformers' CachePool whose sectors come from an ElasticPool: mapped when
        handed to an allocator, given back to the pool as soon as all their blocks are free."""

        def __init__(self, num_sectors: int, num_allocators: int, elastic: ElasticPool, handle: ElasticCB,
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
            self.handle._touch()
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
            _check_layer_kinds(config)
            build = {"kind": kind, "cache": self, "handle": handle, "tensors": [], "pool": None}
            with _lock:  # one vattn cache is built at a time; other threads see torch itself
                saved = cache_mod.torch
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
                    _intercept.build = None
            self.vattn_pool = pool
            handle._track(_calling_manager())

        def _adopt_sectors(self, pool: ElasticPool | None, handle: ElasticCB) -> None:
            """Swap the CachePool for one whose sector calls go through `pool`."""
            old = self.pool
            if pool is None:
                return
            new = VattnCachePool(old.num_sectors, old.num_allocators, pool, handle, old.num_reserved_sectors)
            for i, bps in enumerate(old.blocks_per_sector):
                new.set_blocks_per_sector(i, bps)
            for allocator in self.cache_allocators.values():
                if allocator.pool is not old:
                    raise InvalidConfigError("a transformers cache allocator does not use the cache's CachePool")
                allocator.pool = new
            self.pool = new

        def _adopt_blocks(self, pool: ElasticPool | None, handle: ElasticCB) -> None:
            """Swap the BlockManager's free-block deque for the pool's free blocks."""
            bm = self._block_manager
            if pool is None:
                return
            if len(bm._uninit_block_ids) != bm.num_blocks or bm.num_blocks + TRASH_SECTORS != pool.config.num_blocks:
                raise InvalidConfigError("transformers' BlockManager does not start with every block free")
            bm._uninit_block_ids = _FreeBlocks(pool, handle)

    PagedAttentionCache.__qualname__ = base.__qualname__
    PagedAttentionCache.__module__ = __name__
    VattnCachePool.__module__ = __name__
    return PagedAttentionCache


__all__ = ["SUPPORTED_VERSIONS", "ElasticCB", "enable", "disable", "enable_all", "disable_all", "check_transformers", "design",
           "verified_requirement", "install", "uninstall"]
