"""Host backend: real Linux virtual memory with the CUDA VMM semantics.

reserve  = mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE)
create   = grow one memfd (ftruncate + fallocate: the pages exist on return)
map      = mmap(MAP_SHARED | MAP_FIXED) of the memfd at the page's address
unmap    = mmap(PROT_NONE, MAP_FIXED) over the page: reading it faults again
"""
from __future__ import annotations

import errno
import mmap
import os
from array import array
from typing import NamedTuple, Sequence

import torch

from vattn import _C
from vattn.errors import (
    BackendError,
    InvalidConfigError,
    MapCountLimitError,
    OutOfPhysicalMemoryError,
    OutOfVirtualMemoryError,
)
from vattn.vmem.base import Backend


class HostGroup(NamedTuple):
    """Page b of the group lives in memfd `fd` at `offset + b * stride`."""

    fd: int
    offset: int
    stride: int


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
        try:
            if self._fd < 0:
                self._fd = os.memfd_create("vattn-pages", os.MFD_CLOEXEC)
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
        return [HostGroup(self._fd, base + i * page_size, stride) for i in range(n)]

    def _release(self, groups: list[HostGroup]) -> None:
        # The memfd (and its memory) goes when the last group is released.
        self._live -= len(groups)
        if self._live == 0:
            self.close()

    def _map(self, bases: array, offsets: array, groups: list[HostGroup], page_size: int) -> None:
        fds = array("i", (g.fd for g in groups))
        foffs = array("Q", (g.offset for g in groups))
        fstrides = array("Q", (g.stride for g in groups))
        try:
            _C.host_map(bases, offsets, fds, foffs, fstrides, page_size)
        except OSError as e:
            if e.errno == errno.ENOMEM:
                raise MapCountLimitError(
                    errno.ENOMEM,
                    f"mmap failed: the process has {_num_mappings()} mappings and vm.max_map_count is "
                    f"{_map_count_limit()}; raise it (sysctl -w vm.max_map_count=N) or use a larger page_size") from None
            raise BackendError("mmap", e.errno or 0, errno.errorcode.get(e.errno or 0, "?")) from None

    def _unmap(self, bases: array, offsets: array, page_size: int) -> None:
        try:
            _C.host_unmap(bases, offsets, page_size)
        except OSError as e:
            raise BackendError("mmap(PROT_NONE)", e.errno or 0, errno.errorcode.get(e.errno or 0, "?")) from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd, self._size, self._live = -1, 0, 0
