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
tests/integrations/test_serve.py, see tests/integrations/test_hf_cb_versions.py). The hook checks the exact names,
signatures and source lines it relies on and raises `InvalidConfigError` when they changed.
A release newer than these is recognised by that same check, not by its version string:
when it keeps one design's hook points, vattn warns that it is unverified and runs; an
older release, or a newer one with a changed cache, gets `InvalidConfigError`.

Here: `enable`/`disable` (the registry of enabled models) and the hook's `install`; the
parts are `support` (`DESIGNS`, `design`, `check_transformers`, `memory_problem`), `caches`
(the classes over transformers' own) and `handle` (`ElasticCB`), their names re-exported here.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

from vattn.budget import Budget
from vattn.errors import InvalidConfigError
from vattn.integrations import _env
# The parts, re-exported: `vattn.integrations.hf_cb.X` keeps working for every name below
from vattn.integrations.hf_cb.caches import ALLOC_RETRY_S, TRASH_SECTORS, _alloc_one, _lock, _new_cache_pool  # noqa: F401
from vattn.integrations.hf_cb.caches import make_classes
from vattn.integrations.hf_cb.handle import ElasticCB
from vattn.integrations.hf_cb.support import (  # noqa: F401
    DESIGNS, SUPPORTED_VERSIONS, _modules, check_transformers, design, memory_problem, verified_requirement)

logger = logging.getLogger("vattn.hf_cb")

_handles: dict[int, tuple[weakref.ref, ElasticCB]] = {}  # id(text config) -> (ref to it, handle)
_installed: dict[str, Any] = {}  # what install() replaced
_default: ElasticCB | None = None  # enable_all(): the handle of every model not enabled one by one


# --------------------------------------------------------------- the registry ----
def _check_settings(memory_limit: Any, budget: Any, idle_trim_s: Any) -> float | None:
    if budget is not None and not isinstance(budget, Budget):
        raise InvalidConfigError(f"budget must be a vattn.Budget or None, got {budget!r}")
    if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, int)
                                     or memory_limit < 0):
        raise InvalidConfigError(f"memory_limit must be >= 0 bytes or None, got {memory_limit!r}")
    return _env.idle_delay(idle_trim_s)


def _check_memory() -> None:
    problem = memory_problem()
    if problem:  # fail here, not on transformers' generation thread with "available memory 0"
        raise InvalidConfigError(problem)


def enable(model: Any, *, memory_limit: int | None = None, budget: Budget | None = None,
           page_size: int | None = None, idle_trim_s: float | None = None,
           continuous_batching_config: Any = None) -> ElasticCB:
    """Run `model`'s continuous batching on vattn memory from its next cache on.

    `memory_limit`: bytes of KV pages the model may have mapped (None: no limit but the
    device's and the budget's). `budget`: a `vattn.Budget` shared with other models.
    `page_size`: the pool's page (default: the backend's: 2 MiB on CUDA, 64 KiB on the
    host). `idle_trim_s`: the idle policy: once no block was handed out or given back for
    that many seconds and no request is in flight, `trim()` (prefix-sharing blocks
    evicted) from a background thread (None or negative: only explicit `trim`; the
    integrations' idle-trim rule, `vattn.integrations._env`). Returns the model's
    `ElasticCB` handle (the same one if already enabled, with the new settings). A
    `memory_limit` that leaves no room for one request beyond the trash blocks is refused
    here (InvalidConfigError, with the smallest limit that serves one: `vattn serve`'s check
    at start, `hf_cb.probe.probe_room`), and the model is not enabled; the blocks are those of
    `continuous_batching_config`, the one `generate_batch` will be given (None:
    transformers' default). A shared budget's limit is not checked here (others move it).
    With a limit, transformers' cache and batch buffers are sized from it, not
    from the host's free memory (docs/servers.md, "What bounds the server's memory")."""
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
            handle = ElasticCB(model, memory_limit, budget, page_size, idle_trim_s, _unregister)
            ref = weakref.ref(config, lambda _r, key=id(config), h=handle: _forget(key, h))
            _handles[id(config)] = (ref, handle)
        else:
            if budget is not handle.budget and handle._budget_token is not None:  # its part moves with it
                handle.budget.unregister(handle._budget_token)
                handle._budget_token = None
            handle.memory_limit, handle.budget, handle.page_size = memory_limit, budget, page_size
            handle._set_idle_trim_s(idle_trim_s)
    if memory_limit is not None:
        from vattn.integrations.hf_cb.probe import probe_room  # vattn serve's own check at start

        try:
            probe_room(model, continuous_batching_config, handle, memory_limit, None)
        except BaseException:
            disable(model)
            raise
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
        _default = ElasticCB(None, memory_limit, budget, page_size, idle_trim_s, _unregister)
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


def _unregister(model: Any) -> None:
    """A handle's `disable()`: its model's, or `enable_all`'s for None."""
    if model is None:
        disable_all()
    else:
        disable(model)


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
        cls = make_classes(cache_mod, api, base, design(), _handle_for)
        _installed.update(base=base, api=api, cls=cls, cache_mod=cache_mod)
        api.PagedAttentionCache = cls


def uninstall() -> None:
    with _lock:
        if _installed:
            _installed["api"].PagedAttentionCache = _installed["base"]
            _installed.clear()



__all__ = ["SUPPORTED_VERSIONS", "ElasticCB", "enable", "disable", "enable_all", "disable_all", "check_transformers", "design",
           "verified_requirement", "install", "uninstall"]
