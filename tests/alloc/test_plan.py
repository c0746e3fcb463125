"""`StepPlan`, the seam between deciding and mapping: a plan is decided from the books alone
(no backend call) and lists, per layer kind (`KindPlan`), the page movements that `step`
(and fork) then carry out."""
from __future__ import annotations

import vattn
from tests.conftest import SMALL, check, fill
from vattn.allocator import KindPlan, StepPlan
from vattn.allocator.plan import plan_backing, plan_step

PAGE = 4096  # SMALL: 128 B a token, 32 tokens a page; a page group is 4 pages (2 layers x K/V)


def calls(cache: vattn.KVCache) -> tuple:
    be = cache.backend
    return be.num_map_calls, be.num_unmap_calls, be.num_pages_created


def test_a_step_is_planned_from_the_books_then_carried_out():
    with vattn.KVCache(**SMALL, device="cpu", page_size=PAGE, physical_memory=4 * 4 * PAGE, prefetch=False) as c:
        a, b, new = c.alloc_reqid(), c.alloc_reqid(), c.alloc_reqid()
        assert c.step({a: 64, b: 64})  # 4 page groups: the whole budget
        fill(c, a, 0, 64, 1)
        c.free_reqid(b)  # b's two pages are cached now
        before = calls(c)
        plan = plan_step(c.allocator.kinds, {a: 65, new: 10}, [a, new], c.allocator.max_bytes)
        assert calls(c) == before  # deciding made no backend call
        assert isinstance(plan, StepPlan) and len(plan.kinds) == 1 and isinstance(plan.kinds[0], KindPlan)
        assert plan.served == (a, new) and plan.failed == ()  # oldest first
        kp = plan.kinds[0]
        assert kp.maps == ((a, 2, 1), (new, 0, 1)) and kp.num_new == 2
        assert (kp.num_create, kp.unmaps, kp.num_unmapped, kp.num_evict) == (0, ((b, 2),), 2, 0)
        res = c.step({a: 65, new: 10})  # carries out the same plan
        assert (res.num_mapped, res.num_unmapped) == (2, 2) and res.failed == ()
        check(c, a, 64, 1)
        c.allocator.check_invariants()


def test_a_fork_is_planned_as_shared_groups_a_fresh_page_and_its_copy():
    with vattn.KVCache(**SMALL, device="cpu", page_size=PAGE, prefetch=False) as c:
        a = c.alloc_reqid()
        assert c.step({a: 80})  # pages 0, 1 whole, page 2 partly filled
        books = c.allocator.books
        g, child = c.geometry, 1
        shares, maps, copies = c.allocator.kinds[0].fork_parts(a, child, 80)
        assert shares == ((child, 0, tuple(books.slot_pages[a][:2])),)
        assert maps == ((child, 2, 1),) and copies == ((g.page_offset(a, 2), g.page_offset(child, 2)),)
        plan = plan_backing([books], [maps], {}, c.allocator.max_bytes, copies=[copies], shares=[shares])
        kp = plan.kinds[0]
        assert plan.served == (child,) and kp.shares == shares and kp.maps == maps and kp.copies == copies
        assert kp.num_create == 0 and kp.unmaps == ()
