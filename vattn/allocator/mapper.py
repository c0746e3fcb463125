"""Carrying out `StepPlan`s on the books of every layer kind: creating groups, unmapping slot
tails after their fences, evicting pins, releasing groups for another kind, giving back
pages behind a window, mapping, clearing reused pages. With the page layer (`vattn.pages`),
the only place the slot allocator's driver calls are made. Plain Python.

The books change only after a backend call worked: a failed map leaves its groups spare, a
failed unmap leaves the pages booked to their slots (perhaps unreadable now, but never
handed to another slot while still mapped).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Sequence

from vattn.allocator.plan import KindPlan, StepPlan, Unmaps, plan_unmaps, reclaimable
from vattn.errors import MapCountLimitError, OutOfPhysicalMemoryError

if TYPE_CHECKING:
    from vattn.allocator.books import SlotBooks

GROW_CHUNK = 16  # groups created per growth at least (fewer memfds / cuMemCreate batches)


def carry_out(mappers: Sequence[Mapper], make_plan: Callable[[int], StepPlan], max_bytes: int,
              ) -> tuple[StepPlan, int, int]:
    """Plan within the budget (`max_bytes`), make the groups the plan needs and carry it out
    in every kind (see `vattn.allocator.plan` for the order). A device (or budget) that
    refuses new groups is a shortage now, not a smaller budget: plan again with what exists.
    Returns (the plan carried out, groups mapped, pages unmapped).

    Groups that fit the budget are created before anything moves; those a kind's release
    makes room for, after it. Only a refusal of the latter (the device short of what was just
    given back) finds pages moved: no one's data (free slots, pins, spare groups) but the
    pages behind the windows of the plan's slots, which any iteration from their lengths
    gives back (nothing they read); their lengths stay as they are if they fail then."""
    limit = max_bytes
    layer = mappers[0].books.physical.layer
    while True:
        plan = make_plan(limit)
        pending = [kp.num_create for kp in plan.kinds]
        extra = not any(kp.num_release for kp in plan.kinds)  # (a chunk more only where no kind makes room)
        try:
            _create(mappers, pending, limit, extra)  # what fits now: nothing has moved yet
        except OutOfPhysicalMemoryError:
            limit = layer.created_bytes
            continue
        num_unmapped = 0
        for mapper, kp in zip(mappers, plan.kinds):
            num_unmapped += mapper.unmap_tails(kp.unmaps)
        for mapper, kp in zip(mappers, plan.kinds):
            num_unmapped += mapper.give_back(kp)
        for mapper, kp in zip(mappers, plan.kinds):  # (after the give-back: a pin its slots gave back)
            if kp.num_evict:
                mapper.evict(kp.num_evict)
            if kp.num_release:
                mapper.release_spare(kp.num_release)
        if any(pending):
            try:
                _create(mappers, pending, limit, False)  # in the room the releases made
            except OutOfPhysicalMemoryError:
                limit = layer.created_bytes
                continue
        num_mapped = 0
        for mapper, kp in zip(mappers, plan.kinds):
            mapped, unmapped = mapper.execute(kp, plan.lens)
            num_mapped += mapped
            num_unmapped += unmapped
        return plan, num_mapped, num_unmapped


def _create(mappers: Sequence[Mapper], pending: list[int], limit: int, extra: bool) -> None:
    """Create what fits within `limit` of each kind's `pending` groups (counted down), a
    chunk more where `extra` and room is left after every kind's."""
    layer = mappers[0].books.physical.layer
    for k, mapper in enumerate(mappers):
        gb = mapper.books.geometry.group_bytes
        reserve = sum(m.books.geometry.group_bytes * p for m, p in zip(mappers[k + 1:], pending[k + 1:]))
        count = min(pending[k], max(0, limit - layer.created_bytes - reserve) // gb)
        if count:
            mapper.grow(count, limit=limit, reserve=reserve, extra=extra)
            pending[k] -= count


class Mapper:
    """Moves one layer kind's page groups between the spare list and slots, as plans say.
    Lock held."""

    def __init__(self, books: SlotBooks, *, zero_pages: Callable[[list[int]], None] | None = None,
                 copy_pages: Callable[[list[tuple[int, int]]], None] | None = None) -> None:
        """`zero_pages(offsets)` clears pages (zero_reused_pages); `copy_pages(pairs)` copies the
        page at each (src, dst) offset pair in every buffer of the kind (fork)."""
        self.books = books
        self.zero_pages = zero_pages
        self.copy_pages = copy_pages

    # ----------------------------------------------------------------- plans ----
    def give_back(self, plan: KindPlan) -> int:
        """The plan's pages behind windows (they become holes). Returns the pages unmapped."""
        return sum(self.drop_behind(slot, first) for slot, first in plan.drops)

    def execute(self, plan: KindPlan, lens: dict[int, int] | None = None) -> tuple[int, int]:
        """Map the plan's pages (the groups it needs are spare already). Returns (groups
        mapped, pages unmapped)."""
        num_unmapped = 0
        if not (plan.shares or plan.maps):
            return 0, num_unmapped
        try:
            num_mapped = self.map_slots(plan)
        except MapCountLimitError:
            # Every mapped page is a VMA on the host: give back the cached ones (free slots,
            # pre-mapped tails) and try once more before failing.
            freed = self.reclaim(reclaimable(self.books, lens or {}), self.books.physical.num_created)
            if not freed:
                raise
            num_unmapped += freed
            num_mapped = self.map_slots(plan)
        return num_mapped, num_unmapped

    # ------------------------------------------------------------- movements ----
    def grow(self, count: int, background: bool = False, limit: int = 0, reserve: int = 0,
             extra: bool = True) -> None:
        """Create at least `count` more spare groups (a chunk at a time where `extra`) within
        `limit` bytes of every kind's groups, leaving `reserve` bytes of it to other kinds. In
        the background the lock is released around the driver call (only calls that stop the
        worker first grow otherwise)."""
        books = self.books
        physical, gb = books.physical, books.geometry.group_bytes
        room = (limit - physical.layer.created_bytes - reserve) // gb
        n = min(room, max(count, GROW_CHUNK if extra else count))
        if n <= 0:
            return
        need = min(count, room)
        groups = physical.create(need, n - need, unlocked=books.unlocked(background))
        if groups is None:
            raise budget_refused(need, gb)
        books.add_created(groups)

    def map_slots(self, plan: KindPlan) -> int:
        """Map the plan's given groups, then spare ones, in one backend call (atomic), copy
        what it copies, and book them. Returns the spare groups mapped."""
        books, g = self.books, self.books.geometry
        offsets, groups, takers = [], [], []
        for slot, first, shared in plan.shares:
            offsets += [g.page_offset(slot, first + i) for i in range(len(shared))]
            groups += shared
            takers += [slot] * len(shared)
        num_shared = len(groups)
        spare = books.physical.spare
        for slot, first, count in plan.maps:
            for p in range(first, first + count):
                offsets.append(g.page_offset(slot, p))
                groups.append(spare.pop())
                takers.append(slot)
        fresh = groups[num_shared:]
        holes = [i for i in range(num_shared) if groups[i] is None]  # behind a sliding window: not mapped
        try:
            if holes:
                keep = [i for i in range(len(groups)) if groups[i] is not None]
                books.physical.map([offsets[i] for i in keep], [groups[i] for i in keep])
            else:
                books.physical.map(offsets, groups)
        except BaseException:
            spare.extend(reversed(fresh))  # the map was atomic: nothing of it happened
            raise
        if plan.copies:
            try:
                self.copy_pages(list(plan.copies))
            except BaseException:
                books.physical.unmap([off for off, grp in zip(offsets, groups) if grp is not None])
                spare.extend(reversed(fresh))
                raise
            copied = {dst for _, dst in plan.copies}  # overwritten: no earlier owner's data left
            books.dirty.difference_update(grp for off, grp in zip(offsets, groups) if off in copied)
        refs, slot_pages = books.refs, books.slot_pages
        for slot, grp in zip(takers[:num_shared], groups[:num_shared]):
            if grp is not None:
                refs[grp] += 1
            else:  # a hole (they lead: the slot held nothing before)
                books.lead[slot] += 1
            slot_pages[slot].append(grp)
        for slot, grp in zip(takers[num_shared:], fresh):
            refs[grp] = 1
            slot_pages[slot].append(grp)
        if num_shared:  # (the caller books which slots share them)
            books.dirty.difference_update(groups[:num_shared])  # a live slot's or a pin's data
        for slot in dict.fromkeys(takers):
            books.pages_changed(slot)
        books.note_dirty(takers[num_shared:], fresh)
        return len(fresh)

    def unmap_tails(self, unmaps: Unmaps) -> int:
        """Unmap the last k pages of each (slot, k), after the slot's fence (never under a
        kernel that may read them). A group nobody else maps becomes spare; a shared one only
        loses this slot's reference. Returns the pages unmapped."""
        if not unmaps:
            return 0
        books, g = self.books, self.books.geometry
        offsets = []
        for s, k in unmaps:
            pages = books.slot_pages[s]
            n = len(pages)
            offsets += [g.page_offset(s, p) for p in range(n - k, n) if pages[p] is not None]
        books.physical.wait(books.last_fence[s] for s, _ in unmaps)
        for s, _ in unmaps:
            books.last_fence[s] = None
            books.epoch[s] += 1
        books.physical.unmap(offsets)
        for s, k in unmaps:
            pages = books.slot_pages[s]
            books.unref(reversed(pages[len(pages) - k:]))
            del pages[len(pages) - k:]
            if pages and pages[-1] is None:  # only holes left (they lead): nothing mapped
                pages.clear()
            books.lead[s] = min(books.lead[s], len(pages))
            books.pages_changed(s)
        return len(offsets)

    def drop_behind(self, slot: int, first: int) -> int:
        """Give back the pages of `slot` before page `first` (wholly behind its sliding window),
        after its fence: they become holes (None), the virtual range stays reserved, and a
        group another slot or a pin still holds only loses this slot's reference. Returns
        the pages unmapped."""
        books, g = self.books, self.books.geometry
        pages = books.slot_pages[slot]
        if first > len(pages):
            pages.extend([None] * (first - len(pages)))
        drop = [p for p in range(books.holes(slot), first) if pages[p] is not None]
        if not drop:
            books.lead[slot] = max(books.lead[slot], first)
            books.pages_changed(slot)
            return 0
        books.physical.wait([books.last_fence[slot]])
        books.physical.unmap([g.page_offset(slot, p) for p in drop])
        books.unref(pages[p] for p in drop)
        for p in drop:
            pages[p] = None
        books.lead[slot] = first
        books.pages_changed(slot)
        return len(drop)

    def evict(self, count: int) -> int:
        """Make up to `count` kept groups no slot maps spare (pins, least recently used
        first). Returns how many."""
        return self.books.evict(count)

    def reclaim(self, donors: list[tuple[int, int]], count: int) -> int:
        """Unmap the donors' tail pages until `count` groups became spare. Returns pages unmapped."""
        unmaps, _, _ = plan_unmaps(self.books, donors, count)
        return self.unmap_tails(unmaps)

    def empty(self, slot: int) -> None:
        """Unmap every page of `slot` (after its fence); groups nobody else maps become spare."""
        n = len(self.books.slot_pages[slot])
        if n:
            self.reclaim([(slot, n)], n)
            self.books.slot_pages[slot].clear()  # (holes too)
            self.books.lead[slot] = 0
            self.books.pages_changed(slot)

    def zero_dirty(self, slots: Iterable[int]) -> None:
        """Clear the pages of `slots` that hold an earlier request's data (zero_reused_pages)."""
        books, g = self.books, self.books.geometry
        offsets = []
        for s in slots:
            if s in books.dirty_slots:
                books.dirty_slots.discard(s)
                for p, grp in enumerate(books.slot_pages[s]):
                    if grp in books.dirty:
                        books.dirty.discard(grp)
                        offsets.append(g.page_offset(s, p))
        if offsets:
            self.zero_pages(offsets)

    def release_spare(self, count: int) -> int:
        """Release up to `count` spare groups. Returns how many."""
        spare = self.books.physical.spare
        count = min(count, len(spare))
        self.books.dirty.difference_update(spare[len(spare) - count:] if count else ())
        return self.books.physical.release_spare(count)


def budget_refused(num_groups: int, group_bytes: int) -> OutOfPhysicalMemoryError:
    nbytes = num_groups * group_bytes
    return OutOfPhysicalMemoryError(
        f"the shared budget has no room for {num_groups} more page groups ({nbytes} bytes); free requests here "
        "or in the caches sharing it, or raise its limit")


__all__ = ["GROW_CHUNK", "Mapper", "budget_refused", "carry_out"]
