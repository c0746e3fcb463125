"""Reliability: memory shortages are refusals, not OOM kills; a shortage is not a new
budget; reused pages can be cleared; the map-count limit reclaims first; many threads."""
from __future__ import annotations

import os
import threading

import pytest
import torch

import vattn
from tests.conftest import SMALL, check, fill
from tests.vmem.test_vmem_host import PRELUDE, _run
from vattn.vmem import host
from vattn.vmem.host import HostBackend

KB, MB = 1 << 10, 1 << 20


class TightHost(HostBackend):
    """The host backend on a machine with `avail` bytes available (settable)."""

    def __init__(self, avail: int) -> None:
        super().__init__()
        self.avail = avail

    def free_memory(self) -> int:
        return self.avail


def test_host_default_budget_is_half_of_what_is_available():
    avail = host.available_memory()
    assert avail is not None and avail > 0
    with vattn.KVCache(**SMALL, device="cpu", page_size=64 * KB) as c:
        g = c.geometry
        assert c.allocator.max_pages == min(g.pages_per_slot * 4, int(0.5 * avail) // g.group_bytes)
    with vattn.KVCache(**SMALL, backend=TightHost(host.MIN_HEADROOM + 10 * MB), page_size=64 * KB) as c:
        assert c.allocator.max_pages * c.geometry.group_bytes <= (host.MIN_HEADROOM + 10 * MB) // 2


def test_over_large_growth_is_refused_before_any_memory_is_committed(monkeypatch):
    # A budget far beyond the machine, and a request that needs more than it has: step must
    # refuse before the memfd grows. The syscalls that commit memory are stubbed to fail the
    # test instead of endangering the machine if the check were missing.
    def forbidden(*args):
        raise AssertionError(f"memory was committed: {args}")

    monkeypatch.setattr(host.os, "posix_fallocate", forbidden)
    monkeypatch.setattr(host.os, "ftruncate", forbidden)
    avail = host.available_memory()
    tokens = 1 << 20
    with vattn.KVCache(num_layers=1, num_kv_heads=64, head_dim=128, max_batch_size=1, max_context_len=tokens,
                       dtype="float32", device="cpu", page_size=2 * MB, physical_memory=64 << 40,
                       prefetch=False) as c:
        assert c.geometry.token_bytes_all * tokens > avail  # 64 GiB: more than this machine has
        r = c.alloc_reqid()
        res = c.step({r: tokens})
        assert not res and res.failed == (r,) and res.out_of_memory
        assert c.backend.num_pages_created == 0 and c.stats().num_created_pages == 0
        c.allocator.check_invariants()


def test_refused_growth_names_what_to_lower():
    be = TightHost(host.MIN_HEADROOM + 1 * MB)
    with pytest.raises(vattn.OutOfPhysicalMemoryError, match="lower physical_memory, page_size"):
        be.create(16, 2, 64 * KB)  # 2 MiB > 1 MiB left above the headroom
    assert be._size == 0
    be.close()


@pytest.mark.parametrize("page_size, match", [
    (2**31, "over 1024 MiB"),
    (8 * MB, "larger than a whole slot"),
])
def test_page_size_is_bounded(page_size, match):
    with pytest.raises(vattn.InvalidConfigError, match=match):
        vattn.KVCache(**SMALL, device="cpu", page_size=page_size)  # a slot is 512 x 128 B = 64 KiB


def test_small_pages_up_to_2mib_are_allowed_on_small_slots():
    with vattn.KVCache(**SMALL, device="cpu", page_size=2 * MB) as c:
        r = c.alloc_reqid()
        assert c.step({r: 10})


def test_a_shortage_is_not_a_new_budget():
    group = 2 * 2 * 4 * KB  # 2 layers x K/V x 4 KiB
    be = TightHost(host.MIN_HEADROOM + 100 * MB)
    with vattn.KVCache(**SMALL, backend=be, page_size=4 * KB, physical_memory=64 * group, prefetch=False) as c:
        a = c.alloc_reqid()
        assert c.step({a: 512})  # 16 page groups, one growth chunk
        be.avail = host.MIN_HEADROOM  # the machine is full now
        b = c.alloc_reqid()
        res = c.step({a: 512, b: 512})
        assert res.failed == (b,) and res.out_of_memory
        assert c.allocator.max_pages == 64  # the budget did not shrink
        c.allocator.check_invariants()
        be.avail = host.MIN_HEADROOM + 100 * MB  # memory came back
        res = c.step({a: 512, b: 512})
        assert res and not res.out_of_memory
        assert c.reserve_physical(48 * group) == 16  # and reserve_physical does not say "raise physical_memory"


def test_background_shortage_caps_nothing():
    be = TightHost(host.MIN_HEADROOM)
    with vattn.KVCache(**SMALL, backend=be, page_size=4 * KB, physical_memory=64 * 4 * 4 * KB) as c:
        a = c.alloc_reqid()
        assert not c.step({a: 10})  # nothing can be created
        c.synchronize()
        be.avail = host.MIN_HEADROOM + 100 * MB
        assert c.step({a: 10}) and c.allocator.max_pages == 64


@pytest.mark.parametrize("reclaimed", [False, True])
def test_zero_reused_pages(reclaimed):
    # Without the option, a slot's next request reads the previous one's data where it has
    # not written yet; with it, those positions read zero (through reuse of a freed slot and
    # through pages reclaimed from another slot).
    for zero in (False, True):
        budget = dict(physical_memory=2 * 2 * 4 * KB) if reclaimed else {}
        with vattn.KVCache(**SMALL, device="cpu", page_size=4 * KB, prefetch=False, zero_reused_pages=zero,
                           **budget) as c:
            a = c.alloc_reqid()
            assert c.step({a: 32})  # one page of 32 tokens x 128 B
            fill(c, a, 0, 32, 1)
            c.free_reqid(a)
            b = c.alloc_reqid()
            if reclaimed:  # the other slot: a's page is reclaimed into it
                b = c.alloc_reqid()
                assert b != a
            res = c.step({b: 16})
            assert res and res.num_unmapped == int(reclaimed)
            k = c.k_cache(1)[b, :32]
            if zero:
                assert not k.any() and not c.v_cache(0)[b, :32].any()
            else:
                assert k.abs().sum() > 0  # a's data
            fill(c, b, 0, 16, 2)
            assert c.step({b: 17})  # what b wrote is never cleared again
            check(c, b, 16, 2)


def test_zero_reused_pages_with_background_pre_mapping():
    with vattn.KVCache(**SMALL, device="cpu", page_size=4 * KB, zero_reused_pages=True) as c:
        for rnd in range(6):
            reqs = [c.alloc_reqid() for _ in range(3)]
            lens = {r: 40 + 17 * i + rnd for i, r in enumerate(reqs)}
            assert c.step(lens)
            for r, n in lens.items():
                assert not c.k_cache(0)[r, :n].any()
                fill(c, r, 0, n, rnd + 1)
            c.synchronize()
            for r, n in lens.items():
                check(c, r, n, rnd + 1)
                c.free_reqid(r)
        c.allocator.check_invariants()


def test_concurrent_alloc_step_free_from_many_threads():
    # The contract: alloc_reqid, step (with a dict of the caller's own reqids), free_reqid,
    # stats and reserve_physical may be called from any number of threads; a request's data
    # is never touched by another thread's calls.
    errors: list[BaseException] = []
    with vattn.KVCache(**{**SMALL, "max_batch_size": 8}, device="cpu", page_size=4 * KB,
                       physical_memory=40 * 2 * 2 * 4 * KB) as c:

        def worker(tag: int) -> None:
            try:
                for it in range(40):
                    try:
                        r = c.alloc_reqid()
                    except vattn.NoFreeSlotError:
                        continue
                    n = 0
                    for _ in range(3):
                        new = n + 13 + (tag * 7 + it) % 50
                        if not c.step({r: new}):  # out of pages now: give up this request
                            break
                        fill(c, r, n, new, tag)
                        n = new
                        check(c, r, n, tag)
                    c.stats()
                    c.free_reqid(r)
            except BaseException as e:  # reported below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t + 1,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        c.allocator.check_invariants()
        assert c.num_free_reqids == 8


def test_a_view_keeps_the_memory_of_a_collected_cache_alive():
    # The cache object goes (garbage-collected) while a view lives: its pages stay mapped
    # until the view goes too, then everything is released.
    code = PRELUDE + """
import gc
from tests.conftest import vattn_mappings
k = c.k_cache(0)
del c
gc.collect()
print("sum", float(k[r, :64].sum()), flush=True)   # faults if the pages were unmapped
del k
gc.collect()
assert vattn_mappings() == (0, 0), vattn_mappings()
print("released", flush=True)
"""
    p = _run(code)
    assert p.returncode == 0, (p.returncode, p.stdout, p.stderr)
    assert "sum 1024.0" in p.stdout and "released" in p.stdout


@pytest.mark.parametrize("kw", [dict(zero_reused_pages=True), dict(background=False)])
def test_forgotten_cache_is_released_by_gc_in_every_mode(kw):
    import gc

    from tests.conftest import vattn_mappings

    gc.collect()
    base = vattn_mappings()
    c = vattn.KVCache(**SMALL, device="cpu", page_size=4096, **kw)
    r = c.alloc_reqid()
    assert c.step({r: 300})
    c.fork(r, 100)
    c.synchronize()
    del c
    gc.collect()
    assert vattn_mappings() == base


def test_zero_reused_pages_never_clears_shared_pinned_or_swapped_data():
    from vattn.prefix_cache import PrefixCache

    with vattn.KVCache(**SMALL, device="cpu", page_size=4 * KB, prefetch=False, zero_reused_pages=True) as c:
        pc = PrefixCache(c)
        a = c.alloc_reqid()
        assert c.step({a: 100})
        fill(c, a, 0, 100, 1)
        f = c.fork(a, 64)  # shares a's two whole pages
        pc.insert(a, list(range(96)))
        c.free_reqid(a)  # a's shared and pinned pages are not someone else's garbage
        b = c.alloc_reqid()
        assert pc.map_prefix(b, list(range(97))) == 96
        assert c.step({b: 100, f: 70})
        check(c, b, 96, 1)  # the cached prefix survived the clearing of reused pages
        check(c, f, 64, 1)
        h = c.swap_out(f, 64)
        g = c.alloc_reqid()  # takes f's old slot: the swap-in must copy
        assert c.step({g: 200})
        fill(c, g, 0, 200, 2)
        r = c.swap_in(h)
        assert h.copied_in and c.step({r: 65, b: 100, g: 200})
        check(c, r, 64, 1)  # the copy was not cleared afterwards
        assert not c.k_cache(0)[r, 64:65].any()  # and what lies past it reads zero
        c.allocator.check_invariants()
