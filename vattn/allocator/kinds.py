"""The layer kinds of a slot cache, one manager each (vLLM v1's `SingleTypeKVCacheManager`):
what a kind's books, planning and mapping do differently. Plain Python, no torch.

```
kind            pages a slot of n tokens needs      shared (fork, prefix)     given back
FullAttention   pages_for(n)                         whole pages of the prefix  never (deferred reclamation)
SlidingWindow   the pages its next queries read      pages within the window    pages wholly behind the window
RecurrentState  its state row (fixed), once it ran   never: written in place    with the slot
```
A manager is a kind's `SlotBooks` and `Mapper` and the few decisions that differ (which
pages a fork shares, whether a fork or a swap-out may happen at a length, where a parked
slot's live pages start). The coordinator (`vattn.allocator.coordinator`) plans every kind
of a call before any maps. The recurrent-state kind also keeps *snapshots*: rows of its
buffer, after the slots' rows, holding a copy of a slot's states at a prefix block's end
(the prefix cache's part of a block for the state kind), in the same page layer and budget.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from vattn.allocator.books import SlotBooks
from vattn.allocator.mapper import Mapper
from vattn.allocator.plan import plan_fork
from vattn.errors import InvalidRequestError

if TYPE_CHECKING:
    from vattn.allocator.books import Slots
    from vattn.pages import PageGroups


@dataclass(frozen=True)
class StateGeometry:
    """The recurrent-state kind's layout: one buffer of rows, a row per slot, then a row per
    snapshot; a row holds a slot's states (`state_bytes`) in whole pages.

    ```
    state buffer: [ slot 0 | slot 1 | ... | slot B-1 | snapshot 0 | ... | snapshot S-1 ]
                    row_bytes each (state_bytes rounded up to whole pages)
    ```
    """

    page_size: int
    state_bytes: int
    max_len: int  # a row that holds states holds a slot's every token (its capacity)

    @property
    def row_bytes(self) -> int:
        return -(-self.state_bytes // self.page_size) * self.page_size

    @property
    def pages_per_slot(self) -> int:
        return self.row_bytes // self.page_size

    num_buffers = 1

    @property
    def group_bytes(self) -> int:
        return self.page_size

    token_bytes = 0  # (no token lives in a page: none of the token arithmetic applies)
    share_tokens = share_pages = 1

    def pages_for(self, num_tokens: int) -> int:
        """A slot that holds tokens holds its whole state row."""
        return self.pages_per_slot if num_tokens > 0 else 0

    def page_offset(self, slot: int, page: int) -> int:
        return slot * self.row_bytes + page * self.page_size

    def tokens_in(self, num_pages: int) -> int:
        return self.max_len if num_pages >= self.pages_per_slot else 0

    def held_bytes(self, num_tokens: int) -> int:
        return self.state_bytes if num_tokens > 0 else 0

    def first_writable(self, num_tokens: int) -> int:
        return 0  # the states are written in place: no page of a row is ever shared

    def shared_pages(self, num_tokens: int) -> int:
        return 0


class FullAttention:
    """K/V of full-attention layers: every token kept; forks and prefixes share whole pages."""

    pinned_pages = True  # its pages are a prefix block's pages (`pin`, `map_pinned`)

    def __init__(self, name: str, books: SlotBooks, mapper: Mapper) -> None:
        self.name = name
        self.books = books
        self.mapper = mapper

    @property
    def geometry(self) -> Any:
        return self.books.geometry

    def can_fork(self, slot: int, num_tokens: int) -> bool:
        """Whether a fork of `slot` at `num_tokens` finds every page the child reads."""
        return True

    def fork_refused(self, parent: int, num_tokens: int) -> InvalidRequestError:
        """Why `can_fork(parent, num_tokens)` is False."""
        return InvalidRequestError(f"reqid {parent} cannot be forked at token {num_tokens}")

    def fork_parts(self, parent: int, child: int, num_tokens: int) -> tuple[tuple, tuple, tuple]:
        """(shares, maps, copies) that give `child` the first `num_tokens` tokens of `parent`."""
        return plan_fork(self.books, parent, child, num_tokens)

    def check_swap_out(self, slot: int, num_tokens: int) -> None:
        """InvalidRequestError where the slot's data cannot be parked at `num_tokens`."""

    def first_page(self, slot: int) -> int:
        """The first page `slot` maps (its live pages start there: a swap copies from it)."""
        return 0

    def freed(self, slot: int) -> None:
        """`slot`'s request ended (lock held)."""
        self.books.freed(slot)

    def adopted(self, slot: int) -> None:
        """`slot` got its data from another slot or the host (fork, swap-in; lock held)."""

    def dropped(self, slot: int) -> None:
        """What a prefix hit put into `slot` before its first step is dropped (lock held,
        worker stopped): its pages are unmapped."""
        self.mapper.empty(slot)

    def after_step(self, slot: int, start: int, end: int, supply: Callable[..., Any]) -> None:
        """The step that takes `slot` from `start` to `end` tokens was served."""


class SlidingWindow(FullAttention):
    """K/V of sliding-window layers: pages wholly behind the window are given back as a
    request grows (holes at the start of its row); forks and prefixes share only pages
    within the window."""

    def can_fork(self, slot: int, num_tokens: int) -> bool:
        return self.books.reads_held(slot, num_tokens)

    def fork_refused(self, parent: int, num_tokens: int) -> InvalidRequestError:
        return InvalidRequestError(
            f"reqid {parent}'s sliding-window layers gave back pages the child's first query (at token "
            f"{num_tokens}) reads: fork before the parent moves a window past it, or compute the prompt")

    def check_swap_out(self, slot: int, num_tokens: int) -> None:
        """The parked tokens must hold every key the request's next query (at `num_tokens`)
        reads: refused when the window gave back pages it sees (a count too far behind)."""
        if not self.books.reads_held(slot, num_tokens):
            raise InvalidRequestError(
                f"slot {slot}'s sliding-window layers gave back the pages before token "
                f"{self.geometry.tokens_in(self.books.holes(slot))}, which a request "
                f"resumed at {num_tokens} tokens reads: swap it out at a count its window still holds (its length)")

    def first_page(self, slot: int) -> int:
        return self.books.holes(slot)


class StateBooks(SlotBooks):
    """The recurrent-state kind's books: a row per slot (`slot_pages[s]`, its states), then
    a row per snapshot (`slot_pages[num_slots + i]`). A snapshot row is free (its pages kept
    for the next snapshot, reclaimable), held by a slot (`planned` for the iteration that
    writes it, `taken` once written), or cached (`cached`: kept for a prefix block, least
    recently used first, evicted under memory pressure)."""

    def __init__(self, geometry: StateGeometry, physical: PageGroups, slots: Slots, *, num_snapshots: int,
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

    def row_of(self, index: int) -> int:
        return self.slots.num_slots + index

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


class RecurrentState(FullAttention):
    """The recurrent states of Mamba2 / gated delta-net layers: a fixed row per slot, mapped
    when the slot is first stepped, never shared (the layers write it in place: a fork
    copies it), right at one length only (the slot's latest). Its snapshots are rows of the
    same buffer, kept for the prefix cache's blocks (`want`, `planned`, `take`, `pin`)."""

    pinned_pages = False
    books: StateBooks
    mapper: StateMapper

    def can_fork(self, slot: int, num_tokens: int) -> bool:
        # a state has seen exactly its slot's tokens (none before its first step: a mapped prefix, a restore)
        books = self.books
        return books.slots.max_lens[slot] == num_tokens and slot in books.has_states and slot not in books.restores

    def fork_refused(self, parent: int, num_tokens: int) -> InvalidRequestError:
        return InvalidRequestError(
            f"reqid {parent}'s recurrent states have seen {self.books.slots.max_lens[parent]} tokens, not "
            f"{num_tokens}: they cannot be forked there (compute the child's prompt)")

    def check_swap_out(self, slot: int, num_tokens: int) -> None:
        """The states are parked as they are: at the slot's length, or at its length before
        its last step when that iteration did not run (a scheduler preempting a request it
        had just stepped); any other count is refused."""
        slots = self.books.slots
        if slot in self.books.restores or slot not in self.books.has_states:
            raise InvalidRequestError(f"slot {slot} has no recurrent states yet (they come at its first step): step "
                                      "it first")
        if num_tokens not in (slots.max_lens[slot], slots.prev_lens[slot]):
            raise InvalidRequestError(
                f"slot {slot}'s recurrent states have seen {slots.max_lens[slot]} tokens (or "
                f"{slots.prev_lens[slot]}, before its last step), not {num_tokens}: they are parked as they are")

    def freed(self, slot: int) -> None:
        super().freed(slot)
        self.books.release_rows(slot)
        self.books.has_states.discard(slot)

    def adopted(self, slot: int) -> None:
        self.books.has_states.add(slot)

    def dropped(self, slot: int) -> None:
        """No snapshot is restored into `slot` at its first step (its row is mapped then)."""
        self.books.unhold(slot)

    def after_step(self, slot: int, start: int, end: int, supply: Callable[..., Any]) -> None:
        """The iteration from `start` to `end` runs: the rows the one before it wrote are
        taken, and the boundaries it passes that the prefix cache wants get rows
        (`supply()`: a row with pages, or None; best effort)."""
        books = self.books
        books.has_states.add(slot)  # (the iteration writes them)
        row = books.restores.get(slot)
        if row is not None:  # a prefix hit: its states are the snapshot's before the iteration runs
            g = books.geometry
            self.mapper.copy_pages([(g.page_offset(row, p), g.page_offset(slot, p)) for p in range(g.pages_per_slot)])
            books.unhold(slot)
        planned = books.planned.pop(slot, None)
        if planned:
            books.taken.setdefault(slot, {}).update(planned)
        want = books.wants.get(slot)
        if not want:
            return
        for b in sorted(want):
            if start < b <= end:
                want.discard(b)
                row = supply()
                if row is not None:
                    books.planned.setdefault(slot, {})[b] = row
        if not want:
            del books.wants[slot]

    def due(self, slot: int, end: int) -> bool:
        """Whether a step of `slot` to `end` passes a boundary the prefix cache wants."""
        want = self.books.wants.get(slot)
        return bool(want) and min(want) <= end


__all__ = ["FullAttention", "RecurrentState", "SlidingWindow", "StateBooks", "StateGeometry",
           "StateMapper"]
