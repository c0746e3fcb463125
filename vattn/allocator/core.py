"""`PageAllocator`: the slot allocator's API and its threading (one lock over the books; the
pre-mapping worker stopped around every call that moves pages), composed of parts with one
job each. Plain Python.

```
PageAllocator     alloc_reqid / free_reqid / step, trim, the budget's callbacks, close; locking
 |- books         SlotBooks   slots, group references, pins, dirty marks   (books.py)
 |   '- physical  PageGroups  created / spare groups, budget, fences, release, close (vattn/pages.py)
 |- mapper        Mapper      carries out StepPlans (decided in plan.py)   (mapper.py)
 |- premapper     Premapper   the background worker; what it maps          (premap.py)
 |- sharing       Sharing     fork, pins for the prefix cache              (sharing.py)
 '- swap          Swap        park / resume of swapped-out requests        (swap.py)
```
Unmapping waits for the device: a step records a fence (a CUDA event on the current stream)
for every slot the previous iteration ran, and a slot's pages are unmapped only after its
fence. A slot freed after an iteration still gets that iteration's fence (`ran` is not
cleared by free_reqid).
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from vattn.allocator.books import MemoryStats, SlotBooks, as_index
from vattn.allocator.mapper import Mapper, budget_refused
from vattn.allocator.plan import StepResult, normalize, reclaimable, short_and_edge
from vattn.allocator.premap import Premapper, map_ahead, plan_premap, worker_batch
from vattn.allocator.sharing import Handle, Sharing
from vattn.allocator.swap import Swap
from vattn.errors import InvalidRequestError, NoFreeSlotError, OutOfPhysicalMemoryError
from vattn.pages import PageGroups

if TYPE_CHECKING:  # the books import no torch: sizes are ints by the time they get here
    from vattn.config import Geometry
    from vattn.vmem.base import Backend


class PageAllocator:
    """Books and page movement for one cache. Used through `vattn.KVCache`.

    Cost grows with the work, not the capacity: a `step` that maps nothing touches only the
    requests it names (one pass over them), and the slot `alloc_reqid` hands out next comes
    from a heap.
    """

    def __init__(self, geometry: Geometry, backend: Backend, bases: Sequence[int], *,
                 max_pages: int, background: bool, prefetch: bool, prefetch_tokens: int = 1,
                 zero_pages: Callable[[list[int]], None] | None = None,
                 copy_pages: Callable[[list[tuple[int, int]]], None] | None = None,
                 budget: Any = None, window: int | None = None) -> None:
        """`max_pages`: the budget of page groups. `zero_pages(offsets)` clears pages
        (zero_reused_pages); `copy_pages(pairs)` copies pages between offsets (fork).
        `budget`: a `vattn.Budget` shared with other caches and pools: every group created is
        taken from it, others may ask for our cached pages, and a step it refused asks them
        next time. `window`: these layers' sliding window in tokens (with the kernels'
        margin), None for full attention: a step gives back the pages wholly behind it."""
        self.geometry = geometry
        self.backend = backend
        self.background = background
        self.prefetch = prefetch
        # look-ahead: a slot within this many tokens of its next page pre-maps it
        self.prefetch_tokens = prefetch_tokens
        self.worker_error: BaseException | None = None
        physical = PageGroups(backend, bases, geometry.page_size, geometry.num_buffers, budget=budget,
                              reclaim=self._give_back, cached=self._cached_bytes)
        self.books = SlotBooks(geometry, physical, max_pages, track_dirty=zero_pages is not None, window=window)
        self.mapper = Mapper(self.books, zero_pages=zero_pages, copy_pages=copy_pages)
        self.sharing = Sharing(self.books, self.mapper)
        self.swap = Swap(self.books, self.mapper)
        batch = worker_batch(geometry.num_buffers)
        self._map_ahead = lambda job, worker=None: map_ahead(self.mapper, job, batch, worker)
        self.premapper = Premapper(self.books.lock, lambda job: self._map_ahead(job, self.premapper),
                                   self._record_worker_error)

    # ------------------------------------------------------------------ slots ----
    def alloc_reqid(self, slot: int | None = None) -> int:
        """A free slot (the warm one), or `slot` when given (a hybrid cache's other layer
        kinds take the slot its first kind gave)."""
        books = self.books
        with books.lock:
            books.check_open()
            if not books.free_slots:
                raise NoFreeSlotError(
                    f"all {books.num_slots} slots are in use; free_reqid() one or raise max_batch_size")
            if slot is None:
                slot = books.warm_slot()
            elif slot not in books.free_slots:
                raise InvalidRequestError(f"slot {slot} is not free")
            books.take(slot)
            return slot

    def free_reqid(self, reqid: int) -> None:
        with self.books.lock:
            self.books.check_open()
            self.books.free(self.books.check_active(reqid))

    def num_tokens(self, reqid: int) -> int:
        """The tokens `reqid` holds: its longest step length since alloc (what fork, pin and
        swap_out may take)."""
        with self.books.lock:
            return self.books.max_lens[self.books.check_active(reqid)]

    def allocation(self, slot: int) -> int | None:
        """Which allocation holds `slot` now: a number no later `alloc_reqid` (or fork, or
        swap-in) gives again; None while the slot is free."""
        return self.books.active.get(slot)

    @property
    def num_free_slots(self) -> int:
        return len(self.books.free_slots)

    # ------------------------------------------------------------------- step ----
    def step(self, seq_lens: Sequence[int] | Mapping[int, int]) -> StepResult:
        books, physical, ahead = self.books, self.books.physical, self.prefetch_tokens
        short = physical.take_budget_short()
        if short:  # the budget refused us last time: ask the others (never under our lock)
            physical.budget.reclaim(short, requester=physical.budget_token)
        if self.premapper.busy:  # the worker is mapping: a step that needs nothing new runs beside it
            with books.lock:
                books.check_open()
                lens, short, edge = normalize(books, seq_lens, ahead)
                if not (short or books.shared_slots or books.dirty_slots or self._behind(lens)):
                    books.fence_ran()
                    return self._finish_step(lens, StepResult(), edge)
        with self._quiet():  # the worker stopped after its batch in flight
            lens, short, edge = normalize(books, seq_lens, ahead)
            books.fence_ran()
            if books.shared_slots and self.sharing.unshare_new_owners(lens):
                short, edge = short_and_edge(books, lens, ahead)
            if books.window is not None and self._drop_behind(lens):
                short, edge = short_and_edge(books, lens, ahead)
            result = self.mapper.back(lens, short) if short else StepResult()
            for s in result.failed:  # not backed: this iteration will not run them
                del lens[s]
            if books.dirty_slots:
                self.mapper.zero_dirty(lens)
            return self._finish_step(lens, result, edge if not short else None)

    def _behind(self, lens: dict[int, int]) -> bool:
        """Whether a slot of the step has pages wholly behind its sliding window, or holes
        where it must read (lock held)."""
        books = self.books
        return books.window is not None and any(books.first_needed(s, n) != books.holes(s) for s, n in lens.items())

    def _drop_behind(self, lens: dict[int, int]) -> bool:
        """Sliding window: give back every page of the step's slots wholly behind the window
        of its queries (after the last iteration's fence). A new request's slot holding
        holes where it reads is emptied. Returns whether pages moved (lock held, worker stopped)."""
        books, changed = self.books, False
        for s, n in lens.items():
            first, holes = books.first_needed(s, n), books.holes(s)
            if first > holes:
                changed |= self.mapper.drop_behind(s, first) > 0
            elif first < holes:
                if books.max_lens[s]:
                    raise InvalidRequestError(
                        f"reqid {s}'s sliding-window layers gave back the pages before token "
                        f"{holes * self.geometry.page_size // self.geometry.token_bytes} and this step reads from "
                        f"page {first}; an iteration's queries must start at the previous step's length (free the "
                        "request and compute it again)")
                self.mapper.empty(s)  # a new owner: the earlier request's pages are nothing to it
                changed = True
        return changed

    def _finish_step(self, lens: dict[int, int], result: StepResult, edge: list[int] | None) -> StepResult:
        """The books of the iteration `lens` runs (lock held), and what to pre-map next."""
        books = self.books
        ml = books.max_lens
        for s, n in lens.items():
            m = ml[s]
            if n > m:
                if not m:  # a new request's first length
                    books.eager_tokens = n if not books.eager_tokens else 0.8 * books.eager_tokens + 0.2 * n
                ml[s] = n
                books.prev_lens[s] = m
        books.ran = lens
        if result and self.prefetch:
            self._premap(edge)
        return result

    def _premap(self, edge: list[int] | None) -> None:
        """Hand what the next iterations will want to the worker, or map it now without one
        (`background=False`: the same books, the tests rely on that). `edge`: the slots
        near a page (None: find them)."""
        if edge is None:
            edge = short_and_edge(self.books, self.books.ran, self.prefetch_tokens)[1]
        job = plan_premap(self.books, edge, self.prefetch_tokens)
        if not job or self.premapper.busy:  # busy: a step beside the worker; the next one plans again
            return
        if not self.background:
            try:
                self._map_ahead(job)
            except Exception as e:  # pre-mapping is best effort; the next step maps on demand
                self._record_worker_error(e)
            return
        self.premapper.submit(job)

    def _record_worker_error(self, e: BaseException) -> None:
        if self.worker_error is None:
            warnings.warn(f"vattn: background pre-mapping failed ({e}); step() maps on demand",
                          RuntimeWarning, stacklevel=2)
        self.worker_error = e

    def synchronize(self) -> None:
        """Wait until the background pre-mapping of the last step is done."""
        with self.books.lock:
            self.premapper.wait()

    # ---------------------------------------------------------------- sharing ----
    def fork(self, reqid: int, num_tokens: int, child: int | None = None) -> int:
        """See `KVCache.fork`; `child`: the free slot to fork into (None: one is chosen)."""
        with self._quiet():
            return self.sharing.fork(reqid, num_tokens, child)

    def can_fork(self, reqid: int, num_tokens: int) -> bool:
        """Whether `fork(reqid, num_tokens)` finds every page the child's first query reads
        (a sliding window may have moved past them)."""
        with self.books.lock:
            return self.books.reads_held(self.books.check_active(reqid), as_index(num_tokens, "num_tokens"))

    def pin(self, reqid: int, num_pages: int) -> list[Handle]:
        """See `KVCache.pin`."""
        with self.books.lock:
            self.books.check_open()
            return self.sharing.pin(reqid, num_pages)

    def num_pinned(self, handles: Sequence[Handle]) -> int:
        """How many of `handles`, from the first, are still pinned (not evicted); marks them
        most recently used."""
        with self.books.lock:
            return self.sharing.num_pinned(handles)

    def map_pinned(self, reqid: int, handles: Sequence[Handle]) -> int:
        """See `KVCache.map_pinned`."""
        with self._quiet():
            return self.sharing.map_pinned(reqid, handles)

    def truncate_pinned(self, reqid: int, num_tokens: int) -> int:
        """See `KVCache.truncate_pinned`."""
        with self._quiet():
            return self.sharing.truncate_pinned(reqid, num_tokens)

    @property
    def pins(self) -> OrderedDict[Any, int]:
        """Pinned groups -> the generation of their pin, least recently used first (read only)."""
        return self.books.pins

    # --------------------------------------------------------------- swapping ----
    def park(self, reqid: int) -> tuple[int, int]:
        """`free_reqid`, remembering (slot, epoch): while the slot stays untouched (no new
        owner, no page taken), `resume` gets it back with its data, with no copy. Its pages
        stay mapped until device work enqueued before this call finished."""
        with self.books.lock:
            slot = self.swap.fence_parked(reqid)
        self.free_reqid(slot)
        with self.books.lock:
            return slot, self.books.epoch[slot]

    def resume(self, slot: int, epoch: int, num_tokens: int, new: int | None = None,
               first_page: int = 0) -> tuple[int, bool]:
        """See `Swap.resume`."""
        with self._quiet():
            return self.swap.resume(slot, epoch, num_tokens, new, first_page)

    # ----------------------------------------------------------------- memory ----
    def trim(self) -> int:
        """Give back now every page no live token needs (free slots, pre-mapped tails, pinned
        prefix pages no slot maps): unmap and release them. Returns the page groups released."""
        books = self.books
        with self._quiet():
            books.fence_ran()
            self.mapper.reclaim(reclaimable(books, {}), books.physical.num_created)
            books.evict(len(books.pins))
            return self.mapper.release_spare(len(books.physical.spare))

    def reserve_physical(self, nbytes: int) -> int:
        """Create page groups until at least `nbytes` of physical memory exist. Returns groups created."""
        books, gb = self.books, self.geometry.group_bytes
        nbytes = as_index(nbytes, "nbytes")
        if nbytes < 0:
            raise InvalidRequestError(f"nbytes must be >= 0, got {nbytes}")
        n = -(-nbytes // gb)
        with self._quiet():
            if n > books.max_pages:
                raise OutOfPhysicalMemoryError(
                    f"{nbytes} bytes is {n} page groups, over the budget of {books.max_pages} "
                    f"({books.max_pages * gb} bytes); raise physical_memory")
            before = books.physical.num_created
            if n > before:
                groups = books.physical.create(n - before)
                if groups is None:
                    raise budget_refused(n - before, gb)
                books.physical.put_spare(groups)
            return books.physical.num_created - before

    @property
    def max_pages(self) -> int:
        """The physical budget in page groups (`set_max_pages` changes it)."""
        return self.books.max_pages

    def set_max_pages(self, n: int) -> None:
        """Set the physical budget to `n` page groups (e.g. the minimum over tensor-parallel
        ranks). `n` is an int >= 1 and >= the groups that exist now (`trim()` first to go
        lower); the page groups' size is `geometry.group_bytes`. Raises InvalidRequestError."""
        n = as_index(n, "max_pages")
        with self._quiet():
            created = self.books.physical.num_created
            if n < max(1, created):
                raise InvalidRequestError(
                    f"max_pages must be >= 1 and >= the {created} page groups that exist now, got {n}; "
                    "trim() first to give unused pages back")
            self.books.max_pages = n

    def _give_back(self, nbytes: int) -> int:
        """The shared budget asks for memory (another cache is short): release spare groups,
        then cached pages (free slots, pre-mapped tails, pins no slot maps), up to `nbytes`.
        Never raises. Returns the bytes given back."""
        books, gb = self.books, self.geometry.group_bytes
        want = -(-nbytes // gb)
        try:
            with self._quiet():
                if len(books.physical.spare) < want:
                    books.fence_ran()
                    self.mapper.reclaim(reclaimable(books, {}), want - len(books.physical.spare))
                    if len(books.physical.spare) < want:
                        books.evict(want - len(books.physical.spare))
                return self.mapper.release_spare(min(want, len(books.physical.spare))) * gb
        except Exception:  # closed, or a driver call failed: give what we can, which is nothing
            return 0

    def _cached_bytes(self) -> int:
        """The budget's estimate, without the lock, of what `_give_back` could give now."""
        return self.books.cached_bytes()

    # ---------------------------------------------------------------- figures ----
    def stats(self) -> MemoryStats:
        with self.books.lock:
            self.books.check_open()
            return self.books.stats()

    def check_invariants(self) -> None:
        """Assert the books are consistent (for tests and debugging)."""
        with self.books.lock:
            self.books.check_invariants()

    # ---------------------------------------------------------------- closing ----
    def close(self) -> None:
        """Stop the worker, unmap and release every page (after the device finished)."""
        if self.premapper.is_worker():
            # The garbage collector ran the cache's finalizer on the worker thread, which
            # cannot join itself (and may hold the lock): close from another thread.
            threading.Thread(target=self.close, name="vattn-close", daemon=True).start()
            return
        books = self.books
        self.premapper.cancel = True
        with books.lock:
            if books.closed:
                return
            self.premapper.quiesce()
            books.closed = True
            self.premapper.close()
        self.premapper.join()
        # Every page is given back even when a driver call fails on the way; the first
        # error is raised at the end.
        with books.lock:
            g, n = self.geometry, books.num_slots
            offsets = [g.page_offset(s, p) for s in range(n) for p, grp in enumerate(books.slot_pages[s])
                       if grp is not None]
            mapped = list(books.refs)  # each group once, however many slots map it
            books.slot_pages, books.refs, books.capacity = [[] for _ in range(n)], {}, [0] * n
            books.lead = [0] * n
            books.pins.clear()
            books.shared_slots.clear()
            books.dirty.clear()
            books.dirty_slots.clear()
            errors = books.physical.close(offsets, mapped)
        if errors:
            raise errors[0]

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Hold the lock with the worker stopped (after its batch in flight) and the cache
        open: what every call that changes pages needs."""
        self.premapper.cancel = True  # before taking the lock: the worker stops at its next batch
        with self.books.lock:
            self.books.check_open()
            self.premapper.quiesce()
            self.books.check_open()  # close() may have run while we waited
            yield
