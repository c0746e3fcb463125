"""Swapped-out requests on the slot books: a parked slot keeps its pages (deferred
reclamation), and `resume` gets it back untouched with no copy, or a new slot whose pages
the caller copies the tokens into (`KVCache.swap_out` / `swap_in` make the host copies).
Plain Python.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from vattn.allocator.books import as_index
from vattn.allocator.plan import StepResult
from vattn.errors import InvalidRequestError, NoFreeSlotError, OutOfPhysicalMemoryError

if TYPE_CHECKING:
    from vattn.allocator.books import SlotBooks
    from vattn.allocator.mapper import Mapper


class Swap:
    """park / resume over the books. The caller holds the lock (and has stopped the
    pre-mapping worker for `resume`)."""

    def __init__(self, books: SlotBooks, mapper: Mapper) -> None:
        self.books = books
        self.mapper = mapper

    def fence_parked(self, reqid: int) -> int:
        """The caller may have enqueued device work that reads the slot (`swap_out`'s
        asynchronous copy to host): a fence taken now keeps its pages mapped until that work
        finished, even when the slot did not run in the last iteration. Returns the slot."""
        slot = self.books.check_active(reqid)
        fence = self.books.physical.fence()
        if fence is not None:
            self.books.last_fence[slot] = fence
        return slot

    def resume(self, slot: int, epoch: int, num_tokens: int, new: int | None = None,
               first_page: int = 0) -> tuple[int, bool]:
        """A slot for a parked request of `num_tokens` tokens: its own, untouched since it was
        parked at `epoch` ((slot, False): the data is there), or a new one with pages mapped
        for the tokens ((slot, True): copy the data in). Raises NoFreeSlotError or
        OutOfPhysicalMemoryError and changes nothing when it cannot. `new`: the slot to take
        (a hybrid cache's other layer kinds follow its first kind; the old one is kept
        untouched only when it is that slot). `first_page`: pages before it held nothing
        when parked (behind a sliding window): a new slot maps none there."""
        books = self.books
        num_tokens = as_index(num_tokens, "num_tokens")
        if not 0 < num_tokens <= books.max_len:
            raise InvalidRequestError(f"num_tokens={num_tokens} must be in [1, {books.max_len}]")
        if not books.free_slots:
            raise NoFreeSlotError(f"all {books.num_slots} slots are in use; free_reqid() one or raise max_batch_size")
        if new is not None and new not in books.free_slots:
            raise InvalidRequestError(f"slot {new} is not free")
        if (new in (None, slot) and slot in books.free_slots and books.epoch[slot] == epoch
                and books.capacity[slot] >= num_tokens):
            books.take(slot)
            books.dirty.difference_update(books.slot_pages[slot][:books.geometry.pages_for(num_tokens)])
            books.max_lens[slot] = num_tokens
            return slot, False
        books.fence_ran()
        if new is None:
            new = books.warm_slot()
        books.take(new)
        try:
            pages = books.slot_pages[new]
            if any(grp is not None and books.refs[grp] > 1 for grp in pages) or books.holes(new):
                self.mapper.empty(new)  # the copy must not land in shared pages, nor in holes
            if first_page and books.window is not None:
                self.mapper.drop_behind(new, first_page)
            result = self.mapper.back({new: num_tokens}, [new]) if books.capacity[new] < num_tokens else StepResult()
        except BaseException:
            books.untake(new)
            raise
        if not result:
            books.untake(new)
            raise OutOfPhysicalMemoryError(
                f"no pages for the {num_tokens} tokens of a swapped-out request; free requests or raise "
                "physical_memory")
        if books.dirty_slots:  # clear an earlier owner's data first: the copy fills only the tokens
            self.mapper.zero_dirty([new])
        books.max_lens[new] = num_tokens
        return new, True
