"""The one small interface every virtual-memory backend implements."""
from __future__ import annotations

import threading
import warnings
from abc import ABC, abstractmethod
from array import array
from typing import Any, Sequence

import torch

from vattn.config import DLPACK_DTYPES


class Backend(ABC):
    """Virtual-memory primitives of one device.

    A *group* is the physical memory of one page in each of `num_buffers` buffers; the
    allocator moves groups between slots and never sees what a group is made of.
    Counters (`num_map_calls`, `num_pages_mapped`, ...) count what really reached the OS
    or the driver, so tests and benchmarks can check that work was (not) done.

    *Scratch backing* (`create_scratch`, `map_scratch`, and the `scratch` argument of `map`
    and `unmap`): the pages of a reservation that hold no real page are backed by one shared
    scratch memory instead of being left reserved-only, so that reading or writing them never
    faults (what a tensor handed to another engine needs). A real page replaces the scratch
    when it is mapped and gives way to it again when unmapped. The scratch is never a page
    group: no counter of pages, no budget counts it.
    """

    device: torch.device
    granularity: int  # smallest page size, bytes
    default_page_size: int
    default_memory_fraction = 0.9  # of free_memory() at init: the default physical budget
    new_pages_zeroed = False  # memory `create` gives reads zeros (the host's); a GPU's may hold old data

    def __init__(self) -> None:
        # Page calls come from several threads at once where allocators share a backend (a
        # cache's layer kinds, each with its pre-mapping worker): their books (the host's
        # memfd offsets, the counters) are the backend's, so one call at a time.
        self._page_lock = threading.RLock()
        self.num_map_calls = 0
        self.num_pages_mapped = 0  # page groups
        self.num_unmap_calls = 0
        self.num_pages_unmapped = 0
        self.num_pages_created = 0
        self.num_scratch_calls = 0  # calls that backed pages with scratch (map_scratch, unmap with scratch)
        self.num_scratch_pages = 0  # page offsets backed with scratch by them (per call, all buffers alike)
        self.scratch_bytes = 0  # scratch memory made and not yet released (`create_scratch`)

    def check_page_size(self, page_size: int) -> None:
        """Raise InvalidConfigError unless `page_size` is a multiple of the granularity."""

    # -- address space --------------------------------------------------------------
    @abstractmethod
    def reserve(self, nbytes: int, alignment: int) -> Any:
        """Reserve `nbytes` of address space; returns an object with `.addr` and `.size`."""

    @abstractmethod
    def tensor(self, rng: Any, offset: int, shape: Sequence[int], strides: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A zero-copy torch view of reserved memory (strides in elements)."""

    # -- physical pages -------------------------------------------------------------
    def create(self, n: int, num_buffers: int, page_size: int) -> list:
        """Create `n` page groups of `num_buffers` pages each (raises OutOfPhysicalMemoryError)."""
        with self._page_lock:
            groups = self._create(n, num_buffers, page_size) if n else []
            self.num_pages_created += n
        return groups

    def release(self, groups: list) -> None:
        """Free page groups that are not mapped."""
        if groups:
            with self._page_lock:
                self._release(groups)

    def map(self, bases: Sequence[int], offsets: Sequence[int], groups: list, page_size: int,
            scratch: Any = None) -> None:
        """Map groups[i] at bases[b] + offsets[i] for every buffer b. All or nothing. `scratch`:
        the pages are backed by it now (`map_scratch`); the groups replace it (on failure the
        pages are backed by it again)."""
        if not groups:
            return
        with self._page_lock:
            b, o = array("Q", bases), array("Q", offsets)
            if scratch is None:
                self._map(b, o, groups, page_size)
            else:
                self._map_over_scratch(b, o, groups, page_size, scratch)
            self.num_map_calls += 1
            self.num_pages_mapped += len(groups)

    def unmap(self, bases: Sequence[int], offsets: Sequence[int], page_size: int, scratch: Any = None) -> None:
        """Unmap the pages at bases[b] + offsets[i]: the range stays reserved, reads fault; or,
        with `scratch`, the pages are backed by it again (reads and writes never fault)."""
        if not offsets:
            return
        with self._page_lock:
            b, o = array("Q", bases), array("Q", offsets)
            if scratch is None:
                self._unmap(b, o, page_size)
            else:
                self._unmap_to_scratch(b, o, page_size, scratch)
            self.num_unmap_calls += 1
            self.num_pages_unmapped += len(offsets)

    # -- scratch backing ------------------------------------------------------------
    def create_scratch(self, page_size: int, num_pages: int) -> Any:
        """Scratch memory for a reservation of `num_pages` pages of `page_size` bytes (see the
        class docstring). Release it with `release_scratch` once nothing maps it any more."""
        with self._page_lock:
            scratch = self._create_scratch(page_size, num_pages)
            self.scratch_bytes += self.scratch_size(scratch)
        return scratch

    def release_scratch(self, scratch: Any) -> None:
        """Free scratch memory nothing maps any more."""
        with self._page_lock:
            self._release_scratch(scratch)
            self.scratch_bytes -= self.scratch_size(scratch)

    def map_scratch(self, bases: Sequence[int], offsets: Sequence[int], page_size: int, scratch: Any) -> None:
        """Back the reserved-only pages at bases[b] + offsets[i] with `scratch`. All or nothing."""
        if not offsets:
            return
        with self._page_lock:
            self._map_scratch(array("Q", bases), array("Q", offsets), page_size, scratch)
            self._count_scratch(len(offsets))

    def scratch_size(self, scratch: Any) -> int:
        """Bytes of memory `scratch` may hold (the host's only where something touched it)."""
        return 0

    def _count_scratch(self, num_pages: int) -> None:
        self.num_scratch_calls += 1
        self.num_scratch_pages += num_pages

    def _map_over_scratch(self, bases: array, offsets: array, groups: list, page_size: int, scratch: Any) -> None:
        """A GPU cannot map over a mapping: the scratch goes first (the caller waited for the
        work that may read it), then the groups; on failure the scratch comes back."""
        self._unmap(bases, offsets, page_size)
        try:
            self._map(bases, offsets, groups, page_size)
        except BaseException:
            self._rescue_scratch(bases, offsets, page_size, scratch)
            raise

    def _unmap_to_scratch(self, bases: array, offsets: array, page_size: int, scratch: Any) -> None:
        self._unmap(bases, offsets, page_size)
        self._rescue_scratch(bases, offsets, page_size, scratch)

    def _rescue_scratch(self, bases: array, offsets: array, page_size: int, scratch: Any) -> None:
        """Back reserved-only pages with scratch again; where that fails they stay unbacked
        (reads fault) and the backend notes it (`_holes`), with a warning, rather than leave
        the books and the memory disagreeing."""
        try:
            self._map_scratch(bases, offsets, page_size, scratch)
            self._count_scratch(len(offsets))
        except Exception as e:
            self._holes(bases, offsets)
            warnings.warn(f"vattn: backing {len(offsets)} page(s) with scratch memory failed ({e}); reading "
                          "them faults until they are mapped again", RuntimeWarning, stacklevel=4)

    def _holes(self, bases: array, offsets: array) -> None:
        """Pages a failed scratch map left reserved-only (a backend that must know them keeps them)."""

    def _create_scratch(self, page_size: int, num_pages: int) -> Any:
        raise NotImplementedError(f"{type(self).__name__} has no scratch backing")

    def _release_scratch(self, scratch: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no scratch backing")

    def _map_scratch(self, bases: array, offsets: array, page_size: int, scratch: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no scratch backing")

    def zero(self, views: Sequence[torch.Tensor], pages: Sequence[int], page_size: int) -> None:
        """Clear `pages` (page indices) of every buffer, each given as a flat byte view of
        its reserved range, on the current stream (a backend that records its operations
        records this)."""
        pages = sorted(pages)
        for i, k in runs(pages, 1):
            lo, hi = pages[i] * page_size, (pages[i] + k) * page_size
            for view in views:
                view[lo:hi].zero_()

    # -- ordering against device work -----------------------------------------------
    def fence(self) -> Any:
        """A marker of the device work enqueued so far (None where work is synchronous)."""
        return None

    def wait(self, fence: Any) -> None:
        """Block until the work before `fence` finished."""

    def free_memory(self) -> int | None:
        """Bytes of memory the backend may still take now (None: unknown, no default budget)."""
        return None

    def close(self) -> None:
        """Release what the backend itself holds (not the groups: release() them first)."""

    @staticmethod
    def dlpack_type(dtype: torch.dtype) -> tuple[int, int]:
        return DLPACK_DTYPES[dtype]

    @abstractmethod
    def _create(self, n: int, num_buffers: int, page_size: int) -> list: ...

    @abstractmethod
    def _release(self, groups: list) -> None: ...

    @abstractmethod
    def _map(self, bases: array, offsets: array, groups: list, page_size: int) -> None: ...

    @abstractmethod
    def _unmap(self, bases: array, offsets: array, page_size: int) -> None: ...


def runs(offsets: Sequence[int], step: int) -> list[tuple[int, int]]:
    """(first index, count) of each run of `offsets` that follow one another by `step`."""
    out, i = [], 0
    while i < len(offsets):
        j = i + 1
        while j < len(offsets) and offsets[j] == offsets[j - 1] + step:
            j += 1
        out.append((i, j - i))
        i = j
    return out
