"""The physical page layer under both allocators (`vattn.pages`): a release the backend
refuses keeps its groups (still memory, still counted by the budget, never handed out
again) and close releases them once more; the same for the slot allocator and the pool."""
from __future__ import annotations

import pytest

import vattn
from tests.conftest import SMALL, check, fill
from vattn.vmem.host import HostBackend

PAGE = 4096


class RefusingHost(HostBackend):
    """The host backend, refusing the next `refuse` release calls (nothing released)."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse = 0
        self.released: list[int] = []  # groups per release call that went through

    def _release(self, groups):
        if self.refuse:
            self.refuse -= 1
            raise vattn.BackendError("release", 999, "INJECTED")
        self.released.append(len(groups))
        super()._release(groups)


def test_the_slot_allocator_keeps_unreleased_groups_for_a_retry():
    be, budget = RefusingHost(), vattn.Budget(None)
    cache = vattn.KVCache(**SMALL, device="cpu", page_size=PAGE, prefetch=False, backend=be, budget=budget)
    gb = cache.geometry.group_bytes
    r = cache.alloc_reqid()
    assert cache.step({r: 100})
    cache.free_reqid(r)
    created = cache.stats().num_created_pages
    be.refuse = 1
    with pytest.raises(vattn.BackendError, match="INJECTED"):
        cache.trim()
    pages = cache.allocator.books.physical
    assert len(pages.unreleased) == created and pages.num_created == 0
    assert budget.used == created * gb  # still memory: the budget keeps counting it
    cache.allocator.check_invariants()
    r = cache.alloc_reqid()  # the cache goes on with new groups
    assert cache.step({r: 100})
    fill(cache, r, 0, 100, 1)
    check(cache, r, 100, 1)
    now = cache.stats().num_created_pages
    assert budget.used == (now + created) * gb
    cache.close()
    assert be.released[-1] == now + created  # close retries them with the rest
    assert budget.used == 0 and be._fd == -1 and be._live == 0


def test_the_elastic_pool_keeps_unreleased_groups_for_a_retry():
    be, budget = RefusingHost(), vattn.Budget(None)
    pool = vattn.ElasticPool(16, (256,), "float32", 2, device="cpu", page_size=PAGE, budget=budget, grow=1,
                             backend=be)
    gb = 2 * PAGE
    ids = pool.alloc(8)  # 4 blocks a page: two page groups
    pool.free(ids)
    be.refuse = 1
    with pytest.raises(vattn.BackendError, match="INJECTED"):
        pool.trim()
    pages = pool._books.physical
    assert len(pages.unreleased) == 2 and pages.num_created == 0 and pool.stats().held_bytes == 0
    assert budget.used == 2 * gb
    pool.check_invariants()
    assert pool.alloc(4) is not None  # the pool goes on with new groups
    assert budget.used == 3 * gb
    pool.close()
    assert be.released[-1] == 3  # close retries them with the rest
    assert budget.used == 0 and be._fd == -1 and be._live == 0
