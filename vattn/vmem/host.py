"""Host backend: real Linux virtual memory with the CUDA VMM semantics.

reserve  = mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)
create   = grow one memfd (ftruncate + fallocate: the pages exist on return), after checking
           that the host and the process's cgroup can give that much (`available_memory`)
map      = mmap(MAP_SHARED | MAP_FIXED) of the memfd at the page's address
unmap    = mmap(PROT_NONE, MAP_FIXED) over the page: reading it faults again
scratch  = mmap(MAP_SHARED | MAP_FIXED) of a scratch memfd of `run` pages: the page at
           address a maps scratch page (a // page) % run, so a run of free pages takes one
           mapping (VMA) per `run`-aligned window, and mappings side by side merge; a map or
           an unmap with scratch replaces the mapping in one mmap (never unbacked meanwhile)
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
import warnings
from array import array
from typing import NamedTuple, Sequence

import torch

from vattn import _C
from vattn.errors import (
    BackendError,
    VattnError,
    InvalidConfigError,
    MapCountLimitError,
    OutOfPhysicalMemoryError,
    OutOfVirtualMemoryError,
)
from vattn.vmem.base import Backend


class HostGroup(NamedTuple):
    """Page b (of `num_buffers`, `page` bytes each) of the group lives in memfd `fd` at
    `offset + b * stride`."""

    fd: int
    offset: int
    stride: int
    page: int
    num_buffers: int


# A growth must leave this much memory available: filling the host to the last page wakes
# the kernel's OOM killer, which kills other processes too, instead of failing our call.
MIN_HEADROOM = 256 << 20


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def _cgroup_room() -> int | None:
    """Bytes the process's memory cgroup (v2 or v1) and its ancestors can still charge:
    min over the hierarchy of limit - usage + inactive file cache (reclaimable). None
    when no limit applies or cgroups are not readable."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []  # (mount root, cgroup path, limit file, usage file, inactive-file key in memory.stat)
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            candidates.append(("/sys/fs/cgroup", path, "memory.max", "memory.current", "inactive_file"))
        elif "memory" in controllers.split(","):
            candidates.append(("/sys/fs/cgroup/memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                               "total_inactive_file"))
    room = None
    for root, path, limit_file, usage_file, inactive_key in candidates:
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):  # the process's cgroup, then each ancestor
            d = os.path.join(root, *parts[:depth])
            limit, usage = _read_int(os.path.join(d, limit_file)), _read_int(os.path.join(d, usage_file))
            if limit is None or usage is None or limit >= 1 << 60:  # no limit at this level
                continue
            inactive = 0
            try:
                with open(os.path.join(d, "memory.stat")) as f:
                    for stat in f:
                        key, _, value = stat.partition(" ")
                        if key == inactive_key:
                            inactive = int(value)
            except OSError:
                pass
            level = max(0, limit - usage + inactive)
            room = level if room is None else min(room, level)
    return room


MEMFD_NAME = "vattn-pages"  # what /proc/PID/fd shows of the memfds that hold the pages
SCRATCH_NAME = "vattn-scratch"  # the scratch memfds (never counted as pages: process_page_bytes skips them)
# A scratch run: at least SCRATCH_BYTES (pages further apart than that alias one another),
# and long enough that a whole reservation takes at most SCRATCH_MAPPINGS mappings (VMAs:
# vm.max_map_count is 65530). Its memory is taken only where something touches it.
SCRATCH_BYTES = 16 << 20
SCRATCH_MAPPINGS = 256


class HostScratch(NamedTuple):
    """A scratch memfd `fd` of `num_pages` pages of `page` bytes (see the module docstring)."""

    fd: int
    page: int
    num_pages: int


def scratch_run(num_pages: int, page_size: int) -> int:
    """Pages of the scratch run for a reservation of `num_pages` pages (see SCRATCH_BYTES)."""
    return max(1, min(num_pages, max(-(-num_pages // SCRATCH_MAPPINGS), SCRATCH_BYTES // page_size)))


def process_page_bytes(pid: int) -> int:
    """Physical bytes of the host backend's pages in process `pid` (its `vattn-pages`
    memfds' allocated blocks: released pages are punched out), read from /proc, so from
    outside vattn's books: what tests and benchmarks check the books against."""
    total = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{fd}"
        try:
            if MEMFD_NAME in os.readlink(path):
                total += os.stat(path).st_blocks * 512
        except OSError:  # closed meanwhile
            pass
    return total


def available_memory() -> int | None:
    """Bytes of memory this process may still take without pushing the host or its cgroup
    into the OOM killer: MemAvailable, bounded by the cgroup's room. None if unknown."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    room = _cgroup_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return avail


_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


def _punch_hole(fd: int, offset: int, length: int) -> None:
    """Give the memory of a released page back to the host (the file keeps its size)."""
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        e = ctypes.get_errno()
        raise BackendError("fallocate(PUNCH_HOLE)", e, errno.errorcode.get(e, "?"))


def _map_count_limit() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return None


def _num_mappings() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


class HostBackend(Backend):
    """Linux mmap/memfd backend. Page size: any multiple of the OS page size."""

    default_memory_fraction = 0.5  # of available_memory() at init: the model and the rest need memory too
    new_pages_zeroed = True  # a new memfd range (or a punched hole) reads zeros

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")
        self.granularity = mmap.PAGESIZE
        self.default_page_size = max(64 << 10, mmap.PAGESIZE)
        self._fd = -1  # one memfd per backend, grown chunk by chunk
        self._size = 0
        self._live = 0  # groups not yet released

    def check_page_size(self, page_size: int) -> None:
        if page_size % self.granularity:
            raise InvalidConfigError(
                f"page_size {page_size} is not a multiple of the OS page size {self.granularity}; "
                f"use e.g. {max(1, page_size // self.granularity) * self.granularity}")

    def reserve(self, nbytes: int, alignment: int):
        try:
            return _C.host_reserve(nbytes)
        except OverflowError:
            raise OutOfVirtualMemoryError(f"cannot reserve {nbytes} bytes of address space: too large") from None
        except OSError as e:
            raise OutOfVirtualMemoryError(
                f"cannot reserve {nbytes / 2**30:.1f} GiB of address space ({os.strerror(e.errno)}); "
                "lower max_batch_size or max_context_len") from None

    def tensor(self, rng, offset: int, shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        code, bits = self.dlpack_type(dtype)
        return torch.from_dlpack(rng.dlpack(offset, tuple(shape), tuple(strides), code, bits))

    def _create(self, n: int, num_buffers: int, page_size: int) -> list[HostGroup]:
        # A chunk is buffer-major in the file, so consecutive groups of one buffer are
        # consecutive there too and pages handed out in order merge into one VMA.
        stride = n * page_size
        nbytes = stride * num_buffers
        base = self._size
        avail = self.free_memory()
        if avail is not None and nbytes > avail - MIN_HEADROOM:  # refuse before touching memory
            raise OutOfPhysicalMemoryError(
                f"cannot create {n} page groups ({nbytes / 2**20:.1f} MiB) of host memory: only "
                f"{max(0, avail) / 2**20:.1f} MiB is available (MemAvailable and the cgroup's memory limit), "
                f"and vattn keeps {MIN_HEADROOM >> 20} MiB free; lower physical_memory, page_size or "
                "max_batch_size, or free memory")
        try:
            if self._fd < 0:
                self._fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
            os.ftruncate(self._fd, base + nbytes)
            os.posix_fallocate(self._fd, base, nbytes)  # real memory now, not a SIGBUS later
        except OSError as e:
            if self._fd >= 0:
                os.ftruncate(self._fd, base)
            if e.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
                raise OutOfPhysicalMemoryError(
                    f"cannot create {n} page groups ({nbytes / 2**20:.1f} MiB) of host memory: "
                    f"{os.strerror(e.errno)}; lower physical_memory or free memory") from None
            raise BackendError("memfd", e.errno or 0, errno.errorcode.get(e.errno or 0, "?")) from None
        self._size = base + nbytes
        self._live += n
        return [HostGroup(self._fd, base + i * page_size, stride, page_size, num_buffers) for i in range(n)]

    def free_memory(self) -> int | None:
        return available_memory()

    def _release(self, groups: list[HostGroup]) -> None:
        # The memfd (and its memory) goes when the last group is released; before that, the
        # released pages' memory goes back to the host by punching holes into the file.
        self._live -= len(groups)
        if self._live == 0:
            self.close()
            return
        for grp in groups:
            for b in range(grp.num_buffers):
                _punch_hole(grp.fd, grp.offset + b * grp.stride, grp.page)

    def _map(self, bases: array, offsets: array, groups: list[HostGroup], page_size: int) -> None:
        fds = array("i", (g.fd for g in groups))
        foffs = array("Q", (g.offset for g in groups))
        fstrides = array("Q", (g.stride for g in groups))
        try:
            _C.host_map(bases, offsets, fds, foffs, fstrides, page_size)
        except OSError as e:
            raise _mmap_error(e) from None

    def _unmap(self, bases: array, offsets: array, page_size: int) -> None:
        try:
            _C.host_unmap(bases, offsets, page_size)
        except OSError as e:
            raise BackendError("mmap(PROT_NONE)", e.errno or 0, errno.errorcode.get(e.errno or 0, "?")) from None

    # -- scratch backing ----------------------------------------------------------------
    def _create_scratch(self, page_size: int, num_pages: int) -> HostScratch:
        run = scratch_run(num_pages, page_size)
        fd = os.memfd_create(SCRATCH_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, run * page_size)  # sparse: memory only where something touches it
        except OSError as e:
            os.close(fd)
            raise BackendError("memfd", e.errno or 0, errno.errorcode.get(e.errno or 0, "?")) from None
        return HostScratch(fd, page_size, run)

    def scratch_size(self, scratch: HostScratch) -> int:
        return scratch.num_pages * scratch.page

    def _release_scratch(self, scratch: HostScratch) -> None:
        os.close(scratch.fd)  # the memory goes with the last mapping of it

    def _map_scratch(self, bases: array, offsets: array, page_size: int, scratch: HostScratch) -> None:
        try:
            _C.host_scratch(bases, offsets, page_size, scratch.fd, scratch.num_pages)
        except OSError as e:  # all or nothing: the pages it backed already are reserved-only again
            self._unmap(bases, offsets, page_size)
            raise _mmap_error(e) from None

    def _map_over_scratch(self, bases: array, offsets: array, groups: list, page_size: int,
                          scratch: HostScratch) -> None:
        try:  # MAP_FIXED replaces the scratch in place
            self._map(bases, offsets, groups, page_size)
        except BaseException:  # host_map left the pages reserved-only: scratch again
            self._rescue_scratch(bases, offsets, page_size, scratch)
            raise

    def _unmap_to_scratch(self, bases: array, offsets: array, page_size: int, scratch: HostScratch) -> None:
        try:  # the scratch replaces the page in place
            self._map_scratch(bases, offsets, page_size, scratch)
            self._count_scratch(len(offsets))
        except VattnError as e:  # at vm.max_map_count: reserved-only (the page must go all the same)
            warnings.warn(f"vattn: backing {len(offsets)} page(s) with scratch memory failed ({e}); reading "
                          "them faults until they are mapped again", RuntimeWarning, stacklevel=4)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd, self._size, self._live = -1, 0, 0


def _mmap_error(e: OSError) -> VattnError:
    if e.errno == errno.ENOMEM:
        return MapCountLimitError(
            errno.ENOMEM,
            f"mmap failed: the process has {_num_mappings()} mappings and vm.max_map_count is "
            f"{_map_count_limit()}; raise it (sysctl -w vm.max_map_count=N) or use a larger page_size")
    return BackendError("mmap", e.errno or 0, errno.errorcode.get(e.errno or 0, "?"))
