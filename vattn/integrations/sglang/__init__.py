"""SGLang's KV cache on vattn memory: what `patches/sglang-0.5.23.patch` calls.

SGLang keeps its own token/page allocator (`TokenToKVPoolAllocator`,
`PagedTokenToKVPoolAllocator`: a free list of page ids on the device), its radix cache
and its paged kernels. The patch leaves all of that as it is and changes where the
memory comes from:

```
 k_buffer[l], v_buffer[l]  (virtual, reserved once at SGLang's size, never move)
 [ chunk 0 | chunk 1 | chunk 2 | ... ]      a chunk = C SGLang pages = one vattn page
   pinned    lent      not lent             (the blocks of an ElasticPool)
   (page 0 is SGLang's padding page)

 SGLang's free list  = free pages of *lent* chunks only (always mapped)
 available_size()    = free list + pages of unlent chunks memory can back now
```

- **Mapping (scheduler thread, at allocation).** When an `alloc`/`alloc_extend`/
  `alloc_decode` needs more pages than the free list holds (the gates below have usually
  lent them already), `ensure` takes chunks from
  the `ElasticPool` (page-aware: cached pages first, then the lowest unmapped, mapped in
  one batched call; the pages mapped with new memory are cleared, as SGLang's
  `torch.zeros` buffers started at zero: `ElasticPool(zero_new=True)`) and appends their
  pages to the free list. When memory cannot back the whole request it
  lends nothing and the allocator returns None, nothing changed, as when its static pool
  is full; `available_size()` counted only what memory can back, so SGLang's scheduler
  evicts from the radix cache, retracts or waits first.
- **Refused pages are scheduling events (the gates).** "What memory can back" is the limit
  and the budget; the device can still refuse pages they allow (another process took what
  an idle trim gave back). So the pages are mapped where SGLang's scheduler asks the
  allocator whether work fits, before it counts: the decode check
  (`check_decode_capacity`, which its retract loop repeats) and the prefill budget's
  admission checks (`PrefillBudget.check_prefill`, `can_allocate_prefill`,
  `available_chunk_tokens`) call `realize`, which lends the chunks the admitted work will
  allocate (as many as the limit allows). If the device refuses, what it gave stays lent,
  and until a gate retries (`REFUSED_RETRY_S` later) `available_size()` counts only the
  lent chunks: SGLang's own policy then evicts, leaves requests waiting, shrinks a
  chunked prefill or retracts decodes, and the allocation that follows a passed gate
  finds its pages in the free list. The scheduler keeps serving. (With tensor
  parallelism a refusal on one rank only makes the ranks' batches differ: give each
  process a limit whose sum fits the GPU.)
- **Giving back (scheduler thread, when idle).** SGLang frees pages into its free list;
  they stay mapped. `on_idle` (after `idle_trim_s` of full idleness), `trim()` and the
  allocator's `clear()` (flush_cache) *drain*: the chunks whose pages are all in the free
  list leave it and go back to the pool (`ElasticPool.free`, which records a fence), and
  the pool unmaps them (`sync="device"`: after `torch.cuda.synchronize()`, so no kernel
  on any stream still reads them). The rest of the free list is reordered so that the
  pages of the fullest chunks are handed out first (page-aware packing).
- **Invariant.** A page is unmapped only when its chunk is not lent: no request, no radix
  cache node and no free-list entry names it. Chunk 0 (SGLang's padding page, written by
  padded tokens and CUDA-graph padding) is never given back.
- **Exact count.** The default vattn page is lcm(SGLang page bytes, backend page), so a
  chunk is exactly one page and `available_size()` does not depend on when memory was
  given back (see `chunk_page`; the short last chunk stays lent once lent).
- **mem_fraction_static** sizes the virtual reservation (SGLang's token count, as
  before); physical memory is mapped on demand up to `memory_limit` (default: that size).

Supported: SGLang 0.5.22 and 0.5.23 (`SUPPORTED_VERSIONS`), the plain `MHATokenToKVPool` (NHD
layout, K and V of one shape, no KV quantization method, no post-capture backing, no
memory saver, no custom memory pool) on the target worker with the plain token or paged
allocator, no PD disaggregation. Anything else keeps SGLang's own memory (logged once);
a vattn-backed pool bound to another allocator is backed entirely (never half-mapped).

Settings (environment of the SGLang server processes):
`VATTN_SGLANG=0` turns it off; `VATTN_SGLANG_MEMORY_LIMIT` (bytes of mapped KV pages;
default none but the reservation and the device), `VATTN_SGLANG_PAGE_SIZE` (vattn page
bytes; default `chunk_page`: a multiple of the backend's, 2 MiB on CUDA), `VATTN_SGLANG_IDLE_TRIM_S` (seconds of full
idleness before giving memory back; default 2; negative: never), `VATTN_SGLANG_ZERO=0`
(do not clear new memory).

Here: the calls the patch makes (`create_kv_buffers`, `bind`, the gates, `on_idle`...); the
parts are `settings` (`KVSettings`, `kv_settings`, `check_sglang`) and `backing`
(`ElasticKV`, `chunk_page`), their names re-exported here.
"""
from __future__ import annotations

import logging
import math
import weakref
from typing import Any

from vattn.errors import InvalidConfigError, VattnError
# The parts, re-exported: `vattn.integrations.sglang.X` keeps working for every name below
from vattn.integrations.sglang.backing import REFUSED_RETRY_S, ElasticKV, _free_units, chunk_page  # noqa: F401
from vattn.integrations.sglang.settings import (  # noqa: F401
    SUPPORTED_VERSIONS, KVSettings, _say_once, check_sglang, enabled, kv_settings)

SUPPORTED_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")

logger = logging.getLogger("vattn.sglang")


# ------------------------------------------------------------- the patch's calls ----
def create_kv_buffers(kv_pool: Any, k_shape: tuple, v_shape: tuple) -> bool:
    """`MHATokenToKVPool._create_buffers_normal`: when the pool was built with vattn
    settings and vattn can back it, set its `k_buffer`/`v_buffer` to virtual tensors and
    its `vattn` to the `ElasticKV`; True. Otherwise `vattn` becomes None; False."""
    settings = getattr(kv_pool, "vattn", None)
    if not isinstance(settings, KVSettings):
        return False
    kv_pool.vattn = None
    why = _why_not_pool(kv_pool, tuple(k_shape), tuple(v_shape))
    if why is not None:
        _say_once(f"vattn: this KV pool keeps SGLang's own memory: {why}")
        return False
    try:
        kv = ElasticKV(rows=k_shape[0], page_size=kv_pool.page_size, head_num=k_shape[1], head_dim=k_shape[2],
                       layer_num=kv_pool.layer_num, dtype=kv_pool.store_dtype, device=str(kv_pool.device),
                       settings=settings)
    except VattnError as e:
        e.add_note("vattn could not back SGLang's KV cache; VATTN_SGLANG=0 uses SGLang's own memory")
        raise
    kv_pool.k_buffer, kv_pool.v_buffer = kv.k_buffers, kv.v_buffers
    kv_pool.vattn = kv
    st = kv.stats()
    logger.info("vattn: KV cache of %d tokens x %d layers reserved (%.2f GiB virtual), mapped on demand in "
                "chunks of %d tokens (%.1f MiB), limit %s", kv.virtual_tokens, kv.layer_num,
                kv.num_chunks * st.group_bytes / (1 << 30), kv.chunk_pages * kv.page_size, st.group_bytes / (1 << 20),
                "none" if settings.memory_limit is None else f"{settings.memory_limit} bytes")
    return True


def _why_not_pool(kv_pool: Any, k_shape: tuple, v_shape: tuple) -> str | None:
    if type(kv_pool).__name__ != "MHATokenToKVPool":
        return f"{type(kv_pool).__name__} is not the plain MHATokenToKVPool"
    if getattr(kv_pool, "kv_cache_layout", "nhd") != "nhd" or len(k_shape) != 3:
        return f"the {getattr(kv_pool, 'kv_cache_layout', '?')} layout (vattn backs NHD [tokens, heads, dim])"
    if k_shape != v_shape:
        return f"K {k_shape} and V {v_shape} differ in shape"
    if k_shape[0] % kv_pool.page_size or getattr(kv_pool, "layer_num", 0) < 1:
        return f"{k_shape[0]} rows are not whole pages of {kv_pool.page_size} tokens, or no layers"
    if getattr(kv_pool, "post_capture_active", False):
        return "SGLang's post-capture KV backing is on"
    if getattr(getattr(kv_pool, "memory_saver_adapter", None), "enabled", False):
        return "the torch memory saver is on (it releases the KV memory itself)"
    if getattr(kv_pool, "enable_custom_mem_pool", False):
        return "a custom memory pool (PD transfer) owns the KV memory"
    if str(kv_pool.device).split(":")[0] not in ("cuda", "cpu"):
        return f"device {kv_pool.device} (vattn maps CUDA or host memory)"
    return None


def bind(kv_pool: Any, allocator: Any) -> None:
    """`KVCacheConfigurator._init_pools`, once both exist: the allocator's free list from
    now on holds the pages of lent chunks only. A vattn pool bound to an allocator this
    module does not know is backed entirely (SGLang's static behaviour)."""
    kv = getattr(kv_pool, "vattn", None)
    if not isinstance(kv, ElasticKV):
        return
    if kv.allocator is not None and kv.allocator() is allocator:
        return
    why = None
    if type(allocator).__name__ not in SUPPORTED_ALLOCATORS:
        why = f"its allocator is {type(allocator).__name__}"
    elif allocator.get_kvcache() is not kv_pool or allocator.page_size != kv.page_size:
        why = "its allocator indexes another pool or page size"
    elif kv.allocator is not None:
        why = "a second allocator was bound to it"
    if why is not None:
        _say_once(f"vattn: backing the whole KV cache up front: {why}")
        rest = sorted(set(range(kv.num_chunks)) - kv.lent)
        kv.pool.pin(rest, f"the whole KV cache ({why})", "lower --mem-fraction-static or set VATTN_SGLANG=0",
                    zero=True, error=InvalidConfigError)  # cleared, as SGLang's torch.zeros buffers
        kv.lent.update(rest)
        kv.lent_units = kv.units
        return
    kv.allocator = weakref.ref(allocator)
    allocator.vattn = kv
    allocator.clear()  # calls reset(): the free list becomes chunk 0's pages


def ensure(allocator: Any, num_pages: int) -> None:
    """The allocators' alloc paths, before their "enough free pages?" check: lend chunks
    until the free list holds `num_pages` pages. When memory cannot back that many, lend
    nothing: the allocator returns None and nothing changed (SGLang's contract)."""
    kv = getattr(allocator, "vattn", None)
    if kv is None:
        return
    kv.generation += 1
    short = num_pages - len(allocator.free_pages)
    if short > 0 and short <= kv.extra_units():  # more than memory can back: a miss, nothing lent
        kv.refill(allocator, short)


def _evictable(tree_cache: Any) -> int:
    """Tokens SGLang would evict from its radix cache to make room (0 without one)."""
    if tree_cache is None or not getattr(tree_cache, "supports_prefix_sharing", lambda: True)():
        return 0
    return int(tree_cache.evictable_size())


def realize(allocator: Any, num_tokens: int, tree_cache: Any = None) -> None:
    """`check_decode_capacity` (the decode gate, which the retract loop repeats), before it
    evicts and counts: map now the pages the next decode step allocates. When the device
    refuses, `available_size()` counts only mapped pages: SGLang evicts or retracts."""
    kv = getattr(allocator, "vattn", None)
    if kv is not None:
        ps = allocator.page_size
        kv.realize(allocator, -(-int(num_tokens) // ps), _evictable(tree_cache) // ps)


def realize_prefill(budget: Any, extend_tokens: int, chunk_limit: int | None = None) -> None:
    """The prefill budget's admission checks (`check_prefill`, `can_allocate_prefill`,
    `available_chunk_tokens`), before they count: map now what the requests admitted in
    this pass (`budget.current_offset`) and this one (its extension, at most a chunk, and a
    page) will allocate. When the device refuses, SGLang's count is what is mapped: the
    request waits, or its chunk shrinks (`fit_chunk`)."""
    alloc = budget.allocator
    kv = getattr(alloc, "vattn", None)
    if kv is None:
        return
    ps = alloc.page_size
    n = int(extend_tokens) if chunk_limit is None else min(int(extend_tokens), int(chunk_limit))
    need = math.ceil(budget.current_offset) + -(-n // ps) * ps + ps
    kv.realize(alloc, -(-need // ps), _evictable(budget.tree_cache) // ps)


def fit_chunk(budget: Any, tokens: int | None) -> int | None:
    """`available_chunk_tokens`' answer for a chunked prefill's next chunk, made to fit what
    memory backs now (the free list, the radix cache's evictable tokens and what vattn can
    still map, less this pass's other work and a page): SGLang continues a chunked request
    even when its count is spent, which on memory the device refused would fail the
    allocation. Page-aligned; None (the request waits this pass) when not a page fits."""
    alloc = budget.allocator
    kv = getattr(alloc, "vattn", None)
    if kv is None or tokens is None:
        return tokens
    ps = alloc.page_size
    room = ((_free_units(alloc) + kv.extra_units()) * ps + _evictable(budget.tree_cache)
            - math.ceil(budget.current_offset) - ps)
    fit = room // ps * ps
    return tokens if tokens <= fit else (fit if fit > 0 else None)


def extra_tokens(allocator: Any) -> int:
    """The allocators' `available_size()`: tokens of unlent chunks memory can back now."""
    kv = getattr(allocator, "vattn", None)
    return 0 if kv is None else kv.extra_units() * kv.page_size


def unbacked_tokens(allocator: Any) -> int:
    """The idle invariant check: tokens free in SGLang's count that memory cannot back
    now (they are neither available, evictable nor in use)."""
    kv = getattr(allocator, "vattn", None)
    return 0 if kv is None else (kv.units - kv.lent_units - kv.extra_units()) * kv.page_size


def reset(allocator: Any) -> None:
    """The allocators' `clear()` (start, flush_cache, resize): every page is free again."""
    kv = getattr(allocator, "vattn", None)
    if kv is not None:
        kv.reset(allocator)


def on_idle(allocator: Any) -> None:
    """The scheduler's fully-idle housekeeping (called again and again while idle): after
    `idle_trim_s` with no allocation, give back every chunk no request and no radix-cache
    node uses, once per idle period."""
    kv = getattr(allocator, "vattn", None)
    if kv is None:
        return
    kv.idle.delay = kv.settings.idle_trim_s
    if kv.idle_generation != kv.generation:  # allocations since the last call: idle from now
        kv.idle_generation = kv.generation
        kv.idle.note_busy()
    kv.idle.note_idle()
    if kv.idle.due():
        freed = kv.trim()
        if freed:
            logger.info("vattn: idle, gave back %.1f MiB of KV pages (%.1f MiB mapped)", freed / (1 << 20),
                        kv.stats().mapped_bytes / (1 << 20))


__all__ = ["SUPPORTED_VERSIONS", "KVSettings", "ElasticKV", "enabled", "kv_settings", "create_kv_buffers", "bind",
           "ensure", "realize", "realize_prefill", "fit_chunk", "extra_tokens", "unbacked_tokens", "reset", "on_idle",
           "chunk_page", "check_sglang"]
