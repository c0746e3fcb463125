"""`Coordinator`: the slot allocator's API over every layer kind of a cache, and its
threading (one lock over the books; one pre-mapping worker, stopped around every call that
moves pages), composed of parts with one job each. Plain Python.

```
Coordinator       alloc_reqid / free_reqid / step, fork, pins, swap, snapshots, trim, budget, close
 |- slots         Slots        slots, lengths, fences, the lock           (books.py)
 |- kinds         one manager per layer kind (kinds.py): full attention, sliding window,
 |   |            recurrent state; each a SlotBooks (its pages) and a Mapper (its movements)
 |- layer         PageLayer    every kind's page groups on one budget      (vattn/pages.py)
 |- plans         StepPlan     every kind planned before any maps          (plan.py)
 |- premapper     Premapper    one background worker for every kind        (premap.py)
 '- sharing, swap fork, pins, prefixes; park / resume                      (sharing.py, swap.py)
```
A step is all or nothing across the kinds: a slot is served in every kind or in none, and a
slot that fails keeps exactly the lengths and pages it had (a sliding window's give-back is
part of the plan). Unmapping waits for the device: a step records a fence (a CUDA event on
the current stream) for every slot the previous iteration ran, and a slot's pages are
unmapped only after its fence. A slot freed after an iteration still gets that iteration's
fence (`ran` is not cleared by free_reqid).

The budget is in bytes: `max_bytes` caps the page groups every kind created (one page of
every buffer of the cache is `unit_bytes`; `max_pages` counts those units). With a shared
`vattn.Budget` the page layer also takes every group's bytes from it.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from vattn.allocator import sharing, swap
from vattn.allocator.books import MemoryStats, Slots, SlotBooks, as_index
from vattn.allocator.kinds import FullAttention, RecurrentState, SlidingWindow, StateBooks, StateGeometry, StateMapper
from vattn.allocator.mapper import Mapper, budget_refused, carry_out
from vattn.allocator.plan import (
    StepPlan,
    StepResult,
    check_reads,
    normalize,
    plan_backing,
    plan_step,
    reclaimable,
    short_and_edge,
)
from vattn.allocator.premap import Premapper, map_ahead, plan_premap
from vattn.checks import as_int, is_int
from vattn.errors import InvalidRequestError, NoFreeSlotError, OutOfPhysicalMemoryError
from vattn.pages import PageLayer

if TYPE_CHECKING:  # the books import no torch: sizes are ints by the time they get here
    from vattn.allocator.books import KindGeometry
    from vattn.vmem.base import Backend


_BACKED = StepResult()  # (frozen: one for every step that maps nothing)


@dataclass(frozen=True)
class KindSpec:
    """One layer kind of a cache, as the cache lays it out: its name ("full", "window=W",
    "state"), byte layout, buffers (their base addresses), and for a sliding window its
    tokens (with the kernels' margin), for recurrent states the snapshot rows after the
    slots' rows. `zero_pages(offsets)` clears pages (zero_reused_pages); `copy_pages(pairs)`
    copies pages between offsets in every buffer of the kind (fork, snapshots)."""

    name: str
    geometry: KindGeometry
    bases: Sequence[int]
    window: int | None = None
    num_snapshots: int = 0
    zero_pages: Callable[[list[int]], None] | None = None
    copy_pages: Callable[[list[tuple[int, int]]], None] | None = None

    @property
    def is_state(self) -> bool:
        return isinstance(self.geometry, StateGeometry)


class Coordinator:
    """Books and page movement for one cache, every layer kind. Used through `vattn.KVCache`.

    Cost grows with the work, not the capacity: a `step` that maps nothing touches only the
    requests it names (one pass over them), and the slot `alloc_reqid` hands out next comes
    from a heap.
    """

    def __init__(self, backend: Backend, kinds: Sequence[KindSpec], *, num_slots: int, max_len: int,
                 max_bytes: int, background: bool, prefetch: bool, prefetch_tokens: int = 1,
                 budget: Any = None) -> None:
        """`kinds`: the cache's layer kinds, the first one's pages the warm slot's measure
        (full attention when there is one). `max_bytes`: the budget of every kind's page
        groups. `budget`: a `vattn.Budget` shared with other caches and pools: every group
        created is taken from it, others may ask for our cached pages, and a step it refused
        asks them next time."""
        if not kinds:
            raise ValueError("a cache has one layer kind or more")
        self.backend = backend
        self.background = background
        self.prefetch = prefetch
        # look-ahead: a slot within this many tokens of its next page pre-maps it
        self.prefetch_tokens = prefetch_tokens
        self.worker_error: BaseException | None = None
        self.slots = slots = Slots(num_slots, max_len)
        self.layer = PageLayer(backend, kinds[0].geometry.page_size, budget=budget, reclaim=self._give_back,
                               cached=self._cached_bytes)
        self.kinds: list[FullAttention] = []
        for i, spec in enumerate(kinds):
            physical = self.layer.add_kind(spec.bases)
            if spec.is_state:
                books: SlotBooks = StateBooks(spec.geometry, physical, slots, num_snapshots=spec.num_snapshots,
                                              name=spec.name)
                kind: FullAttention = RecurrentState(spec.name, books, StateMapper(books, copy_pages=spec.copy_pages))
            else:
                books = SlotBooks(spec.geometry, physical, slots, track_dirty=spec.zero_pages is not None,
                                  window=spec.window, primary=i == 0, name=spec.name)
                mapper = Mapper(books, zero_pages=spec.zero_pages, copy_pages=spec.copy_pages)
                kind = (SlidingWindow if spec.window is not None else FullAttention)(spec.name, books, mapper)
            self.kinds.append(kind)
        self._books = [kind.books for kind in self.kinds]
        self._mappers = [kind.mapper for kind in self.kinds]
        self._windows = [kind.books for kind in self.kinds if kind.books.window is not None]
        self._states = [kind for kind in self.kinds if isinstance(kind, RecurrentState)]
        self._pinned = sharing.pinned_kinds(self.kinds)
        self.unit_bytes = sum(b.geometry.group_bytes for b in self._books)  # one page of every buffer
        self.max_bytes = max_bytes
        self.premapper = Premapper(slots.lock, lambda job: map_ahead(self._mappers, job, self.max_bytes,
                                                                     self.premapper), self._record_worker_error)

    @property
    def books(self) -> SlotBooks:
        """The first kind's books (its pages; the slots' books through it)."""
        return self._books[0]

    @property
    def geometry(self) -> Any:
        return self._books[0].geometry

    # ------------------------------------------------------------------ slots ----
    def alloc_reqid(self) -> int:
        """A free slot: the warm one (most pages of the first kind mapped)."""
        slots = self.slots
        with slots.lock:
            slots.check_open()
            if not slots.free_slots:
                raise NoFreeSlotError(
                    f"all {slots.num_slots} slots are in use; free_reqid() one or raise max_batch_size")
            slot = slots.warm_slot()
            swap.take(slots, self.kinds, slot)
            return slot

    def free_reqid(self, reqid: int) -> None:
        slots = self.slots
        with slots.lock:
            slots.check_open()
            slot = slots.check_active(reqid)
            slots.free(slot)
            for kind in self.kinds:
                kind.freed(slot)

    def num_tokens(self, reqid: int) -> int:
        """The tokens `reqid` holds: its longest step length since alloc (what fork, pin and
        swap_out may take)."""
        with self.slots.lock:
            return self.slots.max_lens[self.slots.check_active(reqid)]

    def allocation(self, slot: int) -> int | None:
        """Which allocation holds `slot` now: a number no later `alloc_reqid` (or fork, or
        swap-in) gives again; None while the slot is free."""
        return self.slots.active.get(slot)

    @property
    def num_free_slots(self) -> int:
        return len(self.slots.free_slots)

    def first_pages(self, slot: int) -> list[int]:
        """Per kind, the first page `slot` still maps (pages before it were given back)."""
        with self.slots.lock:
            return [kind.first_page(slot) for kind in self.kinds]

    # ------------------------------------------------------------------- step ----
    def step(self, seq_lens: Sequence[int] | Mapping[int, int]) -> StepResult:
        slots, books, layer, ahead = self.slots, self._books, self.layer, self.prefetch_tokens
        short_bytes = layer.take_budget_short()
        if short_bytes:  # the budget refused us last time: ask the others (never under our lock)
            layer.budget.reclaim(short_bytes, requester=layer.budget_token)
        if self.premapper.busy:  # the worker is mapping: a step that needs nothing new runs beside it
            with slots.lock:
                slots.check_open()
                lens, short, edge = normalize(slots, books, seq_lens, ahead)
                if not (short or self._moves(lens)):
                    slots.fence_ran(layer.fence())
                    return self._finish_step(lens, _BACKED, edge)
        with self._quiet():  # the worker stopped after its batch in flight
            lens, short, edge = normalize(slots, books, seq_lens, ahead)
            windows = self._windows
            if windows:
                check_reads(windows, lens)
            slots.fence_ran(layer.fence())
            if (windows or self._shared()) and sharing.unshare_new_owners(self.kinds, lens):
                short, edge = short_and_edge(books, lens, ahead)
            result = _BACKED
            if short or (windows and self._gives_back(lens)):
                plan, mapped, unmapped = self._carry(lambda limit: plan_step(books, lens, short, limit))
                result = StepResult(plan.failed, mapped, unmapped, out_of_memory=plan.limit < self.max_bytes)
                for s in plan.failed:  # not backed: this iteration will not run them
                    del lens[s]
            for kind in self.kinds:
                if kind.books.dirty_slots:
                    kind.mapper.zero_dirty(lens)
            return self._finish_step(lens, result, edge if not short else None)

    def can_step(self, seq_lens: Sequence[int] | Mapping[int, int]) -> bool:
        """Whether `step(seq_lens)` would back every slot, planned from the books alone
        (nothing maps, nothing moves): the scheduler asks before it admits a request or
        restores a prefix into it, so that neither takes the pages the running requests need
        this iteration. An estimate where a sliding window must first unshare pages a new
        owner writes (the step plans those moves itself); a device that refuses pages the
        budget allows is seen only by the step."""
        with self.slots.lock:
            self.slots.check_open()
            lens, short, _ = normalize(self.slots, self._books, seq_lens, 0)
            if not (short or (self._windows and self._gives_back(lens))):
                return True
            return not plan_step(self._books, lens, short, self.max_bytes).failed

    def _shared(self) -> bool:
        """Whether some kind's slot may map a group another slot shares (lock held)."""
        for b in self._books:
            if b.shared_slots:
                return True
        return False

    def _moves(self, lens: dict[int, int]) -> bool:
        """Whether the step must stop the worker though no slot is short: pages shared with a
        new owner, pages to clear, pages behind a window to give back (or holes where a new
        owner reads), snapshots to plan (lock held)."""
        for b in self._books:
            if b.shared_slots or b.dirty_slots:
                return True
        if self._windows and any(b.first_needed(s, n) != b.holes(s) for b in self._windows for s, n in lens.items()):
            return True
        return bool(self._states) and any(kind.due(s, n) for kind in self._states for s, n in lens.items())

    def _gives_back(self, lens: dict[int, int]) -> bool:
        return any(b.first_needed(s, n) > b.holes(s) for b in self._windows for s, n in lens.items())

    def _carry(self, make_plan: Callable[[int], StepPlan]) -> tuple[StepPlan, int, int]:
        return carry_out(self._mappers, make_plan, self.max_bytes)

    def _finish_step(self, lens: dict[int, int], result: StepResult, edge: list[int] | None) -> StepResult:
        """The books of the iteration `lens` runs (lock held), and what to pre-map next."""
        slots = self.slots
        ml, prev, older, moved = slots.max_lens, slots.prev_lens, slots.older_lens, slots.moved_at
        started: list[tuple[int, int, int]] | None = [] if self._states else None
        slots.num_steps += 1
        step = slots.num_steps
        for s, n in lens.items():
            m = ml[s]
            if n > m:
                if not m:  # a new request's first length
                    slots.eager_tokens = n if not slots.eager_tokens else 0.8 * slots.eager_tokens + 0.2 * n
                ml[s] = n
                older[s] = prev[s]  # (what revert_step restores)
                prev[s] = m
                moved[s] = step
                if started is not None:
                    started.append((s, m, n))
        slots.ran = lens
        if started:  # (a step that runs beside the worker has no snapshot due: `_moves`)
            for kind in self._states:
                for s, m, n in started:
                    kind.after_step(s, m, n, lambda: self._new_snapshot_row(lens))
        if result and self.prefetch:
            self._premap(edge)
        return result

    def revert_step(self, reqids: Sequence[int]) -> None:
        """The last step's iteration will not run for these slots (another tensor-parallel
        rank could not back them): their lengths go back to what they were before it, as if
        they had failed here too (the pages it mapped stay, as pre-mapped pages; the pages it
        gave back behind a window are those any iteration from the same start gives back;
        the snapshot rows it planned are wanted again). Slots the last step did not move are
        left alone."""
        slots = self.slots
        with slots.lock:
            for s in reqids:
                if s not in slots.active or slots.moved_at[s] != slots.num_steps:
                    continue
                slots.max_lens[s], slots.prev_lens[s] = slots.prev_lens[s], slots.older_lens[s]
                slots.moved_at[s] = 0
                slots.ran.pop(s, None)
                for kind in self._states:
                    kind.books.unplan(s)

    def _premap(self, edge: list[int] | None) -> None:
        """Hand what the next iterations will want to the worker, or map it now without one
        (`background=False`: the same books, the tests rely on that). `edge`: the slots
        near a page (None: find them)."""
        if edge is None:
            edge = short_and_edge(self._books, self.slots.ran, self.prefetch_tokens)[1]
        job = plan_premap(self._books, edge, self.prefetch_tokens)
        if not job or self.premapper.busy:  # busy: a step beside the worker; the next one plans again
            return
        if not self.background:
            try:
                map_ahead(self._mappers, job, self.max_bytes)
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
        with self.slots.lock:
            self.premapper.wait()

    # ---------------------------------------------------------------- sharing ----
    def fork(self, reqid: int, num_tokens: int) -> int:
        """See `KVCache.fork`."""
        with self._quiet():
            return sharing.fork(self.slots, self.kinds, self._carry, reqid, num_tokens, self.layer.fence())

    def can_fork(self, reqid: int, num_tokens: int) -> bool:
        """Whether `fork(reqid, num_tokens)` finds what the child reads in every kind (a
        sliding window may have moved past it; recurrent states are right at one length)."""
        with self.slots.lock:
            slot = self.slots.check_active(reqid)
            num_tokens = as_index(num_tokens, "num_tokens")
            return all(kind.can_fork(slot, num_tokens) for kind in self.kinds)

    def pin(self, reqid: int, num_pages: int) -> list[sharing.Handle]:
        """See `KVCache.pin`."""
        with self.slots.lock:
            self.slots.check_open()
            return sharing.pin(self.slots, self._pinned, reqid, num_pages)

    def num_pinned(self, handles: Sequence[sharing.Handle]) -> int:
        """How many of `handles`, from the first, are still pinned (not evicted); marks them
        most recently used."""
        with self.slots.lock:
            return sharing.num_pinned(self._pinned, handles)

    def is_pinned(self, handles: Sequence[sharing.Handle]) -> bool:
        """Whether every one of `handles` is still pinned (a cached block's pages)."""
        return sharing.is_pinned(self._pinned, handles)

    def map_pinned(self, reqid: int, handles: Sequence[sharing.Handle]) -> int:
        """See `KVCache.map_pinned`."""
        with self._quiet():
            return sharing.map_pinned(self.slots, self._pinned, reqid, handles, self.layer.fence())

    def truncate_pinned(self, reqid: int, num_tokens: int) -> int:
        """See `KVCache.truncate_pinned`."""
        with self._quiet():
            return sharing.truncate_pinned(self.slots, self._pinned, reqid, num_tokens)

    def extend_prefix(self, reqid: int, num_tokens: int) -> tuple[int, list[tuple[int, int]]]:
        """See `KVCache.extend_prefix`."""
        with self._quiet():
            return sharing.extend_prefix(self.slots, self.kinds, self._carry, reqid, num_tokens, self.layer.fence())

    def drop_prefix(self, reqid: int) -> None:
        """See `KVCache.drop_prefix`."""
        with self._quiet():
            slot = self.slots.check_active(reqid)
            self.slots.fence_ran(self.layer.fence())
            sharing.drop_prefix(self.slots, self.kinds, slot)

    def first_reads(self, num_tokens: int) -> list[int]:
        """Per K/V kind (the kinds of a pin handle, in order), the first page the query right
        after a slot's first `num_tokens` tokens reads (0 but for a sliding window)."""
        return [sharing.first_read(kind.books, num_tokens) for kind in self._pinned]

    @property
    def pins(self) -> OrderedDict[Any, int]:
        """The first K/V kind's pinned groups -> the generation of their pin, least recently
        used first (read only; what a handle's first pair names)."""
        return self._pinned[0].books.pins

    # --------------------------------------------------------------- swapping ----
    def check_swap_out(self, reqid: int, num_tokens: int) -> None:
        """InvalidRequestError where a kind cannot park `reqid` at `num_tokens` (recurrent
        states are right at their slot's length only)."""
        with self.slots.lock:
            slot = self.slots.check_active(reqid)
            for kind in self.kinds:
                kind.check_swap_out(slot, num_tokens)

    def park(self, reqid: int) -> tuple[int, tuple[int, ...]]:
        """`free_reqid`, remembering (slot, the kinds' epochs): while a kind's pages of the
        slot stay untouched (no new owner, no page taken), `resume` gets them back with their
        data, with no copy. Its pages stay mapped until device work enqueued before this call
        finished."""
        with self.slots.lock:
            slot = swap.fence_parked(self.slots, reqid, self.layer.fence())
        self.free_reqid(slot)
        with self.slots.lock:
            return slot, tuple(kind.books.epoch[slot] for kind in self.kinds)

    def resume(self, slot: int, epochs: Sequence[int], num_tokens: int,
               first_pages: Sequence[int] | None = None) -> tuple[int, tuple[bool, ...]]:
        """See `swap.resume`: (slot, per kind whether its data must be copied in)."""
        firsts = list(first_pages) if first_pages is not None else [0] * len(self.kinds)
        with self._quiet():
            return swap.resume(self.slots, self.kinds, self._carry, slot, epochs, num_tokens, firsts,
                               self.layer.fence())

    # -------------------------------------------------------------- snapshots ----
    def _state(self) -> RecurrentState:
        if not self._states:
            raise InvalidRequestError("this cache keeps no recurrent states (state_bytes=0): it has no snapshots")
        return self._states[0]

    def want_snapshots(self, reqid: int, boundaries: Sequence[int]) -> None:
        """Snapshot `reqid`'s states when an iteration passes each of these token counts (the
        step that plans it gives it a snapshot row when memory allows: `planned_snapshots`)."""
        books = self._state().books
        with self.slots.lock:
            slot = self.slots.check_active(reqid)
            want = {as_int(b, "boundary", InvalidRequestError, low=1) for b in boundaries}
            if want:
                books.wants[slot] = want
            else:
                books.wants.pop(slot, None)

    def planned_snapshots(self) -> dict[int, dict[int, int]]:
        """Per slot of the last step, {token count: snapshot row} its iteration writes (the
        state layers copy their states there when they reach that count)."""
        if not self._states:
            return {}
        books = self._states[0].books
        with self.slots.lock:
            return {s: dict(rows) for s, rows in books.planned.items() if s in self.slots.ran}

    def take_snapshots(self, reqid: int, upto: int) -> dict[int, int]:
        """The snapshot rows `reqid`'s computed iterations wrote at token counts up to `upto`
        ({count: row}): the caller keeps each (`pin_snapshot`) or frees it."""
        books = self._state().books
        upto = as_index(upto, "upto")
        with self.slots.lock:
            slot = self.slots.check_active(reqid)
            out: dict[int, int] = {}
            for held in (books.taken.get(slot), books.planned.get(slot)):
                for b in [b for b in held or () if b <= upto]:
                    out[b] = held.pop(b)
            books.loose.update(out.values())
            return out

    def snapshot(self, reqid: int) -> int | None:
        """A snapshot row holding `reqid`'s states as they are now, or None (no row, or no
        memory even after evicting cached snapshots). InvalidRequestError when `reqid` has no
        states of its own yet: not stepped since its slot was allocated (its row is unmapped,
        or holds an earlier request's), or a restore is pending (`restore_snapshot`)."""
        kind = self._state()
        with self._quiet():
            slot = self.slots.check_active(reqid)
            if slot not in kind.books.has_states or slot in kind.books.restores:
                raise InvalidRequestError(
                    f"reqid {slot} has no recurrent states of its own yet (they come at its first step"
                    f"{', with the snapshot it restores' if slot in kind.books.restores else ''}): step it first")
            row = self._new_snapshot_row({})
            if row is not None:
                g = kind.geometry
                kind.mapper.copy_pages([(g.page_offset(slot, p), g.page_offset(row, p))
                                        for p in range(g.pages_per_slot)])
                kind.books.loose.add(row)
            return row

    def snapshot_row(self) -> int | None:
        """A free snapshot row with its pages mapped, for the caller to fill (a snapshot
        restored from a lower tier), or None when no row or memory is left; keep it with
        `pin_snapshot` or give it back with `free_snapshot`."""
        books = self._state().books
        with self._quiet():
            row = self._new_snapshot_row({})
            if row is not None:
                books.loose.add(row)
            return row

    def _loose_row(self, books: StateBooks, row: Any, call: str) -> int:
        """`row` when it is a snapshot row the caller holds (from `take_snapshots`,
        `snapshot` or `snapshot_row`, not kept or freed since), else InvalidRequestError
        saying what it is. Lock held."""
        row = as_int(row, "row", InvalidRequestError, what="a snapshot row (an int)")
        if row in books.loose:
            return row
        if 0 <= row < books.num_slots:
            what = f"slot {row}'s own state row, not a snapshot row"
        elif not books.num_slots <= row < books.num_slots + books.num_snapshots:
            what = f"not a row of this cache (snapshot rows are {books.num_slots} .. " \
                   f"{books.num_slots + books.num_snapshots - 1})"
        elif row in books.cached:
            what = "kept already (free it by the handle pin_snapshot returned)"
        elif row in books.free_rows:
            what = "free (given back already, or never handed out)"
        else:
            what = "planned for a request's iteration (take_snapshots hands it out once written)"
        raise InvalidRequestError(f"{call}({row}): row {row} is {what}; pass a row that take_snapshots, snapshot "
                                  "or snapshot_row returned, once")

    @staticmethod
    def _handle(handle: Any, call: str) -> tuple[int, int]:
        """A kept snapshot's (row, generation) handle, or InvalidRequestError."""
        if not (isinstance(handle, tuple) and len(handle) == 2 and all(is_int(x) for x in handle)):
            raise InvalidRequestError(f"{call} takes the (row, generation) handle pin_snapshot returned, got {handle!r}")
        return int(handle[0]), int(handle[1])

    def pin_snapshot(self, row: int) -> tuple[int, int]:
        """Keep snapshot `row` (a prefix block's states), evictable least recently used first;
        a (row, generation) handle. `row` is one the caller holds (InvalidRequestError else)."""
        books = self._state().books
        with self.slots.lock:
            row = self._loose_row(books, row, "pin_snapshot")
            books.loose.discard(row)
            gen = next(books._snap_generation)
            books.cached[row] = gen
            return row, gen

    def snapshot_pinned(self, handle: tuple[int, int]) -> bool:
        """Whether the snapshot `handle` names is still kept (not evicted since)."""
        row, gen = self._handle(handle, "snapshot_pinned")
        return self._states[0].books.cached.get(row) == gen if self._states else False

    def free_snapshot(self, handle: int | tuple[int, int]) -> None:
        """Give back a snapshot row the caller holds (`take_snapshots`', `snapshot`'s,
        `snapshot_row`'s), or a kept snapshot's handle (nothing when it was evicted or freed
        since). InvalidRequestError for anything else (a slot's row, a row freed already)."""
        books = self._state().books
        with self.slots.lock:
            if isinstance(handle, tuple):
                row, gen = self._handle(handle, "free_snapshot")
                if books.cached.get(row) != gen:
                    return
                del books.cached[row]
            else:
                row = self._loose_row(books, handle, "free_snapshot")
                books.loose.discard(row)
            books.free_rows.append(row)

    def restore_snapshot(self, reqid: int, handle: tuple[int, int]) -> bool:
        """`reqid`'s states become the kept snapshot's, copied at its first step (its state
        row is mapped then); the snapshot is not evicted meanwhile. False when it was
        evicted already (nothing changed)."""
        books = self._state().books
        row, gen = self._handle(handle, "restore_snapshot")
        with self.slots.lock:
            slot = self.slots.check_active(reqid)
            if books.cached.get(row) != gen:
                return False
            books.hold(slot, row)
            books.cached.move_to_end(row)
            return True

    def _new_snapshot_row(self, lens: Mapping[int, int]) -> int | None:
        """A free snapshot row with its pages mapped, taken from the free rows (evicting the
        least recently used cached snapshot when none is free), or None (lock held, worker
        stopped)."""
        kind = self._states[0]
        books = kind.books
        if not books.free_rows and books.cached:
            row = next(iter(books.cached))
            kind.mapper.evict(len(books.slot_pages[row]))
        if not books.free_rows:
            return None
        mapped = [r for r in books.free_rows if books.slot_pages[r]]
        row = mapped[-1] if mapped else books.free_rows[-1]
        books.free_rows.remove(row)
        missing = kind.geometry.pages_per_slot - len(books.slot_pages[row])
        if missing > 0:
            needs = [[] for _ in self.kinds]
            needs[self.kinds.index(kind)] = [(row, len(books.slot_pages[row]), missing)]
            try:
                plan, _, _ = self._carry(lambda limit: plan_backing(self._books, needs, lens, limit))
            except BaseException:
                books.free_rows.append(row)
                raise
            if plan.failed:
                books.free_rows.append(row)
                return None
        return row

    # ----------------------------------------------------------------- memory ----
    def trim(self) -> int:
        """Give back now every page no live token needs (free slots, pre-mapped tails, pinned
        prefix pages no slot maps, kept snapshots): unmap and release them. Returns the page
        groups released."""
        with self._quiet():
            self.slots.fence_ran(self.layer.fence())
            released = 0
            for kind in self.kinds:
                books = kind.books
                kind.mapper.reclaim(reclaimable(books, {}), books.physical.num_created)
                kind.mapper.evict(books.physical.num_created)
                released += kind.mapper.release_spare(len(books.physical.spare))
            return released

    def reserve_physical(self, nbytes: int) -> int:
        """Create page groups in every kind until at least `nbytes` of physical memory
        exist (each kind its share: as many groups as `nbytes` holds of one page of every
        buffer). Returns groups created."""
        nbytes = as_index(nbytes, "nbytes")
        if nbytes < 0:
            raise InvalidRequestError(f"nbytes must be >= 0, got {nbytes}")
        unit = self.unit_bytes
        n = -(-nbytes // unit)
        with self._quiet():
            # a kind holding more than n groups keeps them: count the bytes there will be
            after = sum(max(n, b.physical.num_created) * b.geometry.group_bytes for b in self._books)
            if after > self.max_bytes:
                raise OutOfPhysicalMemoryError(
                    f"{nbytes} bytes is {n} page groups of every kind: {after} bytes with the groups that exist "
                    f"now, over the budget of {self.max_bytes} bytes; raise physical_memory (or trim() first)")
            created = 0
            for books in self._books:
                physical = books.physical
                if n > physical.num_created:
                    groups = physical.create(n - physical.num_created)
                    if groups is None:
                        raise budget_refused(n - physical.num_created, books.geometry.group_bytes)
                    books.add_created(groups)
                    created += len(groups)
            return created

    @property
    def max_pages(self) -> int:
        """The physical budget in units of one page of every buffer (`set_max_pages` changes it)."""
        return max(1, self.max_bytes // self.unit_bytes)

    def set_max_pages(self, n: int) -> None:
        """Set the physical budget to `n` units of one page of every buffer (e.g. the minimum
        over tensor-parallel ranks). `n` is an int >= 1 whose bytes hold the groups that exist
        now (`trim()` first to go lower); a unit is `unit_bytes`. Raises InvalidRequestError."""
        n = as_index(n, "max_pages")
        with self._quiet():
            created = self.layer.created_bytes
            if n < 1 or n * self.unit_bytes < created:
                raise InvalidRequestError(
                    f"max_pages must be >= 1 and >= the {-(-created // self.unit_bytes)} page groups that exist "
                    f"now, got {n}; trim() first to give unused pages back")
            self.max_bytes = n * self.unit_bytes

    def _give_back(self, nbytes: int) -> int:
        """The shared budget asks for memory (another cache is short): release spare groups,
        then cached pages (free slots, pre-mapped tails, pins no slot maps), up to `nbytes`.
        Never raises. Returns the bytes given back."""
        given = 0
        try:
            with self._quiet():
                for kind in self.kinds:  # spare groups first, every kind's
                    gb = kind.geometry.group_bytes
                    given += kind.mapper.release_spare(min(len(kind.books.physical.spare),
                                                           -(-(nbytes - given) // gb))) * gb
                    if given >= nbytes:
                        return given
                self.slots.fence_ran(self.layer.fence())
                for kind in self.kinds:
                    books, mapper, gb = kind.books, kind.mapper, kind.geometry.group_bytes
                    want = -(-(nbytes - given) // gb)
                    if want <= 0:
                        break
                    mapper.reclaim(reclaimable(books, {}), want)
                    if len(books.physical.spare) < want:
                        mapper.evict(want - len(books.physical.spare))
                    given += mapper.release_spare(min(want, len(books.physical.spare))) * gb
                return given
        except Exception:  # closed, or a driver call failed: give what we can
            return given

    def _cached_bytes(self) -> int:
        """The budget's estimate, without the lock, of what `_give_back` could give now."""
        return sum(b.cached_groups() * b.geometry.group_bytes for b in self._books)

    # ---------------------------------------------------------------- figures ----
    def stats(self) -> MemoryStats:
        """The memory figures; with several kinds, their sums (bytes exact; page counts add
        groups of different sizes) with each kind's own in `kinds`. `free_tokens`: tokens
        that fit in what is spare, cached and left in the budget, were every K/V layer to
        hold them."""
        with self.slots.lock:
            self.slots.check_open()
            room = self.max_bytes - self.layer.created_bytes
            if len(self._books) == 1:
                return self._books[0].stats(self.max_bytes // self._books[0].geometry.group_bytes)
            per = [b.stats(b.physical.num_created + max(0, room) // b.geometry.group_bytes) for b in self._books]
        first = per[0]
        free_bytes = sum((s.num_free_pages + s.num_cached_pages) * s.group_bytes for s in per) + max(0, room)
        token_bytes = sum(b.geometry.held_bytes(1) for b in self._books if not isinstance(b, StateBooks))
        return replace(
            first,
            group_bytes=sum(s.group_bytes for s in per),
            num_created_pages=sum(s.num_created_pages for s in per),
            num_free_pages=sum(s.num_free_pages for s in per),
            num_mapped_pages=sum(s.num_mapped_pages for s in per),
            num_cached_pages=sum(s.num_cached_pages for s in per),
            max_pages=self.max_pages,
            mapped_bytes=sum(s.mapped_bytes for s in per),
            used_bytes=sum(s.used_bytes for s in per),
            free_tokens=free_bytes // token_bytes if token_bytes else 0,
            num_pinned_pages=self._pinned[0].books.stats(0).num_pinned_pages if self._pinned else 0,
            kinds={b.name: s for b, s in zip(self._books, per)},
        )

    def check_invariants(self) -> None:
        """Assert the books are consistent (for tests and debugging)."""
        with self.slots.lock:
            self.slots.check_invariants()
            for books in self._books:
                books.check_invariants()
            assert self.layer.created_bytes <= self.max_bytes, "more pages than the budget"

    # ---------------------------------------------------------------- closing ----
    def close(self) -> None:
        """Stop the worker, unmap and release every page (after the device finished)."""
        if self.premapper.is_worker():
            # The garbage collector ran the cache's finalizer on the worker thread, which
            # cannot join itself (and may hold the lock): close from another thread.
            threading.Thread(target=self.close, name="vattn-close", daemon=True).start()
            return
        slots = self.slots
        self.premapper.cancel = True
        with slots.lock:
            if slots.closed:
                return
            self.premapper.quiesce()
            slots.closed = True
            self.premapper.close()
        self.premapper.join()
        # Every page is given back even when a driver call fails on the way; the first
        # error is raised at the end.
        with slots.lock:
            per_kind = []
            for books in self._books:
                g, n = books.geometry, len(books.slot_pages)
                offsets = [g.page_offset(s, p) for s in range(n) for p, grp in enumerate(books.slot_pages[s])
                           if grp is not None]
                per_kind.append((offsets, list(books.refs)))  # each group once, however many slots map it
                books.slot_pages, books.refs, books.capacity = [[] for _ in range(n)], {}, [0] * n
                books.lead = [0] * n
                books.pins.clear()
                books.shared_slots.clear()
                books.dirty.clear()
                books.dirty_slots.clear()
            errors = self.layer.close(per_kind)
        if errors:
            raise errors[0]

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Hold the lock with the worker stopped (after its batch in flight) and the cache
        open: what every call that changes pages needs."""
        self.premapper.cancel = True  # before taking the lock: the worker stops at its next batch
        with self.slots.lock:
            self.slots.check_open()
            self.premapper.quiesce()
            self.slots.check_open()  # close() may have run while we waited
            yield


__all__ = ["Coordinator", "KindSpec"]
