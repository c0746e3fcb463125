"""ElasticPool and Budget: page-aware placement, deferred giving back, limits, errors,
real host memory, fences, several pools on one budget, threads."""
from __future__ import annotations

import gc
import os
import random
import threading

import numpy as np
import pytest
import torch

import vattn
from tests.alloc.test_faults import FaultyBackend
from tests.conftest import vattn_mappings
from tests.vmem.test_vmem_host import _faulted, _run
from vattn.vmem.host import HostBackend

PAGE = 4096


def make(num_blocks=64, block_floats=256, num_buffers=2, grow=1, **kw) -> vattn.ElasticPool:
    """A float32 pool: block_floats * 4 bytes per block in each buffer, 4 KiB pages, pages
    created one at a time unless `grow` says otherwise."""
    return vattn.ElasticPool(num_blocks, (block_floats,), "float32", num_buffers, page_size=PAGE, grow=grow, **kw)


def fill(pool: vattn.ElasticPool, ids, tag: int) -> None:
    for i, buf in enumerate(pool.buffers):
        for b in ids:
            buf[b] = tag * 1000 + b + 0.5 * i


def check(pool: vattn.ElasticPool, ids, tag: int) -> None:
    for i, buf in enumerate(pool.buffers):
        for b in ids:
            assert torch.all(buf[b] == tag * 1000 + b + 0.5 * i), f"block {b} of buffer {i} corrupted"


@pytest.fixture
def pool():
    with make() as p:
        yield p


# ------------------------------------------------------------------ placement ----
def test_small_blocks_pack_into_partly_used_pages(pool):
    # 1 KiB blocks, 4 KiB pages: 4 blocks a page
    a = pool.alloc(3)
    assert a == [0, 1, 2] and pool.stats().num_mapped_pages == 1
    b = pool.alloc(1)
    assert b == [3] and pool.stats().num_mapped_pages == 1  # the partly used page first
    c = pool.alloc(2)
    assert pool.stats().num_mapped_pages == 2 and c == [4, 5]
    fill(pool, a + b + c, 1)
    pool.free([1, 5])
    d = pool.alloc(1)
    assert d[0] in (1, 5) and pool.stats().num_mapped_pages == 2  # reused, nothing mapped
    check(pool, [x for x in a + b + c if x not in (1, 5)], 1)
    pool.check_invariants()


def test_freed_pages_stay_mapped_until_trim(pool):
    ids = pool.alloc(8)  # two pages
    maps = pool.backend.num_map_calls
    pool.free(ids[4:])
    s = pool.stats()
    assert s.num_mapped_pages == 2 and s.num_cached_pages == 1 and s.num_warm_blocks == 4
    assert pool.backend.num_unmap_calls == 0
    again = pool.alloc(4)  # the cached page: no map call
    assert sorted(again) == ids[4:] and pool.backend.num_map_calls == maps
    pool.free(again)
    assert pool.trim() == 2 * PAGE  # one page group: 2 buffers x 4 KiB
    s = pool.stats()
    assert s.num_mapped_pages == 1 and s.num_cached_pages == 0 and s.mapped_bytes == 2 * PAGE
    check_ids = ids[:4]
    fill(pool, check_ids, 3)
    check(pool, check_ids, 3)
    pool.check_invariants()


def test_partly_used_pages_are_preferred_over_cached_ones(pool):
    ids = pool.alloc(8)
    pool.free(ids[1:4] + ids[4:])  # page 0: one block in use; page 1: cached
    got = pool.alloc(3)
    assert sorted(got) == ids[1:4]  # packed next to block 0, page 1 stays reclaimable
    assert pool.stats().num_cached_pages == 1
    pool.check_invariants()


@pytest.mark.parametrize("block_floats", [768, 1024, 3000, 4096])
def test_blocks_spanning_pages_map_all_their_pages(block_floats):
    with make(num_blocks=12, block_floats=block_floats, num_buffers=1) as p:
        ids = p.alloc(5)
        end = (max(ids) + 1) * block_floats * 4
        assert p.stats().num_mapped_pages == -(-end // PAGE)
        fill(p, ids, 7)
        check(p, ids, 7)
        p.free(ids[1:3])
        p.trim()
        p.check_invariants()
        check(p, [ids[0]] + ids[3:], 7)  # shared edge pages of the blocks in use stay mapped
        more = p.alloc(4)
        fill(p, more, 8)
        check(p, [ids[0]] + ids[3:], 7)
        check(p, more, 8)
        p.check_invariants()


def test_take_specific_blocks(pool):
    assert pool.take([9, 2]) == [9, 2]
    assert pool.stats().num_mapped_pages == 2
    with pytest.raises(vattn.UnknownBlockError, match="already allocated"):
        pool.take([2])
    assert pool.alloc(1) in ([3], [0], [1], [8], [10], [11])
    pool.check_invariants()


def test_pages_are_created_in_chunks_and_the_spare_ones_used_first():
    budget = vattn.Budget()
    with make(num_blocks=64, grow=4, budget=budget) as p:
        p.alloc(1)
        s = p.stats()
        assert (s.num_mapped_pages, s.num_spare_pages) == (1, 3) and p.backend.num_pages_created == 4
        assert budget.used == s.held_bytes == 4 * 2 * PAGE
        p.alloc(15)  # three more pages, full: all spare, nothing created
        s = p.stats()
        assert (s.num_mapped_pages, s.num_spare_pages) == (4, 0) and p.backend.num_pages_created == 4
        p.alloc(1)
        assert p.stats().num_spare_pages == 3
        assert p.trim() == 3 * 2 * PAGE  # the spare ones
        assert p.stats().num_spare_pages == 0 and budget.used == 5 * 2 * PAGE
    with make(num_blocks=64, grow=4, limit=2 * 2 * PAGE) as p:
        p.alloc(1)
        assert p.stats().held_bytes == 2 * 2 * PAGE  # the chunk stops at the limit
        p.set_limit(1 * 2 * PAGE)
        assert p.stats().num_spare_pages == 0


def test_pool_on_the_device(device, request):
    # K and V of 2 layers, 16-token blocks of 8 x 128 fp16 (32 KiB): several blocks a page on
    # both backends (64 KiB host pages, 2 MiB GPU pages); sync="device" as hf_cb uses it
    where = dict(device=device)
    if device == "fakecuda":  # the CUDA backend's C path on tests/fake_cuda's driver, CPU views
        where = dict(device="cpu", backend=request.getfixturevalue("fake_cuda").backend())
    with vattn.ElasticPool(256, (16, 8, 128), "float16", 4, sync="device", **where) as p:
        ids = p.alloc(5)
        for i, buf in enumerate(p.buffers):
            buf[ids] = float(i + 1)
        p.free(ids[1:3])
        more = p.alloc(3)
        assert p.stats().num_mapped_pages == -(-(max(ids + more) + 1) * 32 * 1024 // p.page_size)
        for i, buf in enumerate(p.buffers):
            assert torch.all(buf[[ids[0], *ids[3:]]] == float(i + 1))
        p.free([ids[0], *ids[3:]] + more)
        assert p.trim() > 0 and p.stats().mapped_bytes == 0
        p.check_invariants()


# ------------------------------------------------------------------ limits ----
def test_limit_refuses_and_changes_nothing():
    with make(limit=2 * 2 * PAGE) as p:  # two page groups
        ids = p.alloc(8)
        assert ids is not None
        before = p.stats()
        assert p.alloc(1) is None
        assert p.stats() == before
        assert p.available_blocks() == 0
        p.free(ids[:4])
        assert p.alloc(4) is not None  # the freed page is reused within the limit


def test_set_limit_gives_back_cached_pages_and_later_freed_ones(pool):
    ids = pool.alloc(16)  # 4 pages
    pool.free(ids[8:])
    pool.set_limit(3 * 2 * PAGE)
    s = pool.stats()
    assert s.num_mapped_pages == 3 and s.limit == 3 * 2 * PAGE
    pool.set_limit(1 * 2 * PAGE)  # below what is in use: in-use pages stay
    assert pool.stats().num_mapped_pages == 2
    assert pool.alloc(1) is None
    pool.free(ids[4:8])  # the page is given back at once: over the limit
    assert pool.stats().num_mapped_pages == 1
    check(pool, [], 0)
    pool.set_limit(None)
    assert pool.alloc(4) is not None
    pool.check_invariants()


def test_available_blocks_is_what_alloc_gives_when_blocks_straddle_pages():
    with make(num_blocks=40, block_floats=768, num_buffers=1, limit=5 * PAGE) as p:
        n = p.available_blocks()
        assert n == 6  # 3 KiB blocks: six lie wholly in five 4 KiB pages
        assert p.alloc(n + 1) is None and p.alloc(n) is not None


def test_available_blocks_of_an_empty_mla_sized_pool_is_every_block():
    # 73,728-byte blocks (an MLA layer's) on 2 MiB pages: it reported 35 of 2000, and vLLM's
    # scheduler refused any request that needed more
    with vattn.ElasticPool(2000, (73728,), "uint8", page_size=2 << 20) as p:
        assert p.available_blocks() == p.max_blocks() == 2000
        assert p.alloc(100) is not None
        assert p.available_blocks() == 1900


@pytest.mark.parametrize("block_floats, limit_pages, budget_pages, expected", [
    (256, None, None, 64),  # 4 blocks a page, no limit: every block
    (256, 5, None, 20),  # the limit backs 5 page groups: 20 blocks
    (256, 5, 3, 12),  # the budget's limit is tighter
    (2048, 7, None, 3),  # a block spans 2 pages
    (768, 5, None, 6),  # 3 KiB blocks straddle 4 KiB pages: the six that lie wholly in the first five
])
def test_max_blocks_is_what_the_limits_can_ever_back(block_floats, limit_pages, budget_pages, expected):
    group = 2 * PAGE  # two buffers
    budget = vattn.Budget(budget_pages * group) if budget_pages else None
    with make(block_floats=block_floats, limit=limit_pages * group if limit_pages else None, budget=budget) as p:
        assert p.max_blocks() == expected
        ids = p.alloc(expected)  # that many at once
        assert ids is not None
        assert p.alloc(1) is None  # and not one more
        assert p.max_blocks() == expected  # what is in use does not change it
        p.set_limit(None)
        assert p.max_blocks() == (12 if budget_pages else 64)


def test_exhausted_pool_returns_none(pool):
    ids = pool.alloc(64)
    assert len(set(ids)) == 64
    assert pool.alloc(1) is None
    assert pool.alloc(0) == []
    pool.free(ids)
    assert pool.stats().num_used_blocks == 0


# ------------------------------------------------------------------ errors ----
@pytest.mark.parametrize("bad, err, match", [
    ([64], vattn.UnknownBlockError, "out of range"),
    ([-1], vattn.UnknownBlockError, "out of range"),
    ([5], vattn.UnknownBlockError, "not allocated"),
    ([0, 0], vattn.UnknownBlockError, "twice"),
    ([True], vattn.InvalidRequestError, "must be an int"),
    ([1.0], vattn.InvalidRequestError, "must be an int"),
    (3, vattn.InvalidRequestError, "list of block ids"),
    ("12", vattn.InvalidRequestError, "list of block ids"),
])
def test_bad_frees_change_nothing(pool, bad, err, match):
    ids = pool.alloc(2)
    before = pool.stats()
    with pytest.raises(err, match=match):
        pool.free(bad)
    assert pool.stats() == before
    pool.free(np.array(ids))  # numpy ints are ids
    with pytest.raises(vattn.UnknownBlockError, match="double free"):
        pool.free([ids[0]])
    pool.check_invariants()


@pytest.mark.parametrize("n", [-1, 1.5, "2", None, True])
def test_bad_alloc_counts(pool, n):
    with pytest.raises(vattn.InvalidRequestError):
        pool.alloc(n)


@pytest.mark.parametrize("kw, match", [
    (dict(num_blocks=0), "num_blocks"),
    (dict(block_shape=(4, 0)), "block_shape"),
    (dict(block_shape=()), "at least one dimension"),
    (dict(dtype="float13"), "dtype"),
    (dict(dtype=[1]), "dtype"),
    (dict(dtype=None), "dtype"),
    (dict(num_buffers=-2), "num_buffers"),
    (dict(page_size=1000), "multiple of the OS page size"),
    (dict(page_size=0), "page_size"),
    (dict(limit=-1), "limit"),
    (dict(limit=2.5), "limit"),
    (dict(sync="never"), "sync"),
    (dict(device="tpu"), "device"),
    (dict(budget=10), "budget"),
    (dict(zero_new=1), "zero_new"),
])
def test_bad_configs(kw, match):
    args = dict(num_blocks=8, block_shape=(256,), dtype="float32", page_size=PAGE) | kw
    with pytest.raises(vattn.InvalidConfigError, match=match):
        vattn.ElasticPool(**args)


def test_books_the_host_cannot_hold_are_refused_before_they_are_built(monkeypatch):
    """ElasticPool(3 << 30, ...) passed its checks and its books filled host memory until
    the OOM killer ended the process. The books are measured against what the host can
    give, as pages are: a pool that fits is built, one that does not is a clear error."""
    from vattn.pool import elastic as pool_mod
    from vattn.vmem import host

    monkeypatch.setattr(host, "available_memory", lambda: 8 << 30)  # a host with 8 GiB available
    with pytest.raises(vattn.InvalidConfigError, match=r"num_blocks=3221225472 .* needs about 204\.0 GiB .*books"
                       r".* 8\.0 GiB is available .*lower num_blocks"):
        vattn.ElasticPool(3 << 30, (16, 2, 64), "float32")
    # the boundary: 64 bytes a block and 32 a page (one block a page here), MIN_HEADROOM kept free
    room = (8 << 30) - host.MIN_HEADROOM
    per_block = pool_mod.BOOKS_BYTES_PER_BLOCK + pool_mod.BOOKS_BYTES_PER_PAGE
    with pytest.raises(vattn.InvalidConfigError, match="books"):
        vattn.ElasticPool(room // per_block + 1, (PAGE,), "uint8", page_size=PAGE)
    monkeypatch.setattr(host, "available_memory", lambda: host.MIN_HEADROOM + 100 * per_block)
    with vattn.ElasticPool(100, (PAGE,), "uint8", page_size=PAGE) as p:  # exactly what is available
        assert p.config.num_blocks == 100
    with pytest.raises(vattn.InvalidConfigError, match="books"):
        vattn.ElasticPool(101, (PAGE,), "uint8", page_size=PAGE)


def test_closed_pool_raises(pool):
    ids = pool.alloc(2)
    pool.close()
    pool.close()  # idempotent
    for call in (lambda: pool.alloc(1), lambda: pool.free(ids), pool.trim, pool.stats, lambda: pool.buffer(0),
                 lambda: pool.set_limit(0), lambda: pool.take([5])):
        with pytest.raises(vattn.ClosedError):
            call()


def test_bad_limits_and_buffer_index(pool):
    with pytest.raises(vattn.InvalidConfigError):
        pool.set_limit(-5)
    with pytest.raises(vattn.InvalidRequestError, match="buffer index"):
        pool.buffer(2)


# ------------------------------------------------------------- real memory ----
def test_close_gives_every_page_and_mapping_back():
    gc.collect()
    base = vattn_mappings()
    p = make()
    ids = p.alloc(20)
    fill(p, ids, 1)
    assert vattn_mappings() != base
    p.close()
    assert vattn_mappings() == base
    p2 = make()
    p2.alloc(5)
    del p2
    gc.collect()
    assert vattn_mappings() == base  # a forgotten pool is released by its finalizer


PRELUDE = """
import vattn
p = vattn.ElasticPool(16, (1024,), "float32", 2, page_size=4096, scratch={scratch})   # one page per block
ids = p.alloc(3)
for b in ids:
    p.buffer(0)[b] = 1.0
p.free([ids[1]])
p.trim()
print("trimmed", float(p.buffer(0)[ids[0]].sum()), float(p.buffer(0)[ids[2]].sum()), flush=True)
"""


def test_without_scratch_a_trimmed_block_faults_and_blocks_in_use_do_not():
    r = _run(PRELUDE.format(scratch=False) + "print(float(p.buffer(0)[ids[1]].sum()))\n")
    assert "trimmed 1024.0 1024.0" in r.stdout and _faulted(r), (r.returncode, r.stdout, r.stderr)
    r = _run(PRELUDE.format(scratch=False) + "print(float(p.buffer(1)[10].sum()))\n")  # never allocated
    assert "trimmed" in r.stdout and _faulted(r), (r.returncode, r.stdout, r.stderr)


def test_with_scratch_every_byte_reads_and_writes_and_blocks_in_use_keep_their_data():
    touch = """
for buf in p.buffers:                  # every block, free, trimmed or never allocated
    buf.fill_(7.0)
for b in (ids[0], ids[2]):             # blocks in use: written last, read back
    p.buffer(0)[b] = float(b)
print("all", float(p.buffer(1)[10].sum()), float(p.buffer(0)[ids[1]].sum()) >= 0,
      [float(p.buffer(0)[b].sum()) for b in (ids[0], ids[2])], p.stats().mapped_bytes)
"""
    r = _run(PRELUDE.format(scratch=True) + touch)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert "trimmed 1024.0 1024.0" in r.stdout
    # the scratch is shared (what a free block reads is garbage) and never counted as memory
    assert f"all 7168.0 True [{1024.0 * 0}, {1024.0 * 2}] {2 * 2 * 4096}" in r.stdout, r.stdout


# ------------------------------------------------------------------ fences ----
class Recording(FaultyBackend):
    """Records fence / wait / unmap order (no faults)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.log: list[tuple] = []
        self._n = 0

    def fence(self):
        super().fence()
        self._n += 1
        self.log.append(("fence", self._n))
        return ("fence", self._n)

    def wait(self, fence):
        self.log.append(("wait", fence[1]))

    def unmap(self, bases, offsets, page, scratch=None):
        self.log.append(("unmap", tuple(offsets)))
        return self.inner.unmap(bases, offsets, page, scratch)


def test_unmap_waits_for_the_fence_of_the_last_free_on_the_page():
    be = Recording(HostBackend())
    with vattn.ElasticPool(16, (256,), "float32", 1, page_size=PAGE, backend=be, grow=1) as p:
        a = p.alloc(8)  # pages 0 and 1, mapped over the scratch after fence 1 (work that may read it)
        assert be.log[:2] == [("fence", 1), ("wait", 1)]
        p.free(a[:4])  # fence 2 on page 0
        p.free(a[4:6])  # fence 3 on page 1 (still in use)
        p.free(a[6:])  # fence 4 on page 1
        p.trim()
        unmap = next(i for i, e in enumerate(be.log) if e[0] == "unmap")
        assert sorted(be.log[unmap][1]) == [0, PAGE]
        assert ("wait", 2) in be.log[:unmap] and ("wait", 4) in be.log[:unmap]
        assert ("wait", 3) not in be.log  # superseded by fence 4 on the same page


def test_without_scratch_a_map_waits_for_nothing():
    be = Recording(HostBackend())
    with vattn.ElasticPool(16, (256,), "float32", 1, page_size=PAGE, backend=be, grow=1, scratch=False) as p:
        p.alloc(8)
        assert be.log == []


# ------------------------------------------------------------------ budget ----
def test_budget_take_give_and_limit():
    b = vattn.Budget(100)
    assert b.try_take(60) and not b.try_take(50) and b.used == 60
    b.give(60)
    with pytest.raises(vattn.InvalidRequestError):
        b.give(1)
    b.set_limit(None)
    assert b.try_take(10**12) and b.available() is None
    b.give(10**12)
    for bad in (-1, 1.5, "3"):
        with pytest.raises((vattn.InvalidRequestError, vattn.InvalidConfigError)):
            b.try_take(bad)
        with pytest.raises(vattn.InvalidConfigError):
            b.set_limit(bad)
    with pytest.raises(vattn.InvalidConfigError):
        b.register(5)
    with pytest.raises(vattn.InvalidConfigError):
        b.register(None, 5)
    t1, t2 = b.register(lambda n: 0, lambda: 100), b.register()
    assert b.reclaimable(t2) == 100 and b.reclaimable(t1) == 0 and b.stats().num_participants == 2
    b.unregister(t1)
    b.unregister(t1)  # idempotent
    assert b.reclaimable(t2) == 0


def test_two_pools_share_one_budget():
    budget = vattn.Budget(4 * 2 * PAGE)  # four page groups
    with make(budget=budget) as a, make(budget=budget) as b:
        ids = a.alloc(16)  # all four
        assert budget.used == 4 * 2 * PAGE
        assert b.alloc(1) is None  # a holds it all, in use
        a.free(ids[8:])  # two pages cached in a
        got = b.alloc(5)  # b asks a to give back cached pages
        assert got is not None and b.stats().num_mapped_pages == 2
        assert a.stats().num_mapped_pages == 2 and budget.used == 4 * 2 * PAGE
        check_ids = ids[:8]
        fill(a, check_ids, 4)
        fill(b, got, 5)
        check(a, check_ids, 4)
        budget.set_limit(2 * 2 * PAGE)  # lower at run time
        assert a.alloc(8) is None  # a's partly used... nothing warm left: refused
        b.free(got)
        b.trim()
        assert budget.used == 2 * 2 * PAGE
        a.check_invariants()
        b.check_invariants()
    assert budget.used == 0 and budget.stats().num_participants == 0


def test_reclaim_never_takes_pages_in_use():
    budget = vattn.Budget(2 * 2 * PAGE)
    with make(budget=budget) as a, make(budget=budget) as b:
        ids = a.alloc(8)
        fill(a, ids, 1)
        assert b.alloc(1) is None
        check(a, ids, 1)
        assert budget.reclaim(10 * PAGE) == 0


# ----------------------------------------------------------------- threads ----
def test_threads_alloc_and_free_concurrently():
    budget = vattn.Budget(24 * 2 * PAGE)
    pools = [make(num_blocks=96, budget=budget), make(num_blocks=96, budget=budget)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        pool = pools[seed % 2]
        held: list[tuple[list[int], int]] = []
        try:
            for it in range(150):
                if held and (rng.random() < 0.45 or len(held) > 6):
                    ids, tag = held.pop(rng.randrange(len(held)))
                    check(pool, ids, tag)
                    pool.free(ids)
                else:
                    ids = pool.alloc(rng.randint(1, 5))
                    if ids is not None:
                        tag = seed * 1000 + it
                        fill(pool, ids, tag)
                        held.append((ids, tag))
                for ids, tag in held[-2:]:
                    check(pool, ids, tag)
            for ids, tag in held:
                check(pool, ids, tag)
                pool.free(ids)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    def trimmer() -> None:
        rng = random.Random(99)
        while not stop.is_set():
            pool = pools[rng.randrange(2)]
            try:
                if rng.random() < 0.5:
                    pool.trim()
                else:
                    pool.set_limit(rng.choice([None, 8 * 2 * PAGE, 16 * 2 * PAGE]))
            except BaseException as e:  # pragma: no cover
                errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    t = threading.Thread(target=trimmer)
    t.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    stop.set()
    t.join(timeout=30)
    assert not errors, errors
    for p in pools:
        p.check_invariants()
        assert p.stats().num_used_blocks == 0
    assert budget.used == sum(p.stats().held_bytes for p in pools)
    for p in pools:
        p.close()
    assert budget.used == 0


# ------------------------------------------------------------ zero_new and pin ----
class DirtyHost(HostBackend):
    """The host backend as a GPU's memory behaves: new pages hold old data (0xAB bytes),
    real mappings otherwise."""

    new_pages_zeroed = False

    def _create(self, n, num_buffers, page_size):
        groups = super()._create(n, num_buffers, page_size)
        for g in groups:
            for b in range(num_buffers):
                os.pwrite(g.fd, b"\xab" * page_size, g.offset + b * g.stride)
        return groups


def reads(pool: vattn.ElasticPool, ids, byte: int) -> bool:
    """Whether every byte of blocks `ids` is `byte` in every buffer."""
    return all(bool((buf[b].view(torch.uint8) == byte).all()) for buf in pool.buffers for b in ids)


@pytest.mark.parametrize("zero_new", [False, True])
def test_zero_new_clears_pages_mapped_with_new_memory(zero_new):
    """A page mapped, written, unmapped (its memory given back) and mapped again reads
    zeros with zero_new, and what the new memory held (0xAB) without it; a page given a
    group moved from the pool's own cached page keeps that page's data either way."""
    new = 0 if zero_new else 0xAB
    with make(16, zero_new=zero_new, backend=DirtyHost()) as pool:  # 4 blocks a page
        assert pool.take([0]) == [0] and reads(pool, range(4), new)  # the whole page
        fill(pool, [0], 1)
        assert pool.take([1]) == [1]  # a mapped page: not cleared again
        check(pool, [0], 1)
        pool.free([0, 1])
        assert pool.trim() == 2 * PAGE  # unmapped, released
        assert pool.take([2]) == [2] and reads(pool, range(4), new)  # mapped again: new memory
        fill(pool, [2], 2)
        pool.free([2])
        old = [buf[0:4].clone() for buf in pool.buffers]
        pool.set_limit(2 * PAGE)  # one page group: the cached one
        created = pool.backend.num_pages_created
        assert pool.take([4]) == [4]  # page 1 gets page 0's group (moved, not new)
        assert pool.backend.num_pages_created == created and pool.stats().num_mapped_pages == 1
        assert all(torch.equal(buf[4:8], o) for buf, o in zip(pool.buffers, old))
        pool.check_invariants()


@pytest.mark.parametrize("zero_new", [False, True])
def test_zero_new_clears_spare_groups_when_they_are_mapped(zero_new):
    with make(16, grow=4, zero_new=zero_new, backend=DirtyHost()) as pool:
        pool.take([0])  # one group mapped, three created spare
        assert pool.stats().num_spare_pages == 3
        fill(pool, [0], 1)
        pool.take([4, 8])  # two spare groups: never mapped, new memory
        assert pool.stats().num_spare_pages == 1
        assert reads(pool, [4, 5, 6, 7, 8, 9, 10, 11], 0 if zero_new else 0xAB)
        check(pool, [0], 1)
        pool.check_invariants()


def test_zero_new_does_nothing_where_new_memory_reads_zeros(monkeypatch):
    backend = HostBackend()
    calls = []
    monkeypatch.setattr(backend, "zero", lambda *a: calls.append(a))
    with make(16, zero_new=True, backend=backend) as pool:
        assert pool.alloc(8) is not None and reads(pool, range(8), 0)
    backend.close()
    assert not calls


def test_memory_zero_new_failed_to_clear_is_never_handed_out(monkeypatch):
    backend = DirtyHost()
    real = backend.zero

    def fail_once(*a):
        monkeypatch.setattr(backend, "zero", real)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(backend, "zero", fail_once)
    with make(16, zero_new=True, backend=backend) as pool:
        with pytest.raises(RuntimeError, match="illegal memory access"):
            pool.take([0])
        s = pool.stats()
        assert s.num_used_blocks == 0 and s.num_mapped_pages == 0 and s.held_bytes == 0
        pool.check_invariants()
        assert pool.take([0]) == [0] and reads(pool, range(4), 0)


def test_pin_takes_blocks_that_must_stay_mapped_or_raises():
    with make(16, limit=2 * PAGE) as pool:  # one page group
        assert pool.pin([3], "the padding block", "raise the limit") == [3]
        with pytest.raises(vattn.OutOfPhysicalMemoryError,
                           match=r"^no memory for the null block \(1 page group\(s\) of 8192 bytes under a limit of "
                                 r"8192 bytes\); raise the limit$"):
            pool.pin([4], "the null block", "raise the limit")
        with pytest.raises(vattn.InvalidConfigError, match="VATTN_X_LIMIT"):
            pool.pin([4, 12], "two blocks", "raise VATTN_X_LIMIT", error=vattn.InvalidConfigError)
        s = pool.stats()
        assert s.num_used_blocks == 1 and s.num_mapped_pages == 1  # nothing changed
        with pytest.raises(vattn.UnknownBlockError):
            pool.pin([3], "the padding block", "")
        pool.check_invariants()


def test_pin_with_zero_clears_blocks_that_held_data():
    with make(16) as pool:
        fill(pool, pool.take([0, 1, 2, 5]), 1)
        pool.free([0, 1, 2])  # cached: still mapped, still holding data
        assert pool.pin([0, 1], "the trash blocks", "", zero=True) == [0, 1]
        assert reads(pool, [0, 1], 0)
        assert pool.pin([2], "a block", "") == [2]  # without zero it keeps its data
        check(pool, [2, 5], 1)
        pool.check_invariants()
