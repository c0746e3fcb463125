"""Shared pages across the layer kinds of a slot cache: fork (copy-on-write by
construction), pins for the prefix cache (least recently used first when memory runs
short) and their mapping into a new request's slot. Plain Python.

A shared group holds whole pages of tokens every slot mapping it has written; a slot's
writable tail is always its own. Where a page does not hold a whole number of tokens, a
token may straddle two pages: `map_pinned` shares whole units of lcm(page, token) bytes
(`Geometry.share_pages`), and fork copies the page the first token of its own begins
in. A pin is one more reference, so a pinned group outlives the slots that mapped it
until it is evicted (`SlotBooks.evict`) or trimmed. Every function here works on every
kind at once (the coordinator holds the lock and has stopped the pre-mapping worker where
pages move): a fork or a prefix happens in every kind or in none.

Pin handles: one per page, `(group, generation)` of the first kind whose pages are a
prefix block's (K/V), followed by a tuple of the other such kinds' handles when there are
several; a page behind a sliding window is `(None, 0)`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from vattn.allocator.books import as_index
from vattn.allocator.plan import KindPlan, StepPlan, plan_backing
from vattn.errors import InvalidRequestError, NoFreeSlotError, OutOfPhysicalMemoryError

if TYPE_CHECKING:
    from vattn.allocator.books import Slots
    from vattn.allocator.kinds import KindManager

Handle = tuple[Any, ...]  # (group, generation of its pin[, the other kinds' handles]); (None, 0): behind a window
Carry = Callable[[Callable[[int], StepPlan]], tuple[StepPlan, int, int]]  # mapper.carry_out over the kinds


def check_truncate(kind: KindManager, slot: int, num_tokens: int) -> int:
    """The pages of `slot`'s first `num_tokens` tokens (whole sharing units); raises where
    the kind gave back pages the query right after them reads."""
    g = kind.geometry
    keep = num_tokens // g.share_tokens * g.share_pages
    if num_tokens and not kind.covers(kind.books.holes(slot), keep):
        raise truncate_refused(kind, slot, num_tokens)
    return keep


def truncate_refused(kind: KindManager, slot: int, num_tokens: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"num_tokens={num_tokens}: reqid {slot}'s {kind.what} layers have no pages for the keys "
        "before it (given back); map fewer or no cached tokens")


# ---------------------------------------------------------------------- fork ----
def fork(slots: Slots, kinds: Sequence[KindManager], carry: Carry, reqid: int, num_tokens: int,
         fence: Any) -> int:
    """A new request whose first `num_tokens` tokens are `reqid`'s, in every kind: its slot
    maps the groups of the parent's whole pages and fresh groups for the rest, into which
    those pages are copied (see `KVCache.fork`). Behind a sliding window the parent's holes
    stay holes: only pages within it are shared; a recurrent state is copied whole.
    Returns the child's slot."""
    parent = slots.check_active(reqid)
    num_tokens = as_index(num_tokens, "num_tokens")
    if not 0 < num_tokens <= slots.max_lens[parent]:
        raise InvalidRequestError(
            f"num_tokens={num_tokens} must be in [1, {slots.max_lens[parent]}]: the tokens reqid "
            f"{parent} has (its longest step length)")
    for kind in kinds:
        if not kind.can_fork(parent, num_tokens):
            raise kind.fork_refused(parent, num_tokens)
    slots.fence_ran(fence)
    if not slots.free_slots:
        raise NoFreeSlotError(f"all {slots.num_slots} slots are in use; free_reqid() one or raise max_batch_size")
    # The emptiest free slot, leaving the warm one (the worker pre-maps it) to alloc_reqid.
    warm = slots.warm_slot()
    child = min(slots.free_slots, key=lambda s: (s == warm, slots.warm_pages[s], s))
    parts = [kind.fork_parts(parent, child, num_tokens) for kind in kinds]
    for kind, (_, _, copies) in zip(kinds, parts):
        if copies and kind.mapper.copy_pages is None:
            raise InvalidRequestError("this cache cannot copy pages; fork at a page boundary")
    for kind in kinds:
        kind.mapper.empty(child)  # it keeps nothing of its earlier requests
    books = [kind.books for kind in kinds]
    plan, _, _ = carry(lambda limit: plan_backing(books, [maps for _, maps, _ in parts], {}, limit,
                                                  copies=[c for _, _, c in parts], shares=[s for s, _, _ in parts]))
    if plan.failed:
        raise OutOfPhysicalMemoryError(
            f"no pages left for the copy of reqid {parent}'s last partial page (or its states); free a request or "
            "raise physical_memory")
    slots.take(child)
    for kind, (shares, _, _) in zip(kinds, parts):
        kind.books.new_owner(child)
        kind.adopted(child)
        if shares and shares[0][2]:  # whole pages shared
            kind.books.shared_slots.update((parent, child))
        kind.books.pages_changed(child)
    slots.max_lens[child] = slots.prev_lens[child] = num_tokens  # (a step to it plans no iteration)
    return child


# ---------------------------------------------------------------------- pins ----
def pinned_kinds(kinds: Sequence[KindManager]) -> list[KindManager]:
    """The kinds whose pages are a prefix block's pages (K/V kinds)."""
    return [kind for kind in kinds if kind.pinned_pages]


def pin(slots: Slots, kinds: Sequence[KindManager], reqid: int, num_pages: int) -> list[Handle]:
    """Pin the first `num_pages` pages of `reqid` (whole pages of tokens it wrote) in every
    K/V kind; one handle each (see `KVCache.pin`)."""
    slot = slots.check_active(reqid)
    num_pages = as_index(num_pages, "num_pages")
    g = kinds[0].geometry
    full = slots.max_lens[slot] * g.token_bytes // g.page_size
    if not 0 <= num_pages <= full:
        raise InvalidRequestError(f"num_pages={num_pages}: reqid {slot} has {full} whole pages of tokens to pin")
    per_kind = [kind.books.pin(slot, num_pages) for kind in kinds]
    if len(per_kind) == 1:
        return per_kind[0]
    return [(*first, tuple(rest)) for first, *rest in zip(*per_kind)]


def split(kinds: Sequence[KindManager], handles: Sequence[Handle]) -> list[list[tuple[Any, int]]]:
    """Handles -> per kind, its (group, generation) handles."""
    if len(kinds) == 1:
        return [list(handles)]
    out: list[list[tuple[Any, int]]] = [[(h[0], h[1]) for h in handles]]
    for k in range(1, len(kinds)):
        out.append([h[2][k - 1] for h in handles])
    return out


def num_pinned(kinds: Sequence[KindManager], handles: Sequence[Handle]) -> int:
    """How many of `handles`, from the first, are still pinned in every kind; marks them most
    recently used."""
    n = len(handles)
    for kind, hs in zip(kinds, split(kinds, handles)):
        groups = kind.books.pinned(hs)
        for grp in groups:
            if grp is not None:
                kind.books.pins.move_to_end(grp)
        n = min(n, len(groups))
    return n


def is_pinned(kinds: Sequence[KindManager], handles: Sequence[Handle]) -> bool:
    """Whether every one of `handles` is still pinned in every kind (holes are)."""
    return all(len(kind.books.pinned(hs)) == len(hs) for kind, hs in zip(kinds, split(kinds, handles)))


def map_pinned(slots: Slots, kinds: Sequence[KindManager], reqid: int, handles: Sequence[Handle],
               fence: Any) -> int:
    """Map the leading still-pinned `handles` as the first pages of a request that has not
    run yet (its slot keeps nothing of earlier requests), in every K/V kind alike, in whole
    sharing units (`Geometry.share_pages` pages, `share_tokens` tokens: the request's first
    token of its own then starts on a page boundary, so it never writes into a shared page;
    a unit that lost a page to eviction ends the prefix). Returns the tokens mapped."""
    slot = slots.check_active(reqid)
    if slots.max_lens[slot]:
        raise InvalidRequestError(f"reqid {slot} has run already; map pinned pages before its first step")
    slots.fence_ran(fence)
    g = kinds[0].geometry
    per_kind = [kind.books.pinned(hs) for kind, hs in zip(kinds, split(kinds, handles))]
    # The longest run of whole units, pinned in every kind, whose window is still mapped. A
    # chain may join blocks pinned by different requests ([page, hole, page, page]): the
    # slot's holes lead it, so a page before the last hole is not mapped (no query after the
    # run reads it)
    num = min(len(groups) for groups in per_kind)
    num -= num % g.share_pages
    while num:
        holes = [max((i + 1 for i, grp in enumerate(groups[:num]) if grp is None), default=0) for groups in per_kind]
        if all(kind.covers(h, num) for kind, h in zip(kinds, holes)):
            break
        num -= g.share_pages
    if not num:
        return 0
    for kind, groups, h in zip(kinds, per_kind, holes):
        books = kind.books
        groups = [None] * h + groups[h:num]
        kind.mapper.empty(slot)  # a reused slot: drop its pages first
        kind.mapper.execute(KindPlan(shares=((slot, 0, tuple(groups)),)))
        for grp in groups:  # (the rest of a broken unit stays least recently used: evicted first)
            if grp is not None:  # (None: a hole behind a sliding window)
                books.pins.move_to_end(grp)
        books.shared_slots.add(slot)
    slots.max_lens[slot] = slots.prev_lens[slot] = num // g.share_pages * g.share_tokens
    return slots.max_lens[slot]


def truncate_pinned(slots: Slots, kinds: Sequence[KindManager], reqid: int, num_tokens: int) -> int:
    """Keep only the first `num_tokens` tokens (whole sharing units) of what `map_pinned`
    mapped into a request that has not run yet, in every K/V kind; the later pages stay
    pinned. Refused (nothing changed) where a window kind gave back pages its next query
    would read. Returns the pages unmapped."""
    slot = slots.check_active(reqid)
    num_tokens = as_index(num_tokens, "num_tokens")
    mapped = slots.max_lens[slot]
    keeps = []
    for kind in kinds:
        books, g = kind.books, kind.geometry
        pages = books.slot_pages[slot]
        if (not mapped or mapped * g.share_pages != len(pages) * g.share_tokens
                or any(grp not in books.pins for grp in pages if grp is not None)):
            raise InvalidRequestError(  # it ran (or holds other pages): its own tokens would be lost
                f"reqid {slot} does not hold just the pinned pages map_pinned mapped into it (it ran, or "
                "nothing was mapped): truncate_pinned right after map_pinned, before its first step")
        if num_tokens < 0 or num_tokens % g.share_tokens or num_tokens > mapped:
            raise InvalidRequestError(
                f"num_tokens={num_tokens} must be a whole number of sharing units ({g.share_tokens} tokens in "
                f"{g.share_pages} page(s) each) of at most the {mapped} tokens map_pinned mapped into reqid {slot}")
        keeps.append(check_truncate(kind, slot, num_tokens))
    unmapped = 0
    for kind, keep in zip(kinds, keeps):
        drop = len(kind.books.slot_pages[slot]) - keep
        unmapped += kind.mapper.reclaim([(slot, drop)], drop) if drop else 0
    slots.max_lens[slot] = slots.prev_lens[slot] = num_tokens
    return unmapped


def extend_prefix(slots: Slots, kinds: Sequence[KindManager], carry: Carry, reqid: int, num_tokens: int,
                  fence: Any) -> tuple[int, list[tuple[int, int]]]:
    """Back `num_tokens` tokens of a request that has not run yet with pages after what
    `map_pinned` mapped into it (or from its first page), in every K/V kind, for the caller to
    copy a lower tier's data into (the prefix cache's restore): fresh pages, or those the slot
    kept of an earlier request that nobody shares. A sliding-window kind gets only the pages
    the query at `num_tokens` reads: the ones before become holes, given back where the slot
    mapped pinned pages there. `kinds`: every kind of the cache (the others are left alone).

    Returns (tokens the slot holds now, per K/V kind (first page, pages) the caller fills).
    When memory is short nothing is mapped and the slot keeps what it held, or holds nothing
    (0 tokens) where a window kind had given pages back for it."""
    slot = slots.check_active(reqid)
    num_tokens = as_index(num_tokens, "num_tokens")
    pinned = [kind for kind in kinds if kind.pinned_pages]
    held = slots.max_lens[slot]
    g = pinned[0].geometry
    check_unrun(pinned, slot, held)
    if num_tokens % g.share_tokens or not held < num_tokens <= slots.max_len:
        raise InvalidRequestError(
            f"num_tokens={num_tokens} must be a whole number of sharing units ({g.share_tokens} tokens) above the "
            f"{held} tokens reqid {slot} holds, and at most {slots.max_len}")
    slots.fence_ran(fence)
    end = g.pages_for(num_tokens)
    if not held:  # an earlier request's pages: kept where nobody shares them (the copy overwrites them)
        for kind in pinned:
            books = kind.books
            pages = books.slot_pages[slot]
            if any(grp is None or books.refs[grp] > 1 for grp in pages):
                kind.mapper.empty(slot)
            elif len(pages) > end:
                kind.mapper.reclaim([(slot, len(pages) - end)], len(pages) - end)
    gave_back = False  # a window kind's pages before its first read became holes
    for kind in pinned:
        first = kind.first_read(num_tokens)
        if first > kind.books.holes(slot):
            kind.mapper.drop_behind(slot, first)
            gave_back = True
    needs: list[list[tuple[int, int, int]]] = []
    for kind in kinds:
        start = len(kind.books.slot_pages[slot])
        needs.append([(slot, start, end - start)] if kind.pinned_pages and end > start else [])
    plan, _, _ = carry(lambda limit: plan_backing([k.books for k in kinds], needs, {slot: num_tokens}, limit))
    if plan.failed:
        if not gave_back:
            return held, [(0, 0)] * len(pinned)
        drop_prefix(slots, kinds, slot)
        return 0, [(0, 0)] * len(pinned)
    fill = []
    held_pages = held // g.share_tokens * g.share_pages
    for kind in pinned:
        if kind.books.dirty_slots:  # an earlier owner's data: cleared now, not after the copy
            kind.mapper.zero_dirty([slot])
        kind.books.shared_slots.add(slot)
        first = max(held_pages, kind.books.holes(slot))
        fill.append((first, end - first))
    slots.max_lens[slot] = slots.prev_lens[slot] = num_tokens  # (a step to it plans no iteration)
    return num_tokens, fill


def check_unrun(kinds: Sequence[KindManager], slot: int, held: int) -> None:
    """InvalidRequestError unless `slot` holds just the `held` tokens of pinned pages
    `map_pinned` mapped into it, or is new (no length yet): it has not run."""
    for kind in kinds:
        books, g = kind.books, kind.geometry
        pages = books.slot_pages[slot]
        if held and (held * g.share_pages != len(pages) * g.share_tokens or books.slots.prev_lens[slot] != held
                     or any(grp not in books.pins for grp in pages if grp is not None)):
            raise InvalidRequestError(
                f"reqid {slot} does not hold just the pinned pages map_pinned mapped into it (it ran): extend a "
                "prefix right after map_pinned, before its first step")


def drop_prefix(slots: Slots, kinds: Sequence[KindManager], slot: int) -> None:
    """Unmap every page of a request that has not run yet (what `map_pinned` and
    `extend_prefix` mapped into it) in every kind, and forget a snapshot it was to restore:
    it computes its tokens from the first (a restore that failed)."""
    for kind in kinds:
        kind.dropped(slot)
    slots.max_lens[slot] = slots.prev_lens[slot] = 0


def unshare_new_owners(kinds: Sequence[KindManager], lens: dict[int, int]) -> bool:
    """A new request must not write into pages another slot shares, nor find holes where it
    reads: unmap every page of a freshly allocated slot of the step that still maps a
    shared group (it keeps nothing of them) or holes behind a window. Returns whether any
    page was unmapped."""
    changed = False
    for kind in kinds:
        books = kind.books
        max_lens = books.slots.max_lens
        for s in list(books.shared_slots):
            if not any(grp is not None and books.refs[grp] > 1 for grp in books.slot_pages[s]):
                books.shared_slots.discard(s)
            elif s in lens and not max_lens[s]:
                kind.mapper.empty(s)
                books.shared_slots.discard(s)
                changed = True
        if kind.gives_back:
            for s in lens:
                if books.lead[s] and not max_lens[s]:  # an earlier request's pages are nothing to it
                    kind.mapper.empty(s)
                    changed = True
    return changed


__all__ = ["Handle", "check_truncate", "check_unrun", "drop_prefix", "extend_prefix", "fork", "is_pinned", "map_pinned",
           "num_pinned", "pin", "pinned_kinds", "split", "truncate_pinned", "truncate_refused", "unshare_new_owners"]
