"""ElasticPool books under random operations (a hypothesis state machine against a model of
the books) and under injected backend failures (every call fails in turn)."""
from __future__ import annotations

import dataclasses
import gc
import random
import warnings

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import vattn
from tests.alloc.test_faults import CALLS, FaultyBackend, Injected
from tests.alloc.test_pool import check, fill
from tests.conftest import vattn_mappings
from vattn.vmem.host import HostBackend

PAGE = 4096


class PoolMachine(RuleBasedStateMachine):
    """Two pools on one budget. Model: the blocks each pool has handed out (and their tags)."""

    num_blocks, block_floats, num_buffers = 24, 256, 2  # 1 KiB blocks: four on a page

    def __init__(self) -> None:
        super().__init__()
        self.budget = vattn.Budget(12 * self.num_buffers * PAGE)
        self.pools = [vattn.ElasticPool(self.num_blocks, (self.block_floats,), "float32", self.num_buffers,
                                        page_size=PAGE, budget=self.budget, grow=grow) for grow in (1, 3)]
        self.held: list[dict[int, int]] = [{}, {}]  # pool -> block -> tag
        self.tag = 0

    def teardown(self) -> None:
        for p in self.pools:
            p.close()
        assert self.budget.used == 0

    @rule(i=st.integers(0, 1), n=st.integers(0, 7))
    def alloc(self, i, n) -> None:
        p = self.pools[i]
        before, avail = p.stats(), p.available_blocks()
        got = p.alloc(n)
        if n <= avail:
            assert got is not None, (n, avail, before)
        if n > self.num_blocks - len(self.held[i]):
            assert got is None
        if got is None:  # nothing changed (but the budget: another pool may have given back cached pages)
            assert dataclasses.replace(p.stats(), available_blocks=0) == dataclasses.replace(before, available_blocks=0)
            return
        assert len(got) == n == len(set(got)) and not set(got) & set(self.held[i])
        self.tag += 1
        fill(p, got, self.tag)
        for b in got:
            self.held[i][b] = self.tag

    @precondition(lambda self: self.held[0] or self.held[1])
    @rule(data=st.data())
    def free(self, data) -> None:
        i = data.draw(st.sampled_from([k for k in (0, 1) if self.held[k]]))
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held[i])), min_size=1, unique=True))
        self.pools[i].free(ids)
        for b in ids:
            del self.held[i][b]
        before = self.pools[i].stats()
        with pytest.raises(vattn.UnknownBlockError):
            self.pools[i].free(ids[:1])
        assert self.pools[i].stats() == before

    @rule(i=st.integers(0, 1), b=st.integers(-2, 30))
    def bad_free(self, i, b) -> None:
        if b in self.held[i]:
            return
        before = self.pools[i].stats()
        with pytest.raises(vattn.UnknownBlockError):
            self.pools[i].free([b])
        assert self.pools[i].stats() == before

    @rule(i=st.integers(0, 1), pages=st.one_of(st.none(), st.integers(0, 14)))
    def set_limit(self, i, pages) -> None:
        self.pools[i].set_limit(None if pages is None else pages * self.num_buffers * PAGE)

    @rule(pages=st.one_of(st.none(), st.integers(0, 14)))
    def set_budget(self, pages) -> None:
        self.budget.set_limit(None if pages is None else pages * self.num_buffers * PAGE)

    @rule(i=st.integers(0, 1))
    def trim(self, i) -> None:
        self.pools[i].trim()
        s = self.pools[i].stats()
        assert s.num_cached_pages == 0 and s.num_spare_pages == 0

    @invariant()
    def books_consistent_and_data_intact(self) -> None:
        for p, held in zip(self.pools, self.held):
            p.check_invariants()
            s = p.stats()
            assert s.num_used_blocks == len(held)
            assert s.limit is None or s.held_bytes <= s.limit or s.num_cached_pages == s.num_spare_pages == 0
            for b, tag in held.items():
                check(p, [b], tag)
        assert self.budget.used == sum(p.stats().held_bytes for p in self.pools)


class StraddlingMachine(PoolMachine):
    num_blocks, block_floats, num_buffers = 16, 768, 1  # 3 KiB blocks across 4 KiB pages


class BigBlockMachine(PoolMachine):
    num_blocks, block_floats, num_buffers = 8, 3000, 1  # 11.7 KiB blocks: three or four pages each


_SETTINGS = settings(max_examples=30, stateful_step_count=30, deadline=None)
TestSmallBlocks = PoolMachine.TestCase
TestSmallBlocks.settings = _SETTINGS
TestStraddlingBlocks = StraddlingMachine.TestCase
TestStraddlingBlocks.settings = _SETTINGS
TestBigBlocks = BigBlockMachine.TestCase
TestBigBlocks.settings = _SETTINGS


class ExactCountMachine(RuleBasedStateMachine):
    """One pool, its block size drawn per example: blocks that divide the page, straddle two
    pages, or span several. `available_blocks()` is always the largest n that `alloc(n)`
    gives (vLLM's scheduler admits work by it), `max_blocks()` what an empty pool gives."""

    @initialize(block_bytes=st.one_of(st.sampled_from([256, 1024, 4096, 8192]),  # divide, or are whole pages
                                      st.integers(65, 3 * PAGE).map(lambda x: x * 4 // 4 * 4)),
                num_blocks=st.integers(1, 48), grow=st.sampled_from([1, 3]),
                limit_pages=st.one_of(st.none(), st.integers(0, 12)))
    def make(self, block_bytes, num_blocks, grow, limit_pages) -> None:
        self.pool = vattn.ElasticPool(num_blocks, (block_bytes // 4,), "float32", 1, page_size=PAGE, grow=grow,
                                      limit=None if limit_pages is None else limit_pages * PAGE)
        pages = min(self.pool._books.num_pages, limit_pages if limit_pages is not None else 1 << 30)
        assert self.pool.max_blocks() == self._alloc_all() == min(num_blocks, pages * PAGE // block_bytes)
        self.held: set[int] = set()

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            self.pool.close()

    def _alloc_all(self) -> int:
        """The largest n alloc(n) gives now, found by trying (nothing kept)."""
        p, n = self.pool, 0
        while (got := p.alloc(n + 1)) is not None:
            p.free(got)
            n += 1
        return n

    @rule(n=st.integers(0, 10))
    def alloc(self, n) -> None:
        got = self.pool.alloc(n)
        if got is not None:
            self.held.update(got)

    @rule(data=st.data())
    def take(self, data) -> None:  # a server that picks its own ids: warm blocks stay free
        free = sorted(set(range(self.pool.config.num_blocks)) - self.held)
        if free:
            ids = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=4, unique=True))
            if self.pool.take(ids) is not None:
                self.held.update(ids)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(sorted(self.held)), min_size=1, unique=True))
        self.pool.free(ids)
        self.held -= set(ids)

    @rule(pages=st.one_of(st.none(), st.integers(0, 12)))
    def set_limit(self, pages) -> None:
        self.pool.set_limit(None if pages is None else pages * PAGE)

    @rule(pages=st.integers(0, 4))
    def give_back_some(self, pages) -> None:  # partial give-backs: what leaves blocks half mapped
        with self.pool._books.lock:
            self.pool._books.give_back(pages)

    @rule()
    def trim(self) -> None:
        self.pool.trim()

    @invariant()
    def available_blocks_is_exact(self) -> None:
        if not hasattr(self, "pool"):
            return
        p = self.pool
        n = p.available_blocks()
        before = p.stats()
        assert p.alloc(n + 1) is None, (n, before)
        assert p.stats() == before  # a refused alloc changes nothing
        got = p.alloc(n)
        assert got is not None and len(got) == n, (n, before)
        p.free(got)
        p.check_invariants()


TestExactCount = ExactCountMachine.TestCase
TestExactCount.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)


# ------------------------------------------------------------------ faults ----
def _workload(p: vattn.ElasticPool, seed: int, iters: int = 60) -> None:
    """Random alloc / free / trim / set_limit; any call may fail with the injected error.
    After every call the books are consistent and the blocks handed out hold their data
    (a page of theirs unmapped would fault this process)."""
    rng = random.Random(seed)
    held: dict[int, int] = {}
    for it in range(iters):
        try:
            r = rng.random()
            if held and r < 0.35:
                ids = rng.sample(sorted(held), rng.randint(1, min(6, len(held))))
                p.free(ids)
                for b in ids:
                    del held[b]
            elif r < 0.8:
                got = p.alloc(rng.randint(1, 8))
                if got is not None:
                    fill(p, got, it)
                    held.update(dict.fromkeys(got, it))
            elif r < 0.9:
                p.trim()
            else:
                p.set_limit(rng.choice([None, 4 * 2 * PAGE, 8 * 2 * PAGE]))
        except Injected:
            pass
        p.check_invariants()
        for b, tag in held.items():
            check(p, [b], tag)


def _run(name: str | None, ordinal: int, block_floats: int) -> FaultyBackend:
    be = FaultyBackend(HostBackend(), name, ordinal)
    budget = vattn.Budget(12 * 2 * PAGE)  # twelve page groups
    try:
        p = vattn.ElasticPool(32, (block_floats,), "float32", 2, page_size=PAGE, backend=be, budget=budget, grow=3)
    except Injected:
        assert name == "reserve"
        be.inner.close()
        return be
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "giving back pages over the pool's limit failed"
        _workload(p, seed=ordinal)
        s = p.stats()
        assert budget.used == s.held_bytes + len(p._books.physical.unreleased) * s.group_bytes
        try:
            p.close()
        except Injected:
            pass
    p.close()
    assert be.inner._fd == -1 and be.inner._live == 0  # every page group released
    assert budget.used == 0
    return be


@pytest.fixture(scope="module")
def pool_call_counts() -> dict[int, dict[str, int]]:
    return {bf: _run(None, 0, bf).counts for bf in (256, 768)}


@pytest.mark.parametrize("block_floats", [256, 768], ids=["small-blocks", "straddling-blocks"])
@pytest.mark.parametrize("name", CALLS)
def test_every_backend_call_fails_in_turn(name, block_floats, pool_call_counts):
    gc.collect()
    base = vattn_mappings()
    n = pool_call_counts[block_floats][name]
    assert n > 0, f"the workload never calls {name}"
    for k in sorted({*range(1, min(n, 6) + 1), n // 3, n // 2, n - 1, n} - {0}):
        _run(name, k, block_floats)
    gc.collect()
    assert vattn_mappings() == base  # no mapping and no memfd left behind
