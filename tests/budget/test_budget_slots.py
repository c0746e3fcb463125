"""The slot API on a shared `vattn.Budget`: two caches (or a cache and an elastic pool)
draw from one physical budget; memory one gives back, the other can take."""
from __future__ import annotations

import vattn
from tests.conftest import SMALL, check, fill

PAGE = 4096
GROUP = 2 * 2 * PAGE  # SMALL: 2 layers x K/V


def test_two_caches_share_one_budget():
    budget = vattn.Budget(16 * GROUP)
    kw = dict(**SMALL, device="cpu", page_size=PAGE, prefetch=False)
    with vattn.KVCache(**kw, budget=budget) as a, vattn.KVCache(**kw, budget=budget) as b:
        ra = a.alloc_reqid()
        assert a.step({ra: 512})  # 16 groups: the whole budget
        fill(a, ra, 0, 512, 1)
        assert budget.used == 16 * GROUP
        rb = b.alloc_reqid()
        res = b.step({rb: 100})
        assert not res and res.out_of_memory  # a shortage now, not an error
        a.free_reqid(ra)  # a's pages are cached now: reclaimable by others
        ra2 = a.alloc_reqid()
        assert a.step({ra2: 64})  # a keeps using some of them
        fill(a, ra2, 0, 64, 2)
        assert b.step({rb: 100})  # b asked the budget, and a gave back what it did not need
        fill(b, rb, 0, 100, 3)
        check(a, ra2, 64, 2)
        check(b, rb, 100, 3)
        assert budget.used <= 16 * GROUP
        a.allocator.check_invariants()
        b.allocator.check_invariants()
    assert budget.used == 0 and budget.stats().num_participants == 0


def test_trim_gives_the_budget_back_and_a_pool_can_take_it():
    budget = vattn.Budget(16 * GROUP)
    with vattn.KVCache(**SMALL, device="cpu", page_size=PAGE, prefetch=False, budget=budget) as c:
        r = c.alloc_reqid()
        assert c.step({r: 512})
        c.free_reqid(r)
        with vattn.ElasticPool(64, (32, 2, 16), "float32", 4, device="cpu", page_size=PAGE, budget=budget) as pool:
            ids = pool.alloc(8)  # the pool asks the budget, which asks the cache
            assert ids is not None
            assert budget.used <= 16 * GROUP
            pool.free(ids)
        assert c.trim() >= 0
        assert budget.used == c.stats().num_created_pages * GROUP
