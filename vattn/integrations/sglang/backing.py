"""The vattn backing of one SGLang KV pool (`ElasticKV`): its K/V buffers on an `ElasticPool`
whose blocks are chunks of SGLang pages, lent to SGLang's free list and given back when idle."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any

import torch

from vattn.checks import MAX_PAGE_SIZE
from vattn.errors import InvalidConfigError
from vattn.idle import IdleTrim
from vattn.integrations.sglang.settings import KVSettings
from vattn.pool import ElasticPool, PoolStats
from vattn.vmem import make_backend

REFUSED_RETRY_S = 1.0  # after the device refused new pages, the gates ask it again this much later

logger = logging.getLogger("vattn.sglang")


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
        self.generation = 0  # bumped by every alloc: what on_idle compares (no clock on the allocation path)
        self.idle_generation = -1  # the generation on_idle saw last
        self.idle = IdleTrim(settings.idle_trim_s)  # the idle policy (vattn.idle): on_idle's
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
        self.idle_generation = self.generation  # no idle trim again before the next allocation
        self.idle.note_trimmed()
        return self.pool.trim()

    def set_limit(self, limit: int | None) -> None:
        """A new limit on mapped bytes (None: none). Cached chunks above it go now; chunks in
        SGLang's free list go at the next idle trim. Any thread."""
        self.pool.set_limit(limit)
        self.settings = replace(self.settings, memory_limit=limit)
        self.idle.rearm()

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


def _free_units(alloc: Any) -> int:
    """The allocator's free pages, side lists included (what its available_size() counts
    besides vattn's extra)."""
    n = len(alloc.free_pages) + getattr(alloc, "num_staged_pages", 0)
    release = getattr(alloc, "release_pages", None)
    return n + (len(release) if release is not None else 0)
