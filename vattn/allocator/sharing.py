"""Shared pages on the slot books: fork (copy-on-write by construction), pins for the
prefix cache (least recently used first when memory runs short) and their mapping into a
new request's slot. Plain Python.

A shared group holds whole pages of tokens every slot mapping it has written; a slot's
writable tail is always its own. Where a page does not hold a whole number of tokens, a
token may straddle two pages: `map_pinned` shares whole units of lcm(page, token) bytes
(`Geometry.share_pages`), and fork copies the page the first token of its own begins
in. A pin is one more reference, so a pinned group outlives the slots that mapped it
until it is evicted (`SlotBooks.evict`) or trimmed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from vattn.allocator.books import as_index
from vattn.allocator.plan import StepPlan, plan_fork
from vattn.errors import InvalidRequestError, NoFreeSlotError, OutOfPhysicalMemoryError

if TYPE_CHECKING:
    from vattn.allocator.books import SlotBooks
    from vattn.allocator.mapper import Mapper

Handle = tuple[Any, int]  # (group, generation of its pin); (None, 0): a page behind a sliding window


def window_covers(books: SlotBooks, holes: int, num_pages: int) -> bool:
    """Whether the first `num_pages` pages of a slot, of which the first `holes` were given
    back behind a sliding window, hold every key a query right after them sees (a prefix
    mapped from pinned pages, or cut to that length)."""
    if not holes:
        return True
    g = books.geometry
    if books.window is None:
        return False
    first_read = num_pages * g.page_size // g.token_bytes - books.window + 1  # the next query's first key
    return holes * g.page_size <= first_read * g.token_bytes  # (a token may straddle two pages)


def check_truncate(books: SlotBooks, slot: int, num_tokens: int) -> int:
    """The pages of `slot`'s first `num_tokens` tokens (whole sharing units); raises where
    its sliding window gave back pages the query right after them reads."""
    g = books.geometry
    keep = num_tokens // g.share_tokens * g.share_pages
    if num_tokens and not window_covers(books, books.holes(slot), keep):
        raise truncate_refused(slot, num_tokens)
    return keep


def fork_refused(parent: int, num_tokens: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"reqid {parent}'s sliding-window layers gave back pages the child's first query (at token "
        f"{num_tokens}) reads: fork before the parent moves a window past it, or compute the prompt")


def truncate_refused(slot: int, num_tokens: int) -> InvalidRequestError:
    return InvalidRequestError(
        f"num_tokens={num_tokens}: reqid {slot}'s sliding-window layers have no pages for the window "
        "before it (given back); map fewer or no cached tokens")


class Sharing:
    """fork, pin and map_pinned over the books. The caller holds the lock (and has stopped
    the pre-mapping worker where pages move)."""

    def __init__(self, books: SlotBooks, mapper: Mapper) -> None:
        self.books = books
        self.mapper = mapper

    def fork(self, reqid: int, num_tokens: int, child: int | None = None) -> int:
        """A new request whose first `num_tokens` tokens are `reqid`'s: its slot maps the
        groups of the whole pages, and a fresh group for the partly filled last page, into
        which that page is copied (see `KVCache.fork`). `child`: the free slot to use (the
        other layer kinds of a hybrid cache follow the first kind's choice). Behind a
        sliding window the parent's holes stay holes: only pages within it are shared."""
        books = self.books
        parent = books.check_active(reqid)
        num_tokens = as_index(num_tokens, "num_tokens")
        if not 0 < num_tokens <= books.max_lens[parent]:
            raise InvalidRequestError(
                f"num_tokens={num_tokens} must be in [1, {books.max_lens[parent]}]: the tokens reqid "
                f"{parent} has (its longest step length)")
        if not books.reads_held(parent, num_tokens):
            raise fork_refused(parent, num_tokens)
        books.fence_ran()
        if not books.free_slots:
            raise NoFreeSlotError(f"all {books.num_slots} slots are in use; free_reqid() one or raise max_batch_size")
        g = books.geometry
        if num_tokens * g.token_bytes % g.page_size and self.mapper.copy_pages is None:
            raise InvalidRequestError("this cache cannot copy pages; fork at a page boundary")
        # The emptiest free slot, leaving the warm one (the worker pre-maps it) to alloc_reqid.
        if child is None:
            warm = books.warm_slot()
            child = min(books.free_slots, key=lambda s: (s == warm, len(books.slot_pages[s]), s))
        elif child not in books.free_slots:
            raise InvalidRequestError(f"slot {child} is not free")
        self.mapper.empty(child)  # it keeps nothing of its earlier requests
        plan, _, _ = self.mapper.carry_out(lambda limit: plan_fork(books, parent, child, num_tokens, limit))
        if plan.failed:
            raise OutOfPhysicalMemoryError(
                f"no page left for the copy of reqid {parent}'s last partial page; free a request or "
                "raise physical_memory")
        if num_tokens * g.token_bytes >= g.page_size:  # whole pages shared
            books.shared_slots.update((parent, child))
        books.take(child)
        books.pages_changed(child)
        books.max_lens[child] = num_tokens
        return child

    def pin(self, reqid: int, num_pages: int) -> list[Handle]:
        """Pin the first `num_pages` pages of `reqid` (whole pages of tokens it wrote); one
        handle each (see `KVCache.pin`)."""
        books = self.books
        slot = books.check_active(reqid)
        num_pages = as_index(num_pages, "num_pages")
        full = books.max_lens[slot] * books.geometry.token_bytes // books.geometry.page_size
        if not 0 <= num_pages <= full:
            raise InvalidRequestError(f"num_pages={num_pages}: reqid {slot} has {full} whole pages of tokens to pin")
        return books.pin(slot, num_pages)

    def num_pinned(self, handles: Sequence[Handle]) -> int:
        """How many of `handles`, from the first, are still pinned; marks them most recently used."""
        groups = self.books.pinned(handles)
        for grp in groups:
            if grp is not None:
                self.books.pins.move_to_end(grp)
        return len(groups)

    def map_pinned(self, reqid: int, handles: Sequence[Handle]) -> int:
        """Map the leading still-pinned `handles` as the first pages of a request that has not
        run yet (its slot keeps nothing of earlier requests), in whole sharing units
        (`Geometry.share_pages` pages, `share_tokens` tokens: the request's first token of
        its own then starts on a page boundary, so it never writes into a shared page; a
        unit that lost a page to eviction ends the prefix). Returns the tokens mapped."""
        books = self.books
        slot = books.check_active(reqid)
        g = books.geometry
        if books.max_lens[slot]:
            raise InvalidRequestError(f"reqid {slot} has run already; map pinned pages before its first step")
        books.fence_ran()
        groups = books.pinned(handles)
        # The longest run of whole units whose window is still mapped. A chain may join blocks
        # pinned by different requests ([page, hole, page, page]): the slot's holes lead it, so
        # a page before the last hole is not mapped (no query after the run reads it)
        num = len(groups) - len(groups) % g.share_pages
        while num:
            holes = max((i + 1 for i, grp in enumerate(groups[:num]) if grp is None), default=0)
            if window_covers(books, holes, num):
                break
            num -= g.share_pages
        if not num:
            return 0
        groups = [None] * holes + groups[holes:num]
        self.mapper.empty(slot)  # a reused slot: drop its pages first
        self.mapper.execute(StepPlan({}, shares=((slot, 0, tuple(groups)),)))
        for grp in groups:  # (the rest of a broken unit stays least recently used: evicted first)
            if grp is not None:  # (None: a hole behind a sliding window)
                books.pins.move_to_end(grp)
        books.shared_slots.add(slot)
        books.max_lens[slot] = len(groups) // g.share_pages * g.share_tokens
        return books.max_lens[slot]

    def truncate_pinned(self, reqid: int, num_tokens: int) -> int:
        """Keep only the first `num_tokens` tokens (whole sharing units) of what `map_pinned`
        mapped into a request that has not run yet; the later pages stay pinned. Returns the
        pages unmapped."""
        books = self.books
        slot = books.check_active(reqid)
        num_tokens = as_index(num_tokens, "num_tokens")
        g = books.geometry
        mapped, pages = books.max_lens[slot], books.slot_pages[slot]
        if (not mapped or mapped * g.share_pages != len(pages) * g.share_tokens
                or any(grp not in books.pins for grp in pages if grp is not None)):
            raise InvalidRequestError(  # it ran (or holds other pages): its own tokens would be lost
                f"reqid {slot} does not hold just the pinned pages map_pinned mapped into it (it ran, or "
                "nothing was mapped): truncate_pinned right after map_pinned, before its first step")
        if num_tokens < 0 or num_tokens % g.share_tokens or num_tokens > mapped:
            raise InvalidRequestError(
                f"num_tokens={num_tokens} must be a whole number of sharing units ({g.share_tokens} tokens in "
                f"{g.share_pages} page(s) each) of at most the {mapped} tokens map_pinned mapped into reqid {slot}")
        drop = len(pages) - check_truncate(books, slot, num_tokens)
        unmapped = self.mapper.reclaim([(slot, drop)], drop) if drop else 0
        books.max_lens[slot] = num_tokens
        return unmapped

    def unshare_new_owners(self, lens: dict[int, int]) -> bool:
        """A new request must not write into pages another slot shares: unmap every page of
        a freshly allocated slot that still maps a shared group (it keeps nothing of them).
        Returns whether any page was unmapped."""
        books, changed = self.books, False
        for s in list(books.shared_slots):
            if not any(grp is not None and books.refs[grp] > 1 for grp in books.slot_pages[s]):
                books.shared_slots.discard(s)
            elif s in lens and not books.max_lens[s]:
                self.mapper.empty(s)
                books.shared_slots.discard(s)
                changed = True
        return changed
