"""The strict fake CUDA driver (fake_cuda.c), built once per test session.

`load()` compiles fake_cuda.c with the system C compiler into a temporary directory as
`libcuda.so.1` and returns a `FakeCuda`: the ctypes handle on the same library that vattn's
C extension loads through `_C.cuda_load(path)`, so both see one driver state. Without a
compiler it returns None (the fixtures skip).

    fake = load()
    backend = fake.backend()                       # CudaBackend(cext) on the fake, CPU views
    cache = vattn.KVCache(backend=backend, device="cpu", ...)
    fake.set_fail("cuMemMap", 3)                   # the 3rd cuMemMap since the last reset fails
    fake.assert_clean()                            # nothing live, no rule broken
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import os
import shutil
import subprocess
import tempfile

CUDA_ERROR_UNKNOWN = 999

_SOURCE = os.path.join(os.path.dirname(__file__), "fake_cuda.c")


class FakeCuda:
    """Controls and counters of the fake driver (see fake_cuda.c)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.lib = lib = ctypes.CDLL(path)
        lib.fake_cuda_set_fail.argtypes = [ctypes.c_char_p, ctypes.c_long, ctypes.c_int]
        lib.fake_cuda_calls.argtypes = [ctypes.c_char_p]
        lib.fake_cuda_calls.restype = ctypes.c_long
        lib.fake_cuda_set_memory_limit.argtypes = [ctypes.c_ulonglong]
        lib.fake_cuda_set_fill.argtypes = [ctypes.c_int]
        lib.fake_cuda_set_granularity.argtypes = [ctypes.c_ulonglong]
        lib.fake_cuda_violations.restype = ctypes.c_char_p
        for name in ("handles", "mappings", "reservations", "violations"):
            getattr(lib, f"fake_cuda_num_{name}").restype = ctypes.c_long
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxSetCurrent.argtypes = [ctypes.c_void_p]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]

    # -- controls ---------------------------------------------------------------------
    def reset(self) -> None:
        """Forget call counts, injected failures, violations, the memory cap and the fill."""
        self.lib.fake_cuda_reset()

    def set_fail(self, call: str, ordinal: int = 1, code: int = CUDA_ERROR_UNKNOWN) -> None:
        """The `ordinal`-th call of `call` counted from the last reset (1-based) returns `code`."""
        if self.lib.fake_cuda_set_fail(call.encode(), ordinal, code):
            raise ValueError(f"cannot inject a failure of {call!r} at call {ordinal}")

    def set_memory_limit(self, nbytes: int | None) -> None:
        """cuMemCreate fails with CUDA_ERROR_OUT_OF_MEMORY past `nbytes` live (None: no cap)."""
        self.lib.fake_cuda_set_memory_limit(nbytes or 0)

    def set_fill(self, byte: int | None) -> None:
        """cuMemCreate fills new memory with `byte` (None: zeros). CUDA promises no zeros:
        0xff is NaN in every float type."""
        self.lib.fake_cuda_set_fill(-1 if byte is None else byte)

    def set_granularity(self, nbytes: int) -> None:
        """The granularity (default 64 KiB); only while nothing is reserved or created."""
        if self.lib.fake_cuda_set_granularity(nbytes):
            raise ValueError(f"cannot set the granularity to {nbytes} now")

    def calls(self, call: str) -> int:
        """Calls of `call` since the last reset."""
        return self.lib.fake_cuda_calls(call.encode())

    # -- state ------------------------------------------------------------------------
    @property
    def num_handles(self) -> int:
        return self.lib.fake_cuda_num_handles()

    @property
    def num_mappings(self) -> int:
        return self.lib.fake_cuda_num_mappings()

    @property
    def num_reservations(self) -> int:
        return self.lib.fake_cuda_num_reservations()

    @property
    def num_violations(self) -> int:
        return self.lib.fake_cuda_num_violations()

    def violations(self) -> list[str]:
        return self.lib.fake_cuda_violations().decode().splitlines()

    def live(self) -> tuple[int, int, int]:
        """(handles, mappings, reservations) that exist now."""
        return self.num_handles, self.num_mappings, self.num_reservations

    def assert_clean(self, baseline: tuple[int, int, int] = (0, 0, 0)) -> None:
        """Nothing live beyond `baseline` and no rule broken since the last reset."""
        assert self.live() == baseline, f"leaked (handles, mappings, reservations): {self.live()}, before: {baseline}"
        assert self.num_violations == 0, "driver rules broken:\n" + "\n".join(self.violations())

    # -- contexts of the calling thread -------------------------------------------------
    def current_context(self) -> int:
        """The context current on this thread (0: none)."""
        ctx = ctypes.c_void_p()
        assert self.lib.cuCtxGetCurrent(ctypes.byref(ctx)) == 0
        return ctx.value or 0

    def primary_context(self, device: int) -> int:
        ctx = ctypes.c_void_p()
        assert self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) == 0
        return ctx.value

    def set_current(self, device: int | None) -> None:
        """Make `device`'s primary context current on this thread (None: no context)."""
        ctx = None if device is None else self.primary_context(device)
        assert self.lib.cuCtxSetCurrent(ctx) == 0

    # -- vattn on it --------------------------------------------------------------------
    def backend(self, device_index: int = 0):
        """vattn's CUDA backend on the extension's path, loading this library: CPU views."""
        from vattn.vmem.cuda import CudaBackend

        return CudaBackend(device_index, "cext", libcuda=self.path, host_memory=True)


class RawDriver:
    """The fake's driver API called directly through ctypes, on the calling thread (tests
    of the fake itself). Each call returns the CUresult, and the handle or address made."""

    def __init__(self, fake: FakeCuda, gran: int = 64 << 10) -> None:
        self.lib, self.gran = fake.lib, gran

    def reserve(self, size: int, align: int = 0) -> tuple[int, int]:
        p = ctypes.c_ulonglong()
        rc = self.lib.cuMemAddressReserve(ctypes.byref(p), ctypes.c_size_t(size), ctypes.c_size_t(align),
                                          ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))
        return rc, p.value

    def free(self, ptr: int, size: int) -> int:
        return self.lib.cuMemAddressFree(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))

    def create(self, size: int, device: int = 0) -> tuple[int, int]:
        prop = (ctypes.c_int * 8)(1, 0, 1, device)  # CUmemAllocationProp: pinned, on `device`
        h = ctypes.c_ulonglong()
        rc = self.lib.cuMemCreate(ctypes.byref(h), ctypes.c_size_t(size), prop, ctypes.c_ulonglong(0))
        return rc, h.value

    def release(self, h: int) -> int:
        return self.lib.cuMemRelease(ctypes.c_ulonglong(h))

    def map(self, ptr: int, size: int, h: int, offset: int = 0) -> int:
        return self.lib.cuMemMap(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size), ctypes.c_size_t(offset),
                                 ctypes.c_ulonglong(h), ctypes.c_ulonglong(0))

    def unmap(self, ptr: int, size: int) -> int:
        return self.lib.cuMemUnmap(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))

    def set_access(self, ptr: int, size: int, flags: int = 3, device: int = 0) -> int:
        desc = (ctypes.c_int * 3)(1, device, flags)  # CUmemAccessDesc: device location, flags
        return self.lib.cuMemSetAccess(ctypes.c_ulonglong(ptr), ctypes.c_size_t(size), desc, ctypes.c_size_t(1))


def build(directory: str) -> str | None:
    """Compile fake_cuda.c into `directory`/libcuda.so.1; None without a C compiler."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    path = os.path.join(directory, "libcuda.so.1")  # no -soname: never found by name
    p = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-o", path, _SOURCE, "-lpthread", "-ldl"],
                       capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{cc} failed to build the fake CUDA driver:\n{p.stderr}")
    return path


@functools.lru_cache(maxsize=None)
def load() -> FakeCuda | None:
    """The session's fake driver (built on first use), or None without a C compiler."""
    directory = tempfile.mkdtemp(prefix="vattn-fake-cuda-")
    atexit.register(shutil.rmtree, directory, True)
    path = build(directory)
    if path is None:
        return None
    fake = FakeCuda(path)
    # Touch cuInit now: the tests' contexts (set_current) need it before vattn loads the library.
    assert fake.lib.cuInit(0) == 0
    return fake
