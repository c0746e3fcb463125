"""`ElasticPool`: elastic physical memory under a server's own paged KV cache.

The server keeps its block table and its paged kernels. vattn reserves the block
tensors once (virtual memory: they never move) and decides which physical pages back
the blocks in use:

```
 buffer b (e.g. K of layer l): num_blocks blocks of block_bytes, reserved once
 |<- block 0 ->|<- block 1 ->|<- block 2 ->|<- block 3 ->| ...
 [   page 0    |    page 1   |    page 2   |   page 3    ]   pages: mapped on demand
 (a block may be smaller than a page or span several; page p of every buffer is one
  "page group", mapped and unmapped together in one backend call)
```

- `alloc(n)` picks free blocks *page-aware*: first blocks in pages that are mapped and
  partly used, then blocks in mapped pages nothing uses (cached), then the lowest
  unmapped blocks, whose pages it maps in one batched call. It returns None when the
  memory is short (free blocks, the pool's limit, the shared `Budget`): a scheduling
  miss, and nothing changed.
- `free(ids)` records a fence (a CUDA event on the current stream: call it after the
  kernels that read the blocks were enqueued) and keeps the pages mapped (deferred
  reclamation). A page is unmapped only when no block on it is in use, only after the
  fences of the blocks freed on it, and only when memory is wanted: `trim()`,
  `set_limit()` below the mapped bytes, another pool of the same `Budget` short of
  memory, or this pool's own alloc over its limit.
- `zero_new=True` clears the pages mapped with new memory (page groups the pool creates:
  the device's, which may hold another process's data) before `alloc` returns them, so
  that memory the pool did not hold before reads zeros, as a `torch.zeros` cache does.
  A page given a group moved from the pool's own cached pages keeps its data (this pool's,
  as a reused block does). Nothing is done where new memory reads zeros (the host backend).
- Every page no block holds is backed by one shared *scratch* memory (`scratch=True`, the
  default), swapped for a real page when a block on it is allocated and back when the page
  is given back: the server may read or write any byte of its tensors (a free block, a
  padding row, a block it never allocated) without a fault, and reads garbage there. The
  scratch is no KV memory: the stats, the limit and the budget count real pages only. The
  host maps a scratch memfd of `run` pages (at least 16 MiB, at most 256 mappings for the
  whole reservation: `vattn.vmem.host.scratch_run`), taking memory only where touched; a
  GPU maps one scratch page at many addresses, and mapping a real page there first unmaps
  it after the work enqueued so far (current stream, or the device with sync="device")
  finished. `scratch=False` (vattn's own engine): such pages are reserved only, and
  touching them faults.
- `pin(ids, ...)`: blocks that must stay mapped (a server's null, padding or trash blocks):
  a `take` that raises when memory cannot back them.
- One lock guards the books; backend calls are made under it. A budget's reclaim
  callback runs without the requesting pool's lock (see `vattn.budget`).
"""
from __future__ import annotations

import functools
import math
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from vattn import checks
from vattn.pool.books import BlockBooks, PoolStats
from vattn.budget import Budget
from vattn.checks import as_int
from vattn.config import CUDA_DRIVERS, parse_dtype
from vattn.errors import (
    ClosedError,
    InvalidConfigError,
    InvalidRequestError,
    OutOfPhysicalMemoryError,
    UnknownBlockError,  # (re-exported: it was defined here)
)
from vattn.vmem import host, make_backend
from vattn.vmem.base import Backend

SYNC_MODES = ("stream", "device")


@dataclass(frozen=True)
class PoolConfig:
    """What an `ElasticPool` was asked for. Sizes in bytes.

    `num_buffers` tensors of `[num_blocks, *block_shape]` `dtype` (for example K and V
    of every layer: `num_buffers=2 * num_layers`, `block_shape=(block_size, heads,
    head_dim)`; or one flat byte buffer: `block_shape=(block_bytes,)`, `dtype=uint8`).
    `limit`: the initial memory limit (None: none but the device's). `sync`: what an
    unmap waits for: "stream" (the fences `free` recorded on the current stream) or
    "device" (also every stream of the device: for servers that read the cache on
    streams of their own, e.g. transformers' continuous batching). `grow`: page groups
    created at least at a time (the extra ones stay spare until used, trimmed, or wanted
    by the limit or the budget); default: up to 8, at most 16 MiB. `zero_new`: clear the
    pages mapped with new memory before `alloc` returns them (see the module docstring).
    `scratch`: back every page no block holds with one shared scratch memory, so that no
    read or write of the tensors can fault (see the module docstring); False: such pages are
    reserved only and touching them faults (vattn's own engine, which never does).
    """

    num_blocks: int
    block_shape: tuple[int, ...]
    dtype: torch.dtype = torch.float16
    num_buffers: int = 1
    device: str = "cpu"
    page_size: int | None = None
    limit: int | None = None
    sync: str = "stream"
    cuda_driver: str = "auto"
    grow: int | None = None
    zero_new: bool = False
    scratch: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_blocks", checks.positive(self.num_blocks, "num_blocks"))
        object.__setattr__(self, "num_buffers", checks.positive(self.num_buffers, "num_buffers"))
        shape = self.block_shape
        if not isinstance(shape, (tuple, list, torch.Size)):
            shape = (shape,)
        if not shape:
            raise InvalidConfigError("block_shape must have at least one dimension, got ()")
        object.__setattr__(self, "block_shape", tuple(checks.positive(d, "block_shape") for d in shape))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "device", checks.device(self.device))
        object.__setattr__(self, "page_size", checks.page_size(self.page_size))
        object.__setattr__(self, "limit", checks.byte_limit(self.limit))
        checks.one_of(self.sync, "sync", SYNC_MODES)
        checks.one_of(self.cuda_driver, "cuda_driver", CUDA_DRIVERS)
        object.__setattr__(self, "grow", checks.positive(self.grow, "grow", optional=True))
        checks.flag(self.zero_new, "zero_new")
        checks.flag(self.scratch, "scratch")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one buffer."""
        return math.prod(self.block_shape) * torch.empty((), dtype=self.dtype).element_size()


class ElasticPool:
    """Block tensors in reserved virtual memory; physical pages only under blocks in use.

    ```
    pool = vattn.ElasticPool(num_blocks=4096, block_shape=(16, 8, 128), dtype="float16",
                             num_buffers=2 * num_layers, device="cuda", limit=8 << 30)
    k0, v0 = pool.buffer(0), pool.buffer(1)   # [num_blocks, 16, 8, 128]: the server's paged K/V
    ids = pool.alloc(3)                       # [7, 8, 9], or None: memory is short, schedule less
    ...                                       # the server's kernels read k0[ids], v0[ids]
    pool.free(ids)                            # after enqueuing the last kernels that read them
    pool.set_limit(4 << 30); pool.trim()      # give memory back now
    ```
    Use as a context manager or call `close()`; the tensors must not be used after it.
    """

    def __init__(self, num_blocks: int, block_shape: int | Sequence[int], dtype: torch.dtype | str = torch.float16,
                 num_buffers: int = 1, *, device: str | torch.device = "cpu", page_size: int | None = None,
                 limit: int | None = None, budget: Budget | None = None, sync: str = "stream",
                 cuda_driver: str = "auto", grow: int | None = None, zero_new: bool = False,
                 scratch: bool = True, backend: Backend | None = None) -> None:
        """See `PoolConfig` for the arguments. `backend`: a ready `vattn.vmem.Backend` instead of
        the one `device` names (tests)."""
        self.config = c = PoolConfig(num_blocks, block_shape, dtype, num_buffers, device, page_size, limit, sync,
                                     cuda_driver, grow, zero_new, scratch)
        if budget is not None and not isinstance(budget, Budget):
            raise InvalidConfigError(f"budget must be a vattn.Budget or None, got {budget!r}")
        self.backend = backend if backend is not None else make_backend(torch.device(c.device), c.cuda_driver)
        try:
            page = c.page_size if c.page_size is not None else self.backend.default_page_size
            self.backend.check_page_size(page)
            self.page_size = page
            buffer_bytes = -(-c.num_blocks * c.block_bytes // page) * page
            _check_books_fit(c.num_blocks, buffer_bytes // page)
            self._range = self.backend.reserve(buffer_bytes * c.num_buffers, page)
        except BaseException:
            if backend is None:
                self.backend.close()
            raise
        self.buffer_bytes = buffer_bytes
        bases = [self._range.addr + i * buffer_bytes for i in range(c.num_buffers)]
        shape = (c.num_blocks, *c.block_shape)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        self._buffers = [self.backend.tensor(self._range, i * buffer_bytes, shape, strides, c.dtype)
                         for i in range(c.num_buffers)]
        self._bytes: list[torch.Tensor] = []  # each buffer's reserved bytes, uint8 (zero_new)
        group = page * c.num_buffers
        grow = c.grow if c.grow is not None else max(1, min(8, (16 << 20) // group))
        dev = self.backend.device
        sync = (lambda: torch.cuda.synchronize(dev)) if c.sync == "device" and dev.type == "cuda" else None
        zero = functools.partial(_zero_new_pages, weakref.ref(self)) if c.zero_new and \
            not self.backend.new_pages_zeroed else None
        try:
            self._books = BlockBooks(c.num_blocks, c.block_bytes, c.num_buffers, self.backend, bases, page, budget,
                                     grow, limit=c.limit, scratch=c.scratch, device_sync=sync, zero_pages=zero)
        except BaseException:
            self._buffers, self._range = [], None
            if backend is None:
                self.backend.close()
            raise
        self._pinned: frozenset[int] = frozenset()  # blocks taken with pin and not freed
        self._finalizer = weakref.finalize(self, _close, self._books, self.backend)

    # ----------------------------------------------------------------- tensors ----
    def buffer(self, index: int) -> torch.Tensor:
        """Buffer `index` as a `[num_blocks, *block_shape]` tensor (block i is row i)."""
        try:
            i = as_int(index, "index", InvalidRequestError)
        except InvalidRequestError:
            i = -1
        if not 0 <= i < self.config.num_buffers:
            raise InvalidRequestError(f"buffer index must be an int in [0, {self.config.num_buffers}), got {index!r}")
        if not self._buffers:
            raise ClosedError("this pool was closed; create a new vattn.ElasticPool")
        return self._buffers[i]

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers)

    # ------------------------------------------------------------------ blocks ----
    def alloc(self, n: int) -> list[int] | None:
        """`n` free block ids, their pages mapped; None (nothing changed) when the free
        blocks, the limit or the budget cannot give `n` now: a scheduling miss."""
        n = as_int(n, "n", InvalidRequestError)
        if n < 0:
            raise InvalidRequestError(f"n must be >= 0, got {n}")
        return self._alloc(n, None)

    def take(self, ids: Iterable[int]) -> list[int] | None:
        """Allocate these free blocks (a server that picks its own ids); None when memory is short."""
        return self._alloc(None, self._ids(ids))

    def pin(self, ids: Iterable[int], what: str, hint: str, *, zero: bool = False,
            error: type[Exception] = OutOfPhysicalMemoryError) -> list[int]:
        """Take blocks that must stay mapped (a server's null, padding or trash blocks, or
        every block when it cannot run on elastic memory), or raise `error` ("no memory for
        `what` ...; `hint`") when memory cannot back them now (nothing changed then). `zero`:
        clear them too, whatever `zero_new` says (blocks read as padding must read zeros).
        They are blocks in use like any other: they stay mapped until the caller frees them."""
        ids = self._ids(ids)
        if self.take(ids) is None:
            books = self._books
            pages = books.pages_under(ids)
            under = "" if books.limit is None else f" under a limit of {books.limit} bytes"
            raise error(f"no memory for {what} ({len(pages)} page group(s) of {books.group_bytes} bytes{under}); "
                        f"{hint}")
        self._pinned = self._pinned | set(ids)  # replaced, never changed in place: read without the lock
        if zero:
            self._zero_blocks(ids)
        return ids

    def unpinned_bytes_in_use(self) -> int:
        """Bytes of the mapped pages under blocks in use, but those holding a block taken with
        `pin` (which stay however the others go): what freeing every unpinned block and then
        `trim` would give back. Read without the lock (a budget's `cached()` calls it from
        under other locks): an estimate while another thread allocates or frees."""
        books = self._books
        in_use = books.num_mapped - len(books.cached)  # mapped pages with a block in use
        return max(0, in_use - len(books.pages_under(self._pinned))) * books.group_bytes

    def _alloc(self, n: int | None, ids: list[int] | None) -> list[int] | None:
        books = self._books
        for attempt in range(2):
            with books.lock:
                if ids is not None:
                    books.check_open()
                    for b in ids:
                        if books.used[b]:
                            raise UnknownBlockError(f"block {b} is already allocated")
                if n == 0 or ids == []:
                    books.check_open()
                    return []
                got, need = books.alloc(n, ids)
            if got is not None or not need or attempt or books.physical.budget is None:
                return got
            books.physical.budget.reclaim(need, requester=books.physical.budget_token)  # our lock is not held here
        return None

    def free(self, ids: Iterable[int]) -> None:
        """Return blocks. Their pages stay mapped (cached) until memory is wanted; a fence
        recorded now orders any later unmap after the kernels enqueued so far."""
        ids = self._ids(ids)
        with self._books.lock:
            self._books.free(ids)
        if self._pinned.intersection(ids):
            self._pinned = self._pinned.difference(ids)

    def _ids(self, ids: Iterable[int]) -> list[int]:
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise InvalidRequestError(f"ids must be a list of block ids, got {ids!r}")
        out = [as_int(b, "a block id", InvalidRequestError) for b in ids]
        n = self.config.num_blocks
        for b in out:
            if not 0 <= b < n:
                raise UnknownBlockError(f"block id {b} is out of range [0, {n})")
        if len(set(out)) != len(out):
            raise UnknownBlockError(f"block ids {out} name a block twice")
        return out

    # ------------------------------------------------------------------ memory ----
    def set_limit(self, limit: int | None) -> None:
        """Change the limit on mapped bytes at run time (None: none). New blocks that
        need memory beyond it are refused; cached pages above it are given back now; pages
        under blocks in use stay until the blocks are freed (then they are given back)."""
        limit = checks.byte_limit(limit)
        with self._books.lock:
            self._books.set_limit(limit)

    @property
    def limit(self) -> int | None:
        return self._books.limit

    def trim(self) -> int:
        """Give back every cached and spare page now (waits for the fences). Returns bytes given back."""
        with self._books.lock:
            self._books.check_open()
            return self._books.give_back() * self._books.group_bytes

    def available_blocks(self) -> int:
        """Blocks `alloc` can give now, counting the cached pages other pools of the same
        budget would give back: the count a scheduler checks before it admits work."""
        with self._books.lock:
            self._books.check_open()
            return self._books.available_blocks()

    def max_blocks(self) -> int:
        """The most blocks that can ever be in use at once (pinned ones included): `num_blocks`,
        or fewer under the limit and the budget's limit. A server refuses work that needs more
        (it could never run); work that needs less but more than `available_blocks()` waits."""
        with self._books.lock:
            self._books.check_open()
            return self._books.max_blocks()

    @property
    def num_free_blocks(self) -> int:
        return self._books.num_blocks - self._books.num_used

    def stats(self) -> PoolStats:
        with self._books.lock:
            self._books.check_open()
            return self._books.stats()

    def check_invariants(self) -> None:
        """Assert the books are consistent (tests and debugging)."""
        with self._books.lock:
            self._books.check_invariants()

    # ---------------------------------------------------------------- clearing ----
    def _zero_blocks(self, ids: list[int]) -> None:
        if ids:
            idx = torch.tensor(ids, dtype=torch.int64, device=self._buffers[0].device)
            for buf in self._buffers:
                buf.index_fill_(0, idx, 0)
            self._cleared()

    def _cleared(self) -> None:
        """With sync="device" (other streams read the blocks) wait for the clearing, which
        was enqueued on the current stream, before the caller sees the blocks."""
        dev = self.backend.device
        if self.config.sync == "device" and dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()

    # ----------------------------------------------------------------- closing ----
    def close(self) -> None:
        """Release all physical memory and leave the budget. Idempotent."""
        self._finalizer()
        self._buffers, self._bytes = [], []
        self._range = None  # the address space goes when the last tensor view goes

    def __enter__(self) -> ElasticPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"ElasticPool(num_blocks={c.num_blocks}, block_shape={c.block_shape}, dtype={c.dtype}, "
                f"num_buffers={c.num_buffers}, device={c.device}, page_size={self.page_size}, limit={self.limit})")


def _zero_new_pages(ref: weakref.ref, pages: list[int]) -> None:
    """zero_new: clear the pages an alloc just mapped with new memory (the books' lock is
    held: no other alloc hands out a block on them before they are clear)."""
    pool = ref()
    if pool is None:
        return
    if not pool._bytes:
        pool._bytes = [pool.backend.tensor(pool._range, i * pool.buffer_bytes, (pool.buffer_bytes,), (1,), torch.uint8)
                       for i in range(pool.config.num_buffers)]
    pool.backend.zero(pool._bytes, pages, pool.page_size)
    pool._cleared()


def _close(books: BlockBooks, backend: Backend) -> None:
    try:
        books.close()
    finally:
        backend.close()


# Host bytes of the books (`BlockBooks`: plain Python lists, on the host whatever the device): measured about 50 a
# block (a bytearray entry, the per-block miss list, the cold heap's int) and 32 a page (users, groups, the two
# Fenwick counts of available_blocks), rounded up
BOOKS_BYTES_PER_BLOCK, BOOKS_BYTES_PER_PAGE = 64, 32


def _check_books_fit(num_blocks: int, num_pages: int) -> None:
    """Refuse a pool whose books the host cannot hold, before building them, as the host
    backend refuses pages (`available_memory`, keeping `MIN_HEADROOM` free):
    `ElasticPool(3 << 30, ...)` filled host memory until the OOM killer ended the process."""
    need = BOOKS_BYTES_PER_BLOCK * num_blocks + BOOKS_BYTES_PER_PAGE * num_pages
    avail = host.available_memory()
    if avail is not None and need > avail - host.MIN_HEADROOM:
        raise InvalidConfigError(
            f"num_blocks={num_blocks} ({num_pages} pages a buffer) needs about {need / 2**30:.1f} GiB of host memory "
            f"for the pool's books ({BOOKS_BYTES_PER_BLOCK} bytes a block, {BOOKS_BYTES_PER_PAGE} a page), and "
            f"{max(0, avail) / 2**30:.1f} GiB is available (MemAvailable and the cgroup's memory limit; vattn keeps "
            f"{host.MIN_HEADROOM >> 20} MiB free): lower num_blocks, or use fewer, larger blocks")


__all__ = ["ElasticPool", "PoolConfig", "PoolStats", "UnknownBlockError", "SYNC_MODES"]
