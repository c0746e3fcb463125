"""Swapped-out requests across the layer kinds of a slot cache: a parked slot keeps its
pages (deferred reclamation), and `resume` gets it back untouched with no copy, or pages
mapped for its tokens in the kinds whose pages were taken, which the caller copies the
tokens into (`KVCache.swap_out` / `swap_in` make the host copies). Plain Python.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from vattn.allocator.books import as_index
from vattn.allocator.plan import StepPlan, plan_backing
from vattn.errors import InvalidRequestError, NoFreeSlotError, OutOfPhysicalMemoryError

if TYPE_CHECKING:
    from vattn.allocator.books import Slots
    from vattn.allocator.kinds import KindManager

Carry = Callable[[Callable[[int], StepPlan]], tuple[StepPlan, int, int]]


def fence_parked(slots: Slots, reqid: int, fence: Any) -> int:
    """The caller may have enqueued device work that reads the slot (`swap_out`'s
    asynchronous copy to host): a fence taken now keeps its pages mapped until that work
    finished, even when the slot did not run in the last iteration. Returns the slot."""
    slot = slots.check_active(reqid)
    if fence is not None:
        slots.last_fence[slot] = fence
    return slot


def park(slots: Slots, kinds: Sequence[KindManager], reqid: int, fence: Any) -> tuple[int, tuple[int, ...]]:
    """Free `reqid`'s slot, its pages kept mapped until `fence` (the copy to host swap_out
    enqueued): (slot, every kind's epoch of it), which `resume` compares."""
    slot = fence_parked(slots, reqid, fence)
    slots.free(slot)
    for kind in kinds:
        kind.freed(slot)
    return slot, tuple(kind.books.epoch[slot] for kind in kinds)


def resume(slots: Slots, kinds: Sequence[KindManager], carry: Carry, slot: int, epochs: Sequence[int],
           num_tokens: int, first_pages: Sequence[int], fence: Any) -> tuple[int, tuple[bool, ...]]:
    """A slot for a parked request of `num_tokens` tokens: its own, in the kinds whose pages
    are untouched since it was parked at `epochs` (one per kind), and pages mapped for the
    tokens in the others, or a new slot with pages in every kind. Returns (slot, per kind
    whether the caller must copy the data in). Raises NoFreeSlotError or
    OutOfPhysicalMemoryError and changes nothing when it cannot. `first_pages`: per kind,
    pages before it held nothing when parked (behind a sliding window): none are mapped there."""
    num_tokens = as_index(num_tokens, "num_tokens")
    if not 0 < num_tokens <= slots.max_len:
        raise InvalidRequestError(f"num_tokens={num_tokens} must be in [1, {slots.max_len}]")
    if not slots.free_slots:
        raise NoFreeSlotError(f"all {slots.num_slots} slots are in use; free_reqid() one or raise max_batch_size")
    own = slot in slots.free_slots
    untouched = [own and kind.books.epoch[slot] == epoch and kind.books.capacity[slot] >= num_tokens
                 for kind, epoch in zip(kinds, epochs)]
    if all(untouched):
        take(slots, kinds, slot)
        for kind in kinds:
            kind.books.dirty.difference_update(kind.books.slot_pages[slot][:kind.geometry.pages_for(num_tokens)])
        slots.max_lens[slot] = slots.prev_lens[slot] = num_tokens  # (a step to it plans no iteration)
        for kind in kinds:
            kind.adopted(slot)
        return slot, (False,) * len(kinds)
    slots.fence_ran(fence)
    new = slot if any(untouched) else slots.warm_slot()
    if new != slot:
        untouched = [False] * len(kinds)
    take(slots, kinds, new)
    try:
        needs = [[] if kept else _make_room(kind, new, num_tokens, first)
                 for kind, kept, first in zip(kinds, untouched, first_pages)]
        plan, _, _ = carry(lambda limit: plan_backing([k.books for k in kinds], needs, {new: num_tokens}, limit))
    except BaseException:
        untake(slots, new)
        raise
    if plan.failed:
        untake(slots, new)
        raise OutOfPhysicalMemoryError(
            f"no pages for the {num_tokens} tokens of a swapped-out request; free requests or raise "
            "physical_memory")
    for kind, kept in zip(kinds, untouched):
        if kept:
            kind.books.dirty.difference_update(kind.books.slot_pages[new][:kind.geometry.pages_for(num_tokens)])
        elif kind.books.dirty_slots:  # clear an earlier owner's data first: the copy fills only the tokens
            kind.mapper.zero_dirty([new])
    slots.max_lens[new] = slots.prev_lens[new] = num_tokens
    for kind in kinds:
        kind.adopted(new)
    return new, tuple(not kept for kept in untouched)


def _make_room(kind: KindManager, slot: int, num_tokens: int, first: int) -> list[tuple[int, int, int]]:
    """Ready `slot`'s pages of `kind` for a copy of `num_tokens` tokens in: no shared page nor
    hole (emptied then), none behind `first` (dropped); returns the pages still to map, as
    `plan_backing`'s needs of the slot ([] when none)."""
    books, mapper = kind.books, kind.mapper
    pages = books.slot_pages[slot]
    if any(grp is not None and books.refs[grp] > 1 for grp in pages) or books.holes(slot):
        mapper.empty(slot)  # the copy must not land in shared pages, nor in holes
    if first and kind.gives_back:
        mapper.drop_behind(slot, first)
    missing = kind.geometry.pages_for(num_tokens) - len(books.slot_pages[slot])
    return [(slot, len(books.slot_pages[slot]), missing)] if missing > 0 else []


def take(slots: Slots, kinds: Sequence[KindManager], slot: int) -> None:
    """Hand free `slot` to a new request in every kind."""
    slots.take(slot)
    for kind in kinds:
        kind.books.new_owner(slot)


def untake(slots: Slots, slot: int) -> None:
    """Give back a slot `take` handed out for a call that failed."""
    slots.untake(slot)


__all__ = ["fence_parked", "park", "resume", "take", "untake"]
