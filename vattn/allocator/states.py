"""The recurrent-state kind (Mamba2, gated delta-net layers): its spec, layout, books, mapper
and manager, and the snapshot rows it keeps for the prefix cache (`Snapshots`, its object).
Plain Python, no torch.

```
state buffer: [ slot 0 | slot 1 | ... | slot B-1 | snapshot 0 | ... | snapshot S-1 ]
                row_bytes each (state_bytes rounded up to whole pages)
```
A slot's row is mapped at its first step, never shared (the layers write it in place: a fork
copies it), right at one length only (the slot's latest). A snapshot row holds a copy of a
slot's states at a prefix block's end, in the same page layer and budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

from vattn.allocator.kinds import KindManager, KindSpec
from vattn.allocator.snapshots import Snapshots, StateBooks, StateMapper
from vattn.errors import InvalidRequestError

if TYPE_CHECKING:
    from vattn.allocator.books import Slots
    from vattn.pages import PageGroups


@dataclass(frozen=True)
class StateGeometry:
    """The recurrent-state kind's layout: one buffer of rows, a row per slot, then a row per
    snapshot; a row holds a slot's states (`state_bytes`) in whole pages."""

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


@dataclass(frozen=True, kw_only=True)
class StateSpec(KindSpec):
    """The recurrent-state kind: a `StateGeometry`, and `num_snapshots` rows after the slots'."""

    num_snapshots: int = 0


class RecurrentState(KindManager):
    """The recurrent states of Mamba2 / gated delta-net layers: a fixed row per slot, mapped
    when the slot is first stepped, never shared, right at one length only. It owns the
    cache's snapshots (`self.snapshots`, `KVCache.snapshots`): rows of the same buffer kept
    for the prefix cache's blocks."""

    pinned_pages = False
    sees_steps = True
    what = "recurrent-state"
    books: StateBooks
    mapper: StateMapper

    def __init__(self, spec: StateSpec, books: StateBooks, mapper: StateMapper) -> None:
        super().__init__(spec, books, mapper)
        self.snapshots = Snapshots(books, mapper)

    @classmethod
    def create(cls, spec: KindSpec, physical: PageGroups, slots: Slots, *, primary: bool) -> RecurrentState:
        assert isinstance(spec, StateSpec) and isinstance(spec.geometry, StateGeometry)
        books = StateBooks(spec.geometry, physical, slots, num_snapshots=spec.num_snapshots, name=spec.name)
        return cls(spec, books, StateMapper(books, copy_pages=spec.copy_pages))

    def moves(self, lens: dict[int, int]) -> bool:
        """Also snapshots to plan: a step passing a boundary the prefix cache wants."""
        wants = self.books.wants
        if not wants:
            return super().moves(lens)
        return super().moves(lens) or any((w := wants.get(s)) and min(w) <= n for s, n in lens.items())

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

    def first_page(self, slot: int) -> int:
        return 0

    def freed(self, slot: int) -> None:
        super().freed(slot)
        self.books.release_rows(slot)
        self.books.has_states.discard(slot)

    def adopted(self, slot: int) -> None:
        self.books.has_states.add(slot)

    def dropped(self, slot: int) -> None:
        """No snapshot is restored into `slot` at its first step (its row is mapped then)."""
        self.books.unhold(slot)

    def reverted(self, slot: int) -> None:
        """The snapshot rows planned for the iteration are wanted again."""
        self.books.unplan(slot)

    def after_step(self, slot: int, start: int, end: int, lens: Mapping[int, int]) -> None:
        """The iteration from `start` to `end` runs: the rows the one before it wrote are
        taken, and the boundaries it passes that the prefix cache wants get rows with pages
        (best effort: none when memory is short; `lens`: the step's, whose pages stay)."""
        books = self.books
        books.has_states.add(slot)  # (the iteration writes them)
        row = books.restores.get(slot)
        if row is not None:  # a prefix hit: its states are the snapshot's before the iteration runs
            self.mapper.copy_rows(row, slot)
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
                row = self.snapshots.next_row(lens)
                if row is not None:
                    books.planned.setdefault(slot, {})[b] = row
        if not want:
            del books.wants[slot]


__all__ = ["RecurrentState", "StateGeometry", "StateSpec"]
