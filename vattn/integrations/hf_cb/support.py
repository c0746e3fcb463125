"""Whether hf_cb can run here: the design of the installed transformers' continuous-batching
cache (`DESIGNS`: the releases verified, a newer one recognised by the hook points it keeps)
and whether transformers can size that cache on this machine (`memory_problem`)."""
from __future__ import annotations

import importlib.util
import inspect
import re
import sys
import warnings
from typing import Any, Callable

from vattn.errors import InvalidConfigError


# transformers major.minor -> the design of its continuous-batching cache, each verified with
# tests/integrations/test_hf_cb.py and tests/integrations/test_serve.py (tests/integrations/test_hf_cb_versions.py
# runs them on each); pyproject's extras stop below the next one
DESIGNS = {"5.17": "blocks", "5.18": "sectors", "5.19": "sectors", "5.20": "sectors", "5.21": "sectors", "5.22": "sectors",
           "5.23": "sectors", "5.24": "sectors"}
SUPPORTED_VERSIONS = tuple(DESIGNS)


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

    base = getattr(api, "PagedAttentionCache", None)
    base = getattr(base, "vattn_base", base)  # transformers' own class, also while hf_cb's is installed
    problems = []
    if base is None or base is not getattr(cache_mod, "PagedAttentionCache", None):
        problems.append("continuous_api.PagedAttentionCache is not cache.PagedAttentionCache")
    if kind == "sectors":
        problems += _sector_pool_problems(cache_mod, source)
        methods, first = ("evict_cached_blocks", "free_all_requests", "reset"), []
        needles = ("self.cache_tensor = torch.zeros(", "self.pool = CachePool(self.num_sectors",
                   "register_cache_tensor(self.bytes_per_sector, non_trash_bytes, self.cache_tensor, self.pool)")
    else:
        problems += _block_manager_problems(cache_mod, source)
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


def _sector_pool_problems(cache_mod: Any, source: Callable[[str, Any], str | None]) -> list[str]:
    """What the sectors hook's `VattnCachePool` needs of transformers' `CachePool` and it
    lacks: its methods, its arguments, a free list of which the last one is handed out.
    `source(what, obj)`: the source of `obj`, or None when it cannot be read."""
    pool_cls = getattr(cache_mod, "CachePool", None)
    missing = [name for name in ("allocate_sector", "try_to_free_sectors", "free_blocks", "reset",
                                 "num_free_sectors", "set_blocks_per_sector") if not hasattr(pool_cls, name)]
    problems = [f"CachePool.{name} is missing" for name in missing]
    if pool_cls is not None and not missing:  # what VattnCachePool builds on: a free list, the last one handed out
        if list(inspect.signature(pool_cls.__init__).parameters) != \
                ["self", "num_sectors", "num_allocators", "num_reserved_sectors"]:
            problems.append("CachePool.__init__ takes other arguments")
        for name, needle in (("reset", "self.free_sectors = "), ("allocate_sector", "self.free_sectors.pop()"),
                             ("try_to_free_sectors", "self.free_sectors.append(")):
            src = source(f"CachePool.{name}", getattr(pool_cls, name))
            if src is not None and needle not in src:
                problems.append(f"CachePool.{name} no longer has `{needle}`")
    return problems


def _block_manager_problems(cache_mod: Any, source: Callable[[str, Any], str | None]) -> list[str]:
    """What the blocks hook needs of transformers' `BlockManager` and it lacks: its methods,
    `group_layers_by_attn_type`, a free-block deque used only as `_FreeBlocks` stands in for.
    `source(what, obj)`: the source of `obj`, or None when it cannot be read."""
    problems = []
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
