"""The recurrent-state kind's snapshots: rows of its buffer after the slots' rows, each a
copy of a slot's states at a prefix block's end (the prefix cache's part of a block for the
state kind), in the same page layer and budget. `Snapshots` is what callers use
(`KVCache.snapshots`), owned by the state kind (`RecurrentState.snapshots`); `StateBooks`
and `StateMapper` are the kind's books and mapper, with the rows' states. Plain Python.

```
a snapshot row:  free --(a step plans it: want)--> planned --(its iteration ran)--> taken
                   ^                                                                  |
                   '--- free / evicted <-- cached (pin: a prefix block's) <-- loose <-' (take, capture, new_row)
```
"""
from __future__ import annotations

import contextlib
import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from vattn.allocator.books import SlotBooks, as_index
from vattn.allocator.mapper import Mapper
from vattn.checks import as_int, is_int
from vattn.errors import InvalidRequestError

if TYPE_CHECKING:
    from vattn.allocator.books import KindGeometry, Slots
    from vattn.pages import PageGroups

Handle = tuple[int, int]  # a kept snapshot: (row, generation of its pin)


class StateBooks(SlotBooks):
    """The recurrent-state kind's books: a row per slot (`slot_pages[s]`, its states), then
    a row per snapshot (`slot_pages[num_slots + i]`). A snapshot row is free (its pages kept
    for the next snapshot, reclaimable), held by a slot (`planned` for the iteration that
    writes it, `taken` once written), or cached (`cached`: kept for a prefix block, least
    recently used first, evicted under memory pressure)."""

    def __init__(self, geometry: KindGeometry, physical: PageGroups, slots: Slots, *, num_snapshots: int,
                 name: str = "state") -> None:
        super().__init__(geometry, physical, slots, track_dirty=False, primary=False, name=name)
        extra = num_snapshots
        self.slot_pages += [[] for _ in range(extra)]
        self.capacity += [0] * extra
        self.lead += [0] * extra
        self.epoch += [0] * extra
        self.num_snapshots = num_snapshots
        self.free_rows: list[int] = list(range(slots.num_slots + extra - 1, slots.num_slots - 1, -1))
        self.cached: OrderedDict[int, int] = OrderedDict()  # row -> generation of its pin, LRU first
        self._snap_generation = itertools.count(1)
        self.wants: dict[int, set[int]] = {}  # slot -> token counts to snapshot its states at
        self.planned: dict[int, dict[int, int]] = {}  # slot -> {boundary: row} the coming iteration writes
        self.taken: dict[int, dict[int, int]] = {}  # slot -> {boundary: row} written, not cached yet
        self.restores: dict[int, int] = {}  # slot -> cached row copied into it at its first step
        self.held: dict[int, int] = {}  # cached row -> slots about to restore it (not evicted meanwhile)
        self.loose: set[int] = set()  # rows handed to the caller (taken, snapshot): kept or freed by it
        # slots whose row holds their request's states (stepped, forked, swapped in): a new owner's
        # row holds an earlier request's, and a prefix mapped into a slot brings none
        self.has_states: set[int] = set()

    def next_generation(self) -> int:
        return next(self._snap_generation)

    def pages_changed(self, slot: int) -> None:
        self.capacity[slot] = self.geometry.tokens_in(len(self.slot_pages[slot]))

    def new_owner(self, slot: int) -> None:
        super().new_owner(slot)
        self.has_states.discard(slot)

    def check_slot(self, slot: int) -> None:
        assert len(self.slot_pages[slot]) in (0, self.geometry.pages_per_slot), f"slot {slot}'s state row is partial"

    def num_evictable(self) -> int:
        """Pages of free snapshot rows and cached snapshots (least recently used first) that
        no slot is about to restore."""
        pages = self.slot_pages
        return (sum(len(pages[r]) for r in self.free_rows)
                + sum(len(pages[r]) for r in self.cached if r not in self.held))

    def victims(self, count: int) -> list[int]:
        """The snapshot rows whose pages `count` evicted groups come from: free rows with
        pages first, then cached snapshots, least recently used first."""
        rows, got = [], 0
        for r in itertools.chain([r for r in self.free_rows if self.slot_pages[r]], self.cached):
            if got >= count:
                break
            if r in self.held:
                continue
            rows.append(r)
            got += len(self.slot_pages[r])
        return rows

    def release_rows(self, slot: int) -> None:
        """`slot` leaves: the snapshot rows it held are free again (their pages kept)."""
        self.wants.pop(slot, None)
        for rows in (self.planned.pop(slot, {}), self.taken.pop(slot, {})):
            self.free_rows.extend(rows.values())
        self.unhold(slot)

    def unplan(self, slot: int) -> None:
        """The iteration `slot` was last stepped for will not run: the rows planned for it
        are free again and their boundaries wanted again."""
        rows = self.planned.pop(slot, None)
        if rows:
            self.free_rows.extend(rows.values())
            self.wants.setdefault(slot, set()).update(rows)

    def hold(self, slot: int, row: int) -> None:
        """`slot` restores cached `row` at its first step: it is not evicted meanwhile."""
        self.unhold(slot)
        self.restores[slot] = row
        self.held[row] = self.held.get(row, 0) + 1

    def unhold(self, slot: int) -> None:
        row = self.restores.pop(slot, None)
        if row is not None:
            left = self.held[row] - 1
            if left:
                self.held[row] = left
            else:
                del self.held[row]

    def cached_groups(self) -> int:
        return super().cached_groups() + self.num_evictable()

    def live_tokens(self, slot: int) -> int:
        return self.slots.max_lens[slot]

    def check_invariants(self, max_pages: int | None = None) -> None:
        super().check_invariants(max_pages)
        assert all(s in self.slots.active and len(self.slot_pages[s]) == self.geometry.pages_per_slot
                   for s in self.has_states), "a slot with states has no state row"
        held = [r for rows in (*self.planned.values(), *self.taken.values()) for r in rows.values()]
        rows = held + self.free_rows + list(self.cached) + list(self.loose)
        assert sorted(rows) == list(range(self.num_slots, self.num_slots + self.num_snapshots)), \
            "a snapshot row is lost or in two places"
        for r in held + list(self.cached) + list(self.loose):
            assert len(self.slot_pages[r]) == self.geometry.pages_per_slot, f"snapshot row {r} is not mapped"
        holders: dict[int, int] = {}
        for s, r in self.restores.items():
            assert s in self.slots.active and r in self.cached, f"slot {s} restores a row that is not kept"
            holders[r] = holders.get(r, 0) + 1
        assert holders == self.held


class StateMapper(Mapper):
    """The state kind's mapper: evicting a snapshot unmaps its row (after the device work
    so far: a copy may read or write it)."""

    books: StateBooks

    def evict(self, count: int) -> int:
        books = self.books
        rows = books.victims(count)
        if not rows:
            return 0
        g = books.geometry
        books.physical.wait([books.physical.fence()])
        books.physical.unmap([g.page_offset(r, p) for r in rows for p in range(len(books.slot_pages[r]))])
        freed = 0
        for r in rows:
            freed += len(books.slot_pages[r])
            books.unref(books.slot_pages[r])
            books.slot_pages[r] = []
            books.pages_changed(r)
            if r in books.cached:
                del books.cached[r]
                books.free_rows.append(r)
        return freed

    def copy_rows(self, src: int, dst: int) -> None:
        """Copy row `src`'s pages onto row `dst`'s (both mapped)."""
        g = self.books.geometry
        self.copy_pages([(g.page_offset(src, p), g.page_offset(dst, p)) for p in range(g.pages_per_slot)])


class Snapshots:
    """The cache's snapshots of recurrent states (`KVCache.snapshots`): rows a step fills
    where the prefix cache wants them (`want`, `planned`, `take`), copies of a request's
    states now (`capture`), rows to fill from a lower tier (`new_row`), kept rows (`pin`,
    `is_pinned`, `free`) and restores into a new request (`restore`)."""

    def __init__(self, books: StateBooks, mapper: StateMapper) -> None:
        self.books = books
        self.mapper = mapper
        self.slots = books.slots
        # set by the coordinator (`bind`): its lock with the worker stopped, and backing a row's
        # pages within the budget of every kind
        self._quiet: Callable[[], contextlib.AbstractContextManager[None]] | None = None
        self._back: Callable[[int, int, int, Mapping[int, int]], bool] | None = None

    def bind(self, quiet: Callable[[], contextlib.AbstractContextManager[None]],
             back: Callable[[int, int, int, Mapping[int, int]], bool]) -> None:
        """`quiet()`: the coordinator's lock with the pre-mapping worker stopped; `back(row,
        first, count, lens)`: map `count` pages of `row` from `first` within the budget (False
        when it cannot)."""
        self._quiet, self._back = quiet, back

    def want(self, reqid: int, boundaries: Sequence[int]) -> None:
        """Snapshot `reqid`'s states when an iteration passes each of these token counts (the
        step that plans it gives it a snapshot row when memory allows: `planned`)."""
        books = self.books
        with self.slots.lock:
            slot = self.slots.check_active(reqid)
            want = {as_int(b, "boundary", InvalidRequestError, low=1) for b in boundaries}
            if want:
                books.wants[slot] = want
            else:
                books.wants.pop(slot, None)

    def planned(self) -> dict[int, dict[int, int]]:
        """Per slot of the last step, {token count: snapshot row} its iteration writes (the
        state layers copy their states there when they reach that count)."""
        with self.slots.lock:
            return {s: dict(rows) for s, rows in self.books.planned.items() if s in self.slots.ran}

    def take(self, reqid: int, upto: int) -> dict[int, int]:
        """The snapshot rows `reqid`'s computed iterations wrote at token counts up to `upto`
        ({count: row}): the caller keeps each (`pin`) or frees it (`free`)."""
        books = self.books
        upto = as_index(upto, "upto")
        with self.slots.lock:
            slot = self.slots.check_active(reqid)
            out: dict[int, int] = {}
            for held in (books.taken.get(slot), books.planned.get(slot)):
                for b in [b for b in held or () if b <= upto]:
                    out[b] = held.pop(b)
            books.loose.update(out.values())
            return out

    def capture(self, reqid: int) -> int | None:
        """A snapshot row holding `reqid`'s states as they are now, or None (no row, or no
        memory even after evicting kept snapshots). InvalidRequestError when `reqid` has no
        states of its own yet: not stepped since its slot was allocated (its row is unmapped,
        or holds an earlier request's), or a restore is pending (`restore`)."""
        books = self.books
        with self._quiet():
            slot = self.slots.check_active(reqid)
            if slot not in books.has_states or slot in books.restores:
                raise InvalidRequestError(
                    f"reqid {slot} has no recurrent states of its own yet (they come at its first step"
                    f"{', with the snapshot it restores' if slot in books.restores else ''}): step it first")
            row = self.next_row({})
            if row is not None:
                self.mapper.copy_rows(slot, row)
                books.loose.add(row)
            return row

    def new_row(self) -> int | None:
        """A free snapshot row with its pages mapped, for the caller to fill (a snapshot
        restored from a lower tier), or None when no row or memory is left; keep it with
        `pin` or give it back with `free`."""
        with self._quiet():
            row = self.next_row({})
            if row is not None:
                self.books.loose.add(row)
            return row

    def pin(self, row: int) -> Handle:
        """Keep snapshot `row` (a prefix block's states), evictable least recently used first;
        a (row, generation) handle. `row` is one the caller holds (InvalidRequestError else)."""
        books = self.books
        with self.slots.lock:
            row = self._loose_row(row, "pin")
            books.loose.discard(row)
            gen = books.next_generation()
            books.cached[row] = gen
            return row, gen

    def is_pinned(self, handle: Handle) -> bool:
        """Whether the snapshot `handle` names is still kept (not evicted since)."""
        row, gen = _handle(handle, "is_pinned")
        return self.books.cached.get(row) == gen

    def free(self, handle: int | Handle) -> None:
        """Give back a snapshot row the caller holds (`take`'s, `capture`'s, `new_row`'s), or a
        kept snapshot's handle (nothing when it was evicted or freed since).
        InvalidRequestError for anything else (a slot's row, a row freed already)."""
        books = self.books
        with self.slots.lock:
            if isinstance(handle, tuple):
                row, gen = _handle(handle, "free")
                if books.cached.get(row) != gen:
                    return
                del books.cached[row]
            else:
                row = self._loose_row(handle, "free")
                books.loose.discard(row)
            books.free_rows.append(row)

    def restore(self, reqid: int, handle: Handle) -> bool:
        """`reqid`'s states become the kept snapshot's, copied at its first step (its state
        row is mapped then; before it, a prefix cache hit); the snapshot is not evicted
        meanwhile. False when it was evicted already (nothing changed)."""
        books = self.books
        row, gen = _handle(handle, "restore")
        with self.slots.lock:
            slot = self.slots.check_active(reqid)
            if books.cached.get(row) != gen:
                return False
            books.hold(slot, row)
            books.cached.move_to_end(row)
            return True

    def next_row(self, lens: Mapping[int, int]) -> int | None:
        """A free snapshot row with its pages mapped, taken from the free rows (evicting the
        least recently used kept snapshot when none is free), or None (lock held, worker
        stopped; `lens`: the step's, whose pages are not taken for it)."""
        books = self.books
        if not books.free_rows and books.cached:
            row = next(iter(books.cached))
            self.mapper.evict(len(books.slot_pages[row]))
        if not books.free_rows:
            return None
        mapped = [r for r in books.free_rows if books.slot_pages[r]]
        row = mapped[-1] if mapped else books.free_rows[-1]
        books.free_rows.remove(row)
        have = len(books.slot_pages[row])
        missing = books.geometry.pages_per_slot - have
        if missing > 0:
            try:
                backed = self._back(row, have, missing, lens)
            except BaseException:
                books.free_rows.append(row)
                raise
            if not backed:
                books.free_rows.append(row)
                return None
        return row

    def _loose_row(self, row: Any, call: str) -> int:
        """`row` when it is a snapshot row the caller holds (from `take`, `capture` or
        `new_row`, not kept or freed since), else InvalidRequestError saying what it is.
        Lock held."""
        books = self.books
        row = as_int(row, "row", InvalidRequestError, what="a snapshot row (an int)")
        if row in books.loose:
            return row
        if 0 <= row < books.num_slots:
            what = f"slot {row}'s own state row, not a snapshot row"
        elif not books.num_slots <= row < books.num_slots + books.num_snapshots:
            what = f"not a row of this cache (snapshot rows are {books.num_slots} .. " \
                   f"{books.num_slots + books.num_snapshots - 1})"
        elif row in books.cached:
            what = "kept already (free it by the handle pin returned)"
        elif row in books.free_rows:
            what = "free (given back already, or never handed out)"
        else:
            what = "planned for a request's iteration (take hands it out once written)"
        raise InvalidRequestError(f"snapshots.{call}({row}): row {row} is {what}; pass a row that take, capture "
                                  "or new_row returned, once")


def _handle(handle: Any, call: str) -> Handle:
    """A kept snapshot's (row, generation) handle, or InvalidRequestError."""
    if not (isinstance(handle, tuple) and len(handle) == 2 and all(is_int(x) for x in handle)):
        raise InvalidRequestError(f"snapshots.{call} takes the (row, generation) handle pin returned, got {handle!r}")
    return int(handle[0]), int(handle[1])


__all__ = ["Handle", "Snapshots", "StateBooks", "StateMapper"]
