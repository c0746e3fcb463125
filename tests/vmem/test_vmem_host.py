"""The host backend really maps memory: unmapped reads fault, close gives everything back."""
from __future__ import annotations

import gc
import itertools
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import vattn
from tests.conftest import SMALL, fill, vattn_mappings
from vattn import _C


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


PRELUDE = """
import vattn
c = vattn.KVCache(num_layers=1, num_kv_heads=1, head_dim=16, max_batch_size=2, max_context_len=1024,
                  dtype="float32", device="cpu", page_size=4096, prefetch=False)
r = c.alloc_reqid()
assert c.step({r: 64})   # 64 tokens * 64 B = one 4 KiB page
c.k_cache(0)[r, :64] = 1.0
print("mapped ok", float(c.k_cache(0)[r, :64].sum()), flush=True)
"""


def _faulted(p: subprocess.CompletedProcess) -> bool:
    return p.returncode in (-signal.SIGSEGV, -signal.SIGBUS)


def test_reading_an_unmapped_page_faults():
    p = _run(PRELUDE + "print(float(c.k_cache(0)[r, 64].sum()))\n")
    assert "mapped ok 1024.0" in p.stdout
    assert _faulted(p), (p.returncode, p.stdout, p.stderr)


def test_reading_an_inactive_slot_faults():
    p = _run(PRELUDE + "print(float(c.k_cache(0)[1 - r, 0].sum()))\n")
    assert "mapped ok" in p.stdout and _faulted(p), (p.returncode, p.stderr)


def test_reclaimed_page_no_longer_readable_by_its_old_slot():
    # Budget of one group: the second request takes the first's page; the old address faults
    # instead of showing the new request's data.
    code = """
    import vattn
    c = vattn.KVCache(num_layers=1, num_kv_heads=1, head_dim=16, max_batch_size=2, max_context_len=1024,
                      dtype="float32", device="cpu", page_size=4096, physical_memory=2 * 4096, prefetch=False)
    a = c.alloc_reqid(); assert c.step({a: 64}); c.k_cache(0)[a, :64] = 1.0
    c.free_reqid(a)
    b = c.alloc_reqid(); assert b == a
    b2 = c.alloc_reqid()   # the other slot: must take a's page by reclamation
    res = c.step({b2: 64}); assert res and res.num_unmapped == 1, res
    c.k_cache(0)[b2, :64] = 2.0
    print("moved", flush=True)
    print(float(c.k_cache(0)[a, 0].sum()))
    """
    p = _run(code)
    assert "moved" in p.stdout and _faulted(p), (p.returncode, p.stdout, p.stderr)


def _reserved_bytes(addr: int) -> int:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return hi - lo
    return 0


@pytest.mark.parametrize("drop_tensors_first", [True, False])
def test_close_releases_physical_and_virtual_memory(drop_tensors_first):
    gc.collect()
    base = vattn_mappings()
    c = vattn.KVCache(**SMALL, device="cpu", page_size=4096)
    r = c.alloc_reqid()
    assert c.step({r: 300})
    fill(c, r, 0, 300, 1)
    c.synchronize()
    addr = c.k_cache(0).data_ptr()
    maps, fds = vattn_mappings()
    assert maps > base[0] and fds > base[1]
    assert _reserved_bytes(addr) > 0
    k = c.k_cache(0)
    if drop_tensors_first:
        del k
    c.close()
    assert vattn_mappings() == base  # every page unmapped, every memfd closed
    if drop_tensors_first:
        assert _reserved_bytes(addr) == 0  # the address space is gone too
    else:
        assert _reserved_bytes(addr) > 0  # still reserved (PROT_NONE) while a tensor views it
        del k
        gc.collect()
        assert _reserved_bytes(addr) == 0


def test_forgotten_cache_is_released_by_gc():
    gc.collect()
    base = vattn_mappings()
    c = vattn.KVCache(**SMALL, device="cpu", page_size=4096)
    r = c.alloc_reqid()
    assert c.step({r: 300})
    c.synchronize()
    del c
    gc.collect()
    assert vattn_mappings() == base


def test_map_count_limit_is_a_clear_error():
    # Interleave two slots so no two mapped pages merge into one VMA, until vm.max_map_count.
    code = """
    import vattn
    c = vattn.KVCache(num_layers=32, num_kv_heads=1, head_dim=16, max_batch_size=2, max_context_len=1 << 16,
                      dtype="float32", device="cpu", page_size=4096, prefetch=False)
    a, b = c.alloc_reqid(), c.alloc_reqid()
    n = 0
    try:
        while True:
            n += 64
            c.step({a: n, b: n})
    except vattn.MapCountLimitError as e:
        c.allocator.check_invariants()
        st = c.stats()
        print("limit", n, st.num_mapped_pages, str(e), flush=True)
    # b's pages are cached (mapped) once it is freed, and reclaimable: a keeps growing, and
    # once the mappings left under the limit are spent (how many depends on what else the
    # process maps) its steps give b's pages back and succeed
    c.free_reqid(b)
    unmapped = 0
    for _ in range(64):
        res = c.step({a: n})
        assert res, res
        unmapped += res.num_unmapped
        if unmapped:
            break
        n += 64
    assert unmapped > 0, "a grew by 64 pages without reclaiming b's"
    c.allocator.check_invariants()
    c.close()
    print("closed", flush=True)
    """
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    if limit > 300_000:
        pytest.skip(f"vm.max_map_count={limit} is too high to reach quickly")
    p = _run(code)
    assert p.returncode == 0, p.stderr
    assert "limit" in p.stdout and "vm.max_map_count" in p.stdout and "closed" in p.stdout, p.stdout


def test_dlpack_export_checks_bounds():
    rng = _C.host_reserve(1 << 16)
    with pytest.raises(ValueError, match="past the end"):
        rng.dlpack(0, (1 << 16,), (1,), 2, 32)
    with pytest.raises(ValueError, match="negative"):
        rng.dlpack(0, (-1,), (1,), 2, 32)
    with pytest.raises(ValueError, match="same length"):
        rng.dlpack(0, (4, 4), (1,), 2, 32)
    cap = rng.dlpack(0, (16,), (1,), 2, 32)
    del cap  # an unused capsule frees its export


def test_cuda_load_without_driver_is_an_oserror():
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("a GPU driver is present")
    with pytest.raises(OSError, match="libcuda"):
        _C.cuda_load()


def test_sizes_that_overflow_are_refused():
    with pytest.raises(OverflowError):
        _C.host_reserve(2**64 + 4096)
    rng = _C.host_reserve(1 << 16)
    with pytest.raises(OverflowError):
        rng.dlpack(-8, (2,), (1,), 2, 32)
    with pytest.raises(ValueError, match="past the end"):
        rng.dlpack(0, (2**62 + 1,), (4,), 2, 32)  # the bounds arithmetic would wrap
    with pytest.raises(vattn.OutOfVirtualMemoryError):
        vattn.KVCache(num_layers=1, num_kv_heads=1, head_dim=1024, max_batch_size=2**31,
                      max_context_len=2**21 + 1, dtype="float32", device="cpu", page_size=4096)


def test_dlpack_export_of_any_owner_views_the_same_memory():
    # The exporter the CUDA backend uses (for any owner with .addr and .size), on a host range.
    import torch

    from vattn.vmem import dlpack

    with vattn.KVCache(**SMALL, device="cpu", page_size=4096) as c:
        r = c.alloc_reqid()
        assert c.step({r: 64})
        k = c.k_cache(0)
        offset = k.data_ptr() - c._range.addr
        view = torch.from_dlpack(dlpack.to_capsule(c._range, offset, k.shape, k.stride(), 2, 32, dlpack.KDL_CPU, 0))
        view[r, :64] = 5.0
        assert view.data_ptr() == k.data_ptr() and float(k[r, :64].sum()) == 5.0 * 64 * 2 * 16
        with pytest.raises(ValueError, match="past the end"):
            dlpack.to_capsule(c._range, c._range.size - 4, (2,), (1,), 2, 32, dlpack.KDL_CPU, 0)
        del view


def test_close_while_another_thread_steps():
    import threading

    gc.collect()
    base = vattn_mappings()
    c = vattn.KVCache(**SMALL, device="cpu", page_size=4096)
    r = c.alloc_reqid()
    outcome = []
    stepping = threading.Event()

    def stepper():
        n = 0
        try:
            for i in itertools.count():
                n = n % 500 + 7
                c.step({r: n})
                if i == 50:  # well into stepping (mapping and unmapping): close now
                    stepping.set()
        except vattn.ClosedError:
            outcome.append("closed")
        except Exception as e:  # pragma: no cover - reported by the assert
            outcome.append(e)
        finally:
            stepping.set()

    t = threading.Thread(target=stepper)
    t.start()
    assert stepping.wait(30)
    c.close()
    t.join(timeout=30)
    assert outcome == ["closed"]
    assert vattn_mappings() == base  # nothing a late step mapped survived close


def test_range_keepalive_goes_before_the_range():
    rng = _C.host_reserve(1 << 16)
    addr = rng.addr
    assert rng.keepalive is None
    seen = []

    class Owner:  # stands for the cache's owner, whose finalizer unmaps the pages
        def __del__(self):
            seen.append(_reserved_bytes(addr))

    rng.keepalive = Owner()
    assert isinstance(rng.keepalive, Owner)
    del rng
    assert seen and seen[0] >= 1 << 16  # the owner ran while the range was still reserved
    assert _reserved_bytes(addr) == 0


def test_range_keepalive_can_be_reset_and_cycles_are_collected():
    rng = _C.host_reserve(1 << 16)
    rng.keepalive = [1]
    rng.keepalive = None
    assert rng.keepalive is None
    rng.keepalive = 5
    del rng.keepalive
    assert rng.keepalive is None

    seen = []

    class Owner:
        def __del__(self):
            seen.append(_reserved_bytes(addr))

    owner = Owner()
    owner.rng, addr = rng, rng.addr  # owner -> range -> owner: only the collector frees it
    rng.keepalive = owner
    del owner, rng
    gc.collect()
    assert seen and seen[0] >= 1 << 16
    assert _reserved_bytes(addr) == 0


def _vma_flags(lo: int, hi: int) -> list[set[str]]:
    """VmFlags of every mapping overlapping [lo, hi) (/proc/self/smaps)."""
    flags, inside = [], False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and head == "VmFlags:":
                flags.append(set(line.split()[1:]))
    return flags


def test_every_host_mapping_is_kept_out_of_forked_children():
    # MADV_DONTFORK ("dc") on the reservation, on mapped pages and on pages unmapped again.
    # 128 B a token: 320 tokens fill the budget of 10 page groups
    with vattn.KVCache(**SMALL, device="cpu", page_size=4096, prefetch=False, physical_memory=10 * 4 * 4096) as c:
        lo = c._range.addr
        hi = lo + c._range.size
        r = c.alloc_reqid()
        assert c.step({r: 320})
        c.free_reqid(r)
        assert c.alloc_reqid() == r  # the warm slot keeps its pages; the next one must take them
        assert c.step({c.alloc_reqid(): 100}).num_unmapped == 4
        flags = _vma_flags(lo, hi)
        assert len(flags) > 3 and all("dc" in f for f in flags), flags


def test_forked_child_cannot_read_the_cache():
    code = PRELUDE + """
import ctypes, os, signal
c.k_cache(0)[r, :64] = 7.0
addr = c.k_cache(0)[r].data_ptr()
pid = os.fork()
if pid == 0:
    os.write(1, f"child read {ctypes.c_float.from_address(addr).value}\\n".encode())
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited", flush=True)
print("parent", float(c.k_cache(0)[r, :64].sum()), flush=True)
"""
    p = _run(code)
    assert p.returncode == 0, p.stderr
    assert f"child {int(signal.SIGSEGV)}" in p.stdout and "child read" not in p.stdout, p.stdout
    assert "parent 7168.0" in p.stdout, p.stdout


class _Owner:
    """A reservation as the CUDA paths hand it to dlpack.to_capsule (.addr, .size)."""

    def __init__(self) -> None:
        self.rng = _C.host_reserve(1 << 16)
        self.addr, self.size = self.rng.addr, self.rng.size


def _export(owner, code: int = 2):
    from vattn.vmem import dlpack

    return dlpack.to_capsule(owner, 0, (4,), (1,), code, 32, dlpack.KDL_CPU, 0)


def test_unconsumed_dlpack_capsule_lets_go_of_its_owner():
    import weakref

    owner = _Owner()
    gone = weakref.ref(owner)
    cap = _export(owner)
    del owner, cap
    assert gone() is None


def test_dlpack_owner_goes_when_torch_refuses_the_capsule():
    import torch
    import weakref

    owner = _Owner()
    gone = weakref.ref(owner)
    with pytest.raises(Exception, match="Unsupported code"):
        torch.from_dlpack(_export(owner, code=99))  # no such DLPack type: torch raises before using it
    del owner
    assert gone() is None


def test_view_freed_while_an_exception_is_raised():
    # The tensor dies during unwinding, with the IndexError pending: the deleter must run
    # (the owner goes) and keep the IndexError.
    import torch
    import weakref

    owner = _Owner()
    gone = weakref.ref(owner)
    with pytest.raises(IndexError):
        torch.from_dlpack(_export(owner))[100]
    del owner
    assert gone() is None
