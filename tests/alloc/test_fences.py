"""Ordering against device work: a page is unmapped only after the fence of the last
iteration that may read it. The host has no asynchronous work, so a host backend that
hands out numbered fences and logs its calls shows the order the allocator keeps."""
from __future__ import annotations

import pytest

from tests import fake_cuda
from vattn.allocator import Coordinator, KindSpec
from vattn.config import CacheConfig, Geometry
from vattn.vmem.cuda import CudaBackend
from vattn.vmem.host import HostBackend


class Logging:
    """Numbered fences and a log of fence / wait / unmap, over a real backend."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple] = []
        self.n = 0

    def fence(self) -> int:
        self.n += 1
        self.log.append(("fence", self.n))
        return self.n

    def wait(self, fence: int) -> None:
        self.log.append(("wait", fence))

    def _unmap(self, bases, offsets, page_size) -> None:
        self.log.append(("unmap", len(offsets)))
        super()._unmap(bases, offsets, page_size)


class LoggingHost(Logging, HostBackend):
    pass


class LoggingCuda(Logging, CudaBackend):
    pass


@pytest.fixture
def allocator(device):
    """make(max_pages) -> (Coordinator, its logging backend): 64 tokens a page on every device."""
    made = []

    def make(max_pages: int) -> tuple[Coordinator, Logging]:
        if device == "cpu":
            be = LoggingHost()
        elif device == "fakecuda":
            be = LoggingCuda(0, "cext", libcuda=fake_cuda.load().path, host_memory=True)
        else:
            be = LoggingCuda(0)
        page = max(4096, be.granularity)
        cfg = CacheConfig(num_layers=1, num_kv_heads=page // 4096, head_dim=16, max_batch_size=3,
                          max_context_len=512, dtype="float32")
        g = Geometry(cfg, page)  # 64 B a token per head: 64 tokens a page
        rng = be.reserve(g.buffer_bytes * g.num_buffers, page)
        bases = [rng.addr + b * g.buffer_bytes for b in range(g.num_buffers)]
        a = Coordinator(be, [KindSpec("full", g, bases)], num_slots=cfg.max_batch_size, max_len=cfg.max_context_len,
                        max_bytes=max_pages * g.group_bytes, background=False, prefetch=False)
        made.append((a, rng))
        return a, be

    yield make
    for a, _ in made:
        a.close()
    made.clear()  # the ranges go now, after their pages


def test_freed_slot_is_unmapped_after_its_last_iteration_fence(allocator):
    a_, be = allocator(max_pages=4)
    a, b = a_.alloc_reqid(), a_.alloc_reqid()
    assert a_.step({a: 192, b: 64})  # a: 3 pages, b: 1 page; iteration 1 reads both
    a_.free_reqid(a)  # a finished after iteration 1
    be.log.clear()
    assert a_.step({b: 256})  # b needs 3 more: taken from a, which iteration 1 may still read
    fence = be.log[0]
    assert fence[0] == "fence"
    assert be.log.index(("wait", fence[1])) < be.log.index(("unmap", 3))
    a_.check_invariants()
    a_.close()
    a_.close()


def test_pre_mapped_tail_of_a_running_request_waits_too(allocator):
    a_, be = allocator(max_pages=3)
    a, b = a_.alloc_reqid(), a_.alloc_reqid()
    assert a_.step({a: 64})
    a_.free_reqid(a)
    a2 = a_.alloc_reqid()  # gets a's slot back with its page, holding no token yet
    assert a2 == a
    be.log.clear()
    assert a_.step({b: 192})  # takes a2's untouched page: still after the fence
    fence = be.log[0][1]
    assert ("wait", fence) in be.log and be.log.index(("wait", fence)) < be.log.index(("unmap", 1))
    a_.close()


def test_parked_slot_waits_for_work_enqueued_before_park(allocator):
    """`swap_out` enqueues an asynchronous copy out of the slot, then parks it: the slot
    need not have run in the last iteration (the request the scheduler swaps out is often
    one the failed step could not back), yet its pages must outlive that copy."""
    a_, be = allocator(max_pages=4)
    a, b = a_.alloc_reqid(), a_.alloc_reqid()
    assert a_.step({a: 192})  # only a runs: b holds no page yet
    assert a_.step({a: 192, b: 64})
    a_.books.ran.pop(a)  # as if a's last step had failed: its slot did not run
    be.log.clear()
    slot, _ = a_.park(a)  # the copy out of a's pages is enqueued before this
    park_fence = be.log[0]
    assert park_fence[0] == "fence" and a_.books.last_fence[slot] == park_fence[1]
    be.log.clear()
    assert a_.step({b: 256})  # b takes a's parked pages: only after the copy finished
    assert be.log.index(("wait", park_fence[1])) < be.log.index(("unmap", 3))
    a_.check_invariants()
