"""`vattn.integrations.sglang` without SGLang and without a GPU (host backend).

The two allocators below are SGLang 0.5.23's `TokenToKVPoolAllocator` and
`PagedTokenToKVPoolAllocator` cut down to what the scheduler calls (`alloc`, `free`,
`free_group_begin/end`, `alloc_extend`, `alloc_decode`, `available_size`, `clear`, the
decode gate `check_decode_capacity`), and its plain `PrefillBudget`, with the patch's
one-line calls where the patch puts them. A synthetic trace replays SGLang's
call sequence (prefill with cached prefixes, decode, finish into a radix-cache-like LRU
that is evicted when `available_size()` is short, frees inside free groups) and checks:
what is in use is always mapped and keeps its data, memory grows with load and falls
after free + trim, a short pool is a scheduling miss (None, nothing changed), and the
token books add up. `tests/integrations/test_sglang_patch.py` (slow) runs the real patched classes.
"""
from __future__ import annotations

import math
import random
from collections import OrderedDict

import pytest
import torch

import vattn
from tests.conftest import FakeClock
from vattn.integrations import sglang as vs

H, D, L = 2, 16, 2  # KV heads, head dim, layers: a token row is 128 bytes (fp32)
VPAGE = 4096  # vattn page: 32 token rows


# ------------------------------------------------------- SGLang's classes, cut down ----
class MHATokenToKVPool:
    """The constructor path of SGLang's pool: `_create_buffers_normal` asks vattn first."""

    def __init__(self, size: int, page_size: int, settings=None, layout: str = "nhd", v_head_dim: int = D):
        self.size, self.page_size, self.layer_num = size, page_size, L
        self.store_dtype, self.device = torch.float32, "cpu"
        self.kv_cache_layout, self.post_capture_active, self.enable_custom_mem_pool = layout, False, False
        self.vattn = settings
        rows = size + page_size
        k_shape, v_shape = (rows, H, D), (rows, H, v_head_dim)
        if vs.create_kv_buffers(self, k_shape, v_shape):
            return
        self.k_buffer = [torch.zeros(k_shape) for _ in range(L)]
        self.v_buffer = [torch.zeros(v_shape) for _ in range(L)]


class _Base:
    def __init__(self, size: int, page_size: int, kvcache) -> None:
        self.size, self.page_size, self._kvcache = size, page_size, kvcache
        self.free_group = None
        self.release_pages = None

    def get_kvcache(self):
        return self._kvcache

    def free_group_begin(self):
        assert self.free_group is None
        self.free_group = []

    def free_group_end(self):
        pending, self.free_group = self.free_group, None
        if pending:
            self.free(torch.cat(pending))

    def evict_to_free_tokens(self, tree_cache, num_tokens: int):
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        shortfall = num_tokens - self.available_size()
        if shortfall > 0:
            tree_cache.evict(shortfall)

    def check_decode_capacity(self, *, num_tokens: int, tree_cache, requests=None, spec_algorithm=None):
        """The decode gate: SGLang's retract loop repeats it until the step fits."""
        vs.realize(self, num_tokens, tree_cache)  # patch
        self.evict_to_free_tokens(tree_cache, num_tokens)
        return self.available_size() >= num_tokens


class PrefillBudget:
    """SGLang's plain prefill budget (`mem_cache/prefill_budget.py`), cut down, with the
    patch's calls: admission counts available + evictable less this pass's offsets."""

    def __init__(self, allocator, tree_cache, *, num_mixed_decode_tokens: int = 0):
        self.allocator, self.tree_cache = allocator, tree_cache
        self.page_size = allocator.page_size
        self.total_offset = self.current_offset = num_mixed_decode_tokens

    def ceil_paged_tokens(self, tokens: int) -> int:
        return -(-tokens // self.page_size) * self.page_size

    def _available_and_evictable(self):
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    @property
    def remaining_total(self):
        return self._available_and_evictable() - self.total_offset

    @property
    def remaining_current(self):
        return self._available_and_evictable() - self.current_offset

    def has_capacity(self) -> bool:
        return self.remaining_total > 0 and self.remaining_current > 0

    def check_prefill(self, *, extend_input_len, total_tokens, max_new_tokens, input_tokens, swa_host_hit_length,
                      chunk_limit, auxiliary_swa_host_hit_length=0):
        vs.realize_prefill(self, extend_input_len, chunk_limit)  # patch
        return (True, chunk_limit) if total_tokens < self.remaining_total else (False, None)

    def can_allocate_prefill(self, *, paged_input, extend_input_len, max_new_tokens, chunk_limit):
        vs.realize_prefill(self, extend_input_len)  # patch
        return paged_input <= min(self.remaining_current, self.remaining_total)

    def available_chunk_tokens(self, chunk_limit: int):
        vs.realize_prefill(self, chunk_limit)  # patch
        available = min(chunk_limit, int(self.remaining_total))
        return vs.fit_chunk(self, available if available > 0 else chunk_limit)  # patch

    def fit_chunk(self, *, extend_input_len, max_new_tokens, chunk_limit):
        return chunk_limit

    def reserve(self, extend_input_len, max_new_tokens, *, extra_tokens=0, chunk_limit=None,
                is_chunked_continuation=False):
        immediate = self.ceil_paged_tokens(extend_input_len) + self.page_size + extra_tokens
        self.total_offset += immediate + max_new_tokens
        self.current_offset += immediate


class TokenToKVPoolAllocator(_Base):
    def __init__(self, size: int, kvcache) -> None:
        super().__init__(size, 1, kvcache)
        self.clear()

    def clear(self):
        self.free_pages = torch.arange(1, self.size + 1, dtype=torch.int64)
        self.free_group = None
        self.release_pages = torch.empty((0,), dtype=torch.int64)
        vs.reset(self)  # patch

    def available_size(self):
        return len(self.free_pages) + len(self.release_pages) + vs.extra_tokens(self)  # patch

    def alloc(self, need_size: int):
        vs.ensure(self, need_size)  # patch
        if need_size > len(self.free_pages):
            return None
        out, self.free_pages = self.free_pages[:need_size], self.free_pages[need_size:]
        return out

    def free(self, free_index: torch.Tensor):
        if free_index.numel() == 0:
            return
        if self.free_group is None:
            self.free_pages = torch.cat((self.free_pages, free_index))
        else:
            self.free_group.append(free_index.clone())


class PagedTokenToKVPoolAllocator(_Base):
    def __init__(self, size: int, page_size: int, kvcache) -> None:
        super().__init__(size, page_size, kvcache)
        self.num_pages = size // page_size
        self.clear()

    def clear(self):
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64)
        self.free_group = None
        self.staged_pages, self.num_staged_pages = [], 0
        vs.reset(self)  # patch

    def available_size(self):
        return (len(self.free_pages) + self.num_staged_pages) * self.page_size + vs.extra_tokens(self)  # patch

    def alloc(self, need_size: int):
        num_pages = need_size // self.page_size
        vs.ensure(self, num_pages)  # patch
        if num_pages > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:num_pages], self.free_pages[num_pages:]
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_loc: list[int]):
        ps = self.page_size
        num_new_pages = sum(-(-s // ps) - -(-p // ps) for p, s in zip(prefix_lens, seq_lens))
        vs.ensure(self, num_new_pages)  # patch (the exact-count path)
        if num_new_pages > len(self.free_pages):
            return None
        out, k = [], 0
        for p, s, last in zip(prefix_lens, seq_lens, last_loc):
            for pos in range(p, s):
                if pos % ps == 0:  # a new page, in free-list order
                    last = int(self.free_pages[k]) * ps - 1
                    k += 1
                last += 1
                out.append(last)
        self.free_pages = self.free_pages[num_new_pages:]
        return torch.tensor(out, dtype=torch.int64)

    def alloc_decode(self, seq_lens: list[int], last_loc: list[int]):
        ps = self.page_size
        num_new_pages = sum(s % ps == 1 % ps for s in seq_lens)
        vs.ensure(self, num_new_pages)  # patch
        if num_new_pages > len(self.free_pages):
            return None
        out, k = [], 0
        for s, last in zip(seq_lens, last_loc):
            if (s - 1) % ps == 0:
                out.append(int(self.free_pages[k]) * ps)
                k += 1
            else:
                out.append(last + 1)
        self.free_pages = self.free_pages[num_new_pages:]
        return torch.tensor(out, dtype=torch.int64)

    def free(self, free_index: torch.Tensor):
        if free_index.numel() == 0:
            return
        if self.free_group is None:
            self.free_pages = torch.cat((torch.unique(free_index // self.page_size), self.free_pages))
        else:
            self.free_group.append(free_index.clone())


# ------------------------------------------------------------------ helpers ----
def make(page_size: int, size: int, **settings):
    settings.setdefault("page_size", VPAGE)
    settings.setdefault("idle_trim_s", 0.0)
    pool = MHATokenToKVPool(size, page_size, vs.KVSettings(**settings))
    assert isinstance(pool.vattn, vs.ElasticKV)
    alloc = (TokenToKVPoolAllocator(size, pool) if page_size == 1
             else PagedTokenToKVPoolAllocator(size, page_size, pool))
    vs.bind(pool, alloc)
    return pool, alloc, pool.vattn


def mapped(kv: vs.ElasticKV) -> int:
    return kv.stats().mapped_bytes


def whole(page_size: int, tokens: int) -> int:
    """A KV size near `tokens` whose rows (size + one padding page) fill whole chunks (no
    short last chunk, which stays lent once lent: see test_short_last_chunk...)."""
    chunk = max(1, VPAGE // (page_size * H * D * 4))
    return (tokens // page_size // chunk * chunk - 1) * page_size


def chunk0(kv: vs.ElasticKV) -> int:
    """Bytes mapped for chunk 0 (SGLang's padding page and its neighbours), never given back."""
    first, last = kv.pool._books.pages_of(0)
    return (last - first + 1) * kv.stats().group_bytes


def check_books(kv: vs.ElasticKV, alloc, in_use: list[torch.Tensor]) -> None:
    """Every token in use or in the free list lies in a lent, mapped chunk; the pages add up."""
    kv.pool.check_invariants()
    books = kv.pool._books
    units = [t // alloc.page_size for t in in_use]
    used = torch.unique(torch.cat(units)) if units else torch.empty(0, dtype=torch.int64)
    free = alloc.free_pages
    assert len(torch.unique(free)) == len(free), "a page twice in the free list"
    assert not bool(torch.isin(used, free).any()), "a page in use is in the free list"
    for u in torch.cat((used, free)).tolist():
        chunk = u // kv.chunk_pages
        assert chunk in kv.lent, f"page {u} of chunk {chunk} is not lent"
        first, last = books.pages_of(chunk)
        assert all(books.groups[p] is not None for p in range(first, last + 1)), f"page {u} is unmapped"
    assert len(used) + len(free) + (kv.units - kv.lent_units) == kv.units
    free_tokens = (len(free) + kv.units - kv.lent_units) * alloc.page_size
    assert alloc.available_size() + vs.unbacked_tokens(alloc) == free_tokens


def write(pool, locs: torch.Tensor, value: float) -> None:
    for layer in range(L):
        pool.k_buffer[layer][locs] = value
        pool.v_buffer[layer][locs] = -value


def assert_data(pool, locs: torch.Tensor, value: float) -> None:
    for layer in range(L):
        assert bool((pool.k_buffer[layer][locs] == value).all()) and bool((pool.v_buffer[layer][locs] == -value).all())


# ---------------------------------------------------------------- the trace ----
def replay(pool, alloc, kv, seed: int, steps: int = 160, hold_cache: bool = True) -> dict:
    """SGLang's scheduler, cut down: admit (prefix from the LRU "radix cache", extend),
    decode, finish. Admission and decode check `available_size()` first and evict the
    cache or retract (free a running request) when short, as SGLang does; `alloc`
    returning None after that check would be SGLang's crash and fails the test."""
    rng = random.Random(seed)
    ps = alloc.page_size
    running: dict[int, dict] = {}  # rid -> {"locs": tensor, "value": float}
    cache: OrderedDict[int, torch.Tensor] = OrderedDict()  # rid -> locs of a finished request (whole pages)
    peak = 0
    stats = {"admitted": 0, "retracted": 0, "evicted": 0, "misses": 0}
    rid = 0

    def evict(need_tokens: int) -> None:
        while alloc.available_size() < need_tokens and cache:
            _, locs = cache.popitem(last=False)
            alloc.free(locs)
            stats["evicted"] += 1

    def owned() -> list[torch.Tensor]:
        return [r["locs"] for r in running.values()] + list(cache.values())

    for step in range(steps):
        # admit a few new requests (prefill), some reusing a cached prefix
        for _ in range(rng.randint(0, 3)):
            n = rng.randint(1, 90)
            if ps > 1:
                need = -(-n // ps)
                evict(need * ps)
                if alloc.available_size() < need * ps:
                    stats["misses"] += 1
                    break
                locs = alloc.alloc_extend([0], [n], [-1])
            else:
                evict(n)
                if alloc.available_size() < n:
                    stats["misses"] += 1
                    break
                locs = alloc.alloc(n)
            assert locs is not None, "alloc failed although available_size() said it fits"
            rid += 1
            running[rid] = {"locs": locs, "value": float(rid)}
            write(pool, locs, float(rid))
            stats["admitted"] += 1
        # decode one token for every running request (retract the newest when short)
        while running:
            seq = [len(r["locs"]) + 1 for r in running.values()]
            need_pages = sum((s - 1) % ps == 0 for s in seq)
            evict(need_pages * ps)
            if alloc.available_size() >= need_pages * ps:
                break
            victim = max(running)
            alloc.free(running.pop(victim)["locs"])
            stats["retracted"] += 1
        if running:
            rids = list(running)
            seq = [len(running[r]["locs"]) + 1 for r in rids]
            last = [int(running[r]["locs"][-1]) for r in rids]
            out = alloc.alloc_decode(seq, last) if ps > 1 else alloc.alloc(len(rids))
            assert out is not None, "decode alloc failed although available_size() said it fits"
            for r, loc in zip(rids, out.tolist()):
                running[r]["locs"] = torch.cat((running[r]["locs"], torch.tensor([loc])))
                write(pool, torch.tensor([loc]), running[r]["value"])
        # finish some: into the cache (whole pages, like the radix cache) or freed in a group
        done = [r for r in running if rng.random() < 0.15]
        if done:
            alloc.free_group_begin()
            for r in done:
                locs = running.pop(r)["locs"]
                assert_data(pool, locs, float(r))
                if hold_cache and rng.random() < 0.5:
                    whole = len(locs) // ps * ps
                    cache[r] = locs[:whole]
                    alloc.free(locs[whole:])
                else:
                    alloc.free(locs)
            alloc.free_group_end()
        peak = max(peak, mapped(kv))
        if step % 16 == 0:
            check_books(kv, alloc, owned())
            for r, req in running.items():
                assert_data(pool, req["locs"], req["value"])
    check_books(kv, alloc, owned())
    for r, req in running.items():
        assert_data(pool, req["locs"], req["value"])
    for req in running.values():  # everything finishes; the cache is flushed by eviction
        alloc.free(req["locs"])
    for locs in cache.values():
        alloc.free(locs)
    stats["peak"] = peak
    return stats


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_trace_memory_follows_load(page_size):
    """Memory grows with load, everything in use stays mapped with its data, and a trim
    after everything is freed leaves only chunk 0 (SGLang's padding page) mapped."""
    size = whole(page_size, 4096)
    pool, alloc, kv = make(page_size, size)
    assert not kv.sticky
    base = mapped(kv)
    assert base == chunk0(kv)  # chunk 0 only
    assert alloc.available_size() == size  # no limit: all of it can be backed
    stats = replay(pool, alloc, kv, seed=page_size)
    assert stats["admitted"] > 20 and stats["peak"] > 4 * base
    assert mapped(kv) > base  # freed pages stay mapped (deferred) until trimmed
    check_books(kv, alloc, [])
    assert kv.trim() > 0
    assert mapped(kv) == base and kv.lent == {0}
    check_books(kv, alloc, [])
    assert alloc.available_size() == size


@pytest.mark.parametrize("page_size", [1, 16])
def test_limit_makes_a_short_pool_a_scheduling_miss(page_size):
    """Under a limit, available_size() counts only what memory can back: the trace evicts
    and retracts instead of failing; an alloc beyond it returns None and changes nothing."""
    size = 8192 // page_size * page_size
    limit = 6 * 2 * L * VPAGE  # 6 chunks of 32 token rows
    pool, alloc, kv = make(page_size, size, memory_limit=limit)
    c = kv.chunk_pages
    assert alloc.available_size() == (c - 1 + 5 * c) * page_size  # chunk 0 but its padding page, + 5 chunks
    stats = replay(pool, alloc, kv, seed=7, steps=200)
    assert stats["evicted"] + stats["retracted"] + stats["misses"] > 0
    assert stats["peak"] <= limit
    # everything freed; asking for more than available_size() is a miss: None, nothing changed
    free_before, lent_before, mapped_before = alloc.free_pages.clone(), set(kv.lent), mapped(kv)
    too_many = (alloc.available_size() // page_size + 1) * page_size
    assert alloc.alloc(too_many) is None
    assert torch.equal(alloc.free_pages, free_before) and kv.lent == lent_before and mapped(kv) == mapped_before
    got = alloc.alloc(too_many - page_size)  # exactly what it said fits
    assert got is not None and alloc.available_size() == 0
    check_books(kv, alloc, [got])
    assert kv.stats().mapped_bytes <= limit


def test_set_limit_lower_gives_back_at_the_next_idle_trim():
    pool, alloc, kv = make(1, 4096)
    locs = alloc.alloc(600)  # 19 chunks + chunk 0's 31 pages
    write(pool, locs, 3.0)
    alloc.free(locs[300:])
    kv.set_limit(12 * 2 * L * VPAGE)
    assert alloc.available_size() == len(alloc.free_pages)  # over the limit: no growth
    vs.on_idle(alloc)  # idle_trim_s=0: drains the chunks with no page in use
    assert_data(pool, locs[:300], 3.0)
    assert kv.stats().mapped_bytes <= 12 * 2 * L * VPAGE
    check_books(kv, alloc, [locs[:300]])
    vs.on_idle(alloc)  # nothing allocated since: no second drain
    assert kv.num_drained_chunks == 9


def test_on_idle_waits_for_idle_trim_s_and_once_per_idle_period():
    pool, alloc, kv = make(4, whole(4, 4096), idle_trim_s=5.0)
    clock = kv.idle.clock = FakeClock()
    locs = alloc.alloc(400)
    alloc.free(locs)
    before = mapped(kv)
    vs.on_idle(alloc)  # the idle period begins
    clock.advance(4.0)
    vs.on_idle(alloc)
    assert mapped(kv) == before  # not idle long enough
    alloc.free(alloc.alloc(4))  # busy again: the idle period starts over
    vs.on_idle(alloc)
    clock.advance(4.0)
    vs.on_idle(alloc)
    assert mapped(kv) == before
    clock.advance(2.0)
    vs.on_idle(alloc)
    assert mapped(kv) == chunk0(kv)
    drained = kv.num_drained_chunks
    vs.on_idle(alloc)
    assert kv.num_drained_chunks == drained
    settings = vs.KVSettings(idle_trim_s=-1)
    kv.settings = settings
    alloc.free(alloc.alloc(200))
    clock.advance(100)
    vs.on_idle(alloc)  # never
    assert mapped(kv) > chunk0(kv)


def test_drain_keeps_pages_in_use_and_orders_fullest_chunks_first():
    pool, alloc, kv = make(1, 4096)
    a = alloc.alloc(31 + 32 * 3)  # chunk 0's pages, then chunks 1..3 whole
    write(pool, a, 5.0)
    keep = torch.tensor([40, 100, 101, 102])  # one page in chunk 1, three in chunk 3
    alloc.free(a[~torch.isin(a, keep)])
    assert kv.drain(alloc) == 1  # chunk 2 only
    assert kv.lent == {0, 1, 3}
    assert_data(pool, keep, 5.0)
    order = (alloc.free_pages // kv.chunk_pages).tolist()
    assert order == [3] * 29 + [0] * 31 + [1] * 31  # the fullest chunk's pages first (ties: lower chunk)
    check_books(kv, alloc, [keep])


def test_free_group_defers_drain():
    pool, alloc, kv = make(1, 2048)
    locs = alloc.alloc(100)
    alloc.free_group_begin()
    alloc.free(locs)
    assert kv.drain(alloc) == 0  # inside a free group: nothing moves
    alloc.free_group_end()
    assert kv.drain(alloc) > 0


def test_clear_gives_everything_back():
    """flush_cache calls the allocator's clear(): all chunks but 0 go back to the pool."""
    pool, alloc, kv = make(16, whole(16, 4096))
    locs = alloc.alloc(16 * 50)
    write(pool, locs, 1.0)
    assert mapped(kv) > chunk0(kv)
    alloc.clear()
    assert mapped(kv) == chunk0(kv) and kv.lent == {0}
    assert alloc.available_size() == whole(16, 4096)
    check_books(kv, alloc, [])


def test_new_chunks_read_zeros_and_padding_page_is_mapped():
    pool, alloc, kv = make(1, 2048)
    assert bool((pool.k_buffer[0][0] == 0).all())  # slot 0: padded tokens write here
    locs = alloc.alloc(200)
    write(pool, locs, 9.0)
    alloc.free(locs)
    kv.trim()
    again = alloc.alloc(200)
    again = again[again >= kv.chunk_pages]  # chunk 0 stays lent: its pages keep SGLang's old data
    for layer in range(L):
        assert bool((pool.k_buffer[layer][again] == 0).all()) and bool((pool.v_buffer[layer][again] == 0).all())


@pytest.mark.parametrize("zero", [True, False])
def test_new_memory_is_cleared_unless_off_and_the_padding_chunk_always(zero):
    """On memory whose new pages hold old data (a GPU's; here the host backend made to
    behave so): chunks lent on new memory read zeros unless `VATTN_SGLANG_ZERO=0`, and
    chunk 0 (the padding page) reads zeros whatever it says."""
    from tests.alloc.test_pool import DirtyHost

    size = 2047  # 2048 rows: 64 chunks of 32
    pool = MHATokenToKVPool(size, 1, None)
    kv = vs.ElasticKV(rows=size + 1, page_size=1, head_num=H, head_dim=D, layer_num=L, dtype=torch.float32,
                      device="cpu", settings=vs.KVSettings(page_size=VPAGE, idle_trim_s=0, zero_new_pages=zero),
                      backend=DirtyHost())
    pool.k_buffer, pool.v_buffer, pool.vattn = kv.k_buffers, kv.v_buffers, kv
    alloc = TokenToKVPoolAllocator(size, pool)
    vs.bind(pool, alloc)

    def rows(idx, byte) -> bool:  # (no tensor in the assert: pytest's repr would read unmapped rows)
        return all(bool((b[idx].view(torch.uint8) == byte).all()) for b in pool.k_buffer + pool.v_buffer)

    padding_clear = rows(slice(0, kv.chunk_pages), 0)
    assert padding_clear
    locs = alloc.alloc(200)
    new_as_expected = rows(locs[locs >= kv.chunk_pages], 0 if zero else 0xAB)
    assert new_as_expected
    kv.close()


def test_budget_shared_with_another_pool():
    """Two KV pools on one vattn.Budget: the short one is a miss, and trimming the other
    (at its idle) lets it grow."""
    budget = vattn.Budget(10 * 2 * L * VPAGE)
    pa, aa, ka = make(1, 4096, budget=budget)
    pb, ab, kb = make(1, 4096, budget=budget)
    x = aa.alloc(31 + 32 * 7)  # a: 8 chunks; b: chunk 0 -> 9 of 10 taken
    assert x is not None
    assert ab.available_size() == 31 + 32  # b may grow by one chunk
    assert ab.alloc(31 + 32 * 3) is None
    aa.free(x)
    vs.on_idle(aa)  # a gives its chunks back at its idle
    y = ab.alloc(31 + 32 * 3)
    assert y is not None
    check_books(kb, ab, [y])
    check_books(ka, aa, [])


def test_settings_and_declines(monkeypatch):
    monkeypatch.setenv("VATTN_SGLANG_MEMORY_LIMIT", "1048576")
    monkeypatch.setenv("VATTN_SGLANG_PAGE_SIZE", "8192")
    monkeypatch.setenv("VATTN_SGLANG_IDLE_TRIM_S", "0.5")
    monkeypatch.setenv("VATTN_SGLANG_ZERO", "0")
    s = vs.kv_settings()
    assert s == vs.KVSettings(memory_limit=1 << 20, page_size=8192, idle_trim_s=0.5, zero_new_pages=False)
    assert vs.kv_settings(draft=True) is None
    assert vs.kv_settings(disaggregation="prefill") is None
    assert vs.kv_settings(disaggregation="null") is not None
    monkeypatch.setenv("VATTN_SGLANG", "0")
    assert vs.kv_settings() is None
    monkeypatch.setenv("VATTN_SGLANG", "1")
    monkeypatch.setenv("VATTN_SGLANG_MEMORY_LIMIT", "lots")
    with pytest.raises(vattn.InvalidConfigError, match="VATTN_SGLANG_MEMORY_LIMIT"):
        vs.kv_settings()
    monkeypatch.setenv("VATTN_SGLANG_MEMORY_LIMIT", "0x100000")  # read as the vLLM variables are
    assert vs.kv_settings().memory_limit == 1 << 20
    monkeypatch.setenv("VATTN_SGLANG_IDLE_TRIM_S", "nan")
    with pytest.raises(vattn.InvalidConfigError, match="VATTN_SGLANG_IDLE_TRIM_S"):
        vs.kv_settings()
    monkeypatch.setenv("VATTN_SGLANG_IDLE_TRIM_S", "-3")  # never
    assert vs.kv_settings().idle_trim_s is None
    # pools vattn does not back keep SGLang's own memory
    for kwargs in ({"layout": "hnd"}, {"v_head_dim": 8}):
        pool = MHATokenToKVPool(64, 1, vs.KVSettings(page_size=VPAGE), **kwargs)
        assert pool.vattn is None and pool.k_buffer[0].shape[0] == 65


def test_unknown_allocator_gets_the_whole_cache_backed():
    pool = MHATokenToKVPool(1024, 1, vs.KVSettings(page_size=VPAGE))
    kv = pool.vattn

    class SWATokenToKVPoolAllocator(TokenToKVPoolAllocator):
        pass

    alloc = SWATokenToKVPoolAllocator(1024, pool)
    vs.bind(pool, alloc)
    assert getattr(alloc, "vattn", None) is None
    assert kv.lent == set(range(kv.num_chunks))
    write(pool, torch.arange(1, 1025), 2.0)  # every slot is mapped: nothing faults
    assert_data(pool, torch.arange(1, 1025), 2.0)
    assert alloc.alloc(1024) is not None and alloc.available_size() == 0


def test_chunks_straddle_pages_when_sizes_do_not_divide():
    """A page of 3 tokens x 128 bytes does not divide 4 KiB: chunks of 10 pages straddle
    vattn pages; the books still hold and data survives."""
    pool, alloc, kv = make(3, 3 * 700)
    assert kv.chunk_pages == 10
    stats = replay(pool, alloc, kv, seed=3, steps=100)
    assert stats["admitted"] > 10
    kv.trim()
    check_books(kv, alloc, [])
    assert kv.lent - kv.sticky == {0}


@pytest.mark.parametrize("page_size,chunk_pages,exact", [(1, 512, True), (3, 512, True), (64, 8, True),
                                                      (1000, 1, False)])
def test_default_vattn_page_makes_a_chunk_one_page(page_size, chunk_pages, exact):
    """Without VATTN_SGLANG_PAGE_SIZE the vattn page is lcm(SGLang page, backend page):
    no chunk straddles pages, so available_size() is exact (3-token pages: 384 bytes, a
    192 KiB vattn page of 512 of them). A multiple too large (1000-token pages of 125 KiB)
    keeps the backend's page."""
    pool = MHATokenToKVPool(page_size * 40, page_size, vs.KVSettings())
    kv = pool.vattn
    unit = page_size * H * D * 4
    base = vattn.vmem.make_backend(torch.device("cpu")).default_page_size
    assert kv.chunk_pages == chunk_pages
    assert (kv.chunk_pages * unit == kv.pool.page_size) == exact
    assert kv.pool.page_size == (math.lcm(unit, base) if exact else base)


@pytest.mark.parametrize("limit_chunks", [None, 12])
def test_available_size_does_not_depend_on_when_memory_was_given_back(limit_chunks):
    """Draining and trimming move pages between SGLang's free list, the pool's cache and
    the device, never changing what available_size() says (tensor-parallel ranks trim at
    their own moments and must schedule alike)."""
    limit = None if limit_chunks is None else limit_chunks * 2 * L * VPAGE
    pool, alloc, kv = make(1, 4096, memory_limit=limit)
    locs = alloc.alloc(31 + 32 * 9)
    alloc.free(locs[:31 + 32 * 4])  # chunk 0's pages and chunks 1-4 whole
    alloc.free(locs[31 + 32 * 4::3])  # a third of the rest, scattered
    before = alloc.available_size()
    assert kv.drain(alloc) > 0
    assert alloc.available_size() == before
    assert kv.pool.trim() > 0
    assert alloc.available_size() == before


def test_short_last_chunk_stays_lent_until_clear():
    """1000 tokens + the padding slot are 31 chunks of 32 and one of 9: that short chunk,
    once lent, is not drained (the pool then always hands it out last, which keeps
    available_size() exact under a limit, whenever memory was given back); clear() gives
    it back."""
    pool, alloc, kv = make(1, 1000, memory_limit=40 * 2 * L * VPAGE)
    assert kv.sticky == {31} and len(kv.valid_units(31)) == 9
    locs = alloc.alloc(1000)
    write(pool, locs, 4.0)
    alloc.free(locs[:500])
    before = alloc.available_size()
    kv.drain(alloc)
    kv.pool.trim()
    assert alloc.available_size() == before and 31 in kv.lent
    alloc.free(locs[500:])
    kv.trim()
    assert kv.lent == {0, 31} and alloc.available_size() == 1000
    assert alloc.alloc(1000) is not None
    alloc.clear()
    assert kv.lent == {0} and mapped(kv) == chunk0(kv) and alloc.available_size() == 1000


def test_trace_on_the_cuda_backend_path(fake_cuda):
    """The same trace on vattn's CUDA backend (its C path on tests/fake_cuda's strict
    driver, host memory behind it, CPU views): the fixture checks that nothing leaked and
    no driver rule was broken."""
    page_size, size = 16, 16 * 1023
    pool = MHATokenToKVPool(size, page_size, None)  # SGLang's own buffers, replaced below
    kv = vs.ElasticKV(rows=size + page_size, page_size=page_size, head_num=H, head_dim=D, layer_num=L,
                      dtype=torch.float32, device="cpu", settings=vs.KVSettings(idle_trim_s=0),
                      backend=fake_cuda.backend())
    pool.k_buffer, pool.v_buffer, pool.vattn = kv.k_buffers, kv.v_buffers, kv
    alloc = PagedTokenToKVPoolAllocator(size, page_size, pool)
    vs.bind(pool, alloc)
    stats = replay(pool, alloc, kv, seed=2, steps=120)
    assert stats["admitted"] > 20 and stats["peak"] > chunk0(kv)
    check_books(kv, alloc, [])
    kv.trim()
    assert kv.lent - kv.sticky == {0}
    kv.close()
    del pool, alloc, kv


def test_a_pool_vattn_cannot_back_says_how_to_turn_it_off():
    with pytest.raises(vattn.InvalidConfigError) as e:
        MHATokenToKVPool(1024, 1, vs.KVSettings(page_size=1000))  # not a multiple of the host page
    assert "VATTN_SGLANG=0" in "".join(getattr(e.value, "__notes__", []))


def test_a_budget_shared_with_another_process(monkeypatch, tmp_path):
    """VATTN_BUDGET=NAME: the pool joins a budget another process (a vattn cache here)
    holds all of, cached: SGLang's free count includes those pages, and its allocation
    gets them (the other process, idle, gives them back)."""
    from tests.budget.test_budget_shared import GROUP, Member, memfd_bytes, row, wait_for
    from vattn.budget import shared as budget_shared

    monkeypatch.setenv(budget_shared.DIR_ENV, str(tmp_path))
    monkeypatch.setenv("VATTN_BUDGET", "sg")
    monkeypatch.setenv("VATTN_BUDGET_LIMIT", str(16 * GROUP))
    other = Member("sg")
    try:
        r = other.call("alloc")["out"]
        assert other.call("step", lens={r: 512})["out"]["ok"]  # 16 groups: the whole budget
        other.call("free", r=r)
        budget = vs.kv_settings().budget
        assert isinstance(budget, budget_shared.SharedBudget) and budget.limit == 16 * GROUP
        assert 2 * L * VPAGE == GROUP  # a chunk of 32 rows in the 4 buffers is one of the other's groups
        pool, alloc, kv = make(1, 4096, budget=budget)  # chunk 0: asked of the other
        wait_for(lambda: row("sg", other.pid)["cached"] == 15 * GROUP, 1)
        assert alloc.available_size() == 31 + 15 * 32  # chunk 0's free rows and the other's cached pages
        x = alloc.alloc(31 + 32 * 7)
        assert x is not None
        write(pool, x, 3.0)
        assert_data(pool, x, 3.0)
        check_books(kv, alloc, [x])
        assert memfd_bytes(other.pid) == 8 * GROUP and budget.used == 16 * GROUP
        assert alloc.alloc(32 * 9) is None  # more than the budget: a miss, nothing changed
        check_books(kv, alloc, [x])
        kv.close()
        budget.close()
    finally:
        other.stop()
