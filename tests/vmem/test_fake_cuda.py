"""The CUDA backend's C path against tests/fake_cuda, a strict fake driver with host memory.

First the fake itself: it refuses what the real driver refuses (and what vattn promises
never to do), with real CUresult codes, and counts it. Then vattn on it: contexts, threads,
the range's lifetime, and a failure injected into each driver call.
"""
from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import textwrap
import threading
import warnings
from array import array

import pytest

import vattn
from tests.conftest import REPO, check, fill, new_cache
from tests.fake_cuda import RawDriver

ROOT = str(REPO)

KB = 1 << 10
INVALID_VALUE, OUT_OF_MEMORY, NOT_INITIALIZED, INVALID_CONTEXT = 1, 2, 3, 201
ALREADY_MAPPED, ILLEGAL_STATE = 208, 401


@pytest.fixture
def make(fake_cuda):
    """new_cache on "fakecuda"; closed after the test."""
    made: list[vattn.KVCache] = []

    def make(**kw) -> vattn.KVCache:
        made.append(new_cache("fakecuda", **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.fixture
def drv(fake_cuda) -> RawDriver:
    fake_cuda.set_current(0)
    return RawDriver(fake_cuda)


# ---------------------------------------------------------------- the fake's rules ----

def test_fake_enforces_the_vmm_rules(fake_cuda, drv):
    g = drv.gran
    rc, base = drv.reserve(8 * g, g)
    assert rc == 0 and base % g == 0
    assert drv.reserve(8 * g + 4096)[0] == INVALID_VALUE  # size not a multiple of the granularity
    rc, h = drv.create(g)
    assert rc == 0
    assert drv.create(g + 4096)[0] == INVALID_VALUE
    assert drv.map(base + 4096, g, h) == INVALID_VALUE  # unaligned address
    assert drv.map(base + 8 * g, g, h) == INVALID_VALUE  # outside the reservation
    assert drv.map(base, g, h, offset=g) == INVALID_VALUE  # a handle is mapped whole
    assert drv.map(base, g, h) == 0
    assert drv.map(base, g, h) == ALREADY_MAPPED  # over a mapping
    rc, h2 = drv.create(g)
    assert drv.map(base + g, g, h2) == 0
    assert drv.set_access(base, g // 2) == INVALID_VALUE  # part of a mapping
    assert drv.set_access(base, 3 * g) == INVALID_VALUE  # past the mappings
    assert drv.set_access(base, 2 * g) == 0  # two whole mappings: fine
    assert drv.release(h) == ILLEGAL_STATE  # still mapped (vattn's rule)
    assert drv.free(base, 8 * g) == ILLEGAL_STATE  # pages still mapped in it
    assert drv.unmap(base, g // 2) == INVALID_VALUE
    assert drv.unmap(base, 2 * g) == 0
    assert drv.unmap(base, g) == INVALID_VALUE  # not mapped any more
    assert drv.release(h) == 0 and drv.release(h2) == 0
    assert drv.release(h) == INVALID_VALUE  # double release
    assert drv.free(base, 4 * g) == INVALID_VALUE  # not the whole reservation
    assert drv.free(base, 8 * g) == 0
    assert drv.free(base, 8 * g) == INVALID_VALUE
    assert fake_cuda.num_violations == 15
    assert any("double" in v or "already released" in v for v in fake_cuda.violations())
    fake_cuda.reset()


def test_fake_maps_one_handle_at_several_addresses_as_the_driver_does(fake_cuda, drv):
    # what the scratch backing needs: the same physical memory behind many addresses
    import ctypes

    g = drv.gran
    rc, base = drv.reserve(4 * g, g)
    rc2, h = drv.create(g)
    assert rc == rc2 == 0
    for i in (0, 2, 3):
        assert drv.map(base + i * g, g, h) == 0
    assert drv.set_access(base, g) == 0 and drv.set_access(base + 2 * g, 2 * g) == 0  # a run of two mappings
    ctypes.memset(base + 2 * g + 100, 42, 1)
    assert ctypes.string_at(base + 100, 1) == ctypes.string_at(base + 3 * g + 100, 1) == b"\x2a"
    assert drv.release(h) == ILLEGAL_STATE  # still mapped (vattn's rule)
    assert drv.unmap(base + 2 * g, 2 * g) == 0
    assert ctypes.string_at(base + 100, 1) == b"\x2a"  # the other mapping keeps it
    assert drv.unmap(base, g) == 0 and drv.release(h) == 0 and drv.free(base, 4 * g) == 0
    assert fake_cuda.num_violations == 1
    fake_cuda.reset()


def test_fake_needs_a_current_context(fake_cuda, drv):
    fake_cuda.set_current(None)
    assert drv.reserve(drv.gran)[0] == INVALID_CONTEXT
    assert drv.create(drv.gran)[0] == INVALID_CONTEXT
    assert fake_cuda.num_violations == 2 and "no current context" in fake_cuda.violations()[0]
    fake_cuda.reset()
    errors = []
    t = threading.Thread(target=lambda: errors.append(drv.create(drv.gran)[0]))  # contexts are per thread
    fake_cuda.set_current(0)
    t.start()
    t.join()
    assert errors == [INVALID_CONTEXT]
    fake_cuda.reset()


def test_fake_memory_cap_and_injected_failures(fake_cuda, drv):
    g = drv.gran
    fake_cuda.set_memory_limit(2 * g)
    rc1, h1 = drv.create(g)
    rc2, h2 = drv.create(g)
    assert (rc1, rc2) == (0, 0) and drv.create(g)[0] == OUT_OF_MEMORY  # not a violation
    assert drv.release(h1) == 0 and drv.release(h2) == 0
    fake_cuda.set_fail("cuMemCreate", fake_cuda.calls("cuMemCreate") + 2, 77)
    rc, h = drv.create(g)
    assert rc == 0 and drv.create(g)[0] == 77 and drv.release(h) == 0
    with pytest.raises(ValueError):
        fake_cuda.set_fail("cuMemFree", 1)
    assert fake_cuda.num_violations == 0


def test_fake_granularity_is_settable_while_nothing_lives(fake_cuda, drv):
    rc, h = drv.create(drv.gran)
    with pytest.raises(ValueError):
        fake_cuda.set_granularity(2 << 20)
    assert drv.release(h) == 0
    fake_cuda.set_granularity(2 << 20)
    try:
        assert fake_cuda.backend().granularity == 2 << 20
        assert drv.create(drv.gran)[0] == INVALID_VALUE  # 64 KiB is no multiple of 2 MiB now
    finally:
        fake_cuda.set_granularity(64 * KB)
    fake_cuda.reset()


def test_fake_rules_before_init_access_and_environment(fake_cuda):
    # A fresh process: a call before cuInit, failures injected through the environment, and
    # a page that is mapped but not accessible yet (reading it faults).
    code = textwrap.dedent(f"""
        import ctypes
        from tests.fake_cuda import FakeCuda, RawDriver
        fake = FakeCuda({fake_cuda.path!r})
        drv = RawDriver(fake)
        print("before init", drv.create(drv.gran)[0], fake.num_violations, flush=True)
        fake.lib.cuInit(0)
        fake.set_current(0)
        print("injected", drv.create(drv.gran)[0], drv.create(drv.gran)[0], flush=True)
        rc, base = drv.reserve(drv.gran)
        rc, h = drv.create(drv.gran)
        print("mapped", drv.map(base, drv.gran, h), flush=True)
        print("read", ctypes.c_int.from_address(base).value, flush=True)
    """)
    env = {**os.environ, "VATTN_FAKE_CUDA_FAIL": "cuMemCreate:3:2"}  # the 3rd cuMemCreate: OUT_OF_MEMORY
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert f"before init {NOT_INITIALIZED} 1" in p.stdout, (p.stdout, p.stderr)
    assert f"injected 0 {OUT_OF_MEMORY}" in p.stdout, p.stdout
    assert "mapped 0" in p.stdout and "read" not in p.stdout and p.returncode < 0, (p.returncode, p.stdout, p.stderr)


# ------------------------------------------------------------- vattn on the fake ----

def _in_thread(fn, *args):
    """Run fn on a new thread (no context current there); its exception or None."""
    out = []

    def run():
        try:
            fn(*args)
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out[0]


def test_every_call_leaves_the_callers_context_current(fake_cuda):
    for start in (1, None):  # another device's context (multi-GPU), or none (a new thread)
        fake_cuda.set_current(start)
        before = fake_cuda.current_context()
        be = fake_cuda.backend()  # cuda_load and cuMemGetAllocationGranularity
        g = be.granularity
        rng = be.reserve(4 * g, g)
        groups = be.create(2, 2, g)
        be.map([rng.addr, rng.addr + 2 * g], [0, g], groups, g)
        assert fake_cuda.current_context() == before
        be.unmap([rng.addr, rng.addr + 2 * g], [0, g], g)
        be.release(groups)
        del rng  # cuMemAddressFree in the range's dealloc
        assert fake_cuda.current_context() == before
        assert fake_cuda.calls("cuCtxSetCurrent") > 0
    assert fake_cuda.num_reservations == 0


def test_release_and_close_on_a_thread_without_a_context(fake_cuda, make):
    be = fake_cuda.backend()
    groups = be.create(2, 2, be.granularity)
    assert _in_thread(be.release, groups) is None
    # A cache closed by another thread (the GC's finalizer, vattn-close): its pages are
    # created but not mapped, so close() only releases them.
    cache = make(page_size=4 * KB, prefetch=False)
    assert cache.reserve_physical(4 * cache.geometry.group_bytes) == 4
    assert _in_thread(cache.close) is None
    assert fake_cuda.num_handles == 0 and fake_cuda.num_violations == 0


def test_range_owner_unmaps_before_the_range_is_freed(fake_cuda):
    be = fake_cuda.backend()
    g = be.granularity
    rng = be.reserve(4 * g, g)
    groups = be.create(1, 1, g)
    be.map([rng.addr], [g], groups, g)

    class Owner:  # what the cache's owner does: unmap, then the range may go
        def __del__(self):
            be.unmap([addr], [g], g)
            be.release(groups)

    addr = rng.addr
    rng.keepalive = Owner()
    del rng
    assert fake_cuda.num_reservations == 0 and fake_cuda.num_mappings == 0


def test_range_dropped_with_pages_mapped_warns_and_keeps_its_address_space(fake_cuda, drv):
    be = fake_cuda.backend()
    g = be.granularity
    rng = be.reserve(4 * g, g)
    addr = rng.addr
    groups = be.create(1, 1, g)
    be.map([addr], [0], groups, g)
    with pytest.warns(RuntimeWarning, match=r"cuMemAddressFree failed with CUDA_ERROR_ILLEGAL_STATE .*still mapped"):
        del rng
        gc.collect()
    assert fake_cuda.num_reservations == 1  # never freed with a page behind it
    be.unmap([addr], [0], g)
    be.release(groups)
    assert drv.free(addr, 4 * g) == 0
    fake_cuda.reset()  # the refused cuMemAddressFree was counted


def test_cache_tensors_are_host_views_of_the_fake(fake_cuda, make):
    handles, mappings, _ = fake_cuda.live()
    cache = make(page_size=64 * KB)
    assert cache.k_cache(0).device.type == "cpu" and cache.backend.drv.name == "cext"
    r = cache.alloc_reqid()
    assert cache.step({r: 100})
    fill(cache, r, 0, 100, 1)
    check(cache, r, 100, 1)
    cache.synchronize()
    assert fake_cuda.num_mappings - mappings == cache.geometry.num_buffers * cache.stats().num_mapped_pages
    cache.close()
    assert fake_cuda.live()[:2] == (handles, mappings)


@pytest.mark.parametrize("background", [False, True])
def test_zero_reused_pages_clears_memory_new_from_the_driver(fake_cuda, make, background):
    """CUDA promises no zeros in new memory (the fake fills it with 0xff: NaN in every float
    type). With zero_reused_pages (the engine's setting for FlashAttention 4, whose tiles read
    the rows after a context) no row a request did not write holds anything but zeros, be its
    page new from the driver or an earlier request's; without it, new memory shows through."""
    fake_cuda.set_fill(0xFF)
    try:
        for zero in (False, True):
            cache = make(page_size=64 * KB, zero_reused_pages=zero, prefetch=False, background=background)
            r = cache.alloc_reqid()
            assert cache.step({r: 10})
            fill(cache, r, 0, 10, 1)
            check(cache, r, 10, 1)
            cache.synchronize()
            tpp = cache.page_size // cache.geometry.token_bytes
            rows = cache.k_cache(0)[r, 10:tpp]  # after the context, to its page's end
            assert rows.isnan().all().item() is not zero, (zero, rows.isnan().float().mean())
            if zero:
                assert (rows == 0).all()
                cache.free_reqid(r)  # an earlier request's page: cleared for the next one too
                r2 = cache.alloc_reqid()
                assert cache.step({r2: 3})
                cache.synchronize()
                assert (cache.k_cache(0)[r2, :tpp] == 0).all()
            cache.close()
    finally:
        fake_cuda.set_fill(None)


def _workload(cache, steps: int, seed: int) -> list[Exception]:
    """alloc / step / free at random; errors from the driver are caught, then the books and
    every request's data are checked and the run goes on. Returns the errors."""
    rng = random.Random(seed)
    lens: dict[int, int] = {}
    tags: dict[int, int] = {}
    errors = []
    for i in range(steps):
        if lens and rng.random() < 0.15:
            s = rng.choice(sorted(lens))
            cache.free_reqid(s)
            del lens[s], tags[s]
        if cache.num_free_reqids and rng.random() < 0.4:
            s = cache.alloc_reqid()
            lens[s], tags[s] = 0, i + 1
        new = {s: min(n + (rng.randint(1, 200) if n == 0 else 9), cache.config.max_context_len) for s, n in lens.items()}
        try:
            res = cache.step(new)
        except (vattn.BackendError, vattn.OutOfPhysicalMemoryError) as e:
            errors.append(e)
            res = None
        cache.allocator.check_invariants()
        if res is not None:
            for s in res.failed:
                cache.free_reqid(s)
                del lens[s], tags[s]
                new.pop(s)
            for s, n in new.items():
                fill(cache, s, lens[s], n, tags[s])
                lens[s] = n
        for s, n in lens.items():
            check(cache, s, n, tags[s])
    return errors


@pytest.mark.parametrize("call, ordinal, code, error", [
    ("cuMemCreate", 2, 999, vattn.BackendError),
    ("cuMemCreate", 2, OUT_OF_MEMORY, None),  # a shortage: step refuses requests, raises nothing
    ("cuMemMap", 3, 999, vattn.BackendError),
    ("cuMemMap", 30, 999, vattn.BackendError),
    ("cuMemSetAccess", 5, 999, vattn.BackendError),
    ("cuCtxGetCurrent", 9, 999, vattn.BackendError),  # the context switch itself
])
def test_a_failing_driver_call_keeps_the_books_and_leaks_nothing(fake_cuda, make, call, ordinal, code, error):
    # Pre-mapping is on (synchronous, so the run is deterministic): a failure there is the
    # allocator's worker_error, and step maps on demand.
    cache = make(page_size=4 * KB, max_context_len=512, physical_memory=12 * 4 * 4 * KB, background=False)
    fake_cuda.set_fail(call, fake_cuda.calls(call) + ordinal, code)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "background pre-mapping failed"
        errors = _workload(cache, steps=60, seed=3)
    errors += [cache.allocator.worker_error] if cache.allocator.worker_error else []
    if error is None:
        assert not errors
    else:
        assert len(errors) == 1 and isinstance(errors[0], error) and errors[0].call == call, errors
    cache.close()  # the fixture checks: nothing live, no rule broken (the undo paths included)


@pytest.mark.parametrize("code, error", [(OUT_OF_MEMORY, vattn.OutOfVirtualMemoryError), (999, vattn.BackendError)])
def test_failing_reserve_is_a_vattn_error(fake_cuda, code, error):
    fake_cuda.set_fail("cuMemAddressReserve", 1, code)
    with pytest.raises(error, match="cuMemAddressReserve"):
        new_cache("fakecuda")


def test_array_of_handles_is_released_once(fake_cuda):
    # release() hands every handle back and reports the first error: a double release is caught.
    be = fake_cuda.backend()
    groups = be.create(2, 1, be.granularity)
    be.release(groups)
    with pytest.raises(vattn.BackendError, match=r"cuMemRelease failed with CUDA_ERROR_INVALID_VALUE"):
        be.release(groups[:1])
    assert fake_cuda.num_violations == 1
    fake_cuda.reset()


def test_extension_loads_the_fake_beside_the_default_driver(fake_cuda):
    from vattn import _C

    d = _C.cuda_load(fake_cuda.path)
    assert isinstance(d, _C.CudaDriver) and d.path == fake_cuda.path
    assert d.granularity(0) == 64 * KB
    with pytest.raises(_C.DriverError) as e:
        d.create(1, 4 * KB, 0)  # not a multiple of the granularity
    assert e.value.args == ("cuMemCreate", INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE")
    fake_cuda.reset()
    with pytest.raises(_C.DriverError):
        d.reserve(64 * KB, 0, 7)  # the fake has two devices
    with pytest.raises(TypeError):
        d.release(array("i", [1]), 0)
