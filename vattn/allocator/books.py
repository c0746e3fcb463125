"""The slot allocator's books: the slots every layer kind shares (`Slots`: which are
active, their lengths, fences, the lock), and each kind's pages (`SlotBooks`: which page
groups each slot maps, and the references, pins and dirty marks of every group). Plain
Python, no torch.

A slot's pages in a kind are a prefix `slot_pages[s]` of references to that kind's page
groups; in a kind that gives pages back (a sliding window, chunked attention: its manager
says which, `vattn.allocator.kinds`) its leading entries may be holes (None): pages wholly
behind what its queries read, unmapped while the slot's virtual range stays reserved. A group may be
mapped into several slots at once (a fork shares the whole pages of a prefix); `refs`
counts the slots that map each group, plus one while it is pinned:

```
created groups = spare (free, unmapped) + distinct mapped or pinned groups + in flight (worker)
sum of refs    = sum over slots of len(slot_pages[s]) + len(pins)            (per kind)
```
A shared group holds whole pages of tokens that every slot mapping it has already
written: no slot ever writes into it. A slot's writable tail (from its length on) is in
groups of its own.

A slot (reqid) is *active* between alloc_reqid and free_reqid and *free* otherwise. A free
slot keeps its pages (deferred reclamation). A slot has one length for every kind
(`Slots.max_lens`): a step moves it in every kind or in none. `epoch[s]` (a kind's) changes
whenever the slot's data in that kind may change hands (a new owner, pages taken), so a
parked request can tell which kinds of its slot are untouched.
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol

from vattn.checks import as_int
from vattn.errors import ClosedError, InvalidRequestError, UnknownReqIdError

if TYPE_CHECKING:  # the books import no torch: sizes are ints by the time they get here
    from vattn.pages import PageGroups


class KindGeometry(Protocol):
    """What the books, plans and mappers read of a kind's byte layout (`vattn.config.Geometry`
    for K/V kinds, `StateGeometry` for states)."""

    page_size: int

    @property
    def num_buffers(self) -> int: ...
    @property
    def group_bytes(self) -> int: ...
    @property
    def token_bytes(self) -> int: ...
    @property
    def share_tokens(self) -> int: ...
    @property
    def share_pages(self) -> int: ...
    @property
    def pages_per_slot(self) -> int: ...
    def pages_for(self, num_tokens: int) -> int: ...
    def page_offset(self, slot: int, page: int) -> int: ...
    def tokens_in(self, num_pages: int) -> int: ...
    def held_bytes(self, num_tokens: int) -> int: ...
    def first_writable(self, num_tokens: int) -> int: ...
    def shared_pages(self, num_tokens: int) -> int: ...


@dataclass(frozen=True)
class MemoryStats:
    """Memory figures in bytes (all buffers, K and V of every layer) and page groups.

    The `num_*_pages` fields and `max_pages` count page groups (one page of every buffer,
    `group_bytes` in all), the unit that is mapped; the names are kept for compatibility.
    """

    page_size: int
    group_bytes: int
    num_created_pages: int  # page groups that exist (spare, mapped or pinned)
    num_free_pages: int  # spare: created, mapped nowhere
    num_mapped_pages: int  # mapped into any slot
    num_cached_pages: int  # mapped but under no live token: free slots, pre-mapped tails (reclaimable)
    max_pages: int  # budget
    mapped_bytes: int
    used_bytes: int  # bytes holding tokens of active requests
    free_tokens: int  # tokens that still fit (spare, budget and cached pages)
    num_active: int
    num_pinned_pages: int = 0  # kept for the prefix cache (mapped in a slot or not)
    # A cache of several layer kinds: each kind's own figures ("full", "window=W",
    # "state"), whose sums these are (page groups of different sizes added; bytes exact;
    # the pins are the first kind's). None: one kind.
    kinds: dict[str, MemoryStats] | None = None
    # The offload tiers under the cache (`KVCache.host`, vattn.offload): bytes of host memory
    # (prefix blocks and swapped-out requests) and of disk files they hold
    host_bytes: int = 0
    disk_bytes: int = 0

    @property
    def fragmentation_bytes(self) -> int:
        """Mapped to active requests but holding no token (internal fragmentation)."""
        return self.active_bytes - self.used_bytes

    @property
    def created_bytes(self) -> int:
        """Physical bytes of the page groups that exist (every layer kind's)."""
        if self.kinds:
            return sum(k.created_bytes for k in self.kinds.values())
        return self.num_created_pages * self.group_bytes

    @property
    def active_bytes(self) -> int:
        if self.kinds:
            return sum(k.active_bytes for k in self.kinds.values())
        return (self.num_mapped_pages - self.num_cached_pages) * self.group_bytes

    @property
    def fragmentation(self) -> float:
        return self.fragmentation_bytes / self.active_bytes if self.active_bytes else 0.0


class Slots:
    """The books every layer kind shares, guarded by `lock`: which slots are active (and
    their allocation order), their lengths, the fences of the iterations that read them.

    Cost grows with the work, not the capacity: the slot `alloc_reqid` hands out next comes
    from a heap over the first kind's pages (`warm_pages`, kept by that kind's books).
    """

    def __init__(self, num_slots: int, max_len: int) -> None:
        self.num_slots = n = num_slots
        self.max_len = max_len
        self.lock = threading.Lock()
        self.closed = False
        self.free_slots: set[int] = set(range(n))
        self.warm_pages = [0] * n  # the first kind's pages of each slot (what warm_slot prefers)
        self._warm_heap = [(0, s) for s in range(n)]  # (-pages, slot) of free slots; stale entries skipped
        self.active: dict[int, int] = {}  # active slot -> allocation order (age)
        self._counter = itertools.count()
        self.ran: dict[int, int] = {}  # the latest step's lengths: the iteration after it reads these slots
        self.max_lens = [0] * n  # longest length since alloc: pages below it hold data
        # Sliding windows: the slot's previous step length below its latest one (where the
        # queries of the iteration being planned start; a step re-planned at the same length
        # is the same iteration).
        self.prev_lens = [0] * n
        # A tensor-parallel rank takes a step back that another rank could not back
        # (`Coordinator.revert_step`): each slot's previous length before prev_lens, and the
        # step that last moved it (steps counted in num_steps).
        self.older_lens = [0] * n
        self.moved_at = [0] * n
        self.num_steps = 0
        self.last_fence: list[Any] = [None] * n  # the slot's pages may be unmapped once this passed
        self.eager_tokens = 0.0  # running mean of new requests' first lengths

    def take(self, slot: int) -> None:
        """Hand free `slot` to a new request."""
        self.free_slots.remove(slot)
        self.active[slot] = next(self._counter)
        self.prev_lens[slot] = 0

    def untake(self, slot: int) -> None:
        """Give back a slot `take` handed out for a call that failed."""
        del self.active[slot]
        self.free_slots.add(slot)
        self.max_lens[slot] = 0
        self.warm_changed(slot)

    def free(self, slot: int) -> None:
        """The request in active `slot` ended; the slot keeps its pages."""
        del self.active[slot]
        self.free_slots.add(slot)
        self.max_lens[slot] = 0
        self.warm_changed(slot)

    def revert(self, reqids: Iterable[int]) -> list[int]:
        """The last step's iteration will not run for `reqids`: the lengths of those it moved
        go back to what they were before it. Returns those slots."""
        out = []
        for s in reqids:
            if s not in self.active or self.moved_at[s] != self.num_steps:
                continue
            self.max_lens[s], self.prev_lens[s] = self.prev_lens[s], self.older_lens[s]
            self.moved_at[s] = 0
            self.ran.pop(s, None)
            out.append(s)
        return out

    def warm_slot(self) -> int:
        """The free slot alloc_reqid hands out next: most pages mapped, then lowest index."""
        heap, pages, free = self._warm_heap, self.warm_pages, self.free_slots
        while True:
            neg, s = heap[0]
            if s in free and -neg == pages[s]:
                return s
            heapq.heappop(heap)

    def warm_changed(self, slot: int) -> None:
        """`slot`'s first-kind pages changed, or it became free: keep the heap in step."""
        if slot in self.free_slots:
            heap = self._warm_heap
            if len(heap) > 4 * self.num_slots + 64:  # drop the stale entries now and then
                heap[:] = [(-self.warm_pages[s], s) for s in self.free_slots]
                heapq.heapify(heap)
            heapq.heappush(heap, (-self.warm_pages[slot], slot))

    def check_active(self, reqid: Any) -> int:
        """`reqid` as the int of an active slot, or UnknownReqIdError."""
        slot = as_index(reqid, "reqid")
        if slot not in self.active:
            state = "out of range" if not 0 <= slot < self.num_slots else "not allocated (or already freed)"
            raise UnknownReqIdError(f"reqid {slot} is {state}")
        return slot

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("this cache was closed; create a new one with vattn.init()")

    @contextlib.contextmanager
    def unlocked(self, release: bool) -> Iterator[None]:
        """Drop the (held) lock for the block when `release`: the worker's driver calls."""
        if not release:
            yield
            return
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()

    def fence_ran(self, fence: Any) -> None:
        """The kernels of the last iteration read its slots: their pages may be unmapped
        only after `fence`, taken now (at a step's start, and before any call between
        iterations that may unmap pages: fork, map_pinned, trim, resume)."""
        if fence is not None:
            for s in self.ran:
                self.last_fence[s] = fence

    def check_invariants(self) -> None:
        assert self.free_slots.isdisjoint(self.active)
        assert len(self.free_slots) + len(self.active) == self.num_slots
        assert all(not self.max_lens[s] for s in self.free_slots), "a free slot keeps a length"


class SlotBooks:
    """The books of one layer kind: which of its page groups each slot maps, and their
    references, pins and dirty marks. The slot-level books (`slots`: active slots, lengths,
    fences, the lock) are every kind's; the names below read them for the code that plans
    and maps one kind.
    """

    def __init__(self, geometry: KindGeometry, physical: PageGroups, slots: Slots, *, track_dirty: bool,
                 primary: bool = True, name: str = "full") -> None:
        """`primary`: the first kind, whose pages `alloc_reqid` prefers (the warm slot).
        Which pages a query reads, and so which may become holes, is the kind's manager's
        (`vattn.allocator.kinds`): the books only keep them."""
        self.geometry = geometry
        self.physical = physical  # the page layer's groups of this kind: spare, fences
        self.slots = slots
        self.name = name
        self.primary = primary
        n = slots.num_slots
        self.slot_pages: list[list[Any]] = [[] for _ in range(n)]
        self.capacity = [0] * n  # tokens the slot's mapped pages hold (kept with slot_pages)
        self.refs: dict[Any, int] = {}  # group -> slots mapping it + 1 if pinned
        # Pinned groups (the prefix cache's pages), least recently used first: a pin is one
        # more reference, so a pinned group outlives the slots that mapped it (its data stays
        # in physical memory, unmapped) until it is evicted under memory pressure or trim().
        self.pins: OrderedDict[Any, int] = OrderedDict()  # group -> generation of its pin
        self._generation = itertools.count(1)
        self.shared_slots: set[int] = set()  # slots that may map a group shared with another slot
        self.lead = [0] * n  # holes (None) leading slot_pages[s]: pages given back behind a window
        self.epoch = [0] * n
        # zero_reused_pages: groups holding data of a request that no longer owns them, and the
        # slots that hold such groups; `step` clears them before the slot's request runs.
        self.track_dirty = track_dirty
        self.dirty: set[Any] = set()
        self.dirty_slots: set[int] = set()
        self.in_flight: list[Any] = []  # groups the worker is mapping right now (lock released)

    # ----------------------------------------------------- the slots' books, read here ----
    @property
    def lock(self) -> threading.Lock:
        return self.slots.lock

    @property
    def num_slots(self) -> int:
        return self.slots.num_slots

    @property
    def max_len(self) -> int:
        return self.slots.max_len

    @property
    def active(self) -> dict[int, int]:
        return self.slots.active

    @property
    def free_slots(self) -> set[int]:
        return self.slots.free_slots

    @property
    def max_lens(self) -> list[int]:
        return self.slots.max_lens

    @property
    def prev_lens(self) -> list[int]:
        return self.slots.prev_lens

    @property
    def ran(self) -> dict[int, int]:
        return self.slots.ran

    @property
    def last_fence(self) -> list[Any]:
        return self.slots.last_fence

    @property
    def eager_tokens(self) -> float:
        return self.slots.eager_tokens

    def check_active(self, reqid: Any) -> int:
        return self.slots.check_active(reqid)

    def check_open(self) -> None:
        self.slots.check_open()

    def warm_slot(self) -> int:
        return self.slots.warm_slot()

    def unlocked(self, release: bool) -> contextlib.AbstractContextManager[None]:
        return self.slots.unlocked(release)

    # ----------------------------------------------------------------- slots ----
    def new_owner(self, slot: int) -> None:
        """`slot` got a new owner: its data in this kind changed hands."""
        self.epoch[slot] += 1

    def freed(self, slot: int) -> None:
        """The request in `slot` ended (the slot keeps its pages)."""
        if self.track_dirty and self.slot_pages[slot]:  # the next owner must not read them
            # (pages shared with a live slot or pinned are someone's data still: a new owner
            # drops them unread at its first step)
            self.dirty.update(grp for grp in self.slot_pages[slot] if grp is not None and self.refs[grp] == 1)
            self.dirty_slots.add(slot)

    def holes(self, slot: int) -> int:
        """Leading pages of `slot` given back behind what its queries read (None entries)."""
        return self.lead[slot]

    def num_mapped(self, slot: int) -> int:
        """Pages of `slot` that are mapped (its holes are not)."""
        return len(self.slot_pages[slot]) - self.holes(slot)

    def pages_changed(self, slot: int) -> None:
        """Keep the derived figures of `slot` in step with `slot_pages[slot]`."""
        n = len(self.slot_pages[slot])
        self.capacity[slot] = self.geometry.tokens_in(n)
        if self.primary:
            self.slots.warm_pages[slot] = n
            self.slots.warm_changed(slot)

    # ---------------------------------------------------------------- groups ----
    def unref(self, groups: Iterable[Any]) -> None:
        """Drop one reference to each group; a group nobody maps or pins becomes spare."""
        refs, spare = self.refs, self.physical.spare
        for grp in groups:
            if grp is None:  # a hole behind a sliding window: nothing mapped
                continue
            left = refs[grp] - 1
            if left:
                refs[grp] = left
            else:
                del refs[grp]
                spare.append(grp)

    def pin(self, slot: int, num_pages: int) -> list[tuple[Any, int]]:
        """Pin the first `num_pages` groups of `slot` (a pin is one more reference); one
        (group, generation) handle each. A group pinned already keeps its handle and
        becomes the most recently used."""
        handles = []
        for grp in self.slot_pages[slot][:num_pages]:
            if grp is None:  # behind a sliding window: nothing to keep
                handles.append((None, 0))
                continue
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

    def pinned(self, handles: Iterable[tuple[Any, int]]) -> list[Any]:
        """The groups of the leading `handles` that are still pinned (not evicted since);
        None for a hole (a page pinned behind a sliding window)."""
        groups: list[Any] = []
        for grp, gen in handles:
            if grp is None:
                groups.append(None)
                continue
            if self.pins.get(grp) != gen:
                break
            groups.append(grp)
        return groups

    def num_evictable(self) -> int:
        """Pinned groups no slot maps: what `evict` can make spare."""
        refs = self.refs
        return sum(refs[grp] == 1 for grp in self.pins)

    def evict(self, count: int) -> int:
        """Unpin up to `count` pinned groups that no slot maps, least recently used first;
        they become spare. Returns how many."""
        refs, victims = self.refs, []
        for grp in self.pins:
            if len(victims) >= count:
                break
            if refs[grp] == 1:
                victims.append(grp)
        for grp in victims:
            del self.pins[grp]
        self.unref(victims)
        return len(victims)

    def add_created(self, groups: list[Any]) -> None:
        """Groups new from the driver become spare; under zero_reused_pages they count as
        dirty (whatever the memory held: CUDA promises no zeros), cleared before a request
        reads them."""
        if self.track_dirty:
            self.dirty.update(groups)
        self.physical.put_spare(groups)

    def note_dirty(self, slots: list[int], groups: list[Any]) -> None:
        """zero_reused_pages: a slot that got a group with someone else's data must be cleared."""
        if self.dirty:
            self.dirty_slots.update(s for s, grp in zip(slots, groups) if grp in self.dirty)

    # --------------------------------------------------------------- figures ----
    def stats(self, max_pages: int) -> MemoryStats:
        """This kind's figures; `max_pages`: the groups of this kind the budget could hold."""
        g, refs, pins, physical = self.geometry, self.refs, self.pins, self.physical
        pin_only = sum(refs[grp] == 1 for grp in pins)
        mapped = len(refs) - pin_only  # distinct groups mapped in a slot: a shared one is memory once
        active, max_lens = self.slots.active, self.slots.max_lens
        holding = {grp for s in active for grp in self.slot_pages[s][:g.pages_for(max_lens[s])] if grp is not None}
        cached = len(refs) - len(holding)  # pages under no live token (pinned ones too)
        spare = len(physical.spare) + max(0, max_pages - physical.num_created) + cached
        return MemoryStats(
            page_size=g.page_size,
            group_bytes=g.group_bytes,
            num_created_pages=physical.num_created,
            num_free_pages=len(physical.spare),
            num_mapped_pages=mapped,
            num_cached_pages=cached,
            max_pages=max_pages,
            mapped_bytes=mapped * g.group_bytes,
            used_bytes=sum(g.held_bytes(self.live_tokens(s)) for s in active),
            free_tokens=g.tokens_in(spare),
            num_active=len(active),
            num_pinned_pages=len(pins),
        )

    def live_tokens(self, slot: int) -> int:
        """Tokens of `slot` in mapped pages (those behind its window were given back)."""
        n, holes = self.slots.max_lens[slot], self.lead[slot]
        if not holes:
            return n
        g = self.geometry
        return max(0, n - holes * g.page_size // g.token_bytes)

    def cached_groups(self) -> int:
        """An estimate, without the lock, of what could be given back now: spare groups, free
        slots' pages and pins."""
        pages, lead = self.slot_pages, self.lead
        return (len(self.physical.spare) + len(self.pins)
                + sum(len(pages[s]) - lead[s] for s in list(self.slots.free_slots)))

    def check_invariants(self, max_pages: int | None = None) -> None:
        """Assert this kind's books are consistent (for tests and debugging). Lock held."""
        mapped = [grp for pages in self.slot_pages for grp in pages if grp is not None]
        counts: dict[Any, int] = {}
        for grp in mapped:
            counts[grp] = counts.get(grp, 0) + 1
        for grp in self.extra_refs():
            counts[grp] = counts.get(grp, 0) + 1
        for grp in self.pins:
            counts[grp] = counts.get(grp, 0) + 1
        assert counts == self.refs, "reference counts differ from the slots' pages and the pins"
        everywhere = list(counts) + self.physical.spare + self.in_flight
        assert len(everywhere) == self.physical.num_created
        assert max_pages is None or self.physical.num_created <= max_pages
        assert len(set(everywhere)) == self.physical.num_created, "a group is in two places"
        assert not set(everywhere) & set(self.physical.unreleased), "an unreleased group is in use"
        for s, pages in enumerate(self.slot_pages):
            held = [grp for grp in pages if grp is not None]
            assert len(set(held)) == len(held), f"slot {s} maps a group twice"
            lead = next((i for i, grp in enumerate(pages) if grp is not None), len(pages))
            assert lead == self.lead[s], f"slot {s}: {lead} leading holes, booked {self.lead[s]}"
            assert len(held) == len(pages) - lead, f"slot {s} has a hole after a mapped page"
            if any(counts[grp] > 1 for grp in held):
                assert s in self.shared_slots
        g, max_lens = self.geometry, self.slots.max_lens
        for s in self.slots.active:  # the writable tail (from the length on) is the slot's own
            if not max_lens[s]:  # not stepped yet: its first step unshares it
                continue
            first_writable = g.first_writable(max_lens[s])
            assert all(counts.get(grp) == 1 for grp in self.slot_pages[s][first_writable:]), \
                f"slot {s} may write a shared page"
            self.check_slot(s)

    def check_slot(self, slot: int) -> None:
        """Assert `slot` (active, with tokens) maps the pages its tokens need."""
        g, pages = self.geometry, self.slot_pages[slot]
        assert g.pages_for(self.slots.max_lens[slot]) <= len(pages) <= g.pages_per_slot, f"slot {slot}: {len(pages)} pages"

    def extra_refs(self) -> Iterable[Any]:
        """Groups referenced outside the slots and the pins (the state kind's snapshots)."""
        return ()


def as_index(value: Any, what: str) -> int:
    """An int argument of a call (a reqid, a length, a count), or InvalidRequestError."""
    return as_int(value, what, InvalidRequestError)
