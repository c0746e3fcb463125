"""The allocator core: slots, page groups and the physical pool. Plain Python books.

A slot's pages are a prefix `slot_pages[s]` of references to page groups. A group may be
mapped into several slots at once (a fork shares the whole pages of a prefix); `refs`
counts the slots that map each mapped group:

```
created groups = pool (free, unmapped) + distinct mapped groups + in flight (worker)
sum of refs    = sum over slots of len(slot_pages[s])
```
A shared group holds whole pages of tokens that every slot mapping it has already
written: no slot ever writes into it. A slot's writable tail (from its length on) is in
groups of its own; a new request in a freed slot that still maps shared groups gets its
pages unmapped first. Unmapping a shared group from one slot frees nothing until the
last slot lets go.

A slot (reqid) is *active* between alloc_reqid and free_reqid and *free* otherwise. A free
slot keeps its pages (deferred reclamation); pages move to another slot only when the pool
and the budget cannot serve a `step`. The worker thread (background pre-mapping) only ever
maps pool pages into slots; only `step` unmaps. One lock guards the books. The worker takes
it to plan and to commit each batch but not across the driver call, so other callers wait
for bookkeeping only; `step` cancels the job and waits for at most the batch in flight.

Unmapping waits for the device: `step` records a fence (a CUDA event on the current stream)
when it starts, for every slot the previous iteration ran, and `_reclaim` waits on a slot's
fence before it unmaps any of its pages. A slot freed after an iteration still gets that
iteration's fence (`ran` is not cleared by free_reqid).
"""
from __future__ import annotations

import contextlib
import heapq
from collections import OrderedDict
import itertools
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from vattn.checks import as_int
from vattn.errors import (
    ClosedError,
    ContextLengthError,
    InvalidRequestError,
    MapCountLimitError,
    NoFreeSlotError,
    OutOfPhysicalMemoryError,
    UnknownReqIdError,
)

if TYPE_CHECKING:  # the books import no torch: sizes are ints by the time they get here
    from vattn.config import Geometry
    from vattn.vmem.base import Backend

_GROW_CHUNK = 16  # groups created per pool growth at least (fewer memfds / cuMemCreate batches)
_WORKER_BATCH = 16  # groups the worker maps per lock hold, at most
_WORKER_CALLS = 64  # buffers x groups the worker maps per lock hold, about (at least one group)


@dataclass(frozen=True)
class StepResult:
    """What `step` did. Truthy when every active request is backed."""

    failed: tuple[int, ...] = ()
    num_mapped: int = 0  # page groups mapped by this call (synchronously)
    num_unmapped: int = 0  # page groups reclaimed from other slots by this call
    # The device (or host) refused new pages in this call although the budget had room: a
    # shortage now, not a smaller budget; later steps try to grow again.
    out_of_memory: bool = False

    def __bool__(self) -> bool:
        return not self.failed

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass(frozen=True)
class MemoryStats:
    """Memory figures in bytes (all buffers, K and V of every layer) and page groups."""

    page_size: int
    group_bytes: int
    num_created_pages: int  # page groups that exist
    num_free_pages: int  # in the pool, unmapped
    num_mapped_pages: int  # mapped into any slot
    num_cached_pages: int  # mapped but under no live token: free slots, pre-mapped tails (reclaimable)
    max_pages: int  # budget
    mapped_bytes: int
    used_bytes: int  # bytes holding tokens of active requests
    free_tokens: int  # tokens that still fit (pool, budget and cached pages)
    num_active: int
    num_pinned_pages: int = 0  # kept for the prefix cache (mapped in a slot or not)

    @property
    def fragmentation_bytes(self) -> int:
        """Mapped to active requests but holding no token (internal fragmentation)."""
        return self.active_bytes - self.used_bytes

    @property
    def active_bytes(self) -> int:
        return (self.num_mapped_pages - self.num_cached_pages) * self.group_bytes

    @property
    def fragmentation(self) -> float:
        return self.fragmentation_bytes / self.active_bytes if self.active_bytes else 0.0


@dataclass
class StepPlan:
    """What a `step` will do, computed from the books alone (no backend call): who is
    served, who fails, how many groups to create, which pages to reclaim and from whom.
    Executing it is `_execute`; swapping, tensor parallelism and servers that reserve
    per request hook in between."""

    lens: dict[int, int]  # slot -> length to back, every active slot of the step
    served: list[int]  # slots that get pages now, oldest request first
    failed: list[int]  # slots that cannot be backed: the caller preempts them
    need: dict[int, int]  # served slot -> pages it must have
    num_new: int  # groups the served slots take from the pool
    grow: int  # groups to create first
    donors: list[tuple[int, int]]  # (slot, tail pages that may be unmapped), in the order to take them
    limit: int  # groups this step may have in all (the budget, or what exists after a refusal)


class Premapper:
    """The background pre-mapping worker: one thread that carries out the job `step`
    submits (map pool pages into slots that the next iteration will want), batch by batch.

    It shares the allocator's lock: it holds it to plan and commit each batch but drops
    it around the driver call. `quiesce` (lock held) stops the job after the batch in
    flight and waits for it; `cancel` may be set without the lock (a caller that wants the
    lock soon tells the worker to stop early).
    """

    def __init__(self, allocator: PageAllocator) -> None:
        self.alloc = allocator
        self.cv = threading.Condition(allocator._lock)
        self.job: list[tuple[int, int]] = []  # (slot, target pages)
        self.busy = False
        self.cancel = False
        self.thread: threading.Thread | None = None

    def submit(self, job: list[tuple[int, int]]) -> None:
        """Start `job` on the worker thread (lock held)."""
        self.job, self.cancel, self.busy = job, False, True
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="vattn-premap", daemon=True)
            self.thread.start()
        self.cv.notify_all()

    def quiesce(self) -> None:
        """Stop the job after its current batch and wait for it (lock held)."""
        self.cancel = True
        while self.busy:
            self.cv.wait()

    def wait(self) -> None:
        """Wait until the job is done, without stopping it (lock held)."""
        while self.busy:
            self.cv.wait()

    @property
    def stopped(self) -> bool:
        return self.cancel or self.alloc._closed

    def is_worker(self) -> bool:
        return self.thread is not None and threading.current_thread() is self.thread

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def _loop(self) -> None:
        with self.cv:
            while not self.alloc._closed:
                if not self.busy:
                    self.cv.wait()
                    continue
                try:
                    self.alloc._run_job(self.job, background=True)
                except Exception as e:  # step() will meet the same error synchronously
                    self.alloc._record_worker_error(e)
                self.job, self.busy = [], False
                self.cv.notify_all()


class PageAllocator:
    """Books and page movement for one cache. Used through `vattn.KVCache`.

    Cost grows with the work, not the capacity: a `step` that maps nothing touches only
    the requests it names (one pass over them), and the slot `alloc_reqid` hands out next
    comes from a heap.
    """

    def __init__(self, geometry: Geometry, backend: Backend, bases: Sequence[int], *,
                 max_pages: int, background: bool, prefetch: bool, prefetch_tokens: int = 1,
                 zero_pages: Callable[[list[int]], None] | None = None,
                 copy_pages: Callable[[list[tuple[int, int]]], None] | None = None,
                 budget: Any = None) -> None:
        self.geometry = geometry
        self.backend = backend
        self.bases = list(bases)
        self.num_slots = n = geometry.config.max_batch_size
        self.max_len = geometry.config.max_context_len
        self.max_pages = max_pages  # budget of groups
        self.background = background
        self.prefetch = prefetch
        self.prefetch_tokens = prefetch_tokens  # look-ahead: a slot within this many tokens of its next page pre-maps it
        # groups the worker maps per lock hold: about _WORKER_CALLS driver calls, so that a step that
        # must stop the worker waits for few (a 32-layer per-layer group is 64 calls, ~2.8 ms on an H100)
        self._worker_batch = max(1, min(_WORKER_BATCH, _WORKER_CALLS // geometry.num_buffers))

        self.slot_pages: list[list[Any]] = [[] for _ in range(n)]
        self.cap = [0] * n  # tokens the slot's mapped pages hold (kept with slot_pages)
        self.pool: list[Any] = []  # pop() hands out the lowest-offset group of a chunk first
        self.refs: dict[Any, int] = {}  # group -> slots mapping it + 1 if pinned
        # Pinned groups (the prefix cache's pages), least recently used first: a pin is one
        # more reference, so a pinned group outlives the slots that mapped it (its data stays
        # in physical memory, unmapped) until it is evicted under memory pressure or trim().
        self.pins: OrderedDict[Any, int] = OrderedDict()  # group -> generation of its pin
        self._generation = itertools.count(1)
        self.shared_slots: set[int] = set()  # slots that may map a group shared with another slot
        self.num_created = 0
        self.free_slots: set[int] = set(range(n))
        self._warm_heap = [(0, s) for s in range(n)]  # (-pages, slot) of free slots; stale entries skipped
        self.alloc_seq: dict[int, int] = {}  # active slot -> allocation order (age)
        self.ran: dict[int, int] = {}  # the latest step's lengths: the iteration after it reads these slots
        self.max_lens = [0] * n  # longest length since alloc: pages below it hold data
        self.last_fence: list[Any] = [None] * n
        self.epoch = [0] * n  # changes when a slot's data may change hands (new owner, pages taken)
        self.eager_tokens = 0.0  # running mean of new requests' first lengths
        self._counter = itertools.count()
        # zero_reused_pages: groups holding data of a request that no longer owns them, and the
        # slots that hold such groups; `step` clears them before the slot's request runs.
        self.zero_pages = zero_pages
        self.copy_pages = copy_pages  # (src offset, dst offset) pairs: copy those pages in every buffer
        self.dirty: set[Any] = set()
        self.dirty_slots: set[int] = set()

        self._lock = threading.Lock()
        self.in_flight: list[Any] = []  # groups the worker is mapping right now (lock released)
        self._closed = False
        self.worker_error: BaseException | None = None
        self.premapper = Premapper(self)
        # A physical budget shared with other caches and pools (`vattn.Budget`): every group
        # created is taken from it and given back when released; others may ask for our
        # cached pages (`_give_back`), and a step the budget refused asks them next time.
        self.budget = budget
        self._budget_short = 0  # bytes a step could not take from the budget
        self._budget_token = budget.register(self._give_back, self._cached_bytes) if budget is not None else None

    # ------------------------------------------------------------------ slots ----
    def alloc_reqid(self) -> int:
        with self._lock:
            self._check_open()
            if not self.free_slots:
                raise NoFreeSlotError(
                    f"all {self.num_slots} slots are in use; free_reqid() one or raise max_batch_size")
            slot = self._warm_slot()
            self._take(slot)
            return slot

    def _take(self, slot: int) -> None:
        """Hand free `slot` to a new request."""
        self.free_slots.remove(slot)
        self.alloc_seq[slot] = next(self._counter)
        self.epoch[slot] += 1

    def free_reqid(self, reqid: int) -> None:
        with self._lock:
            self._check_open()
            slot = self._check_active(reqid)
            del self.alloc_seq[slot]
            self.free_slots.add(slot)
            self.max_lens[slot] = 0
            self._pages_changed(slot)
            if self.zero_pages is not None and self.slot_pages[slot]:  # the next owner must not read them
                # (pages shared with a live slot or pinned are someone's data still: a new owner
                # drops them unread at its first step)
                self.dirty.update(grp for grp in self.slot_pages[slot] if self.refs[grp] == 1)
                self.dirty_slots.add(slot)

    def _warm_slot(self) -> int:
        """The free slot alloc_reqid hands out next: most pages mapped, then lowest index."""
        heap, pages, free = self._warm_heap, self.slot_pages, self.free_slots
        while True:
            neg, s = heap[0]
            if s in free and -neg == len(pages[s]):
                return s
            heapq.heappop(heap)

    def _pages_changed(self, slot: int) -> None:
        """Keep the derived figures of `slot` in step with `slot_pages[slot]`."""
        g = self.geometry
        self.cap[slot] = len(self.slot_pages[slot]) * g.page_size // g.token_bytes
        if slot in self.free_slots:
            heap = self._warm_heap
            if len(heap) > 4 * self.num_slots + 64:  # drop the stale entries now and then
                heap[:] = [(-len(self.slot_pages[s]), s) for s in self.free_slots]
                heapq.heapify(heap)
            heapq.heappush(heap, (-len(self.slot_pages[slot]), slot))

    # ------------------------------------------------------------------- step ----
    def step(self, seq_lens: Sequence[int] | Mapping[int, int]) -> StepResult:
        if self._budget_short:  # the budget refused us last time: ask the others (never under our lock)
            short, self._budget_short = self._budget_short, 0
            self.budget.reclaim(short, requester=self._budget_token)
        if self.premapper.busy:  # the worker is mapping: a step that needs nothing new runs beside it
            with self._lock:
                self._check_open()
                lens, short, edge = self._normalize(seq_lens)
                if not (short or self.shared_slots or self.dirty_slots):
                    self._note_fence()
                    return self._finish_step(lens, StepResult(), edge)
        with self._quiet():  # the worker stopped after its batch in flight
            lens, short, edge = self._normalize(seq_lens)
            self._note_fence()
            if self.shared_slots and self._unshare_new_owners(lens):
                short, edge = self._short(lens)
            result = self._back(lens, short) if short else StepResult()
            for s in result.failed:  # not backed: this iteration will not run them
                del lens[s]
            if self.dirty_slots:
                self._zero_dirty(lens)
            return self._finish_step(lens, result, edge if not short else None)

    def _note_fence(self) -> None:
        """The kernels of the last iteration read its slots: they may unmap after this fence."""
        fence = self.backend.fence()
        if fence is not None:
            for s in self.ran:
                self.last_fence[s] = fence

    def _finish_step(self, lens: dict[int, int], result: StepResult, edge: list[int] | None) -> StepResult:
        """The books of the iteration `lens` runs (lock held), and what to pre-map next."""
        ml = self.max_lens
        for s, n in lens.items():
            m = ml[s]
            if n > m:
                if not m:  # a new request's first length
                    self.eager_tokens = n if not self.eager_tokens else 0.8 * self.eager_tokens + 0.2 * n
                ml[s] = n
        self.ran = lens
        if result and self.prefetch:
            self._schedule_prefetch(edge)
        return result

    def _normalize(self, seq_lens: Sequence[int] | Mapping[int, int]) -> tuple[dict[int, int], list[int], list[int]]:
        """One pass over `seq_lens`: the active slots' lengths, the slots short of pages now,
        and those within `prefetch_tokens` of a page (the edge). Raises (changing nothing) on
        a bad entry."""
        if isinstance(seq_lens, Mapping):
            items = seq_lens.items()
        elif isinstance(seq_lens, (str, bytes)) or not hasattr(seq_lens, "__len__"):
            raise InvalidRequestError(
                f"seq_lens must be a list of {self.num_slots} lengths or a dict reqid -> length, "
                f"got {type(seq_lens).__name__}")
        else:
            if len(seq_lens) != self.num_slots:
                raise InvalidRequestError(
                    f"seq_lens has {len(seq_lens)} entries; give one per slot (max_batch_size="
                    f"{self.num_slots}) or a dict reqid -> length")
            items = enumerate(seq_lens)
        cap, active, max_len, num_slots = self.cap, self.alloc_seq, self.max_len, self.num_slots
        ahead = self.prefetch_tokens
        lens: dict[int, int] = {}
        short: list[int] = []
        edge: list[int] = []
        for r, n in items:
            if type(r) is not int:
                r = self._index(r, "reqid")
            if type(n) is not int:
                n = self._index(n, f"seq_lens[{r}]")
            if not 0 < n <= max_len or r not in active:
                if n == 0 and 0 <= r < num_slots:
                    continue  # inactive, as in the list form
                self._bad_length(r, n)
            lens[r] = n
            c = cap[r]
            if n > c:
                short.append(r)
            elif n + ahead > c:
                edge.append(r)
        return lens, short, edge

    def _bad_length(self, slot: int, n: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise UnknownReqIdError(f"reqid {slot} is out of range [0, {self.num_slots})")
        if n < 0:
            raise InvalidRequestError(f"seq_lens[{slot}] = {n} is negative")
        if n > self.max_len:
            raise ContextLengthError(
                f"seq_lens[{slot}] = {n} exceeds max_context_len = {self.max_len}; "
                "stop the request or init with a larger max_context_len")
        raise UnknownReqIdError(f"reqid {slot} has length {n} but is not allocated; call alloc_reqid() first")

    def _short(self, lens: dict[int, int]) -> tuple[list[int], list[int]]:
        """(slots short of pages now, slots within `prefetch_tokens` of a page)."""
        cap, ahead = self.cap, self.prefetch_tokens
        return [s for s, n in lens.items() if n > cap[s]], [s for s, n in lens.items() if n <= cap[s] < n + ahead]

    @staticmethod
    def _index(v: Any, what: str) -> int:
        return as_int(v, what, InvalidRequestError)

    def _check_active(self, reqid: Any) -> int:
        slot = self._index(reqid, "reqid")
        if slot not in self.alloc_seq:
            state = "out of range" if not 0 <= slot < self.num_slots else "not allocated (or already freed)"
            raise UnknownReqIdError(f"reqid {slot} is {state}")
        return slot

    def _back(self, lens: dict[int, int], short: list[int]) -> StepResult:
        """Plan, create what the plan needs, and carry it out. A device that refuses new
        pages is a shortage now (the budget stays): plan again with what exists."""
        limit = self.max_pages
        while True:
            plan = self._plan(lens, short, limit)
            try:
                if plan.grow > 0:
                    self._grow(plan.grow, limit=limit)
            except OutOfPhysicalMemoryError:
                limit = self.num_created
                continue
            return self._execute(plan)

    def _plan(self, lens: dict[int, int], short: list[int], limit: int) -> StepPlan:
        """Who is served (oldest first: the caller preempts the newest) from the pool, new
        pages within `limit`, and pages reclaimed from free slots and pre-mapped tails."""
        g, pages = self.geometry, self.slot_pages
        need = {s: g.pages_for(lens[s]) for s in short}
        order = sorted(short, key=self.alloc_seq.__getitem__)
        supply = len(self.pool) + (limit - self.num_created)
        donors: list[tuple[int, int]] = []
        if sum(need[s] - len(pages[s]) for s in order) > supply:  # only then look at other slots
            donors = self._reclaimable(lens)
            supply += self._freeable(donors)  # pinned pages included: evicted after the donors
        served, failed, num_new = [], [], 0
        for s in order:
            missing = need[s] - len(pages[s])
            if missing <= supply:
                served.append(s)
                supply -= missing
                num_new += missing
            else:
                failed.append(s)
        grow = min(num_new - len(self.pool), limit - self.num_created)
        return StepPlan(lens, served, failed, {s: need[s] for s in served}, num_new, grow, donors, limit)

    def _execute(self, plan: StepPlan) -> StepResult:
        """Reclaim what the pool lacks after growing, then map (one atomic backend call)."""
        short = plan.num_new - len(self.pool)
        num_unmapped = self._reclaim(plan.donors, short) if short > 0 else 0
        if plan.num_new > len(self.pool):  # the donors were not enough: evict prefix-cache pages
            self._evict(plan.num_new - len(self.pool))
        try:
            num_mapped = self._map_slots(plan.served, plan.need)
        except MapCountLimitError:
            # Every mapped page is a VMA on the host: give back the cached ones (free slots,
            # pre-mapped tails) and try once more before failing.
            freed = self._reclaim(self._reclaimable(plan.lens), self.num_created)
            if not freed:
                raise
            num_unmapped += freed
            num_mapped = self._map_slots(plan.served, plan.need)
        return StepResult(tuple(plan.failed), num_mapped, num_unmapped, out_of_memory=plan.limit < self.max_pages)

    def _map_slots(self, slots: list[int], need: dict[int, int]) -> int:
        """Map pool groups into `slots` up to `need` pages each, in one backend call (atomic)."""
        g = self.geometry
        offsets, groups, takers = [], [], []
        for s in slots:
            for p in range(len(self.slot_pages[s]), need[s]):
                offsets.append(g.page_offset(s, p))
                groups.append(self.pool.pop())
                takers.append(s)
        try:
            self.backend.map(self.bases, offsets, groups, g.page_size)
        except BaseException:
            self.pool.extend(reversed(groups))  # the map was atomic: nothing of it happened
            raise
        for s, grp in zip(takers, groups):
            self.slot_pages[s].append(grp)
            self.refs[grp] = 1
        for s in slots:
            self._pages_changed(s)
        self._note_dirty(takers, groups)
        return len(groups)

    def _note_dirty(self, slots: list[int], groups: list[Any]) -> None:
        """zero_reused_pages: a slot that got a group with someone else's data must be cleared."""
        if self.dirty:
            self.dirty_slots.update(s for s, grp in zip(slots, groups) if grp in self.dirty)

    def _zero_dirty(self, slots: Iterator[int] | dict[int, int]) -> None:
        """Clear the pages of `slots` that hold an earlier request's data (zero_reused_pages)."""
        g = self.geometry
        offsets = []
        for s in slots:
            if s in self.dirty_slots:
                self.dirty_slots.discard(s)
                for p, grp in enumerate(self.slot_pages[s]):
                    if grp in self.dirty:
                        self.dirty.discard(grp)
                        offsets.append(g.page_offset(s, p))
        if offsets:
            self.zero_pages(offsets)

    def _reclaimable(self, lens: dict[int, int]) -> list[tuple[int, int]]:
        """(slot, pages) that may be taken, in the order to take them: free slots with
        fewest pages first (the warm slot last), then pre-mapped tails of active slots
        (past both the step's length and the longest length written)."""
        g = self.geometry
        free = sorted((s for s in self.free_slots if self.slot_pages[s]), key=lambda s: (len(self.slot_pages[s]), s))
        donors = [(s, len(self.slot_pages[s])) for s in free]
        for s in sorted(self.alloc_seq):
            keep = g.pages_for(max(lens.get(s, 0), self.max_lens[s]))
            if len(self.slot_pages[s]) > keep:
                donors.append((s, len(self.slot_pages[s]) - keep))
        return donors


    def _freeable(self, donors: list[tuple[int, int]]) -> int:
        """Groups that unmapping all the donors' (slot, last k pages) and evicting pins would
        free: those whose every reference is among them (a group a live slot maps beyond
        the donors' tails frees nothing)."""
        taken: dict[Any, int] = {}
        for s, k in donors:
            pages = self.slot_pages[s]
            for grp in pages[len(pages) - k:]:
                taken[grp] = taken.get(grp, 0) + 1
        pins, refs = self.pins, self.refs
        return (sum(t + (grp in pins) == refs[grp] for grp, t in taken.items())
                + sum(refs[grp] == 1 for grp in pins))  # pinned, mapped nowhere

    def _reclaim(self, donors: list[tuple[int, int]], count: int) -> int:
        """Unmap the donors' tail pages until `count` groups went back to the pool (a group
        shared with another slot only loses this slot's reference). Returns pages unmapped."""
        g = self.geometry
        offsets, takes, freed = [], [], 0
        left: dict[Any, int] = {}  # references a group keeps after the unmaps planned so far
        for s, k in donors:
            if freed >= count:
                break
            pages = self.slot_pages[s]
            n, take = len(pages), 0
            while take < k and freed < count:
                take += 1
                grp = pages[n - take]
                left[grp] = left.get(grp, self.refs[grp]) - 1
                freed += left[grp] == 0
            if self.last_fence[s] is not None:  # never unmap under a kernel that may read it
                self.backend.wait(self.last_fence[s])
                self.last_fence[s] = None
            offsets += [g.page_offset(s, p) for p in range(n - take, n)]
            takes.append((s, take))
            self.epoch[s] += 1
        # Books change only after the unmap: if it fails, the pages stay booked to their slots
        # (perhaps unreadable now, but never handed to another slot while still mapped).
        self.backend.unmap(self.bases, offsets, g.page_size)
        for s, take in takes:
            pages = self.slot_pages[s]
            self._unref(reversed(pages[len(pages) - take:]))
            del pages[len(pages) - take:]
            self._pages_changed(s)
        return len(offsets)

    def _empty(self, slot: int) -> None:
        """Unmap every page of `slot` (after its fence); groups nobody else maps go to the pool."""
        n = len(self.slot_pages[slot])
        if n:
            self._reclaim([(slot, n)], n)

    def _unref(self, groups: Iterator[Any] | list[Any]) -> None:
        """Drop one slot's reference to each group; a group nobody maps goes to the pool."""
        for grp in groups:
            left = self.refs[grp] - 1
            if left:
                self.refs[grp] = left
            else:
                del self.refs[grp]
                self.pool.append(grp)

    def _unshare_new_owners(self, lens: dict[int, int]) -> bool:
        """A new request must not write into pages another slot shares: unmap every page of
        a freshly allocated slot that still maps a shared group (it keeps nothing of them).
        Returns whether any page was unmapped."""
        changed = False
        for s in list(self.shared_slots):
            pages = self.slot_pages[s]
            if not any(self.refs[grp] > 1 for grp in pages):
                self.shared_slots.discard(s)
            elif s in lens and not self.max_lens[s]:
                self._empty(s)
                self.shared_slots.discard(s)
                changed = True
        return changed

    def _grow(self, count: int, background: bool = False, limit: int | None = None) -> None:
        """Create at least `count` more groups (a chunk at a time) within `limit` (default:
        the budget). In the background the lock is released around the driver call (only
        step and reserve_physical grow the pool otherwise, and both stop the worker first)."""
        room = (self.max_pages if limit is None else limit) - self.num_created
        n = min(room, max(count, _GROW_CHUNK))
        if n <= 0:
            return
        nb, page = self.geometry.num_buffers, self.geometry.page_size
        with self._unlocked(background):
            try:
                groups = self._create(n)
            except OutOfPhysicalMemoryError:
                if n <= count:
                    raise
                n = min(count, room)  # the chunk did not fit; what is needed may
                groups = self._create(n)
        self.num_created += n
        self.pool.extend(reversed(groups))

    def _create(self, n: int) -> list[Any]:
        """Create `n` groups, taking their bytes from the shared budget first (if any)."""
        g = self.geometry
        nbytes = n * g.group_bytes
        if self.budget is not None and not self.budget.try_take(nbytes):
            self._budget_short = max(self._budget_short, nbytes)
            raise OutOfPhysicalMemoryError(
                f"the shared budget has no room for {n} more page groups ({nbytes} bytes); free requests here "
                "or in the caches sharing it, or raise its limit")
        try:
            return self.backend.create(n, g.num_buffers, g.page_size)
        except BaseException:
            if self.budget is not None:
                self.budget.give(nbytes)
            raise

    def _release(self, groups: list[Any]) -> None:
        """Release unmapped groups and give their bytes back to the shared budget."""
        self.backend.release(groups)
        if self.budget is not None and groups:
            self.budget.give(len(groups) * self.geometry.group_bytes)

    def reserve_physical(self, nbytes: int) -> int:
        """Create page groups until at least `nbytes` of physical memory exist. Returns groups created."""
        nbytes = self._index(nbytes, "nbytes")
        if nbytes < 0:
            raise InvalidRequestError(f"nbytes must be >= 0, got {nbytes}")
        n = -(-nbytes // self.geometry.group_bytes)
        with self._quiet():
            if n > self.max_pages:
                raise OutOfPhysicalMemoryError(
                    f"{nbytes} bytes is {n} page groups, over the budget of {self.max_pages} "
                    f"({self.max_pages * self.geometry.group_bytes} bytes); raise physical_memory")
            before = self.num_created
            if n > before:
                groups = self._create(n - before)
                self.num_created = n
                self.pool.extend(reversed(groups))
            return self.num_created - before

    def set_max_pages(self, n: int) -> None:
        """Set the physical budget to `n` page groups (e.g. the minimum over tensor-parallel
        ranks). `n` is an int >= 1 and >= the groups that exist now (`trim()` first to go
        lower); the page groups' size is `geometry.group_bytes`. Raises InvalidRequestError."""
        n = self._index(n, "max_pages")
        with self._quiet():
            if n < max(1, self.num_created):
                raise InvalidRequestError(
                    f"max_pages must be >= 1 and >= the {self.num_created} page groups that exist now, got {n}; "
                    "trim() first to give unused pages back")
            self.max_pages = n

    def _fence_ran(self) -> None:
        """Record a fence for the slots the last iteration read: calls between iterations
        that may unmap pages (fork, map_pinned, trim, resume) must wait for that iteration."""
        fence = self.backend.fence()
        if fence is not None:
            for s in self.ran:
                self.last_fence[s] = fence

    # ----------------------------------------------------------------- swapping ----
    def park(self, reqid: int) -> tuple[int, int]:
        """`free_reqid`, remembering (slot, epoch): while the slot stays untouched (no new
        owner, no page taken), `resume` gets it back with its data, with no copy.

        The caller may have enqueued device work that reads the slot (`swap_out`'s
        asynchronous copy to host): a fence taken now keeps its pages mapped until that
        work finished, even when the slot did not run in the last iteration."""
        with self._lock:
            slot = self._check_active(reqid)
            fence = self.backend.fence()
            if fence is not None:
                self.last_fence[slot] = fence
        self.free_reqid(slot)
        with self._lock:
            return slot, self.epoch[slot]

    def resume(self, slot: int, epoch: int, num_tokens: int) -> tuple[int, bool]:
        """A slot for a parked request of `num_tokens` tokens: its own slot, untouched since
        `park` (returns (slot, False): the data is there), or a new one with pages mapped
        for the tokens (returns (slot, True): copy the data in). Raises NoFreeSlotError or
        OutOfPhysicalMemoryError and changes nothing when it cannot."""
        with self._quiet():
            num_tokens = self._index(num_tokens, "num_tokens")
            if not 0 < num_tokens <= self.max_len:
                raise InvalidRequestError(f"num_tokens={num_tokens} must be in [1, {self.max_len}]")
            if not self.free_slots:
                raise NoFreeSlotError(f"all {self.num_slots} slots are in use; free_reqid() one or raise max_batch_size")
            if slot in self.free_slots and self.epoch[slot] == epoch and self.cap[slot] >= num_tokens:
                self._take(slot)
                self.dirty.difference_update(self.slot_pages[slot][:self.geometry.pages_for(num_tokens)])
                self.max_lens[slot] = num_tokens
                return slot, False
            self._fence_ran()
            new = self._warm_slot()
            self._take(new)
            try:
                if any(self.refs[grp] > 1 for grp in self.slot_pages[new]):  # the copy must not land in shared pages
                    self._empty(new)
                result = self._back({new: num_tokens}, [new]) if self.cap[new] < num_tokens else StepResult()
            except BaseException:
                self._untake(new)
                raise
            if not result:
                self._untake(new)
                raise OutOfPhysicalMemoryError(
                    f"no pages for the {num_tokens} tokens of a swapped-out request; free requests or raise "
                    "physical_memory")
            if self.dirty_slots:  # clear an earlier owner's data first: the copy fills only the tokens
                self._zero_dirty([new])
            self.max_lens[new] = num_tokens
            return new, True

    def _untake(self, slot: int) -> None:
        del self.alloc_seq[slot]
        self.free_slots.add(slot)
        self._pages_changed(slot)

    # ----------------------------------------------------------------- sharing ----
    def fork(self, reqid: int, num_tokens: int) -> int:
        """A new request (returned reqid) whose first `num_tokens` tokens are `reqid`'s.

        The whole pages of those tokens are shared: the new slot maps the same physical
        groups. The partly filled last page is copied into a fresh group (the only copy),
        so both requests write from `num_tokens` on into pages of their own. Raises
        NoFreeSlotError, or OutOfPhysicalMemoryError when no page is left for that copy."""
        with self._quiet():
            parent = self._check_active(reqid)
            num_tokens = self._index(num_tokens, "num_tokens")
            if not 0 < num_tokens <= self.max_lens[parent]:
                raise InvalidRequestError(
                    f"num_tokens={num_tokens} must be in [1, {self.max_lens[parent]}]: the tokens reqid "
                    f"{parent} has (its longest step length)")
            self._fence_ran()
            if not self.free_slots:
                raise NoFreeSlotError(f"all {self.num_slots} slots are in use; free_reqid() one or raise max_batch_size")
            g = self.geometry
            full = num_tokens * g.token_bytes // g.page_size  # whole pages: shared
            copy = g.pages_for(num_tokens) - full  # 1 if the last page is partly filled
            if copy and self.copy_pages is None:
                raise InvalidRequestError("this cache cannot copy pages; fork at a page boundary")
            # The emptiest free slot, leaving the warm one (the worker pre-maps it) to alloc_reqid.
            warm = self._warm_slot()
            child = min(self.free_slots, key=lambda s: (s == warm, len(self.slot_pages[s]), s))
            self._empty(child)  # it keeps nothing of its earlier requests
            fresh = []
            if copy:
                if not self.pool:
                    try:
                        self._grow(1)
                    except OutOfPhysicalMemoryError:
                        pass
                if not self.pool:
                    donors = [(s, k) for s, k in self._reclaimable({}) if s != child]
                    self._reclaim(donors, 1)
                if not self.pool:
                    self._evict(1)
                if not self.pool:
                    raise OutOfPhysicalMemoryError(
                        f"no page left for the copy of reqid {parent}'s last partial page; free a request or "
                        "raise physical_memory")
                fresh = [self.pool.pop()]
            shared = self.slot_pages[parent][:full]
            groups = shared + fresh
            offsets = [g.page_offset(child, p) for p in range(len(groups))]
            try:
                self.backend.map(self.bases, offsets, groups, g.page_size)
            except BaseException:
                self.pool.extend(fresh)  # the map was atomic: nothing of it happened
                raise
            if copy:
                try:
                    self.copy_pages([(g.page_offset(parent, full), g.page_offset(child, full))])
                except BaseException:
                    self.backend.unmap(self.bases, offsets, g.page_size)
                    self.pool.extend(fresh)
                    raise
            for grp in shared:
                self.refs[grp] += 1
            self.refs.update(dict.fromkeys(fresh, 1))
            self.dirty.difference_update(fresh)  # overwritten by the copy
            self.slot_pages[child] = groups
            if shared:
                self.shared_slots.update((parent, child))
            self._take(child)
            self._pages_changed(child)
            self.max_lens[child] = num_tokens
            return child

    def trim(self) -> int:
        """Give back now every page no live token needs (free slots, pre-mapped tails, pinned
        prefix pages no slot maps): unmap and release them. Returns the page groups released."""
        with self._quiet():
            self._fence_ran()
            donors = self._reclaimable({})
            self._reclaim(donors, self.num_created)
            self._evict(len(self.pins))
            return self._release_pool(len(self.pool))

    def _release_pool(self, count: int) -> int:
        """Release up to `count` pool groups (lock held). Returns how many."""
        groups = self.pool[len(self.pool) - count:] if count else []
        del self.pool[len(self.pool) - len(groups):]
        self.dirty.difference_update(groups)
        self._release(groups)
        self.num_created -= len(groups)
        return len(groups)

    def _give_back(self, nbytes: int) -> int:
        """The shared budget asks for memory (another cache is short): release pool groups,
        then cached pages (free slots, pre-mapped tails, pins no slot maps), up to `nbytes`.
        Never raises. Returns the bytes given back."""
        gb = self.geometry.group_bytes
        want = -(-nbytes // gb)
        try:
            with self._quiet():
                if len(self.pool) < want:
                    self._fence_ran()
                    self._reclaim(self._reclaimable({}), want - len(self.pool))
                    if len(self.pool) < want:
                        self._evict(want - len(self.pool))
                return self._release_pool(min(want, len(self.pool))) * gb
        except Exception:  # closed, or a driver call failed: give what we can, which is nothing
            return 0

    def _cached_bytes(self) -> int:
        """An estimate, without the lock, of what `_give_back` could give now."""
        pages = self.slot_pages
        cached = len(self.pool) + sum(len(pages[s]) for s in list(self.free_slots)) + len(self.pins)
        return cached * self.geometry.group_bytes

    def pin(self, reqid: int, num_pages: int) -> list[tuple[Any, int]]:
        """Keep the first `num_pages` pages of `reqid` (whole pages of tokens it wrote) after
        the request ends, for the prefix cache. Returns one handle per page; a page already
        pinned keeps its handle (and becomes the most recently used)."""
        with self._lock:
            self._check_open()
            slot = self._check_active(reqid)
            num_pages = self._index(num_pages, "num_pages")
            full = self.max_lens[slot] * self.geometry.token_bytes // self.geometry.page_size
            if not 0 <= num_pages <= full:
                raise InvalidRequestError(
                    f"num_pages={num_pages}: reqid {slot} has {full} whole pages of tokens to pin")
            handles = []
            for grp in self.slot_pages[slot][:num_pages]:
                gen = self.pins.get(grp)
                if gen is None:
                    gen = self.pins[grp] = next(self._generation)
                    self.refs[grp] += 1
                else:
                    self.pins.move_to_end(grp)
                handles.append((grp, gen))
            if handles:
                self.shared_slots.add(slot)  # its pinned pages are shared with the prefix cache
            return handles

    def num_pinned(self, handles: Sequence[tuple[Any, int]]) -> int:
        """How many of `handles`, from the first, are still pinned (not evicted); marks them
        most recently used."""
        with self._lock:
            n = 0
            for grp, gen in handles:
                if self.pins.get(grp) != gen:
                    break
                self.pins.move_to_end(grp)
                n += 1
            return n

    def map_pinned(self, reqid: int, handles: Sequence[tuple[Any, int]]) -> int:
        """Map pinned pages as the first pages of a request that has not run yet (its slot
        keeps nothing of earlier requests) and count their tokens as written. Returns the
        number of tokens mapped: the leading handles that are still pinned."""
        with self._quiet():
            slot = self._check_active(reqid)
            g = self.geometry
            if not g.whole_tokens_per_page:
                raise InvalidRequestError(
                    f"a page of {g.page_size} bytes does not hold a whole number of {g.token_bytes}-byte "
                    "tokens; pick a page size that does to map pinned pages")
            if self.max_lens[slot]:
                raise InvalidRequestError(f"reqid {slot} has run already; map pinned pages before its first step")
            self._fence_ran()
            groups = []
            for grp, gen in handles:
                if self.pins.get(grp) != gen:
                    break
                groups.append(grp)
            if not groups:
                return 0
            self._empty(slot)  # a reused slot: drop its pages first
            self.backend.map(self.bases, [g.page_offset(slot, p) for p in range(len(groups))], groups, g.page_size)
            for grp in groups:
                self.refs[grp] += 1
                self.pins.move_to_end(grp)
            self.dirty.difference_update(groups)  # the prefix's data: never cleared
            self.slot_pages[slot] = list(groups)
            self.shared_slots.add(slot)
            self.max_lens[slot] = len(groups) * g.whole_tokens_per_page
            self._pages_changed(slot)
            return self.max_lens[slot]

    def truncate_pinned(self, reqid: int, num_tokens: int) -> int:
        """Keep only the first `num_tokens` tokens of what `map_pinned` mapped into a request
        that has not run yet, unmapping the later pages (they stay pinned): tensor-parallel
        ranks keep the prefix all of them could map. `num_tokens` is a whole number of pages,
        at most what is mapped. Returns the pages unmapped."""
        with self._quiet():
            slot = self._check_active(reqid)
            num_tokens = self._index(num_tokens, "num_tokens")
            tpp = self.geometry.whole_tokens_per_page
            mapped, pages = self.max_lens[slot], self.slot_pages[slot]
            if not mapped or mapped != len(pages) * tpp or any(grp not in self.pins for grp in pages):
                raise InvalidRequestError(  # it ran (or holds other pages): its own tokens would be lost
                    f"reqid {slot} does not hold just the pinned pages map_pinned mapped into it (it ran, or "
                    "nothing was mapped): truncate_pinned right after map_pinned, before its first step")
            if not tpp or num_tokens < 0 or num_tokens % tpp or num_tokens > mapped:
                raise InvalidRequestError(
                    f"num_tokens={num_tokens} must be a whole number of pages of at most the {mapped} tokens "
                    f"map_pinned mapped into reqid {slot}")
            drop = len(pages) - num_tokens // tpp
            unmapped = self._reclaim([(slot, drop)], drop) if drop else 0
            self.max_lens[slot] = num_tokens
            return unmapped

    def _evict(self, count: int) -> int:
        """Unpin up to `count` pinned groups that no slot maps, least recently used first;
        they go to the pool. Returns how many."""
        refs, victims = self.refs, []
        for grp in self.pins:
            if len(victims) >= count:
                break
            if refs[grp] == 1:
                victims.append(grp)
        for grp in victims:
            del self.pins[grp]
        self._unref(victims)
        return len(victims)

    # ------------------------------------------------------------- prefetching ----
    def _schedule_prefetch(self, edge: list[int] | None) -> None:
        """Plan what the next iterations will want: `prefetch_tokens` more tokens for every
        running request that is that close to a page (`edge`; None: find them), then pages
        for the request that gets the warm slot. Hand it to the worker (or do it now)."""
        g, max_len, lens, ahead = self.geometry, self.max_len, self.ran, self.prefetch_tokens
        if edge is None:
            edge = self._short(lens)[1]
        job = [(s, g.pages_for(min(lens[s] + ahead, max_len))) for s in edge]
        if self.free_slots and self.eager_tokens:
            job.append((self._warm_slot(), g.pages_for(min(int(self.eager_tokens), max_len))))
        job = [(s, t) for s, t in job if t > len(self.slot_pages[s])]
        if not job or self.premapper.busy:  # busy: a step beside the worker; the next one plans again
            return
        if not self.background:
            try:
                self._run_job(job)
            except Exception as e:  # pre-mapping is best effort; the next step maps on demand
                self._record_worker_error(e)
            return
        self.premapper.submit(job)

    def _run_job(self, job: list[tuple[int, int]], background: bool = False) -> None:
        """Map pool (or newly created) pages into the job's slots; never reclaims.

        Lock held on entry. In the background it is released around each driver call:
        nothing else changes `slot_pages` meanwhile (only step and close do, and they stop
        the worker first), and the batch's groups sit in `in_flight` until committed."""
        g = self.geometry
        for s, target in job:
            while not (background and self.premapper.stopped):
                have = len(self.slot_pages[s])
                n = min(target - have, self._worker_batch)
                if n <= 0:
                    break
                if len(self.pool) < n:
                    try:
                        self._grow(n - len(self.pool), background)
                    except OutOfPhysicalMemoryError:
                        pass  # a shortage now: pre-map what the pool has; step tries again later
                    n = min(n, len(self.pool))
                    if n == 0 or (background and self.premapper.stopped):
                        return
                groups = [self.pool.pop() for _ in range(n)]
                offsets = [g.page_offset(s, have + i) for i in range(n)]
                self.in_flight = groups
                try:
                    with self._unlocked(background):
                        self.backend.map(self.bases, offsets, groups, g.page_size)
                except BaseException:
                    self.pool.extend(reversed(groups))  # the map was atomic
                    raise
                finally:
                    self.in_flight = []
                self.slot_pages[s].extend(groups)
                self.refs.update(dict.fromkeys(groups, 1))
                self._pages_changed(s)
                self._note_dirty([s] * n, groups)

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Hold the lock with the worker stopped (after its batch in flight) and the cache
        open: what every call that changes pages needs."""
        self.premapper.cancel = True  # before taking the lock: the worker stops at its next batch
        with self._lock:
            self._check_open()
            self.premapper.quiesce()
            self._check_open()  # close() may have run while we waited
            yield

    @contextlib.contextmanager
    def _unlocked(self, release: bool) -> Iterator[None]:
        """Drop the (held) lock for the block when `release`: the worker's driver calls."""
        if not release:
            yield
            return
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def _record_worker_error(self, e: BaseException) -> None:
        if self.worker_error is None:
            warnings.warn(f"vattn: background pre-mapping failed ({e}); step() maps on demand",
                          RuntimeWarning, stacklevel=2)
        self.worker_error = e

    def synchronize(self) -> None:
        """Wait until the background pre-mapping of the last step is done."""
        with self._lock:
            self.premapper.wait()

    # ------------------------------------------------------------------ figures ----
    def stats(self) -> MemoryStats:
        with self._lock:
            self._check_open()
            g = self.geometry
            refs, pins = self.refs, self.pins
            pin_only = sum(refs[grp] == 1 for grp in pins)
            mapped = len(refs) - pin_only  # distinct groups mapped in a slot: a shared one is memory once
            holding = {grp for s in self.alloc_seq for grp in self.slot_pages[s][:g.pages_for(self.max_lens[s])]}
            cached = len(refs) - len(holding)  # pages under no live token (pinned ones too)
            spare = len(self.pool) + (self.max_pages - self.num_created) + cached
            return MemoryStats(
                page_size=g.page_size,
                group_bytes=g.group_bytes,
                num_created_pages=self.num_created,
                num_free_pages=len(self.pool),
                num_mapped_pages=mapped,
                num_cached_pages=cached,
                max_pages=self.max_pages,
                mapped_bytes=mapped * g.group_bytes,
                used_bytes=sum(self.max_lens[s] for s in self.alloc_seq) * g.token_bytes_all,
                free_tokens=spare * g.page_size // g.token_bytes,
                num_active=len(self.alloc_seq),
                num_pinned_pages=len(pins),
            )

    def check_invariants(self) -> None:
        """Assert the books are consistent (for tests and debugging)."""
        with self._lock:
            mapped = [grp for pages in self.slot_pages for grp in pages]
            counts: dict[Any, int] = {}
            for grp in mapped:
                counts[grp] = counts.get(grp, 0) + 1
            for grp in self.pins:
                counts[grp] = counts.get(grp, 0) + 1
            assert counts == self.refs, "reference counts differ from the slots' pages and the pins"
            everywhere = list(counts) + self.pool + self.in_flight
            assert len(everywhere) == self.num_created <= self.max_pages
            assert len(set(everywhere)) == self.num_created, "a group is in two places"
            for s, pages in enumerate(self.slot_pages):
                assert len(set(pages)) == len(pages), f"slot {s} maps a group twice"
                if any(counts[grp] > 1 for grp in pages):
                    assert s in self.shared_slots
            for s in self.alloc_seq:  # the writable tail (from the length on) is the slot's own
                if not self.max_lens[s]:  # not stepped yet: its first step unshares it
                    continue
                pages = self.slot_pages[s]
                first_writable = self.max_lens[s] * self.geometry.token_bytes // self.geometry.page_size
                assert all(counts[grp] == 1 for grp in pages[first_writable:]), f"slot {s} may write a shared page"
            assert self.free_slots.isdisjoint(self.alloc_seq)
            assert len(self.free_slots) + len(self.alloc_seq) == self.num_slots
            for s in self.alloc_seq:
                assert len(self.slot_pages[s]) >= self.geometry.pages_for(self.max_lens[s])
                assert len(self.slot_pages[s]) <= self.geometry.pages_per_slot

    # ------------------------------------------------------------------ closing ----
    def close(self) -> None:
        """Stop the worker, unmap and release every page (after the device finished)."""
        if self.premapper.is_worker():
            # The garbage collector ran the cache's finalizer on the worker thread, which
            # cannot join itself (and may hold the lock): close from another thread.
            threading.Thread(target=self.close, name="vattn-close", daemon=True).start()
            return
        self.premapper.cancel = True
        with self._lock:
            if self._closed:
                return
            self.premapper.quiesce()
            self._closed = True
            self.premapper.cv.notify_all()
        self.premapper.join()
        # Every page is given back even when a driver call fails on the way; the first
        # error is raised at the end.
        errors: list[Exception] = []
        with self._lock:
            g = self.geometry
            try:
                fence = self.backend.fence()
                if fence is not None:
                    self.backend.wait(fence)
            except Exception as e:
                errors.append(e)
            offsets = [g.page_offset(s, p) for s in range(self.num_slots) for p in range(len(self.slot_pages[s]))]
            for _ in range(2):  # once more if the unmap failed (a transient error)
                try:
                    self.backend.unmap(self.bases, offsets, g.page_size)
                    break
                except Exception as e:
                    errors.append(e)
            groups = self.pool + list(self.refs)  # each group once, however many slots map it
            self.pool, self.slot_pages, self.refs = [], [[] for _ in range(self.num_slots)], {}
            self.cap = [0] * self.num_slots
            self.pins.clear()
            self.shared_slots.clear()
            self.dirty.clear()
            self.dirty_slots.clear()
            try:
                self._release(groups)
            except Exception as e:
                errors.append(e)
            self.num_created = 0
        if self.budget is not None:
            self.budget.unregister(self._budget_token)
        if errors:
            raise errors[0]

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this cache was closed; create a new one with vattn.init()")
