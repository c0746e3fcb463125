"""What the coordinator does to the memory of every layer kind at once, outside a step:
trimming, reserving, giving back to a shared budget, the figures, and unbooking every page
at close. Each function runs with the coordinator's lock held and its worker stopped
(`Coordinator._quiet`; `stats` needs the lock only). Plain Python.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from vattn.allocator.books import MemoryStats
from vattn.allocator.mapper import budget_refused
from vattn.allocator.plan import reclaimable
from vattn.errors import OutOfPhysicalMemoryError

if TYPE_CHECKING:
    from vattn.allocator.books import SlotBooks, Slots
    from vattn.allocator.kinds import KindManager
    from vattn.pages import PageLayer


def trim(kinds: Sequence[KindManager]) -> int:
    """Give back every page no live token needs (free slots, pre-mapped tails, pins no slot
    maps, kept snapshots): unmap and release them (the caller took the fence of the
    iteration in flight). Returns the page groups released."""
    released = 0
    for kind in kinds:
        books = kind.books
        kind.mapper.reclaim(reclaimable(books, {}), books.physical.num_created)
        kind.mapper.evict(books.physical.num_created)
        released += kind.mapper.release_spare(len(books.physical.spare))
    return released


def reserve(kinds: Sequence[KindManager], n: int, max_bytes: int, nbytes: int) -> int:
    """Create page groups in every kind until each has `n` (what `nbytes` asked for), all
    within `max_bytes`, or OutOfPhysicalMemoryError with nothing created. Returns groups
    created."""
    # a kind holding more than n groups keeps them: count the bytes there will be
    after = sum(max(n, k.books.physical.num_created) * k.geometry.group_bytes for k in kinds)
    if after > max_bytes:
        raise OutOfPhysicalMemoryError(
            f"{nbytes} bytes is {n} page groups of every kind: {after} bytes with the groups that exist "
            f"now, over the budget of {max_bytes} bytes; raise physical_memory (or trim() first)")
    created = 0
    for kind in kinds:
        books, physical = kind.books, kind.books.physical
        if n > physical.num_created:
            groups = physical.create(n - physical.num_created)
            if groups is None:
                raise budget_refused(n - physical.num_created, books.geometry.group_bytes)
            books.add_created(groups)
            created += len(groups)
    return created


def give_back(kinds: Sequence[KindManager], slots: Slots, layer: PageLayer, nbytes: int) -> int:
    """Release up to `nbytes`: spare groups of every kind first, then cached pages (free
    slots, pre-mapped tails, pins no slot maps, kept snapshots). Never raises (a driver call
    that failed ends it). Returns the bytes given back."""
    given = 0
    try:
        for kind in kinds:  # spare groups first, every kind's
            gb = kind.geometry.group_bytes
            given += kind.mapper.release_spare(min(len(kind.books.physical.spare), -(-(nbytes - given) // gb))) * gb
            if given >= nbytes:
                return given
        slots.fence_ran(layer.fence())
        for kind in kinds:
            books, mapper, gb = kind.books, kind.mapper, kind.geometry.group_bytes
            want = -(-(nbytes - given) // gb)
            if want <= 0:
                break
            mapper.reclaim(reclaimable(books, {}), want)
            if len(books.physical.spare) < want:
                mapper.evict(want - len(books.physical.spare))
            given += mapper.release_spare(min(want, len(books.physical.spare))) * gb
        return given
    except Exception:  # a driver call failed: give what we could
        return given


def stats(kinds: Sequence[KindManager], max_bytes: int, created_bytes: int, max_pages: int) -> MemoryStats:
    """The memory figures; with several kinds, their sums (bytes exact; page counts add
    groups of different sizes) with each kind's own in `kinds`. `free_tokens`: tokens that
    fit in what is spare, cached and left in the budget, were every K/V layer to hold them
    (lock held)."""
    books = [kind.books for kind in kinds]
    room = max_bytes - created_bytes
    if len(books) == 1:
        return books[0].stats(max_bytes // books[0].geometry.group_bytes)
    per = [b.stats(b.physical.num_created + max(0, room) // b.geometry.group_bytes) for b in books]
    free_bytes = sum((s.num_free_pages + s.num_cached_pages) * s.group_bytes for s in per) + max(0, room)
    kv = [kind for kind in kinds if kind.pinned_pages]  # the K/V kinds: what a token takes
    token_bytes = sum(kind.geometry.held_bytes(1) for kind in kv)
    return replace(
        per[0],
        group_bytes=sum(s.group_bytes for s in per),
        num_created_pages=sum(s.num_created_pages for s in per),
        num_free_pages=sum(s.num_free_pages for s in per),
        num_mapped_pages=sum(s.num_mapped_pages for s in per),
        num_cached_pages=sum(s.num_cached_pages for s in per),
        max_pages=max_pages,
        mapped_bytes=sum(s.mapped_bytes for s in per),
        used_bytes=sum(s.used_bytes for s in per),
        free_tokens=free_bytes // token_bytes if token_bytes else 0,
        num_pinned_pages=len(kv[0].books.pins) if kv else 0,
        kinds={b.name: s for b, s in zip(books, per)},
    )


def unbook(books: Sequence[SlotBooks]) -> list[tuple[list[int], list[Any]]]:
    """Empty every kind's books (closing): per kind, the offsets of its mapped pages and its
    groups (each once, however many slots map it), for the page layer to unmap and release."""
    per_kind = []
    for b in books:
        g, n = b.geometry, len(b.slot_pages)
        offsets = [g.page_offset(s, p) for s in range(n) for p, grp in enumerate(b.slot_pages[s]) if grp is not None]
        per_kind.append((offsets, list(b.refs)))
        b.slot_pages, b.refs, b.capacity = [[] for _ in range(n)], {}, [0] * n
        b.lead = [0] * n
        b.pins.clear()
        b.shared_slots.clear()
        b.dirty.clear()
        b.dirty_slots.clear()
    return per_kind


__all__ = ["give_back", "reserve", "stats", "trim", "unbook"]
