"""The scratch backing (`Backend.create_scratch`, `map_scratch`, and `map` / `unmap` with
`scratch`): a page that holds no real page reads and writes without a fault, a real page
replaces the scratch and gives way to it again, and a failure leaves every page backed. On
the host backend and on the CUDA backend over tests/fake_cuda's strict driver (whose
fixture fails the test on any broken driver rule or anything left live)."""
from __future__ import annotations

import warnings

import pytest
import torch

import vattn
from vattn import MapCountLimitError
from vattn.errors import BackendError
from vattn.vmem import host
from vattn.vmem.host import HostBackend, HostGroup

N = 8  # pages of each of the two buffers


@pytest.fixture(params=["host", "fakecuda"])
def backend(request):
    if request.param == "host":
        be = HostBackend()
    else:
        be = request.getfixturevalue("fake_cuda").backend()
    yield be
    be.close()


def _setup(be):
    """A reservation of two buffers of N pages, wholly on scratch: (P, range, bases, views, scratch)."""
    P = max(64 << 10, be.granularity)
    rng = be.reserve(2 * N * P, P)
    bases = [rng.addr, rng.addr + N * P]
    views = [be.tensor(rng, b * N * P, (N * P,), (1,), torch.uint8) for b in range(2)]
    scratch = be.create_scratch(P, 2 * N)
    be.map_scratch(bases, [p * P for p in range(N)], P, scratch)
    return P, rng, bases, views, scratch


def _teardown(be, P, bases, groups, scratch):
    be.unmap(bases, [p * P for p in range(N)], P)  # every page, real and scratch
    be.release(groups)
    be.release_scratch(scratch)
    assert be.scratch_bytes == 0


def test_free_pages_read_and_write_and_real_pages_replace_the_scratch(backend):
    be = backend
    P, rng, bases, views, scratch = _setup(be)
    for v in views:
        v.fill_(1)  # no page is real yet: every byte is scratch
    created = be.num_pages_created
    groups = be.create(2, 2, P)
    be.map(bases, [1 * P, 3 * P], groups, P, scratch)
    for b, v in enumerate(views):
        v[P:2 * P].fill_(10 + b)
        v[3 * P:4 * P].fill_(20 + b)
    for v in views:  # write every scratch page, around the real ones
        for p in (0, 2, 4, 5, 6, 7):
            v[p * P:(p + 1) * P].fill_(5)
    for b, v in enumerate(views):
        assert torch.all(v[P:2 * P] == 10 + b) and torch.all(v[3 * P:4 * P] == 20 + b)
    be.unmap(bases, [1 * P], P, scratch)  # page 1 gives way to the scratch again
    for b, v in enumerate(views):
        v[P:2 * P].fill_(9)  # no fault
        assert torch.all(v[3 * P:4 * P] == 20 + b)  # the other real page is untouched
    be.map(bases, [1 * P], groups[:1], P, scratch)  # and back: the group kept its data
    for b, v in enumerate(views):
        assert torch.all(v[P:2 * P] == 10 + b)
    # the scratch is no page: counted apart from the page counters
    assert be.num_pages_created - created == 2 and be.scratch_bytes >= P
    assert be.num_scratch_calls >= 2 and be.num_map_calls >= 2
    _teardown(be, P, bases, groups, scratch)


def test_a_failed_map_over_the_scratch_leaves_the_scratch(backend, request):
    be = backend
    P, rng, bases, views, scratch = _setup(be)
    if isinstance(be, HostBackend):
        bad = [HostGroup(-1, 0, P, P, 2)]  # mmap of fd -1: EBADF
    else:
        fake = request.getfixturevalue("fake_cuda")
        fake.set_fail("cuMemMap", fake.calls("cuMemMap") + 1)
        bad = be.create(1, 2, P)
    with pytest.raises(BackendError):
        be.map(bases, [2 * P], bad, P, scratch)
    for v in views:
        v.fill_(3)  # every page still backed
        assert torch.all(v == 3)
    _teardown(be, P, bases, [] if isinstance(be, HostBackend) else bad, scratch)


def test_a_failed_scratch_map_warns_and_the_page_is_skipped_later(fake_cuda):
    be = fake_cuda.backend()
    P, rng, bases, views, scratch = _setup(be)
    groups = be.create(1, 2, P)
    be.map(bases, [2 * P], groups, P, scratch)
    fake_cuda.set_fail("cuMemMap", fake_cuda.calls("cuMemMap") + 1)  # the scratch's map back fails
    with pytest.warns(RuntimeWarning, match="reading them faults"):
        be.unmap(bases, [2 * P], P, scratch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        be.map(bases, [2 * P], groups, P, scratch)  # nothing to unmap first there: no broken rule
        be.unmap(bases, [2 * P], P, scratch)
        views[0][2 * P:3 * P].fill_(1)
    _teardown(be, P, bases, groups, scratch)
    be.close()


def _scratch_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(host.SCRATCH_NAME in line for line in f)


def test_host_scratch_runs_merge_into_few_mappings(monkeypatch):
    # a scratch run of 4 pages: the 64 pages of a buffer take 16 mappings, not 64, and a page
    # that goes back to the scratch merges with its neighbours again
    monkeypatch.setattr(host, "SCRATCH_BYTES", 4 * 4096)
    be = HostBackend()
    P, pages = 4096, 64
    rng = be.reserve(pages * P, P)
    before = _scratch_mappings()
    scratch = be.create_scratch(P, pages)
    assert scratch.num_pages == 4 and be.scratch_bytes == 4 * P
    be.map_scratch([rng.addr], [p * P for p in range(pages)], P, scratch)
    windows = pages // 4 + (rng.addr // P % 4 != 0)  # the runs are aligned to addresses, not to the range
    assert _scratch_mappings() - before == windows
    groups = be.create(1, 1, P)
    mid = next(p for p in range(4, 8) if (rng.addr // P + p) % 4 == 1)  # inside a window, not at its edge
    be.map([rng.addr], [P * mid], groups, P, scratch)  # the window splits in two
    assert _scratch_mappings() - before == windows + 1
    be.unmap([rng.addr], [P * mid], P, scratch)
    assert _scratch_mappings() - before == windows  # merged back
    be.unmap([rng.addr], [p * P for p in range(pages)], P)
    be.release(groups)
    be.release_scratch(scratch)
    assert _scratch_mappings() == before
    be.close()


def test_host_scratch_at_the_map_count_limit_leaves_the_page_unbacked_with_a_warning(monkeypatch):
    be = HostBackend()
    P = 4096
    rng = be.reserve(4 * P, P)
    scratch = be.create_scratch(P, 4)
    be.map_scratch([rng.addr], [p * P for p in range(4)], P, scratch)
    groups = be.create(1, 1, P)
    be.map([rng.addr], [P], groups, P, scratch)

    def at_the_limit(*a):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(host._C, "host_scratch", at_the_limit)
    with pytest.warns(RuntimeWarning, match="reading them faults"):
        be.unmap([rng.addr], [P], P, scratch)  # the real page goes all the same
    monkeypatch.undo()
    with pytest.raises(MapCountLimitError, match="vm.max_map_count"):
        monkeypatch.setattr(host._C, "host_scratch", at_the_limit)
        be.map_scratch([rng.addr], [P], P, scratch)
    monkeypatch.undo()
    be.map_scratch([rng.addr], [P], P, scratch)  # below the limit again
    be.tensor(rng, 0, (4 * P,), (1,), torch.uint8).fill_(1)
    be.unmap([rng.addr], [p * P for p in range(4)], P)
    be.release(groups)
    be.release_scratch(scratch)
    be.close()


CALLS = ("cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess")


def test_driver_calls_of_a_page_turn_and_of_the_start_up_on_a_gpu(fake_cuda, monkeypatch):
    """What docs/vllm.md states the scratch costs on a GPU, counted on the strict fake driver
    through `vattn bench alloc`'s page turns: a map first unmaps the scratch page there, an
    unmap maps it back (with its access); the start-up maps it at every page (one access call
    for the run). Nothing else changes."""
    import argparse

    from vattn.bench import alloc

    def pool(args, n, page, scratch):
        return vattn.ElasticPool(n, (page,), torch.uint8, 1, page_size=page, grow=1, scratch=scratch,
                                 backend=fake_cuda.backend())

    monkeypatch.setattr(alloc, "_scratch_pool", pool)
    per: dict[bool, dict[str, int]] = {}
    for scratch in (False, True):
        before = {c: fake_cuda.calls(c) for c in CALLS}
        p = pool(None, 64, fake_cuda.backend().granularity, scratch)
        start = {c: fake_cuda.calls(c) - before[c] for c in CALLS}
        assert start == ({c: 0 for c in CALLS} if not scratch else
                         {"cuMemCreate": 1, "cuMemRelease": 0, "cuMemMap": 64, "cuMemUnmap": 0, "cuMemSetAccess": 1})
        before = {c: fake_cuda.calls(c) for c in CALLS}
        for i in range(4):
            p.free(p.take([7 * i]))
            p.trim()
        per[scratch] = {c: (fake_cuda.calls(c) - before[c]) // 4 for c in CALLS}
        p.close()
    assert per[False] == {"cuMemCreate": 1, "cuMemRelease": 1, "cuMemMap": 1, "cuMemUnmap": 1, "cuMemSetAccess": 1}
    assert per[True] == {"cuMemCreate": 1, "cuMemRelease": 1, "cuMemMap": 2, "cuMemUnmap": 2, "cuMemSetAccess": 2}
    rows = alloc.bench_scratch(argparse.Namespace(device="cpu"), [fake_cuda.backend().granularity], [1 / 64], 2)
    assert [r["scratch"] for r in rows] == [False, True]
    assert rows[1]["scratch_calls_per_turn"] == 1 and rows[1]["map_calls_per_turn"] == 1
