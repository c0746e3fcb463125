"""`HybridAllocator`: one `PageAllocator` per layer kind of a model that mixes full-attention
and sliding-window layers (Gemma-2/3, Mistral, Qwen2 with use_sliding_window, gpt-oss),
behind the single allocator's API. Plain Python.

```
kind "full"         layers 5, 11, ...   page groups of their K/V buffers only: every page kept
kind "window=4096"  layers 0-4, 6-10    page groups of their K/V buffers only: pages wholly
                                        behind the window given back as the request grows
```
Every kind has the same slots: the first kind (full attention when there is one) picks a
slot (alloc, fork, swap-in) and the others take that slot. The kinds draw their pages from
one `vattn.Budget` (the cache's physical memory): a kind short of pages asks the others for
their cached ones (free slots, pre-mapped tails, pins) before a step fails. A pin handle is
the first kind's `(group, generation)` followed by the other kinds' handles, so code that
reads `handle[0]`, `handle[1]` (the prefix cache) sees the first kind's.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace
from typing import Any, Mapping, Sequence

from vattn.allocator.books import MemoryStats
from vattn.allocator.core import PageAllocator
from vattn.allocator.plan import StepResult
from vattn.allocator.sharing import check_truncate, fork_refused
from vattn.errors import InvalidRequestError


class HybridAllocator:
    """The page allocators of a cache's layer kinds, kept on the same slots."""

    def __init__(self, kinds: Sequence[tuple[str, PageAllocator]], *, budget: Any = None,
                 whole_group_bytes: int = 0) -> None:
        """`kinds`: (name, allocator), the first one picks slots. `budget`: the budget the kinds
        share when the cache made it (its limit is `max_pages` in groups of
        `whole_group_bytes`, one page of every buffer); None: a caller's budget."""
        if len(kinds) < 2:
            raise ValueError("a hybrid allocator needs two layer kinds or more")
        self.names = [name for name, _ in kinds]
        self.parts = [alloc for _, alloc in kinds]
        self.primary = self.parts[0]
        self.geometry = self.primary.geometry
        self.budget = budget
        self.whole_group_bytes = whole_group_bytes

    # ------------------------------------------------------------------ slots ----
    def _follow(self, first: int, call: Any) -> list[Any]:
        """Run `call(alloc)` on every kind after the first; a failure frees `first` in the
        kinds that took it and is raised."""
        out, done = [], [self.primary]
        try:
            for alloc in self.parts[1:]:
                out.append(call(alloc))
                done.append(alloc)
        except BaseException:
            for alloc in done:
                alloc.free_reqid(first)
            raise
        return out

    def alloc_reqid(self) -> int:
        slot = self.primary.alloc_reqid()
        self._follow(slot, lambda a: a.alloc_reqid(slot))
        return slot

    def free_reqid(self, reqid: int) -> None:
        for alloc in self.parts:
            alloc.free_reqid(reqid)

    def num_tokens(self, reqid: int) -> int:
        return self.primary.num_tokens(reqid)

    def allocation(self, slot: int) -> int | None:
        return self.primary.allocation(slot)

    @property
    def num_free_slots(self) -> int:
        return self.primary.num_free_slots

    @property
    def worker_error(self) -> BaseException | None:
        return next((a.worker_error for a in self.parts if a.worker_error is not None), None)

    @property
    def books(self) -> Any:
        """The first kind's books (slots, lengths)."""
        return self.primary.books

    def first_pages(self, slot: int) -> list[int]:
        """Per kind, the first page `slot` still maps (pages before it were given back)."""
        out = []
        for alloc in self.parts:
            with alloc.books.lock:
                out.append(alloc.books.holes(slot))
        return out

    # ------------------------------------------------------------------- step ----
    def step(self, seq_lens: Sequence[int] | Mapping[int, int]) -> StepResult:
        """Every kind backs the step; a slot that any kind could not back failed. A kind that
        failed for want of budget asks the other kinds for their cached pages and tries once
        more (the budget's protocol)."""
        results = []
        for alloc in self.parts:
            res = alloc.step(seq_lens)
            if res.failed and alloc.books.physical.budget_short:
                res = alloc.step(seq_lens)  # take_budget_short: the others give back first
            results.append(res)
        failed = sorted(set().union(*(r.failed for r in results)))
        return StepResult(tuple(failed), sum(r.num_mapped for r in results), sum(r.num_unmapped for r in results),
                          out_of_memory=any(r.out_of_memory for r in results))

    def synchronize(self) -> None:
        for alloc in self.parts:
            alloc.synchronize()

    # ---------------------------------------------------------------- sharing ----
    def fork(self, reqid: int, num_tokens: int) -> int:
        if not self.can_fork(reqid, num_tokens):  # refused before any kind forks
            raise fork_refused(reqid, num_tokens)
        child = self.primary.fork(reqid, num_tokens)
        self._follow(child, lambda a: a.fork(reqid, num_tokens, child))
        return child

    def can_fork(self, reqid: int, num_tokens: int) -> bool:
        return all(alloc.can_fork(reqid, num_tokens) for alloc in self.parts)

    def pin(self, reqid: int, num_pages: int) -> list[tuple[Any, ...]]:
        """One handle per page: the first kind's (group, generation), then the other kinds'."""
        per_kind = [alloc.pin(reqid, num_pages) for alloc in self.parts]
        return [(*first, tuple(rest)) for first, *rest in zip(*per_kind)]

    def _split(self, handles: Sequence[tuple[Any, ...]]) -> list[list[tuple[Any, int]]]:
        """Composite handles -> per kind, its handles."""
        out: list[list[tuple[Any, int]]] = [[(h[0], h[1]) for h in handles]]
        for k in range(1, len(self.parts)):
            out.append([h[2][k - 1] for h in handles])
        return out

    def num_pinned(self, handles: Sequence[tuple[Any, ...]]) -> int:
        return min(alloc.num_pinned(hs) for alloc, hs in zip(self.parts, self._split(handles)))

    def map_pinned(self, reqid: int, handles: Sequence[tuple[Any, ...]]) -> int:
        """Every kind maps what it still has; all keep the fewest tokens (none when a window
        kind lacks the pages right before them)."""
        mapped = [alloc.map_pinned(reqid, hs) for alloc, hs in zip(self.parts, self._split(handles))]
        n = min(mapped)
        if n < max(mapped):
            try:
                self.truncate_pinned(reqid, n)
            except InvalidRequestError:  # a window kind cannot stop there: map nothing
                n = 0
                self.truncate_pinned(reqid, 0)
        return n

    def truncate_pinned(self, reqid: int, num_tokens: int) -> int:
        """Every kind keeps the first `num_tokens` tokens; refused (nothing changed) where a
        window kind gave back pages its next query would read."""
        for alloc in self.parts:
            with alloc.books.lock:  # (whole units: checked by each kind's truncate_pinned)
                check_truncate(alloc.books, reqid, num_tokens)
        unmapped = 0
        for alloc in self.parts:
            if alloc.num_tokens(reqid) > num_tokens:
                unmapped += alloc.truncate_pinned(reqid, num_tokens)
        return unmapped

    @property
    def pins(self) -> OrderedDict[Any, int]:
        """The first kind's pins (what `handle[0]`, `handle[1]` name)."""
        return self.primary.pins

    # --------------------------------------------------------------- swapping ----
    def park(self, reqid: int) -> tuple[int, tuple[int, ...]]:
        """Every kind parks the slot; the epoch is theirs, one each."""
        parked = [alloc.park(reqid) for alloc in self.parts]
        return parked[0][0], tuple(epoch for _, epoch in parked)

    def resume(self, slot: int, epoch: tuple[int, ...], num_tokens: int,
               first_pages: Sequence[int] | None = None) -> tuple[int, tuple[bool, ...]]:
        """The first kind picks the slot; each kind says whether its pages must be copied in
        (a kind's pages may have been taken while another's were not)."""
        firsts = list(first_pages) if first_pages is not None else [0] * len(self.parts)
        new, copy = self.primary.resume(slot, epoch[0], num_tokens, first_page=firsts[0])
        rest = self._follow(new, lambda a: a.resume(slot, epoch[self.parts.index(a)], num_tokens, new,
                                                     firsts[self.parts.index(a)]))
        return new, (copy, *(c for _, c in rest))

    # ----------------------------------------------------------------- memory ----
    def trim(self) -> int:
        return sum(alloc.trim() for alloc in self.parts)

    def reserve_physical(self, nbytes: int) -> int:
        """Create pages in every kind, in proportion to its share of a token's bytes."""
        total = sum(a.geometry.group_bytes for a in self.parts)
        return sum(a.reserve_physical(nbytes * a.geometry.group_bytes // total) for a in self.parts)

    @property
    def max_pages(self) -> int:
        """The physical budget in groups of one page of every buffer (the whole cache's)."""
        if self.budget is not None and self.budget.limit is not None:
            return max(1, self.budget.limit // self.whole_group_bytes)
        return max(1, min(a.max_pages * a.geometry.group_bytes for a in self.parts) // self.whole_group_bytes)

    def set_max_pages(self, n: int) -> None:
        """Set the physical budget to `n` groups of one page of every buffer (the minimum over
        tensor-parallel ranks): the kinds' shared budget, or each kind's share of it."""
        if self.budget is not None:
            self.budget.set_limit(n * self.whole_group_bytes)
            return
        total = sum(a.geometry.group_bytes for a in self.parts)
        for a in self.parts:
            a.set_max_pages(max(1, n * total // len(self.parts) // a.geometry.group_bytes))

    # ---------------------------------------------------------------- figures ----
    def stats(self) -> MemoryStats:
        """The kinds' figures summed (bytes exact; page counts add groups of different sizes),
        with each kind's own in `kinds`. `free_tokens`: tokens that fit in what is spare,
        cached and left in the budget, were every layer to hold them."""
        per = [alloc.stats() for alloc in self.parts]
        first = per[0]
        free_bytes = sum((s.num_free_pages + s.num_cached_pages) * s.group_bytes for s in per)
        if self.budget is not None and self.budget.limit is not None:
            free_bytes += max(0, self.budget.limit - self.budget.used)
        else:
            free_bytes += min((s.max_pages - s.num_created_pages) * s.group_bytes for s in per)
        token_bytes = sum(a.geometry.token_bytes_all for a in self.parts)
        return replace(
            first,
            group_bytes=sum(s.group_bytes for s in per),
            num_created_pages=sum(s.num_created_pages for s in per),
            num_free_pages=sum(s.num_free_pages for s in per),
            num_mapped_pages=sum(s.num_mapped_pages for s in per),
            num_cached_pages=sum(s.num_cached_pages for s in per),
            max_pages=self.max_pages,
            mapped_bytes=sum(s.mapped_bytes for s in per),
            used_bytes=sum(s.used_bytes for s in per),
            free_tokens=free_bytes // token_bytes,
            num_pinned_pages=first.num_pinned_pages,
            kinds=dict(zip(self.names, per)),
        )

    def check_invariants(self) -> None:
        for alloc in self.parts:
            alloc.check_invariants()
        slots = [sorted(a.books.active) for a in self.parts]
        assert all(s == slots[0] for s in slots), "the layer kinds' active slots differ"

    def close(self) -> None:
        errors = []
        for alloc in self.parts:
            try:
                alloc.close()
            except Exception as e:  # noqa: BLE001 - close them all, raise the first
                errors.append(e)
        if errors:
            raise errors[0]


__all__ = ["HybridAllocator"]
