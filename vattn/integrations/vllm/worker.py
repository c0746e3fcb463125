"""vLLM's worker side: the KV cache's backing allocation on vattn memory (`WorkerKV`),
reserved once and mapped page by page by the scheduler's operations."""
from __future__ import annotations

from typing import Any

import torch

from vattn.errors import OpsOutOfOrderError, OutOfPhysicalMemoryError, UnsupportedLayoutError
from vattn.integrations.vllm.layout import block_layout, memory_limit
from vattn.integrations.vllm.scheduler import PageOps, _new_books
from vattn.vmem import make_backend
from vattn.vmem.base import Backend


class WorkerKV:
    """A worker's KV cache backing allocation on vattn memory: reserved once (the KV
    views never move), pages mapped and unmapped by the scheduler's operations.

    Every page of the reservation that holds no real page is backed by the backend's scratch
    memory (`vattn.vmem.base.Backend`, "scratch backing"): vLLM owns the tensor and may touch
    any byte of it (a block the scheduler never handed out, a padding row, a test), which must
    never fault (on a GPU: an illegal address, the end of the engine). A "map" operation
    replaces the scratch (after the device finished the work that may read it), an "unmap"
    puts it back."""

    def __init__(self, kv_cache_config: Any, size: int, device: torch.device | str,
                 backend: Backend | None = None) -> None:
        self.device = torch.device(device)
        self.layout = g = block_layout(kv_cache_config)
        if size > g.reserved_bytes:
            raise UnsupportedLayoutError(f"an allocation of {size} bytes is larger than the KV cache's reservation "
                                         f"of {g.reserved_bytes} bytes")
        self.backend = backend if backend is not None else make_backend(self.device)
        self._own_backend = backend is None
        self.backend.check_page_size(g.page_size)
        self._range = self.backend.reserve(g.reserved_bytes, g.page_size)
        self.whole = self.backend.tensor(self._range, 0, (g.reserved_bytes,), (1,), torch.int8)
        self.tensor = self.whole[:size]
        self.bases = [self._range.addr + r for r in g.regions]
        # the whole reservation on scratch (regions, the gaps between them, the tail)
        self._all = ([self._range.addr], [p * g.page_size for p in range(g.reserved_bytes // g.page_size)])
        self.scratch = self.backend.create_scratch(g.page_size, len(self._all[1]))
        try:
            self.backend.map_scratch(*self._all, g.page_size, self.scratch)
        except BaseException:
            self.backend.release_scratch(self.scratch)
            raise
        self.groups: dict[int, Any] = {}  # scheduler's group id -> this worker's physical group
        self.mapped: dict[int, int] = {}  # page -> group id
        self.spare: list[Any] = []  # created ahead for the scheduler's next creates (`reserve`)
        # each region's bytes, for the "zero" operations (skipped where new memory reads zeros: the host)
        self.regions = [self.whole[r:r + g.num_pages * g.page_size] for r in g.regions]
        self.seq = 0
        self.closed = False
        pool, rec = _new_books(g, memory_limit())
        initial = rec.drain()  # the state the scheduler's books start in
        pool.close()
        self._apply(initial)

    def apply(self, ops: PageOps | None) -> None:
        """Apply the next batch of the scheduler's page operations (in order)."""
        if ops is None:
            return
        if self.closed:
            raise OpsOutOfOrderError("page operations for a closed vattn KV cache")
        if ops.key != self.layout.key:
            raise OpsOutOfOrderError(f"page operations for block layout (geometry) {ops.key}, this worker has "
                                     f"{self.layout.key}")
        if ops.seq != self.seq + 1:
            raise OpsOutOfOrderError(f"page operations batch {ops.seq} after batch {self.seq}")
        self._apply(ops.ops)
        self.seq = ops.seq

    def _apply(self, ops: list[tuple]) -> None:
        P, synced = self.layout.page_size, False
        for op in ops:
            kind = op[0]
            if kind == "create":  # from the reserve; the device only when none was confirmed
                made = [self.spare.pop() for _ in range(min(len(op[1]), len(self.spare)))]
                if len(made) < len(op[1]):
                    made += self.backend.create(len(op[1]) - len(made), len(self.bases), P)
                self.groups.update(zip(op[1], made))
            elif kind == "map":
                if not synced:  # the fence: a GPU unmaps the scratch there, which kernels may read
                    self.synchronize()
                    synced = True
                pages, ids = op[1], op[2]
                self.backend.map(self.bases, [p * P for p in pages], [self.groups[i] for i in ids], P, self.scratch)
                self.mapped.update(zip(pages, ids))
            elif kind == "zero":
                if not self.backend.new_pages_zeroed:
                    self.backend.zero(self.regions, op[1], P)
            elif kind == "unmap":
                if not synced:  # the fence: nothing enqueued before this batch reads these pages after
                    self.synchronize()
                    synced = True
                self.backend.unmap(self.bases, [p * P for p in op[1]], P, self.scratch)
                for p in op[1]:
                    del self.mapped[p]
            elif kind == "release":
                self.backend.release([self.groups.pop(i) for i in op[1]])
            else:
                raise OpsOutOfOrderError(f"unknown page operation {kind!r}")

    def reserve(self, target: int) -> int:
        """Hold `target` page groups created and ready (release any beyond it); returns how
        many it holds: fewer when the device refused (another process, PyTorch's caching
        allocator took the memory), which is not an error: the scheduler waits."""
        P, extra = self.layout.page_size, len(self.spare) - max(0, target)
        if extra > 0:
            self.backend.release([self.spare.pop() for _ in range(extra)])
        need = target - len(self.spare)
        try:
            if need > 0:
                self.spare += self.backend.create(need, len(self.bases), P)
        except OutOfPhysicalMemoryError:
            for _ in range(need):  # one at a time: what the device still has
                try:
                    self.spare += self.backend.create(1, len(self.bases), P)
                except OutOfPhysicalMemoryError:
                    break
        return len(self.spare)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def mapped_bytes(self) -> int:
        return len(self.mapped) * self.layout.page_size * len(self.bases)

    def is_mapped(self, block: int) -> bool:
        """Whether every page of `block` is mapped here."""
        g = self.layout
        first, last = block * g.block_bytes // g.page_size, ((block + 1) * g.block_bytes - 1) // g.page_size
        return all(p in self.mapped for p in range(first, last + 1))

    def close(self) -> None:
        """Unmap and release every page (after the device finished). Views must not be used after."""
        if self.closed:
            return
        self.closed = True
        self.synchronize()
        P = self.layout.page_size
        try:
            self.backend.unmap(*self._all, P)  # every page, real and scratch
            self.mapped.clear()
            self.backend.release(list(self.groups.values()) + self.spare)
            self.groups.clear()
            self.spare.clear()
            self.backend.release_scratch(self.scratch)
        finally:
            if self._own_backend:
                self.backend.close()
            self.whole = self.tensor = self._range = None  # the address space goes with the last view
            self.regions = []
