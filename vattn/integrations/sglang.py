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
"""
from __future__ import annotations

import logging
import math
import os
import time
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from vattn.budget import Budget
from vattn.checks import MAX_PAGE_SIZE
from vattn.errors import InvalidConfigError, VattnError
from vattn.integrations import _env
from vattn.pool import ElasticPool, PoolStats
from vattn.vmem import make_backend

SUPPORTED_VERSIONS = ("0.5.22", "0.5.23")
SUPPORTED_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")
REFUSED_RETRY_S = 1.0  # after the device refused new pages, the gates ask it again this much later

logger = logging.getLogger("vattn.sglang")


# ------------------------------------------------------------------ settings ----
@dataclass(frozen=True)
class KVSettings:
    """How a KV pool uses vattn memory. `memory_limit`: bytes of mapped pages (None: the
    reservation and the device bound it). `page_size`: vattn page bytes (None: the
    backend's). `idle_trim_s`: full idleness before `on_idle` gives memory back, by the
    integrations' idle-trim rule (`vattn.integrations._env`: None, or a negative number,
    never). `zero_new_pages`: clear pages mapped with new memory (`ElasticPool(zero_new=)`;
    chunk 0 is cleared whatever this says). `budget`: a `vattn.Budget`
    shared with other pools of this process, or with other processes of this GPU
    (`from_env`: `VATTN_BUDGET=NAME`, `vattn.Budget.shared` on the current GPU)."""

    memory_limit: int | None = None
    page_size: int | None = None
    idle_trim_s: float | None = 2.0
    zero_new_pages: bool = True
    budget: Budget | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "idle_trim_s", _env.idle_delay(self.idle_trim_s, "idle_trim_s"))

    @staticmethod
    def from_env(env: Any = None) -> KVSettings:
        env = os.environ if env is None else env
        nbytes = "an integer number of bytes"
        limit = _env.number("VATTN_SGLANG_MEMORY_LIMIT", int, None, low=0, env=env, what=nbytes)
        page = _env.number("VATTN_SGLANG_PAGE_SIZE", int, None, low=1, env=env, what=nbytes)
        trim = _env.idle_trim_s("VATTN_SGLANG_IDLE_TRIM_S", 2.0, env=env)
        return KVSettings(memory_limit=limit, page_size=page, idle_trim_s=trim,
                          zero_new_pages=_env.flag("VATTN_SGLANG_ZERO", env), budget=_env.budget(env))


def enabled(env: Any = None) -> bool:
    """False when `VATTN_SGLANG=0` (the patched SGLang then uses its own memory)."""
    return _env.flag("VATTN_SGLANG", env)


_said: set[str] = set()


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        logger.warning(msg)


def kv_settings(*, draft: bool = False, disaggregation: Any = None, settings: KVSettings | None = None
                ) -> KVSettings | None:
    """The configurator's call for a plain MHA pool: the settings, or None (with the
    reason logged once) when this pool keeps SGLang's own memory."""
    if not enabled():
        return None
    why = None
    if draft:
        why = "a speculative draft worker's pool is indexed by its target's allocator"
    elif str(getattr(disaggregation, "value", disaggregation) or "null").lower() != "null":
        why = f"PD disaggregation ({disaggregation}) registers the whole KV buffer with its transfer engine"
    if why is not None:
        _say_once(f"vattn: this KV pool keeps SGLang's own memory: {why}")
        return None
    return settings if settings is not None else KVSettings.from_env()


# ---------------------------------------------------------------- the backing ----
class ElasticKV:
    """The vattn backing of one SGLang `MHATokenToKVPool`: an `ElasticPool` whose blocks
    are chunks of `chunk_pages` SGLang pages in each of the `2 * layer_num` K/V buffers.

    SGLang page `u` (a token id when page_size is 1) lies in chunk `u // chunk_pages`.
    All methods but `set_limit` and `stats` run on SGLang's scheduler thread."""

    def __init__(self, *, rows: int, page_size: int, head_num: int, head_dim: int, layer_num: int,
                 dtype: torch.dtype, device: str, settings: KVSettings, backend: Any = None) -> None:
        if rows % page_size:
            raise InvalidConfigError(f"vattn: {rows} KV rows are not whole pages of {page_size} tokens")
        if layer_num < 1:
            raise InvalidConfigError(f"vattn: a KV pool of {layer_num} layers has nothing to back")
        self.settings = settings
        self.page_size = page_size  # SGLang's tokens per page
        self.rows = rows
        self.layer_num = layer_num
        self.total_units = rows // page_size  # SGLang pages, padding page 0 included
        row_bytes = head_num * head_dim * torch.empty((), dtype=dtype).element_size()
        unit_bytes = page_size * row_bytes  # one SGLang page of one buffer
        own = backend is None
        backend = make_backend(torch.device(device)) if own else backend
        try:
            page = settings.page_size if settings.page_size is not None else chunk_page(unit_bytes, backend)
            self.chunk_pages = max(1, page // unit_bytes)
            self.num_chunks = -(-self.total_units // self.chunk_pages)
            self.pool = ElasticPool(self.num_chunks, (self.chunk_pages * page_size, head_num, head_dim), dtype,
                                    2 * layer_num, device=device, page_size=page, limit=settings.memory_limit,
                                    budget=settings.budget, sync="device", zero_new=settings.zero_new_pages,
                                    backend=backend)
        except BaseException:
            if own:
                backend.close()
            raise
        flat = [self.pool.buffer(i).view(-1, head_num, head_dim)[:rows] for i in range(2 * layer_num)]
        self.k_buffers, self.v_buffers = flat[0::2], flat[1::2]  # K and V of a layer side by side
        self.units = self.total_units - 1  # the allocator's page ids are 1..units
        self.lent: set[int] = set()  # chunks whose pages SGLang's free list may name
        self.pinned: set[int] = set()  # lent for good: chunk 0 (SGLang's padding page)
        # The last chunk, when it has fewer than chunk_pages pages, is never drained once lent
        # (only a clear() gives it back): the pool then hands it out last, which keeps
        # available_size() exact (see extra_units).
        last = self.num_chunks - 1
        self.sticky = {last} if last and len(self.valid_units(last)) < self.chunk_pages else set()
        self.lent_units = 0  # allocator pages in lent chunks
        self.allocator: Any = None  # weakref to the bound allocator
        self.generation = 0  # bumped by every alloc: what on_idle compares
        self.idle_generation = -1  # the generation when the current idle period began...
        self.idle_since = 0.0  # ...and when (no clock on the allocation path)
        self.trimmed_generation = -1
        self.refused = False  # the device refused pages: count only lent chunks until a gate retries...
        self.retry_at = 0.0  # ...at this time (monotonic)
        self.num_refusals = 0
        self.num_drained_chunks = 0
        self._pin(0)

    # ---------------------------------------------------------------- geometry ----
    def valid_units(self, chunk: int) -> range:
        """The allocator's page ids in `chunk` (page 0 and pages past `units` excluded)."""
        c = self.chunk_pages
        return range(max(chunk * c, 1), min((chunk + 1) * c, self.units + 1))

    def _pin(self, chunk: int) -> None:
        """Lend `chunk` for good, cleared (padded tokens write and read it)."""
        self.pool.pin([chunk], f"the KV cache's chunk {chunk}", "raise VATTN_SGLANG_MEMORY_LIMIT", zero=True,
                      error=InvalidConfigError)
        self.lent.add(chunk)
        self.pinned.add(chunk)
        self.lent_units += len(self.valid_units(chunk))

    # ------------------------------------------------------- the allocator side ----
    def extra_units(self) -> int:
        """Allocator pages of unlent chunks that memory can back now. Exact: the pool hands
        out cached chunks first (always whole ones: the short last chunk is never drained),
        then the lowest unmapped ones (the short last chunk last). None while the device
        refuses pages (until a gate asks it again)."""
        return 0 if self.refused else self._backable_units()

    def _backable_units(self) -> int:
        """What the limit and the budget let unlent chunks back (the device not asked)."""
        unlent = self.units - self.lent_units
        if unlent <= 0:
            return 0
        budget = self.settings.budget
        if self.pool.limit is None and (budget is None or budget.limit is None):
            return unlent
        return min(unlent, self.pool.available_blocks() * self.chunk_pages)

    def realize(self, alloc: Any, pages: int, evictable_pages: int = 0) -> None:
        """A gate of SGLang's scheduler, before it counts: lend chunks until the free list
        holds `pages` pages, or as many as the limit allows when SGLang would evict the
        rest (`evictable_pages`) from its radix cache. Nothing when it cannot fit even
        then (SGLang's count says no). When the device refuses, the chunks it gave stay
        lent and `extra_units()` is 0 until a gate `REFUSED_RETRY_S` later asks again."""
        if self.refused and time.monotonic() < self.retry_at:
            return
        short = pages - _free_units(alloc)
        if self.refused:  # time to ask the device again, for a chunk at least (else SGLang's count
            short = max(short, 1)  # would stay at what is mapped while nothing more is needed now)
        if short <= 0:
            return
        lend = min(short, self._backable_units())
        if lend <= 0 or short > lend + evictable_pages:
            return
        self.refill(alloc, lend, partial=True)

    def refill(self, alloc: Any, short: int, partial: bool = False) -> bool:
        """Lend chunks until the free list has `short` more pages. False when memory cannot
        back that many: then nothing is lent (all or nothing, as SGLang's allocator), or
        with `partial` what was lent stays. A device refusal marks the pool refused."""
        got: list[int] = []
        while short > 0:
            want = -(-short // self.chunk_pages)
            ids = self.pool.alloc(want)
            if ids is None and want > 1:  # take what memory allows
                ids = self.pool.alloc(min(want - 1, self.pool.available_blocks()))
            if not ids:
                if self.lent_units < self.units:  # the device (or a budget shared in-process) refused
                    self._refused()
                break
            for chunk in sorted(ids):
                self.lent.add(chunk)
                self.lent_units += len(self.valid_units(chunk))
                short -= len(self.valid_units(chunk))
                got.append(chunk)
        if short > 0 and not partial:
            self._give_back(got)
            got = []
        if got:  # the pool cleared the pages it mapped with new memory (zero_new) and synchronized
            units = torch.cat([torch.arange(r.start, r.stop, dtype=torch.int64) for r in map(self.valid_units, got)])
            alloc.free_pages = torch.cat((alloc.free_pages, units.to(alloc.free_pages.device)))
        if short > 0:
            return False
        if self.refused:
            self.refused = False
            logger.info("vattn: the device backs new KV pages again")
        return True

    def _refused(self) -> None:
        if not self.refused:
            self.num_refusals += 1
            logger.warning("vattn: the device refused new KV pages (another process holds the memory); SGLang "
                           "counts only mapped pages and waits or retracts, asking again every %.0f s",
                           REFUSED_RETRY_S)
        self.refused = True
        self.retry_at = time.monotonic() + REFUSED_RETRY_S

    def _give_back(self, chunks: list[int]) -> None:
        """Lent chunks no page of which SGLang holds go back to the pool (unmapped when
        memory is wanted, after the fence `free` records)."""
        if chunks:
            self.pool.free(chunks)
            for c in chunks:
                self.lent.discard(c)
                self.lent_units -= len(self.valid_units(c))

    def drain(self, alloc: Any) -> int:
        """Return to the pool every lent chunk whose pages are all in the free list; reorder
        the rest (fullest chunks first). Returns chunks returned. Not inside a free group."""
        if getattr(alloc, "free_group", None) is not None:
            return 0
        free = _take_free_list(alloc)
        dev = free.device
        chunk_of = free // self.chunk_pages
        counts = torch.bincount(chunk_of, minlength=self.num_chunks).cpu().tolist()
        full = [c for c in sorted(self.lent - self.pinned - self.sticky) if counts[c] == len(self.valid_units(c))]
        if full:
            keep = ~torch.isin(chunk_of, torch.tensor(full, dtype=torch.int64, device=dev))
            free, chunk_of = free[keep], chunk_of[keep]
        # page-aware order: pages of chunks with the fewest free pages (the fullest) first
        count_t = torch.tensor(counts, dtype=torch.int64, device=dev)
        order = torch.argsort(count_t[chunk_of] * (self.units + 1) + free)
        alloc.free_pages = free[order]
        self._give_back(full)
        self.num_drained_chunks += len(full)
        return len(full)

    def reset(self, alloc: Any) -> None:
        """The allocator was cleared (flush_cache): every page is free. Give all back."""
        units = alloc.size // alloc.page_size
        if units > self.units:
            raise InvalidConfigError(f"vattn: SGLang resized its KV cache to {units} pages of {self.page_size} "
                                     f"tokens; the reservation holds {self.units}")
        self._give_back(sorted(self.lent - self.pinned))
        mine = [u for c in sorted(self.lent) for u in self.valid_units(c) if u <= units]
        alloc.free_pages = torch.tensor(mine, dtype=torch.int64, device=alloc.free_pages.device)
        self.refused = False
        self.pool.trim()

    # ------------------------------------------------------------------ control ----
    def trim(self) -> int:
        """Give back now every chunk no page of which is in use (scheduler thread, idle).
        Returns bytes given back."""
        alloc = self.allocator() if self.allocator is not None else None
        if alloc is not None:
            self.drain(alloc)
        self.trimmed_generation = self.generation
        return self.pool.trim()

    def set_limit(self, limit: int | None) -> None:
        """A new limit on mapped bytes (None: none). Cached chunks above it go now; chunks in
        SGLang's free list go at the next idle trim. Any thread."""
        self.pool.set_limit(limit)
        self.settings = replace(self.settings, memory_limit=limit)
        self.trimmed_generation = -1

    def stats(self) -> PoolStats:
        """The pool's figures (`mapped_bytes`, `used_bytes` = lent chunks, `peak_mapped_bytes`...)."""
        return self.pool.stats()

    @property
    def virtual_tokens(self) -> int:
        return self.units * self.page_size

    def close(self) -> None:
        self.pool.close()

    def __repr__(self) -> str:
        return (f"ElasticKV({self.units} pages of {self.page_size} tokens, {self.chunk_pages} a chunk, "
                f"{len(self.lent)}/{self.num_chunks} chunks lent)")


def chunk_page(unit_bytes: int, backend: Any) -> int:
    """The vattn page for SGLang pages of `unit_bytes` (per buffer): the least common
    multiple of the two, so that a chunk is exactly one vattn page (or a page exactly one
    chunk). Then `available_size()` is exact, whatever was drained or trimmed before
    (tensor-parallel ranks, which trim at their own moments, count alike). When that
    multiple is over 16 of the larger, the backend's page (chunks then straddle pages and
    the count is a lower bound)."""
    base = backend.default_page_size
    page = math.lcm(unit_bytes, base)
    return page if page <= 16 * max(base, unit_bytes) and page <= MAX_PAGE_SIZE else base


def _take_free_list(alloc: Any) -> torch.Tensor:
    """Every free page id of the allocator as one tensor; its side lists emptied."""
    free = alloc.free_pages
    if getattr(alloc, "staged_pages", None):  # paged allocator, need_sort
        free = torch.cat((free, *alloc.staged_pages))
        alloc.staged_pages, alloc.num_staged_pages = [], 0
    release = getattr(alloc, "release_pages", None)
    if release is not None and len(release):  # token allocator, need_sort
        free = torch.cat((free, release))
        alloc.release_pages = release[:0]
    return free


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


def _free_units(alloc: Any) -> int:
    """The allocator's free pages, side lists included (what its available_size() counts
    besides vattn's extra)."""
    n = len(alloc.free_pages) + getattr(alloc, "num_staged_pages", 0)
    release = getattr(alloc, "release_pages", None)
    return n + (len(release) if release is not None else 0)


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
    if kv is None or kv.settings.idle_trim_s is None or kv.trimmed_generation == kv.generation:
        return
    now = time.monotonic()
    if kv.idle_generation != kv.generation:  # allocations since the last call: idle from now
        kv.idle_generation, kv.idle_since = kv.generation, now
    if now - kv.idle_since >= kv.settings.idle_trim_s:
        freed = kv.trim()
        if freed:
            logger.info("vattn: idle, gave back %.1f MiB of KV pages (%.1f MiB mapped)", freed / (1 << 20),
                        kv.stats().mapped_bytes / (1 << 20))


def check_sglang(version: str) -> None:
    """Raise InvalidConfigError unless `version` is one the patch was written against."""
    if version not in SUPPORTED_VERSIONS:
        raise InvalidConfigError(f"vattn's SGLang patch is for SGLang {', '.join(SUPPORTED_VERSIONS)}; "
                                 f"this is {version}")


__all__ = ["SUPPORTED_VERSIONS", "KVSettings", "ElasticKV", "enabled", "kv_settings", "create_kv_buffers", "bind",
           "ensure", "realize", "realize_prefill", "fit_chunk", "extra_tokens", "unbacked_tokens", "reset", "on_idle",
           "chunk_page", "check_sglang"]
