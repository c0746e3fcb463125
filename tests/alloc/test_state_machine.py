"""Random alloc / step / free sequences against a simple model of the books."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import vattn
from tests import fake_cuda
from tests.conftest import fill, new_cache

B, L, PAGE = 3, 256, 4096  # 1 layer x 1 head x 16 dims x fp32 = 64 B/token: 64 tokens a page, 4 pages a slot
BUDGET = 6  # page groups
INDEX = st.integers(min_value=0, max_value=1 << 16)  # which of the candidates (modulo their number)
FRACTION = st.integers(min_value=1, max_value=1 << 16)  # how much of what there is, in 1/65536ths


def pick(items: list, i: int):
    return items[i % len(items)]


def part(whole: int, frac: int) -> int:
    """Between 1 and `whole` (>= 1): `frac` 65536ths of it, rounded up."""
    return max(1, -(-whole * frac >> 16))


class CacheMachine(RuleBasedStateMachine):
    background = True
    device = "cpu"
    head_dim = 16

    def __init__(self) -> None:
        super().__init__()
        self.live_before = fake_cuda.load().live() if self.device == "fakecuda" else None
        self.cache = new_cache(self.device, num_layers=1, num_kv_heads=1, head_dim=self.head_dim, max_batch_size=B,
                               max_context_len=L, page_size=PAGE, physical_memory=BUDGET * 2 * PAGE,
                               background=self.background)
        self.g = self.cache.geometry
        self.lens: dict[int, int] = {}  # model: active reqid -> tokens written (and backed)
        self.tags: dict[int, int] = {}  # the tag a request writes its own tokens with
        self.segs: dict[int, list[tuple[int, int, int]]] = {}  # reqid -> (start, end, tag) it holds
        self.pages: dict[int, list[int]] = {}  # reqid -> identity of each page (shared pages share one)
        self.page_ids = iter(range(1 << 30))
        self.pinned: list[tuple[list, list, list]] = []  # (handles, segments they hold, page ids)
        self.n = 0

    def teardown(self) -> None:
        self.cache.close()
        if self.device == "fakecuda":  # every example leaves the driver clean
            del self.cache  # and with it the range: the machine holds no view
            fake_cuda.load().assert_clean(self.live_before)

    # Every draw has the same bounds whatever the state, and no rule has a precondition: with
    # background pre-mapping, which slots a short step fails (and so the lengths after it)
    # depends on how far the worker got, and hypothesis calls a run whose draws depend on
    # that flaky. A rule that does not apply to the state it finds does nothing.
    @rule()
    def alloc(self) -> None:
        if len(self.lens) == B:
            with pytest.raises(vattn.NoFreeSlotError):
                self.cache.alloc_reqid()
            return
        r = self.cache.alloc_reqid()
        assert 0 <= r < B and r not in self.lens
        self.n += 1
        self.lens[r], self.tags[r], self.segs[r], self.pages[r] = 0, self.n, [], []

    @rule(i=INDEX)
    def free(self, i: int) -> None:
        if not self.lens:
            return
        r = pick(sorted(self.lens), i)
        self.cache.free_reqid(r)
        del self.lens[r], self.tags[r], self.segs[r], self.pages[r]
        with pytest.raises(vattn.UnknownReqIdError):
            self.cache.free_reqid(r)

    @rule(scheduled=st.lists(st.booleans(), min_size=B, max_size=B),
          grow=st.lists(st.integers(min_value=0, max_value=200), min_size=B, max_size=B))
    def step(self, scheduled: list[bool], grow: list[int]) -> None:
        new = {r: min(L, n + grow[r]) for r, n in self.lens.items() if scheduled[r]}  # (reqids are slots < B)
        distinct = {p for r in self.lens for p in self.pages[r]}
        grown = sum(max(0, self.g.pages_for(new.get(r, 0)) - len(self.pages[r])) for r in self.lens)
        need = len(distinct) + grown
        res = self.cache.step(new)
        assert bool(res) == (need <= BUDGET), (new, self.lens, res)
        assert set(res.failed) <= {r for r, n in new.items() if self.g.pages_for(n) > self.g.pages_for(self.lens[r])}
        for r, n in new.items():
            if r not in res.failed:
                fill(self.cache, r, self.lens[r], n, self.tags[r])
                self.segs[r].append((self.lens[r], n, self.tags[r]))
                self.lens[r] = n
                while len(self.pages[r]) < self.g.pages_for(n):
                    self.pages[r].append(next(self.page_ids))

    @rule(i=INDEX, frac=FRACTION)
    def fork(self, i: int, frac: int) -> None:
        parents = sorted(r for r, n in self.lens.items() if n)
        if len(self.lens) == B or not parents:
            return
        parent = pick(parents, i)
        k = part(self.lens[parent], frac)
        full = k * self.g.token_bytes // self.g.page_size
        partial = self.g.pages_for(k) - full
        distinct = {p for r in self.lens for p in self.pages[r]}
        try:
            child = self.cache.fork(parent, k)
        except vattn.OutOfPhysicalMemoryError:
            assert partial and len(distinct) + 1 > BUDGET  # no page for the copy
            return
        assert child not in self.lens
        self.n += 1
        self.lens[child], self.tags[child] = k, self.n
        self.segs[child] = [(a, min(b, k), t) for a, b, t in self.segs[parent] if a < k]
        self.pages[child] = self.pages[parent][:full] + ([next(self.page_ids)] if partial else [])

    @rule(i=INDEX, frac=FRACTION)
    def pin(self, i: int, frac: int) -> None:
        held = sorted(r for r, n in self.lens.items() if n >= 64)
        if not held:
            return
        r = pick(held, i)
        k = part(self.lens[r] * self.g.token_bytes // self.g.page_size, frac)
        handles = self.cache.pin(r, k)
        end = k * self.g.page_size // self.g.token_bytes
        self.pinned.append((handles, [(a, min(b, end), t) for a, b, t in self.segs[r] if a < end], self.pages[r][:k]))

    @rule(i=INDEX)
    def map_pinned(self, i: int) -> None:
        if not self.pinned or len(self.lens) == B:
            return
        handles, segs, ids = pick(self.pinned, i)
        self.alloc()
        r = max(self.lens, key=self.tags.__getitem__)  # the one alloc() just made
        n = self.cache.map_pinned(r, handles)
        k = n * self.g.token_bytes // self.g.page_size
        assert n % self.g.share_tokens == 0 and n * self.g.token_bytes == k * self.g.page_size and k <= len(handles)
        self.lens[r] = n
        self.segs[r] = [(a, min(b, n), t) for a, b, t in segs if a < n]
        self.pages[r] = ids[:k]

    @rule(r=st.integers(min_value=-2, max_value=B + 2), n=st.integers(min_value=-3, max_value=L + 3))
    def bad_step(self, r, n) -> None:
        if 0 <= n <= L and (r in self.lens or (0 <= r < B and n == 0)):
            return  # valid (a zero for a free slot is allowed, as in the list form)
        self.cache.synchronize()
        before = self.cache.stats()
        with pytest.raises(vattn.InvalidRequestError):
            self.cache.step({r: n})
        assert self.cache.stats() == before

    @invariant()
    def books_consistent_and_data_intact(self) -> None:
        self.cache.allocator.check_invariants()
        for r, segs in self.segs.items():
            for start, end, tag in segs:
                check_range(self.cache, r, start, end, tag)


def check_range(cache: vattn.KVCache, slot: int, start: int, end: int, tag: int) -> None:
    """Tokens [start, end) of `slot` hold what `fill(cache, slot, start, end, tag)` wrote."""
    import torch

    pos = torch.arange(start, end, dtype=torch.float32)
    for layer in range(cache.config.num_layers):
        val = (tag * 1000 + layer * 100 + pos % 97)[:, None, None]
        k, v = cache.k_cache(layer)[slot, start:end], cache.v_cache(layer)[slot, start:end]
        assert torch.equal(k, val.expand_as(k)), (slot, layer, start, end)
        assert torch.equal(v, -val.expand_as(v)), (slot, layer, start, end)


class SyncCacheMachine(CacheMachine):
    background = False


class StraddleCacheMachine(CacheMachine):
    """96 B tokens: a token straddles pages, forks copy the page their first own token
    begins in, and pinned pages map in units of 128 tokens in 3 pages (issue 23)."""
    head_dim = 24


class FakeCudaCacheMachine(CacheMachine):  # the CUDA backend on tests/fake_cuda's driver
    device = "fakecuda"


class FakeCudaSyncCacheMachine(SyncCacheMachine):
    device = "fakecuda"


TestBackground = CacheMachine.TestCase
TestBackground.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)
TestStraddle = StraddleCacheMachine.TestCase
TestStraddle.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
TestSync = SyncCacheMachine.TestCase
TestSync.settings = settings(max_examples=25, stateful_step_count=60, deadline=None)
TestFakeCudaBackground = pytest.mark.usefixtures("fake_cuda")(FakeCudaCacheMachine.TestCase)
TestFakeCudaBackground.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
TestFakeCudaSync = pytest.mark.usefixtures("fake_cuda")(FakeCudaSyncCacheMachine.TestCase)
TestFakeCudaSync.settings = settings(max_examples=15, stateful_step_count=60, deadline=None)
