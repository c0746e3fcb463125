"""CUDA backend: the driver's virtual memory management API, in PyTorch's context.

reserve  = cuMemAddressReserve              (virtual only, never moves)
create   = cuMemCreate, one handle per page per buffer, from a pool made ahead of time
map      = cuMemMap + cuMemSetAccess        (one SetAccess per contiguous run per buffer)
unmap    = cuMemUnmap                       (the range stays reserved)
close    = cuMemRelease / cuMemAddressFree
scratch  = one handle of one page, mapped (cuMemMap + cuMemSetAccess) at every page that
           holds no real page; a map first unmaps the scratch there (the caller waited for
           the kernels that may read it), an unmap maps it back

Two drivers with one interface: the C extension (`vattn._C`, dlopen of libcuda.so.1 or of
a given path, one call per batch without the GIL) and `cuda-python` (`cuda.bindings.driver`).
With `cuda_driver="auto"` vattn takes the extension and falls back to cuda-python. Every call
runs in the device's primary context, the one PyTorch uses, made current on the calling
thread for the call only (the pre-mapping worker is another thread): the caller's own
context is current again afterwards, so `torch.cuda.current_device()` never changes.

Ordering against kernels: `fence()` records a CUDA event on the current stream; the
allocator records one at the start of every `step` for the slots the previous iteration
used, and `wait()`s on a slot's event before unmapping any of its pages, so a page is
never unmapped under a kernel that may still read it. The event covers the current stream
of the thread that calls `step`: an engine that reads the cache on other streams must
make the current stream wait for them before `step`.

Tensors are DLPack views made by `vattn._C.dlpack`, on both paths (see `dlpack.py`).
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from array import array
from typing import Any, Iterator, NamedTuple, Sequence

import torch

from vattn.config import CUDA_DRIVERS
from vattn.errors import (
    BackendError,
    InvalidConfigError,
    OutOfPhysicalMemoryError,
    OutOfVirtualMemoryError,
    VattnError,
)
from vattn.vmem import dlpack
from vattn.vmem.base import Backend, runs

CUDA_ERROR_OUT_OF_MEMORY = 2


def _raise(call: str, code: int, name: str) -> None:
    if code == CUDA_ERROR_OUT_OF_MEMORY and call == "cuMemCreate":
        raise OutOfPhysicalMemoryError(
            f"cuMemCreate failed with {name} ({code}): the GPU has no memory for more pages; "
            "lower physical_memory or free GPU memory")
    if code == CUDA_ERROR_OUT_OF_MEMORY and call == "cuMemAddressReserve":
        raise OutOfVirtualMemoryError(
            f"cuMemAddressReserve failed with {name} ({code}): lower max_batch_size or max_context_len")
    raise BackendError(call, code, name)


class _CextDriver:
    """The driver calls through vattn._C (dlopen of `libcuda`, default libcuda.so.1)."""

    name = "cext"

    def __init__(self, dev: int, libcuda: str | None = None) -> None:
        try:
            from vattn import _C
        except ImportError as e:
            raise InvalidConfigError(
                f"the C extension vattn._C cannot be imported ({e}); reinstall vattn with a C compiler "
                "(pip install -e .)") from None
        self._C, self.dev = _C, dev
        try:
            self.d = _C.cuda_load(libcuda)
        except OSError as e:
            raise InvalidConfigError(
                f"the CUDA driver cannot be loaded: {e}; install the NVIDIA driver, or use device='cpu'") from None
        except _C.DriverError as e:
            call, code, name = e.args
            raise BackendError(call, code, name, "the CUDA driver is installed but does not start; check that "
                               "nvidia-smi sees the GPU, or use device='cpu'") from None

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except self._C.DriverError as e:
            _raise(*e.args)

    def granularity(self) -> int:
        return self._call(self.d.granularity, self.dev)

    def reserve(self, size: int, align: int) -> Any:
        return self._call(self.d.reserve, size, align, self.dev)

    def create(self, n: int, size: int) -> list[int]:
        return self._call(self.d.create, n, size, self.dev)

    def release(self, handles: Sequence[int]) -> None:
        self._call(self.d.release, array("Q", handles), self.dev)

    def map(self, bases: array, offsets: array, handles: Sequence[int], page: int) -> None:
        self._call(self.d.map, bases, offsets, array("Q", handles), page, self.dev)

    def unmap(self, bases: array, offsets: array, page: int) -> None:
        self._call(self.d.unmap, bases, offsets, page, self.dev)


class _PyRange:
    """A reserved device range; freed when the last tensor (or owner) lets go.

    `keepalive`: one object kept alive by the range and dropped first when the range goes,
    while it is still reserved (an owner whose finalizer unmaps the pages), as on `_C.Range`.
    """

    def __init__(self, drv: _PyDriver, addr: int, size: int) -> None:
        self._drv, self.addr, self.size = drv, addr, size
        self.keepalive: Any = None

    def __del__(self) -> None:
        self.keepalive = None  # the owner unmaps first; the range is freed after
        try:
            self._drv.free_range(self.addr, self.size)
        except Exception as e:  # never freed with pages behind it: it leaks, loudly
            if not sys.is_finalizing():  # at exit the driver frees it with the context
                warnings.warn(f"vattn: {e} for a CUDA range of {self.size} bytes at {self.addr:#x}; its address "
                              "space leaks (were pages still mapped in it?)", RuntimeWarning, stacklevel=2)


class _PyDriver:
    """The driver calls through cuda-python (`cuda.bindings.driver`). `driver` may be any
    module with the same API (the tests check the call sequence with a recording one)."""

    name = "cuda-python"

    def __init__(self, dev: int, driver: Any = None) -> None:
        if driver is None:
            try:
                from cuda.bindings import driver
            except ImportError:
                try:
                    from cuda import cuda as driver  # cuda-python < 12.8
                except ImportError:
                    raise InvalidConfigError(
                        "the cuda-python path needs `pip install cuda-python` (or build vattn's C "
                        "extension and use cuda_driver='cext')") from None
        self.d, self.dev = driver, dev
        self._ok = driver.CUresult.CUDA_SUCCESS
        try:
            ret = driver.cuInit(0)  # cuda-python loads libcuda here (cuda-pathfinder)
        except Exception as e:  # DynamicLibNotFoundError, RuntimeError, OSError, ...
            raise InvalidConfigError(
                f"cuda-python cannot load the CUDA driver ({type(e).__name__}: {e}); install the NVIDIA "
                "driver, or use device='cpu'") from None
        self._check("cuInit", ret)
        _, cudev = self._check("cuDeviceGet", driver.cuDeviceGet(dev))
        _, self._ctx = self._check("cuDevicePrimaryCtxRetain", driver.cuDevicePrimaryCtxRetain(cudev))
        self._prop = driver.CUmemAllocationProp()
        self._prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = dev
        self._access = driver.CUmemAccessDesc()
        self._access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = dev
        self._access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE

    def _check(self, call: str, ret: Any) -> tuple:
        ret = ret if isinstance(ret, tuple) else (ret,)
        if ret[0] != self._ok:
            code = int(ret[0])
            err, name = self.d.cuGetErrorName(ret[0])
            _raise(call, code, name.decode() if isinstance(name, bytes) else str(name))
        return ret

    @contextlib.contextmanager
    def _in_ctx(self) -> Iterator[None]:
        """The device's primary context current on this thread for the block; the caller's after."""
        prev = self._check("cuCtxGetCurrent", self.d.cuCtxGetCurrent())[1]
        if int(prev) == int(self._ctx):
            yield
            return
        self._check("cuCtxSetCurrent", self.d.cuCtxSetCurrent(self._ctx))
        try:
            yield
        finally:
            self.d.cuCtxSetCurrent(prev)  # never fails the call: the books follow what was done

    def granularity(self) -> int:
        flag = self.d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        with self._in_ctx():
            ret = self.d.cuMemGetAllocationGranularity(self._prop, flag)
        return int(self._check("cuMemGetAllocationGranularity", ret)[1])

    def reserve(self, size: int, align: int) -> _PyRange:
        with self._in_ctx():
            ptr = self._check("cuMemAddressReserve", self.d.cuMemAddressReserve(size, align, 0, 0))[1]
        return _PyRange(self, int(ptr), size)

    def free_range(self, addr: int, size: int) -> None:
        with self._in_ctx():
            self._check("cuMemAddressFree", self.d.cuMemAddressFree(addr, size))

    def create(self, n: int, size: int) -> list[int]:
        handles: list[Any] = []
        with self._in_ctx():
            try:
                for _ in range(n):
                    handles.append(self._check("cuMemCreate", self.d.cuMemCreate(size, self._prop, 0))[1])
            except BaseException:
                for h in handles:
                    self.d.cuMemRelease(h)
                raise
        return [int(h) for h in handles]

    def release(self, handles: Sequence[int]) -> None:
        with self._in_ctx():
            rets = [self.d.cuMemRelease(h) for h in handles]  # release all, then report the first error
        for ret in rets:
            self._check("cuMemRelease", ret)

    def map(self, bases: array, offsets: array, handles: Sequence[int], page: int) -> None:
        nb, done = len(bases), []
        with self._in_ctx():
            try:
                for b, base in enumerate(bases):
                    for i, off in enumerate(offsets):
                        self._check("cuMemMap", self.d.cuMemMap(base + off, page, 0, handles[i * nb + b], 0))
                        done.append(base + off)
                    for i, k in runs(offsets, page):  # one SetAccess per contiguous run
                        self._check("cuMemSetAccess",
                                    self.d.cuMemSetAccess(base + offsets[i], k * page, [self._access], 1))
            except BaseException:  # atomic: undo what this call mapped
                for addr in done:
                    self.d.cuMemUnmap(addr, page)
                raise

    def unmap(self, bases: array, offsets: array, page: int) -> None:
        with self._in_ctx():
            for base in bases:
                for i, k in runs(offsets, page):
                    self._check("cuMemUnmap", self.d.cuMemUnmap(base + offsets[i], k * page))


class CudaScratch(NamedTuple):
    """The scratch page: one handle of `page` bytes, mapped at every page no real page backs."""

    handle: int
    page: int


class CudaBackend(Backend):
    """CUDA driver VMM backend. A page group is `num_buffers` handles of `page_size` bytes.

    `driver`: "cext" (vattn._C), "cuda-python", or "auto": the extension, then cuda-python
    when the extension cannot load the driver (the environment variable VATTN_CUDA_DRIVER
    picks one for "auto"). The other arguments are seams for tests and unusual installs:
    - `libcuda`: the driver library the extension loads (default: libcuda.so.1 from the
      loader's search path; the tests pass tests/fake_cuda's library);
    - `driver_module`: what the cuda-python path uses instead of `cuda.bindings.driver`;
    - `host_memory=True`: the driver's memory is host memory (the tests' fake drivers).
      torch.cuda is not touched, views are CPU tensors, fences are no-ops and there is no
      default budget. Build the cache with `KVCache(backend=..., device="cpu")`.
    """

    def __init__(self, device_index: int = 0, driver: str = "auto", *, libcuda: str | None = None,
                 driver_module: Any = None, host_memory: bool = False) -> None:
        super().__init__()
        if driver not in CUDA_DRIVERS:
            raise InvalidConfigError(f"cuda_driver must be one of {CUDA_DRIVERS}, got {driver!r}")
        if not host_memory:
            if not torch.cuda.is_available():
                raise InvalidConfigError(
                    "device='cuda' needs a CUDA GPU and driver, and torch.cuda.is_available() is False; "
                    "use device='cpu' for the host backend")
            if not 0 <= device_index < torch.cuda.device_count():
                raise InvalidConfigError(f"no CUDA device {device_index}; this machine has {torch.cuda.device_count()}")
            torch.cuda.init()
            torch.zeros(1, device=torch.device("cuda", device_index))  # PyTorch's primary context exists now
        self.index = device_index
        self.host_memory = host_memory
        self.device = torch.device("cpu") if host_memory else torch.device("cuda", device_index)
        self.drv = self._open(driver, libcuda, driver_module)
        self.granularity = self.drv.granularity()
        self.default_page_size = self.granularity
        self._unbacked: set[int] = set()  # addresses a failed scratch map left reserved-only

    def _open(self, driver: str, libcuda: str | None, module: Any) -> _CextDriver | _PyDriver:
        driver = os.environ.get("VATTN_CUDA_DRIVER", driver) if driver == "auto" else driver
        if driver == "cuda-python":
            return _PyDriver(self.index, module)
        try:
            return _CextDriver(self.index, libcuda)
        except VattnError as e:
            if driver == "cext":
                raise
            cext_error = e
        try:
            return _PyDriver(self.index, module)
        except VattnError as e:
            raise InvalidConfigError(
                f"neither CUDA driver path works. The C extension: {cext_error}. cuda-python: {e}") from None

    def check_page_size(self, page_size: int) -> None:
        if page_size % self.granularity:
            raise InvalidConfigError(
                f"page_size {page_size} is not a multiple of this GPU's granularity {self.granularity} "
                f"({self.granularity >> 20} MiB on stock drivers); use {self.granularity} or a multiple, and "
                "layout='fused' to put fewer tokens of one request in each page")

    def reserve(self, nbytes: int, alignment: int) -> Any:
        # pages are multiples of the granularity; the driver wants a power-of-two alignment
        return self.drv.reserve(nbytes, self.granularity)

    def tensor(self, rng, offset, shape, strides, dtype) -> torch.Tensor:
        code, bits = self.dlpack_type(dtype)
        device = (dlpack.KDL_CPU, 0) if self.host_memory else (dlpack.KDL_CUDA, self.index)
        return torch.from_dlpack(dlpack.to_capsule(rng, offset, shape, strides, code, bits, *device))

    def _create(self, n: int, num_buffers: int, page_size: int) -> list[tuple[int, ...]]:
        flat = self.drv.create(n * num_buffers, page_size)
        return [tuple(flat[i * num_buffers:(i + 1) * num_buffers]) for i in range(n)]

    def _release(self, groups: list[tuple[int, ...]]) -> None:
        self.drv.release([h for grp in groups for h in grp])

    def _map(self, bases: array, offsets: array, groups: list[tuple[int, ...]], page_size: int) -> None:
        self.drv.map(bases, offsets, [h for grp in groups for h in grp], page_size)

    def _unmap(self, bases: array, offsets: array, page_size: int) -> None:
        if self._unbacked:  # rare: skip the pages a failed scratch map left with nothing mapped
            addrs = [b + o for b in bases for o in offsets]
            if not self._unbacked.isdisjoint(addrs):
                for a in addrs:
                    if a not in self._unbacked:
                        self.drv.unmap(array("Q", [a]), array("Q", [0]), page_size)
                self._unbacked.difference_update(addrs)
                return
        self.drv.unmap(bases, offsets, page_size)

    # -- scratch backing: one page mapped at many addresses -------------------------------
    def _create_scratch(self, page_size: int, num_pages: int) -> CudaScratch:
        return CudaScratch(self.drv.create(1, page_size)[0], page_size)

    def scratch_size(self, scratch: CudaScratch) -> int:
        return scratch.page

    def _release_scratch(self, scratch: CudaScratch) -> None:
        self.drv.release([scratch.handle])

    def _map_scratch(self, bases: array, offsets: array, page_size: int, scratch: CudaScratch) -> None:
        self.drv.map(bases, offsets, [scratch.handle] * (len(bases) * len(offsets)), page_size)

    def _holes(self, bases: array, offsets: array) -> None:
        self._unbacked.update(b + o for b in bases for o in offsets)

    def fence(self) -> Any:
        if self.host_memory:  # no device work to wait for
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, fence: Any) -> None:
        fence.synchronize()

    def free_memory(self) -> int | None:
        return None if self.host_memory else torch.cuda.mem_get_info(self.device)[0]
