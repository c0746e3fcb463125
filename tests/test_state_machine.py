"""Random alloc / step / free sequences against a simple model of the books."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import vattn
from tests import fake_cuda
from tests.conftest import check, fill, new_cache

B, L, PAGE = 3, 256, 4096  # 1 layer x 1 head x 16 dims x fp32 = 64 B/token: 64 tokens a page, 4 pages a slot
BUDGET = 6  # page groups


class CacheMachine(RuleBasedStateMachine):
    background = True
    device = "cpu"

    def __init__(self) -> None:
        super().__init__()
        self.live_before = fake_cuda.load().live() if self.device == "fakecuda" else None
        self.cache = new_cache(self.device, num_layers=1, num_kv_heads=1, head_dim=16, max_batch_size=B,
                               max_context_len=L, page_size=PAGE, physical_memory=BUDGET * 2 * PAGE,
                               background=self.background)
        self.g = self.cache.geometry
        self.lens: dict[int, int] = {}  # model: active reqid -> tokens written (and backed)
        self.tags: dict[int, int] = {}
        self.n = 0

    def teardown(self) -> None:
        self.cache.close()
        if self.device == "fakecuda":  # every example leaves the driver clean
            del self.cache  # and with it the range: the machine holds no view
            fake_cuda.load().assert_clean(self.live_before)

    @precondition(lambda self: len(self.lens) < B)
    @rule()
    def alloc(self) -> None:
        r = self.cache.alloc_reqid()
        assert 0 <= r < B and r not in self.lens
        self.n += 1
        self.lens[r], self.tags[r] = 0, self.n

    @precondition(lambda self: len(self.lens) == B)
    @rule()
    def alloc_when_full(self) -> None:
        with pytest.raises(vattn.NoFreeSlotError):
            self.cache.alloc_reqid()

    @precondition(lambda self: self.lens)
    @rule(data=st.data())
    def free(self, data) -> None:
        r = data.draw(st.sampled_from(sorted(self.lens)))
        self.cache.free_reqid(r)
        del self.lens[r], self.tags[r]
        with pytest.raises(vattn.UnknownReqIdError):
            self.cache.free_reqid(r)

    @rule(data=st.data())
    def step(self, data) -> None:
        new = {}
        for r, n in self.lens.items():
            if data.draw(st.booleans()):  # scheduled this iteration
                new[r] = data.draw(st.integers(min_value=n, max_value=min(L, n + 200)))
        need = sum(max(self.g.pages_for(new.get(r, 0)), self.g.pages_for(n)) for r, n in self.lens.items())
        res = self.cache.step(new)
        assert bool(res) == (need <= BUDGET), (new, self.lens, res)
        assert set(res.failed) <= {r for r, n in new.items() if self.g.pages_for(n) > self.g.pages_for(self.lens[r])}
        for r, n in new.items():
            if r not in res.failed:
                fill(self.cache, r, self.lens[r], n, self.tags[r])
                self.lens[r] = n

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
        for r, n in self.lens.items():
            check(self.cache, r, n, self.tags[r])


class SyncCacheMachine(CacheMachine):
    background = False


class FakeCudaCacheMachine(CacheMachine):  # the CUDA backend on tests/fake_cuda's driver
    device = "fakecuda"


class FakeCudaSyncCacheMachine(SyncCacheMachine):
    device = "fakecuda"


TestBackground = CacheMachine.TestCase
TestBackground.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestSync = SyncCacheMachine.TestCase
TestSync.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestFakeCudaBackground = pytest.mark.usefixtures("fake_cuda")(FakeCudaCacheMachine.TestCase)
TestFakeCudaBackground.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestFakeCudaSync = pytest.mark.usefixtures("fake_cuda")(FakeCudaSyncCacheMachine.TestCase)
TestFakeCudaSync.settings = settings(max_examples=15, stateful_step_count=30, deadline=None)
