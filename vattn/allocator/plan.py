"""Deciding what a call does to the page tables of every layer kind, from the books alone
(no backend call): `StepPlan`, the typed seam between deciding and mapping. Plain Python,
no torch.

`step` (and `resume`, `fork`, `map_pinned`) turn their request into a `StepPlan`: who is
served (a slot is served in every kind or in none) and, per kind, a `KindPlan`; the
coordinator carries it out (`vattn.allocator.mapper.carry_out`) in this order:

```
create num_create                groups, those the budget has room for (at least: a chunk may
                                 bring more; refused -> plan again, nothing moved)
unmap  unmaps                    (slot, tail pages) of free slots and pre-mapped tails, each after
                                 its slot's fence: groups nobody else holds become spare
drop   drops                     (slot, first page): a served slot's pages wholly behind its
                                 sliding window, after its fence (they become holes)
evict  num_evict                 pins no slot maps (now), least recently used first: spare
release num_release              spare groups, to make room in the budget for another kind's
create num_create                the rest, in that room
map    shares, then maps         in one backend call per kind: given groups (a parent's, pins),
                                 then spare groups; copies after it (fork's partial last page)
```
Who is served is decided here too: oldest requests first, the rest `failed` (the caller
preempts them), so a plan never asks for more than spare + budget + what is reclaimable,
counted in bytes over every kind (a kind's spare or cached groups may be released to make
room for another's). A failed slot moves in no kind: its lengths and pages stay as they were.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

from vattn.allocator.books import as_index
from vattn.errors import ContextLengthError, InvalidRequestError, UnknownReqIdError

if TYPE_CHECKING:
    from vattn.allocator.books import SlotBooks, Slots

Unmaps = tuple[tuple[int, int], ...]  # (slot, tail pages to unmap)


class Reach(Protocol):
    """What a plan asks a layer kind's manager (`vattn.allocator.kinds.KindManager`): its
    books, and which page the queries of a step read first (pages before it go back where
    the kind `gives_back`)."""

    books: SlotBooks
    gives_back: bool

    def first_needed(self, slot: int, new_len: int) -> int: ...


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
class KindPlan:
    """The page movements of one layer kind in a plan: groups to make spare (donors' tails,
    pins), to release for another kind, to create; pages to give back behind a window; what
    to map where. Pages are (slot, page index) places; groups are the books' group handles."""

    num_create: int = 0  # groups to create
    unmaps: Unmaps = ()  # (slot, tail pages), in order, each after the slot's fence
    num_unmapped: int = 0  # pages those unmaps take (a shared page frees no group)
    num_evict: int = 0  # pins no slot maps, evicted least recently used first
    num_release: int = 0  # spare groups released: room in the budget for another kind's groups
    drops: tuple[tuple[int, int], ...] = ()  # (slot, first page it keeps): given back behind its window
    shares: tuple[tuple[int, int, tuple[Any, ...]], ...] = ()  # (slot, first page, groups mapped there)
    maps: tuple[tuple[int, int, int], ...] = ()  # (slot, first page, pages) mapped with spare groups
    copies: tuple[tuple[int, int], ...] = ()  # (src, dst) page offsets copied once mapped

    @property
    def num_new(self) -> int:
        """Spare groups the maps take."""
        return sum(count for _, _, count in self.maps)


@dataclass(frozen=True)
class StepPlan:
    """What one call does to every layer kind: who is served, and each kind's movements.

    Like vLLM v1's `KVCacheBlocks` between its scheduler and `KVCacheManager`: deciding
    (`plan_step`, `plan_backing`) and mapping (`vattn.allocator.mapper`) meet only here, so
    a plan can be inspected, tested or agreed on before any backend call.
    """

    lens: Mapping[int, int]  # slot -> length to back, every active slot of the step
    served: tuple[int, ...] = ()  # slots that get pages now, oldest request first
    failed: tuple[int, ...] = ()  # slots that cannot be backed: the caller preempts them
    kinds: tuple[KindPlan, ...] = field(default_factory=tuple)  # per layer kind, in the cache's order
    limit: int = 0  # bytes this call may have created in all (the budget, or what exists after a refusal)


# ------------------------------------------------------------- step arguments ----
def normalize(slots: Slots, kinds: Sequence[SlotBooks], seq_lens: Sequence[int] | Mapping[int, int],
              ahead: int) -> tuple[dict[int, int], list[int], list[int]]:
    """One pass over `seq_lens`: the active slots' lengths, the slots short of pages now (in
    any kind), and those within `ahead` tokens of a page (the edge, for pre-mapping). Raises
    (changing nothing) on a bad entry."""
    num_slots = slots.num_slots
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
    active, max_len = slots.active, slots.max_len
    lens: dict[int, int] = {}
    if len(kinds) > 1:  # short or near a page in some kind: their least capacity, after the checks
        lens.update(_entries(slots, items))
        short, edge = short_and_edge(kinds, lens, ahead)
        return lens, short, edge
    capacity = kinds[0].capacity  # (one kind: checked and sorted in one pass, the step's hot loop)
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
            _bad_length(slots, r, n)
        lens[r] = n
        c = capacity[r]
        if n > c:
            short.append(r)
        elif n + ahead > c:
            edge.append(r)
    return lens, short, edge


def _entries(slots: Slots, items: Iterable[tuple[Any, Any]]) -> Iterator[tuple[int, int]]:
    """(slot, length) of every active slot of `items` (a zero for a free slot skipped);
    raises on a bad entry."""
    active, max_len, num_slots = slots.active, slots.max_len, slots.num_slots
    for r, n in items:
        r, n = as_index(r, "reqid"), as_index(n, f"seq_lens[{r}]")
        if not 0 < n <= max_len or r not in active:
            if n == 0 and 0 <= r < num_slots:
                continue  # inactive, as in the list form
            _bad_length(slots, r, n)
        yield r, n


def _bad_length(slots: Slots, slot: int, n: int) -> None:
    if not 0 <= slot < slots.num_slots:
        raise UnknownReqIdError(f"reqid {slot} is out of range [0, {slots.num_slots})")
    if n < 0:
        raise InvalidRequestError(f"seq_lens[{slot}] = {n} is negative")
    if n > slots.max_len:
        raise ContextLengthError(
            f"seq_lens[{slot}] = {n} exceeds max_context_len = {slots.max_len}; "
            "stop the request or init with a larger max_context_len")
    raise UnknownReqIdError(f"reqid {slot} has length {n} but is not allocated; call alloc_reqid() first")


def short_and_edge(kinds: Sequence[SlotBooks], lens: dict[int, int], ahead: int) -> tuple[list[int], list[int]]:
    """(slots short of pages now in some kind, slots within `ahead` tokens of a page in some kind)."""
    if len(kinds) == 1:
        capacity = kinds[0].capacity
        short, edge = [], []
        for s, n in lens.items():
            c = capacity[s]
            if n > c:
                short.append(s)
            elif n + ahead > c:
                edge.append(s)
        return short, edge
    caps = [b.capacity for b in kinds]
    short, edge = [], []
    for s, n in lens.items():
        c = min(cap[s] for cap in caps)
        if n > c:
            short.append(s)
        elif n + ahead > c:
            edge.append(s)
    return short, edge


# --------------------------------------------------------------------- plans ----
def plan_step(managers: Sequence[Reach], lens: dict[int, int], short: Sequence[int], limit: int) -> StepPlan:
    """Who of the step's slots is served in every kind (oldest first: the caller preempts the
    newest) and the movements that back them: pages behind what each kind's queries read
    given back, then spare groups, new ones within `limit` (bytes), and pages reclaimed from
    free slots, pre-mapped tails and pins, of the kind or (released) of another. `short`:
    the slots short of pages in some kind (the others only give back pages)."""
    kinds = [m.books for m in managers]
    local = [m for m in managers if m.gives_back]
    cands = set(short)
    if local:
        cands.update(s for s, n in lens.items() if any(m.first_needed(s, n) > m.books.lead[s] for m in local))
    K = len(kinds)
    # per candidate slot and kind: (first page kept, first page mapped, pages to map, groups given back)
    wants = {s: [_slot_need(m, s, lens[s]) for m in managers] for s in cands}
    # slots that only give pages back first (always served), then the others oldest first
    active = kinds[0].slots.active
    order = sorted(cands, key=lambda s: (any(w[2] for w in wants[s]), active[s]))
    gb = [b.geometry.group_bytes for b in kinds]
    spare = [len(b.physical.spare) for b in kinds]
    room = limit - sum(b.physical.num_created * g for b, g in zip(kinds, gb))
    avail = [0] * K  # groups of each kind its donors and pins could give
    donors: list[list[tuple[int, int]]] | None = None
    # A group given back frees memory once every slot that maps it gives it back (forks share
    # the pages of a prompt): counted for a set of served slots at once.
    frees = _GiveBack(kinds, wants)

    def fits_demand(demand: list[int]) -> bool:
        return sum((d - s - a) * g for d, s, a, g in zip(demand, spare, avail, gb)) <= room

    def fits(served: list[int]) -> bool:
        released = frees.released(served)
        if donors is not None and frees.shared:  # a group the slots give back and a free slot holds
            avail[:] = [freeable(b, d, r) for b, d, r in zip(kinds, donors, released)]
        return fits_demand([sum(wants[s][k][2] for s in served) - freed
                            for k, freed in enumerate(frees.freed(released))])

    if fits(order):
        served = order
    else:  # only then look at other slots
        donors = [reclaimable(b, lens) for b in kinds]
        avail = [freeable(b, d) for b, d in zip(kinds, donors)]  # pinned pages included: evicted after the donors
        if frees.shared:
            served = frees.serve(order, fits, lambda s: not any(w[2] for w in wants[s]))
        else:  # every group given back is the slot's own: one by one, oldest first
            served, demand = [], [0] * K
            for s in order:
                after = [d + w[2] - len(w[3]) for d, w in zip(demand, wants[s])]
                if fits_demand(after):
                    served.append(s)
                    demand = after
    failed = [s for s in order if s not in served]
    new = [sum(wants[s][k][2] for s in served) for k in range(K)]
    released = frees.released(served)
    supplies = plan_supply(kinds, new, frees.freed(released), lens, limit, donors, released)
    assert supplies is not None, "the step's plan served more than the budget holds"
    return StepPlan(lens, tuple(served), tuple(failed), _kind_plans(kinds, served, wants, supplies), limit)


def _kind_plans(kinds: Sequence[SlotBooks], served: list[int], wants: dict[int, list[tuple[int, int, int, list[Any]]]],
                supplies: list[dict[str, Any]]) -> tuple[KindPlan, ...]:
    """Each kind's movements for the `served` slots: the pages behind what they read given
    back, their new pages mapped, from `supplies` (`plan_supply`'s, per kind)."""
    plans = []
    for k, b in enumerate(kinds):
        drops = tuple((s, wants[s][k][0]) for s in served if wants[s][k][0] > b.lead[s])
        maps = tuple((s, wants[s][k][1], wants[s][k][2]) for s in served if wants[s][k][2] > 0)
        plans.append(KindPlan(drops=drops, maps=maps, **supplies[k]))
    return tuple(plans)


def _slot_need(m: Reach, s: int, n: int) -> tuple[int, int, int, list[Any]]:
    """(first page `s` keeps in kind `m`, the first page it maps, pages to map, the groups its
    give-back unmaps) for a step to length `n`."""
    b = m.books
    pages = b.slot_pages[s]
    holes = b.lead[s]
    first = m.first_needed(s, n)
    start, back = len(pages), []
    if first > holes:  # wholly behind the window: given back, spare unless someone else holds it
        back = [grp for grp in pages[holes:first] if grp is not None]
        start = max(start, first)
    else:
        first = holes
    return first, start, max(0, b.geometry.pages_for(n) - start), back


class _GiveBack:
    """The groups a set of served slots frees by giving back pages behind their windows:
    those no slot outside the set, and no pin, still holds."""

    def __init__(self, kinds: Sequence[SlotBooks], wants: Mapping[int, list[tuple[int, int, int, list[Any]]]]) -> None:
        self.kinds, self.wants = kinds, wants
        # shared: some group given back is held by more than the slot giving it back
        self.shared = any(b.refs[grp] > 1 for k, b in enumerate(kinds) for w in wants.values() for grp in w[k][3])

    def released(self, served: Sequence[int]) -> list[dict[Any, int]]:
        """Per kind, group -> references `served` gives back."""
        out = []
        for k in range(len(self.kinds)):
            held: dict[Any, int] = {}
            for s in served:
                for grp in self.wants[s][k][3]:
                    held[grp] = held.get(grp, 0) + 1
            out.append(held)
        return out

    def freed(self, released: list[dict[Any, int]]) -> list[int]:
        """Per kind, the groups those references free (no other slot nor pin holds them)."""
        return [sum(n == b.refs[grp] for grp, n in r.items()) for b, r in zip(self.kinds, released)]

    def serve(self, order: list[int], fits: Callable[[list[int]], bool], always: Callable[[int], bool]) -> list[int]:
        """The slots of `order` (oldest first after those that only give back) served where a
        group given back is shared: the newest dropped until the rest fits (their shared pages
        free memory together), then the dropped ones, oldest first, that fit."""
        served = list(order)
        dropped: list[int] = []
        while served and not fits(served) and not always(served[-1]):
            dropped.append(served.pop())
        if not fits(served):  # (only slots that give back: they fit, more free with them than without)
            served = [s for s in served if always(s)]
        for s in reversed(dropped):
            if fits(served + [s]):
                served.append(s)
        return served


def plan_supply(kinds: Sequence[SlotBooks], new: Sequence[int], freed: Sequence[int], lens: Mapping[int, int],
                limit: int, donors: list[list[tuple[int, int]]] | None = None,
                released: Sequence[Mapping[Any, int]] | None = None) -> list[dict[str, Any]] | None:
    """Where each kind's `new` spare groups come from (its spare ones and `freed`, those its
    give-back frees): new groups within `limit` (bytes), then its donors' tails and pins,
    then groups another kind releases (its spare surplus, then its donors' and pins) to make
    room. `released`: per kind, the references to groups the plan's give-back drops (a group
    it shares with a free slot or a pin is freed by unmapping or evicting those). Per kind
    the KindPlan fields (num_create, unmaps, num_unmapped, num_evict, num_release), or None
    when the budget cannot hold them."""
    K = len(kinds)
    released = released if released is not None else [{}] * K
    gb = [b.geometry.group_bytes for b in kinds]
    deficit = [n - len(b.physical.spare) - f for n, b, f in zip(new, kinds, freed)]
    room = limit - sum(b.physical.num_created * g for b, g in zip(kinds, gb))
    create = [0] * K
    for k in range(K):
        if deficit[k] > 0 and room > 0:
            c = min(deficit[k], room // gb[k])
            create[k], room, deficit[k] = c, room - c * gb[k], deficit[k] - c
    out = [dict(num_create=create[k]) for k in range(K)]
    if all(d <= 0 for d in deficit):
        return out
    if donors is None:
        donors = [reclaimable(b, lens) for b in kinds]
    avail = [freeable(b, d, r) for b, d, r in zip(kinds, donors, released)]
    take = [0] * K  # groups each kind makes spare from its donors and pins
    for k in range(K):
        if deficit[k] > 0:
            take[k] = min(deficit[k], avail[k])
            deficit[k] -= take[k]
    short = sum(max(0, d) * g for d, g in zip(deficit, gb)) - max(0, room)
    release = [0] * K
    if short > 0:  # another kind's groups make room: its spare surplus first, then its cached pages
        for j in range(K):
            r = min(max(0, -deficit[j]), -(-short // gb[j]))
            release[j] += r
            short -= r * gb[j]
        for j in range(K):
            if short <= 0:
                break
            r = min(avail[j] - take[j], -(-short // gb[j]))
            take[j] += r
            release[j] += r
            short -= r * gb[j]
        if short > 0:
            return None
    for k in range(K):
        create[k] += max(0, deficit[k])
        unmaps, num_unmapped, got = plan_unmaps(kinds[k], donors[k], take[k], released[k]) if take[k] else ((), 0, 0)
        out[k] = dict(num_create=create[k], unmaps=unmaps, num_unmapped=num_unmapped,
                      num_evict=max(0, take[k] - got), num_release=release[k])
    return out


def plan_backing(kinds: Sequence[SlotBooks], needs: Sequence[Sequence[tuple[int, int, int]]],
                 lens: Mapping[int, int], limit: int, copies: Sequence[tuple[tuple[int, int], ...]] = (),
                 shares: Sequence[tuple[tuple[int, int, tuple[Any, ...]], ...]] = ()) -> StepPlan:
    """The plan that maps `needs[k]` ((slot, first page, pages) of kind k) in every kind, or
    none: `failed` is the slots of the needs when the budget cannot hold them all (a fork,
    a resume, a snapshot). `copies`, `shares`: per kind, carried with its maps."""
    K = len(kinds)
    new = [sum(c for _, _, c in needs[k]) for k in range(K)]
    supplies = plan_supply(kinds, new, [0] * K, lens, limit)
    slots = tuple(sorted({s for need in needs for s, _, _ in need}))
    if supplies is None:
        return StepPlan(lens, failed=slots, kinds=tuple(KindPlan() for _ in kinds), limit=limit)
    return StepPlan(lens, served=slots, limit=limit, kinds=tuple(
        KindPlan(maps=tuple(needs[k]), copies=tuple(copies[k]) if copies else (),
                 shares=tuple(shares[k]) if shares else (), **supplies[k]) for k in range(K)))


def plan_unmaps(books: SlotBooks, donors: list[tuple[int, int]], count: int,
                released: Mapping[Any, int] | None = None) -> tuple[Unmaps, int, int]:
    """The donors' tail pages to unmap, in order, until `count` groups become spare (a group
    another slot or a pin still holds frees nothing; `released`: references the plan gives
    back otherwise). Returns (unmaps, pages, groups freed)."""
    refs, unmaps, freed, num_pages = books.refs, [], 0, 0
    released = released or {}
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
            left[grp] = left.get(grp, refs[grp] - released.get(grp, 0)) - 1
            freed += left[grp] == 0
        unmaps.append((s, take))
        num_pages += take
    return tuple(unmaps), num_pages, freed


def reclaimable(books: SlotBooks, lens: Mapping[int, int]) -> list[tuple[int, int]]:
    """(slot, pages) that may be taken, in the order to take them: free slots with fewest
    pages first (the warm slot last), then pre-mapped tails of active slots (past both the
    step's length and the longest length written)."""
    g, pages, max_lens = books.geometry, books.slot_pages, books.slots.max_lens
    free = sorted((s for s in books.slots.free_slots if pages[s]), key=lambda s: (len(pages[s]), s))
    donors = [(s, len(pages[s])) for s in free]
    for s in sorted(books.slots.active):
        keep = g.pages_for(max(lens.get(s, 0), max_lens[s]))
        if len(pages[s]) > keep:
            donors.append((s, len(pages[s]) - keep))
    return donors


def freeable(books: SlotBooks, donors: list[tuple[int, int]], released: Mapping[Any, int] | None = None) -> int:
    """Groups that unmapping all the donors' (slot, last k pages) and evicting pins would
    free: those whose every reference is among them (a group a live slot maps beyond the
    donors' tails frees nothing), counting the references `released` gives back otherwise
    (a group those free alone is not counted here)."""
    taken: dict[Any, int] = {}
    for s, k in donors:
        pages = books.slot_pages[s]
        for grp in pages[len(pages) - k:]:
            if grp is None:
                continue
            taken[grp] = taken.get(grp, 0) + 1
    pins, refs = books.pins, books.refs
    released = released or {}
    evictable = books.num_evictable()
    if released:  # a pinned group whose slots all give it back: evictable now
        evictable += sum(refs[grp] - n == 1 for grp, n in released.items() if grp in pins)
    return (sum(t + released.get(grp, 0) + (grp in pins) == refs[grp] for grp, t in taken.items())
            + evictable)  # pinned (or kept), mapped nowhere
