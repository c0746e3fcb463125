"""vattn: a vAttention-style KV-cache memory manager.

Each request's KV cache is contiguous in virtual memory; physical pages are mapped on
demand, so unmodified attention kernels read the cache as a plain
`[batch, seq, heads, head_dim]` tensor.

The paper's API works on a default instance:

    vattn.init(num_layers=..., num_kv_heads=..., head_dim=..., max_batch_size=...,
               max_context_len=..., dtype=..., device=..., page_size=...)
    r = vattn.alloc_reqid(); vattn.step({r: n}); vattn.free_reqid(r)
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

from vattn._lazy import lazy_exports
# The errors are eager: a plain module with no imports, and what every caller catches.
from vattn.errors import (
    BackendError,
    ClosedError,
    ContextLengthError,
    FatalEngineError,
    InvalidConfigError,
    InvalidRequestError,
    MapCountLimitError,
    NoFreeSlotError,
    NotInitializedError,
    OutOfPhysicalMemoryError,
    OutOfVirtualMemoryError,
    UnknownReqIdError,
    UnsafeOffloadDirError,
    UnsupportedModelError,
    VattnError,
)

if TYPE_CHECKING:
    from vattn.allocator import MemoryStats, StepResult
    from vattn.budget import Budget
    from vattn.cache import KVCache
    from vattn.config import CacheConfig
    from vattn.engine import LLM, CompletionOutput, RequestOutput, SamplingParams
    from vattn.pool import ElasticPool, PoolStats, UnknownBlockError

__version__ = "0.1.0"

_default: KVCache | None = None


def init(config: CacheConfig | None = None, **kwargs: Any) -> KVCache:
    """Reserve the virtual K/V tensors and return the cache; it also becomes the default
    instance the module-level functions use (several instances may live side by side).
    Give a `CacheConfig` or its fields as keywords.

    Arguments (keywords, sizes in bytes): num_layers, num_kv_heads, head_dim,
    max_batch_size, max_context_len, dtype (default float16), device ('cpu' = host
    backend, 'cuda[:N]'), page_size (default: the backend's), layout ('per-layer' or
    'fused'), physical_memory (cap on physical pages; default: no cap), background
    (pre-map on a worker thread, default True), prefetch (pre-map at all, default True),
    prefetch_tokens (pre-map a request's next page once it is this many tokens away, default 16),
    zero_reused_pages (clear pages that held another request's data, default False),
    budget (a `vattn.Budget` shared with other caches and elastic pools, default none).
    """
    global _default
    from vattn.cache import KVCache

    _default = KVCache(config, **kwargs)
    return _default


def _cache() -> KVCache:
    if _default is None:
        raise NotInitializedError("call vattn.init(...) first")
    return _default


def alloc_reqid() -> int:
    """`KVCache.alloc_reqid` on the default instance."""
    return _cache().alloc_reqid()


def free_reqid(reqid: int) -> None:
    """`KVCache.free_reqid` on the default instance."""
    _cache().free_reqid(reqid)


def step(seq_lens: Sequence[int] | Mapping[int, int]) -> StepResult:
    """`KVCache.step` on the default instance."""
    return _cache().step(seq_lens)


def k_cache(layer: int):
    """`KVCache.k_cache` on the default instance."""
    return _cache().k_cache(layer)


def v_cache(layer: int):
    """`KVCache.v_cache` on the default instance."""
    return _cache().v_cache(layer)


def close() -> None:
    """Close the default instance and forget it."""
    global _default
    if _default is not None:
        _default.close()
        _default = None


__all__ = [
    "LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "KVCache", "CacheConfig", "StepResult", "MemoryStats", "init", "alloc_reqid", "free_reqid", "step",
    "k_cache", "v_cache", "close", "VattnError", "InvalidConfigError", "InvalidRequestError",
    "UnknownReqIdError", "ContextLengthError", "NoFreeSlotError", "OutOfVirtualMemoryError",
    "OutOfPhysicalMemoryError", "MapCountLimitError", "BackendError", "NotInitializedError", "ClosedError",
    "FatalEngineError", "UnsupportedModelError", "UnsafeOffloadDirError",
    "ElasticPool", "PoolStats", "UnknownBlockError", "Budget",
]

# Loaded on first use (PEP 562): `import vattn`, its books (vattn.allocator) and its
# backends (vattn._C, vattn.vmem) stay free of torch, the engine and the integrations.
_EXPORTS = {
    "LLM": "vattn.engine", "SamplingParams": "vattn.engine", "RequestOutput": "vattn.engine",
    "CompletionOutput": "vattn.engine", "KVCache": "vattn.cache", "CacheConfig": "vattn.config",
    "StepResult": "vattn.allocator", "MemoryStats": "vattn.allocator",
    "ElasticPool": "vattn.pool", "PoolStats": "vattn.pool", "UnknownBlockError": "vattn.pool",
    "Budget": "vattn.budget",  # elastic memory for servers with their own block tables
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
