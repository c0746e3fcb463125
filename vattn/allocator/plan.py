"""Deciding what a call does to the page tables, from the books alone (no backend call):
`StepPlan`, the typed seam between deciding and mapping. Plain Python, no torch.

`step` (and `resume`, and `fork`, and `map_pinned`) turn their request into a `StepPlan`;
`Mapper.carry_out` carries one out, in this order:

```
create num_create groups        (at least: a chunk may bring more; refused -> plan again)
unmap  unmaps                   (slot, tail pages), each after its slot's fence: groups nobody
                                else maps become spare, shared ones lose one reference
evict  num_evict pins           no slot maps them: least recently used first, to spare
map    shares, then maps        in one backend call: given groups (a parent's, pins), then
                                spare groups; copies after it (fork's partial last page)
```
Who is served is decided here too: oldest requests first, the rest `failed` (the caller
preempts them), so a plan never asks for more than spare + budget + what is reclaimable.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from vattn.allocator.books import as_index
from vattn.errors import ContextLengthError, InvalidRequestError, UnknownReqIdError

if TYPE_CHECKING:
    from vattn.allocator.books import SlotBooks

Unmaps = tuple[tuple[int, int], ...]  # (slot, tail pages to unmap)


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
class StepPlan:
    """The page movements of one call, in terms of the books: who is served, how many groups
    to create, which slot tails to unmap, how many pins to evict, and what to map where.

    Like vLLM v1's `KVCacheBlocks` between its scheduler and `KVCacheManager`: deciding
    (`plan_step`, `plan_fork`) and mapping (`Mapper`) meet only here, so a plan can be
    inspected, tested or agreed on (tensor-parallel ranks, a server's workers) before any
    backend call. Pages are (slot, page index) places; groups are the books' group handles.
    """

    lens: Mapping[int, int]  # slot -> length to back, every active slot of the step
    served: tuple[int, ...] = ()  # slots that get pages now, oldest request first
    failed: tuple[int, ...] = ()  # slots that cannot be backed: the caller preempts them
    num_create: int = 0  # groups to create first
    unmaps: Unmaps = ()  # (slot, tail pages), in order, each after the slot's fence
    num_unmapped: int = 0  # pages those unmaps take (a shared page frees no group)
    num_evict: int = 0  # pins no slot maps, evicted least recently used first
    shares: tuple[tuple[int, int, tuple[Any, ...]], ...] = ()  # (slot, first page, groups mapped there)
    maps: tuple[tuple[int, int, int], ...] = ()  # (slot, first page, pages) mapped with spare groups
    copies: tuple[tuple[int, int], ...] = ()  # (src, dst) page offsets copied once mapped
    limit: int = 0  # groups this call may have in all (the budget, or what exists after a refusal)

    @property
    def num_new(self) -> int:
        """Spare groups the maps take."""
        return sum(count for _, _, count in self.maps)


# ------------------------------------------------------------- step arguments ----
def normalize(books: SlotBooks, seq_lens: Sequence[int] | Mapping[int, int],
              ahead: int) -> tuple[dict[int, int], list[int], list[int]]:
    """One pass over `seq_lens`: the active slots' lengths, the slots short of pages now,
    and those within `ahead` tokens of a page (the edge, for pre-mapping). Raises (changing
    nothing) on a bad entry."""
    num_slots = books.num_slots
    if isinstance(seq_lens, Mapping):
        items = seq_lens.items()
    elif isinstance(seq_lens, (str, bytes)) or not hasattr(seq_lens, "__len__"):
        raise InvalidRequestError(
            f"seq_lens must be a list of {num_slots} lengths or a dict reqid -> length, "
            f"got {type(seq_lens).__name__}")
    else:
        if len(seq_lens) != num_slots:
            raise InvalidRequestError(
                f"seq_lens has {len(seq_lens)} entries; give one per slot (max_batch_size="
                f"{num_slots}) or a dict reqid -> length")
        items = enumerate(seq_lens)
    capacity, active, max_len = books.capacity, books.active, books.max_len
    lens: dict[int, int] = {}
    short: list[int] = []
    edge: list[int] = []
    for r, n in items:
        if type(r) is not int:
            r = as_index(r, "reqid")
        if type(n) is not int:
            n = as_index(n, f"seq_lens[{r}]")
        if not 0 < n <= max_len or r not in active:
            if n == 0 and 0 <= r < num_slots:
                continue  # inactive, as in the list form
            _bad_length(books, r, n)
        lens[r] = n
        c = capacity[r]
        if n > c:
            short.append(r)
        elif n + ahead > c:
            edge.append(r)
    return lens, short, edge


def _bad_length(books: SlotBooks, slot: int, n: int) -> None:
    if not 0 <= slot < books.num_slots:
        raise UnknownReqIdError(f"reqid {slot} is out of range [0, {books.num_slots})")
    if n < 0:
        raise InvalidRequestError(f"seq_lens[{slot}] = {n} is negative")
    if n > books.max_len:
        raise ContextLengthError(
            f"seq_lens[{slot}] = {n} exceeds max_context_len = {books.max_len}; "
            "stop the request or init with a larger max_context_len")
    raise UnknownReqIdError(f"reqid {slot} has length {n} but is not allocated; call alloc_reqid() first")


def short_and_edge(books: SlotBooks, lens: dict[int, int], ahead: int) -> tuple[list[int], list[int]]:
    """(slots short of pages now, slots within `ahead` tokens of a page)."""
    capacity = books.capacity
    return ([s for s, n in lens.items() if n > capacity[s]],
            [s for s, n in lens.items() if n <= capacity[s] < n + ahead])


# --------------------------------------------------------------------- plans ----
def plan_step(books: SlotBooks, lens: dict[int, int], short: list[int], limit: int) -> StepPlan:
    """Who of `short` is served (oldest first: the caller preempts the newest) from spare
    groups, new ones within `limit`, and pages reclaimed from free slots, pre-mapped tails
    and pins; and the movements that back them."""
    g, pages = books.geometry, books.slot_pages
    need = {s: g.pages_for(lens[s]) for s in short}
    order = sorted(short, key=books.active.__getitem__)
    supply = len(books.physical.spare) + (limit - books.physical.num_created)
    donors: list[tuple[int, int]] = []
    if sum(need[s] - len(pages[s]) for s in order) > supply:  # only then look at other slots
        donors = reclaimable(books, lens)
        supply += freeable(books, donors)  # pinned pages included: evicted after the donors
    served, failed, maps = [], [], []
    for s in order:
        missing = need[s] - len(pages[s])
        if missing <= supply:
            served.append(s)
            supply -= missing
            maps.append((s, len(pages[s]), missing))
        else:
            failed.append(s)
    return _supplied(books, StepPlan(lens, tuple(served), tuple(failed), maps=tuple(maps), limit=limit), donors)


def plan_fork(books: SlotBooks, parent: int, child: int, num_tokens: int, limit: int) -> StepPlan:
    """`child` (empty) maps the groups of `parent`'s whole pages of `num_tokens` tokens, and a
    spare group for the partly filled last page, into which that page is copied. `failed`
    is (child,) when no group can be had for the copy."""
    g = books.geometry
    full = num_tokens * g.token_bytes // g.page_size  # whole pages: shared
    copy = g.pages_for(num_tokens) - full  # 1 if the last page is partly filled
    shares = ((child, 0, tuple(books.slot_pages[parent][:full])),)
    if not copy:
        return StepPlan({}, shares=shares, limit=limit)
    donors: list[tuple[int, int]] = []
    if len(books.physical.spare) + (limit - books.physical.num_created) < copy:
        donors = reclaimable(books, {})
        if freeable(books, donors) < copy:
            return StepPlan({}, failed=(child,), limit=limit)
    plan = StepPlan({}, shares=shares, maps=((child, full, copy),),
                    copies=((g.page_offset(parent, full), g.page_offset(child, full)),), limit=limit)
    return _supplied(books, plan, donors)


def _supplied(books: SlotBooks, plan: StepPlan, donors: list[tuple[int, int]]) -> StepPlan:
    """`plan` with where its spare groups come from: those there are, then new ones within
    the limit, then the donors' tails (in order), then pins no slot maps."""
    spare = len(books.physical.spare)
    deficit = plan.num_new - spare
    if deficit <= 0:
        return plan
    create = min(deficit, plan.limit - books.physical.num_created)
    # What `create` brings is exactly that (at the limit) or at least the deficit (below it).
    missing = deficit - max(0, create)
    unmaps, num_unmapped, freed = plan_unmaps(books, donors, missing) if missing > 0 else ((), 0, 0)
    return dataclasses.replace(plan, num_create=max(0, create), unmaps=unmaps, num_unmapped=num_unmapped,
                               num_evict=max(0, missing - freed))


def plan_unmaps(books: SlotBooks, donors: list[tuple[int, int]], count: int) -> tuple[Unmaps, int, int]:
    """The donors' tail pages to unmap, in order, until `count` groups become spare (a group
    another slot or a pin still holds frees nothing). Returns (unmaps, pages, groups freed)."""
    refs, unmaps, freed, num_pages = books.refs, [], 0, 0
    left: dict[Any, int] = {}  # references a group keeps after the unmaps planned so far
    for s, k in donors:
        if freed >= count:
            break
        pages = books.slot_pages[s]
        n, take = len(pages), 0
        while take < k and freed < count:
            take += 1
            grp = pages[n - take]
            if grp is None:  # a hole behind a sliding window: nothing to free
                continue
            left[grp] = left.get(grp, refs[grp]) - 1
            freed += left[grp] == 0
        unmaps.append((s, take))
        num_pages += take
    return tuple(unmaps), num_pages, freed


def reclaimable(books: SlotBooks, lens: Mapping[int, int]) -> list[tuple[int, int]]:
    """(slot, pages) that may be taken, in the order to take them: free slots with fewest
    pages first (the warm slot last), then pre-mapped tails of active slots (past both the
    step's length and the longest length written)."""
    g, pages = books.geometry, books.slot_pages
    free = sorted((s for s in books.free_slots if pages[s]), key=lambda s: (len(pages[s]), s))
    donors = [(s, len(pages[s])) for s in free]
    for s in sorted(books.active):
        keep = g.pages_for(max(lens.get(s, 0), books.max_lens[s]))
        if len(pages[s]) > keep:
            donors.append((s, len(pages[s]) - keep))
    return donors


def freeable(books: SlotBooks, donors: list[tuple[int, int]]) -> int:
    """Groups that unmapping all the donors' (slot, last k pages) and evicting pins would
    free: those whose every reference is among them (a group a live slot maps beyond the
    donors' tails frees nothing)."""
    taken: dict[Any, int] = {}
    for s, k in donors:
        pages = books.slot_pages[s]
        for grp in pages[len(pages) - k:]:
            if grp is None:
                continue
            taken[grp] = taken.get(grp, 0) + 1
    pins, refs = books.pins, books.refs
    return (sum(t + (grp in pins) == refs[grp] for grp, t in taken.items())
            + sum(refs[grp] == 1 for grp in pins))  # pinned, mapped nowhere
