"""The CUDA backend's driver-call sequence, checked on the CPU with a recording driver.

This does not test the GPU (tests/vmem/test_gpu.py does, with the `gpu` marker); it checks what
vattn asks of the driver: one cuMemSetAccess per contiguous run, atomic maps, errors that
name the call and the CUresult, and no leaked handles when cuMemCreate runs out of memory.
"""
from __future__ import annotations

import enum
import threading
from array import array
from types import SimpleNamespace

import pytest

import vattn
from tests.conftest import REPO
from vattn.vmem.cuda import CudaBackend

GRAN = 2 << 20


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_CONTEXT = 201


CTX = [0x1000, 0x2000]  # the primary contexts of devices 0 and 1 (ints, like int(CUcontext))


class FakeDriver:
    """Just enough of cuda.bindings.driver, with a model of reserved/mapped memory."""

    CUresult = CUresult
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)

    def __init__(self, fail: dict[str, int] | None = None, max_handles: int = 1 << 30) -> None:
        self.calls: list[tuple] = []
        self.fail = dict(fail or {})  # call name -> fail on the n-th call (1-based)
        self.max_handles = max_handles
        self.handles: set[int] = set()
        self.mapped: dict[int, int] = {}  # page address -> handle
        self.access: set[int] = set()
        self.next_handle = 100
        self.tls = threading.local()  # the current context, per thread

    @staticmethod
    def CUmemAllocationProp():
        return SimpleNamespace(type=0, location=SimpleNamespace(type=0, id=-1))

    @staticmethod
    def CUmemAccessDesc():
        return SimpleNamespace(location=SimpleNamespace(type=0, id=-1), flags=0)

    def _rec(self, name, *args):
        self.calls.append((name, *args))
        n = sum(c[0] == name for c in self.calls)
        return self.fail.get(name) == n

    def _vmm(self, name, *args, fail=CUresult.CUDA_ERROR_INVALID_VALUE) -> int:
        """Record a VMM call; the error it must return: `fail` when injected, INVALID_CONTEXT
        when the device's context is not current on this thread (vattn must make it so)."""
        if self._rec(name, *args):
            return fail
        return CUresult.CUDA_ERROR_INVALID_CONTEXT if self.current() != CTX[0] else 0

    def current(self) -> int:
        return getattr(self.tls, "ctx", 0)

    def cuInit(self, flags):
        if self._rec("cuInit", flags):
            return (CUresult.CUDA_ERROR_NO_DEVICE,)
        return (CUresult.CUDA_SUCCESS,)

    def cuDeviceGet(self, i):
        self._rec("cuDeviceGet", i)
        return CUresult.CUDA_SUCCESS, i

    def cuDevicePrimaryCtxRetain(self, dev):
        self._rec("cuDevicePrimaryCtxRetain", dev)
        return CUresult.CUDA_SUCCESS, CTX[dev]

    def cuCtxGetCurrent(self):
        return CUresult.CUDA_SUCCESS, self.current()

    def cuCtxSetCurrent(self, ctx):
        assert int(ctx) in (0, *CTX)
        self.tls.ctx = int(ctx)
        return (CUresult.CUDA_SUCCESS,)

    def cuGetErrorName(self, code):
        return CUresult.CUDA_SUCCESS, CUresult(code).name.encode()

    def cuMemGetAllocationGranularity(self, prop, flag):
        assert prop.location.type == 1 and prop.type == 1 and self.current() == CTX[0]
        return CUresult.CUDA_SUCCESS, GRAN

    def cuMemAddressReserve(self, size, align, addr, flags):
        if err := self._vmm("cuMemAddressReserve", size, align):
            return err, 0
        return CUresult.CUDA_SUCCESS, 1 << 40

    def cuMemAddressFree(self, ptr, size):
        if err := self._vmm("cuMemAddressFree", ptr, size):
            return (err,)
        if any(ptr <= p < ptr + size for p in self.mapped):  # pages still mapped in it
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemCreate(self, size, prop, flags):
        if err := self._vmm("cuMemCreate", size, fail=CUresult.CUDA_ERROR_OUT_OF_MEMORY):
            return err, 0
        if len(self.handles) >= self.max_handles:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, 0
        self.next_handle += 1
        self.handles.add(self.next_handle)
        return CUresult.CUDA_SUCCESS, self.next_handle

    def cuMemRelease(self, h):
        if err := self._vmm("cuMemRelease", h):
            return (err,)
        self.handles.remove(h)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemMap(self, ptr, size, offset, h, flags):
        if err := self._vmm("cuMemMap", ptr, size, h):
            return (err,)
        if ptr in self.mapped or h not in self.handles:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        assert size == GRAN and offset == 0
        self.mapped[ptr] = h
        return (CUresult.CUDA_SUCCESS,)

    def cuMemSetAccess(self, ptr, size, descs, count):
        err = self._vmm("cuMemSetAccess", ptr, size)
        assert count == 1 and descs[0].flags == 3 and descs[0].location.id == 0
        pages = range(ptr, ptr + size, GRAN)
        if err or not all(p in self.mapped for p in pages):
            return (err or CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.access.update(pages)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemUnmap(self, ptr, size):
        if err := self._vmm("cuMemUnmap", ptr, size):
            return (err,)
        for p in range(ptr, ptr + size, GRAN):
            if p not in self.mapped:
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            del self.mapped[p]
            self.access.discard(p)
        return (CUresult.CUDA_SUCCESS,)


def _backend(**kw) -> tuple[CudaBackend, FakeDriver]:
    drv = FakeDriver(**kw)
    return CudaBackend(0, "cuda-python", driver_module=drv, host_memory=True), drv


def test_granularity_and_page_size_check():
    be, _ = _backend()
    assert be.granularity == be.default_page_size == GRAN
    be.check_page_size(4 * GRAN)
    with pytest.raises(vattn.InvalidConfigError, match=r"granularity 2097152.*fused"):
        be.check_page_size(256 << 10)


def test_map_sets_access_once_per_contiguous_run():
    be, drv = _backend()
    groups = be.create(4, 2, GRAN)  # 4 groups x 2 buffers
    assert len(drv.handles) == 8 and all(len(g) == 2 for g in groups)
    bases = [1 << 40, (1 << 40) + (1 << 36)]
    offsets = [0, GRAN, 2 * GRAN, 10 * GRAN]  # a run of 3 and a single page
    drv.calls.clear()
    be.map(bases, offsets, groups, GRAN)
    maps = [c for c in drv.calls if c[0] == "cuMemMap"]
    access = [c for c in drv.calls if c[0] == "cuMemSetAccess"]
    assert len(maps) == 8
    assert [(p, s) for _, p, s in access] == [
        (bases[0], 3 * GRAN), (bases[0] + 10 * GRAN, GRAN), (bases[1], 3 * GRAN), (bases[1] + 10 * GRAN, GRAN)]
    # page b of group i is handle groups[i][b]
    assert drv.mapped[bases[1] + 10 * GRAN] == groups[3][1]
    assert len(drv.access) == 8
    be.unmap(bases, offsets, GRAN)
    unmaps = [c for c in drv.calls if c[0] == "cuMemUnmap"]
    assert len(unmaps) == 4 and not drv.mapped  # one cuMemUnmap per run per buffer
    be.release(groups)
    assert not drv.handles
    assert (be.num_pages_mapped, be.num_pages_unmapped, be.num_pages_created) == (4, 4, 4)


def test_failed_map_is_undone_and_names_the_call():
    be, drv = _backend(fail={"cuMemMap": 5})
    groups = be.create(3, 2, GRAN)
    with pytest.raises(vattn.BackendError, match=r"cuMemMap failed with CUDA_ERROR_INVALID_VALUE \(1\)") as e:
        be.map([1 << 40, 1 << 41], [0, GRAN, 2 * GRAN], groups, GRAN)
    assert e.value.call == "cuMemMap" and e.value.code == 1
    assert not drv.mapped and not drv.access  # atomic: nothing stays mapped
    assert be.num_pages_mapped == 0


def test_failed_set_access_is_undone():
    be, drv = _backend(fail={"cuMemSetAccess": 2})
    groups = be.create(2, 2, GRAN)
    with pytest.raises(vattn.BackendError, match="cuMemSetAccess"):
        be.map([1 << 40, 1 << 41], [0, 4 * GRAN], groups, GRAN)
    assert not drv.mapped


def test_out_of_device_memory_is_catchable_and_leaks_nothing():
    be, drv = _backend(max_handles=5)
    with pytest.raises(vattn.OutOfPhysicalMemoryError, match="cuMemCreate"):
        be.create(3, 2, GRAN)  # needs 6 handles
    assert not drv.handles  # the 5 created were released


def test_reserve_and_free_range():
    be, drv = _backend()
    rng = be.reserve(8 * GRAN, GRAN)
    assert rng.addr == 1 << 40 and rng.size == 8 * GRAN
    assert ("cuMemAddressReserve", 8 * GRAN, GRAN) in drv.calls
    del rng
    assert ("cuMemAddressFree", 1 << 40, 8 * GRAN) in drv.calls


def test_unknown_driver_name():
    with pytest.raises(vattn.InvalidConfigError, match="cuda_driver"):
        CudaBackend(0, driver="nvml", driver_module=FakeDriver(), host_memory=True)
    with pytest.raises(vattn.InvalidConfigError, match="cuda_driver"):
        vattn.KVCache(num_layers=1, num_kv_heads=1, head_dim=8, max_batch_size=1, max_context_len=8, cuda_driver="x")


def test_array_inputs_are_accepted():
    be, drv = _backend()
    groups = be.create(1, 1, GRAN)
    be.map(array("Q", [1 << 40]), array("Q", [0]), groups, GRAN)
    assert drv.mapped == {1 << 40: groups[0][0]}


def test_range_drops_keepalive_before_it_is_freed():
    be, drv = _backend()
    rng = be.reserve(8 * GRAN, GRAN)

    class Owner:  # its finalizer would unmap the pages: the range must still be reserved
        def __del__(self):
            drv.calls.append(("owner",))

    rng.keepalive = Owner()
    del rng
    names = [c[0] for c in drv.calls]
    assert names.index("owner") < names.index("cuMemAddressFree")


def test_calls_leave_the_callers_context_current():
    be, drv = _backend()
    for before in (CTX[1], 0):  # another device's context (multi-GPU), or none (a new thread)
        drv.cuCtxSetCurrent(before)
        rng = be.reserve(8 * GRAN, GRAN)
        groups = be.create(2, 1, GRAN)
        be.map([rng.addr], [0, GRAN], groups, GRAN)
        assert drv.current() == before
        be.unmap([rng.addr], [0, GRAN], GRAN)
        be.release(groups)
        del rng
        assert drv.current() == before
    assert not drv.handles and not drv.mapped


def test_range_dropped_with_pages_mapped_warns_and_is_not_freed():
    be, drv = _backend()
    rng = be.reserve(8 * GRAN, GRAN)
    be.map([rng.addr], [0], be.create(1, 1, GRAN), GRAN)
    with pytest.warns(RuntimeWarning, match=r"cuMemAddressFree failed with CUDA_ERROR_INVALID_VALUE .*still mapped"):
        del rng


class _NoLibcuda(FakeDriver):
    """cuda-python installed, but it cannot find libcuda (cuda-pathfinder raises on first use)."""

    class DynamicLibNotFoundError(RuntimeError):
        pass

    def cuInit(self, flags):
        raise self.DynamicLibNotFoundError("Failure finding libcuda.so: no candidate found")


def test_cuda_python_without_libcuda_is_a_vattn_error():
    with pytest.raises(vattn.InvalidConfigError, match=r"cuda-python cannot load the CUDA driver "
                                                        r"\(DynamicLibNotFoundError: Failure finding libcuda"):
        CudaBackend(0, "cuda-python", driver_module=_NoLibcuda(), host_memory=True)


def test_cuinit_failure_is_a_vattn_error(fake_cuda):
    fake_cuda.set_fail("cuInit", 1, int(CUresult.CUDA_ERROR_NO_DEVICE))
    with pytest.raises(vattn.BackendError, match=r"cuInit failed with CUDA_ERROR_NO_DEVICE \(100\).*nvidia-smi"):
        CudaBackend(0, "cext", libcuda=fake_cuda.path, host_memory=True)
    with pytest.raises(vattn.BackendError, match=r"cuInit failed with CUDA_ERROR_NO_DEVICE \(100\)"):
        CudaBackend(0, "cuda-python", driver_module=FakeDriver(fail={"cuInit": 1}), host_memory=True)


def test_missing_libcuda_is_a_vattn_error(tmp_path):
    with pytest.raises(vattn.InvalidConfigError, match=r"cannot load .*libcuda.so.1.*install the NVIDIA driver"):
        CudaBackend(0, "cext", libcuda=str(tmp_path / "libcuda.so.1"), host_memory=True)


def test_auto_falls_back_to_cuda_python(fake_cuda):
    fake_cuda.set_fail("cuInit", 1, int(CUresult.CUDA_ERROR_NO_DEVICE))
    be = CudaBackend(0, "auto", libcuda=fake_cuda.path, driver_module=FakeDriver(), host_memory=True)
    assert be.drv.name == "cuda-python" and be.granularity == GRAN
    fake_cuda.reset()
    assert CudaBackend(0, "auto", libcuda=fake_cuda.path, driver_module=FakeDriver(), host_memory=True).drv.name == "cext"


def test_auto_with_both_paths_failing_names_both(tmp_path):
    with pytest.raises(vattn.InvalidConfigError) as e:
        CudaBackend(0, "auto", libcuda=str(tmp_path / "libcuda.so.1"), driver_module=_NoLibcuda(), host_memory=True)
    msg = str(e.value)
    assert "C extension: the CUDA driver cannot be loaded" in msg and "cuda-python: cuda-python cannot load" in msg


# The cuda-python path through the real bindings (cuda.bindings.driver, where installed: the GPU
# image has cuda-bindings 13.x) on tests/fake_cuda: their types, return tuples and enums are what
# _PyDriver expects, with a failure injected into each kind of call. A child process: the
# bindings load libcuda.so.1 by name (cuda-pathfinder), here the fake, through LD_LIBRARY_PATH.
_BINDINGS_CHILD = r"""
import sys, warnings
import vattn
from cuda.bindings import driver
from tests import fake_cuda as F
from tests.conftest import new_cache
from tests.vmem.test_fake_cuda import _workload
from vattn.vmem.cuda import CudaBackend

fake = F.FakeCuda(sys.argv[1])
assert fake.lib.cuInit(0) == 0
F.load = lambda: fake  # new_cache("fakecuda") on the cuda-python path
F.FakeCuda.backend = lambda self, device_index=0: CudaBackend(device_index, "cuda-python", host_memory=True)
be = fake.backend()
assert be.drv.name == "cuda-python" and be.drv.d is driver and be.granularity == 64 << 10
assert fake.calls("cuMemGetAllocationGranularity") == 1, "the bindings did not load the fake"
cases = [(None, 0, 0, None), ("cuMemCreate", 2, 2, None), ("cuMemCreate", 2, 999, vattn.BackendError),
         ("cuMemMap", 3, 999, vattn.BackendError), ("cuMemSetAccess", 5, 999, vattn.BackendError),
         ("cuCtxGetCurrent", 9, 999, vattn.BackendError)]
for call, ordinal, code, error in cases:
    fake.reset()
    cache = new_cache("fakecuda", page_size=4096, max_context_len=512, physical_memory=12 * 4 * 4 * 4096,
                      background=False)
    if call:
        fake.set_fail(call, fake.calls(call) + ordinal, code)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        errors = _workload(cache, steps=60, seed=3)
    errors += [cache.allocator.worker_error] if cache.allocator.worker_error else []
    if error is None:
        assert not errors, (call, errors)
    else:
        assert len(errors) == 1 and isinstance(errors[0], error) and errors[0].call == call, (call, errors)
        assert f"{call} failed with CUDA_ERROR_UNKNOWN (999)" in str(errors[0]), str(errors[0])
    assert fake.current_context() == 0  # each call's context was put back
    cache.close()
    fake.assert_clean()
print("ok", len(cases))
"""


def test_cuda_python_bindings_on_the_fake_driver(fake_cuda, tmp_path):
    pytest.importorskip("cuda.bindings.driver")
    import os
    import subprocess
    import sys

    root = str(REPO)
    env = {**os.environ, "LD_LIBRARY_PATH": os.path.dirname(fake_cuda.path), "PYTHONPATH": root,
           "CUDA_VISIBLE_DEVICES": ""}  # torch, if it looks, must not take the fake for a GPU
    p = subprocess.run([sys.executable, "-c", _BINDINGS_CHILD, fake_cuda.path], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok 6", p.stdout[-3000:] + p.stderr[-3000:]
