"""The elastic pool's books: which blocks are in use and which pages back them, over the page
layer (`vattn.pages`); where the next block goes (page-aware placement) is their `FreeBlocks`
(`placement.py`). Plain Python.

```
 buffer b: num_blocks blocks of block_bytes; page p of every buffer is one page group
 |<- block 0 ->|<- block 1 ->|<- block 2 ->| ...     a block may be smaller than a page
 [   page 0    |    page 1   |    page 2   ]         or span several: pages_of(b) = (first, last)
```
Every free block is *warm* (all its pages mapped) or *cold* (`FreeBlocks`). A page no
block in use is on is *cached*: mapped, given back when memory is wanted (after the fences
of the blocks freed on it). A cached page that holds no warm block (every block on it misses
another page: blocks that span pages) is useless memory: it goes back with the page that
made it so (`_unmap`), so every cached page holds a warm block, which is what makes
`available_blocks` exact.
"""
from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from vattn.errors import ClosedError, OutOfPhysicalMemoryError, UnknownBlockError
from vattn.pages import PageGroups
from vattn.pool.placement import BlockPages, Counts, FreeBlocks

if TYPE_CHECKING:
    from vattn.budget import Budget
    from vattn.vmem.base import Backend

_PLANNED = object()  # a page booked as mapped while an alloc is being planned


@dataclass(frozen=True)
class PoolStats:
    """Memory figures of one pool, in bytes (all buffers) and counts. The `num_*_pages`
    fields count page groups (one page of every buffer, `group_bytes` in all)."""

    num_blocks: int
    block_bytes: int  # one block in every buffer
    page_size: int
    group_bytes: int  # one page in every buffer: the unit that is mapped
    num_used_blocks: int
    num_warm_blocks: int  # free blocks whose pages are all mapped (no mapping needed)
    num_mapped_pages: int
    num_cached_pages: int  # mapped, no block in use on them: what trim() gives back (with the spare ones)
    num_spare_pages: int  # created ahead, not mapped: handed out before creating more
    mapped_bytes: int
    used_bytes: int  # blocks in use
    peak_mapped_bytes: int
    limit: int | None
    available_blocks: int  # blocks alloc can give now, other pools' cached pages counted (see available_blocks())

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.num_used_blocks

    @property
    def cached_bytes(self) -> int:
        return self.num_cached_pages * self.group_bytes

    @property
    def held_bytes(self) -> int:
        """Physical bytes the pool holds (mapped and spare): what the limit bounds."""
        return (self.num_mapped_pages + self.num_spare_pages) * self.group_bytes


class BlockBooks:
    """The pool's books and page movement. Holds no reference to the `ElasticPool` (its
    finalizer) and none to torch tensors. `lock` guards them; backend calls are made under it."""

    def __init__(self, num_blocks: int, block_bytes: int, num_buffers: int, backend: Backend, bases: list[int],
                 page_size: int, budget: Budget | None, grow: int, *, limit: int | None = None,
                 scratch: bool = False, device_sync: Callable[[], None] | None = None,
                 zero_pages: Callable[[list[int]], None] | None = None) -> None:
        """`num_blocks` blocks of `block_bytes` in each of `num_buffers` buffers at `bases`.
        `grow`: groups created at least per creation (the rest kept spare). `limit`: bytes the
        pool may hold (None: none). `scratch`: back every page with no group by the backend's
        scratch memory (reads and writes of a free block never fault). `device_sync`
        (sync="device") waits for every stream before an unmap; `zero_pages(pages)` clears
        the pages mapped with new memory (zero_new)."""
        self.zero_pages = zero_pages
        self.grow = grow
        self.page_size = page_size
        self.block_bytes = block_bytes  # one block in one buffer
        self.num_blocks = num_blocks
        self.num_buffers = num_buffers
        self.geometry = geometry = BlockPages(num_blocks, block_bytes, page_size)
        self.num_pages = geometry.num_pages  # pages per buffer
        self.pages_of, self.pages_under, self.blocks_on = geometry.pages_of, geometry.pages_under, geometry.blocks_on
        self.group_bytes = page_size * num_buffers
        self.limit: int | None = limit
        self.physical = PageGroups(backend, bases, page_size, num_buffers, budget=budget,
                                   reclaim=self.reclaim_for_budget, cached=self.cached_bytes,
                                   device_sync=device_sync)
        if scratch:
            try:
                self.physical.back_with_scratch(self.num_pages)
            except BaseException:
                self.physical.close([], [])  # leave the budget
                raise

        self.used = bytearray(self.num_blocks)
        self.num_used = 0
        self.users = [0] * self.num_pages  # blocks in use on each page
        self.groups: list[Any] = [None] * self.num_pages  # the group mapped at each page (None: unmapped)
        self.num_mapped = 0
        self.miss = [self.pages_of(b)[1] - self.pages_of(b)[0] + 1 for b in range(self.num_blocks)]  # unmapped pages
        self.unmapped = Counts([1] * self.num_pages)  # for available_blocks
        self.free_blocks = FreeBlocks(geometry, self.users, self.used, self.miss)  # where the next block goes
        self.cached: set[int] = set()  # mapped pages with no block in use
        self.fences: dict[int, Any] = {}  # page -> fence of the last free of a block on it
        self.peak_mapped = 0
        self.closed = False
        self.lock = threading.Lock()

    # -------------------------------------------------------------- held pages ----
    @property
    def num_held(self) -> int:
        """Groups the pool holds: mapped and spare (what the limit bounds)."""
        return self.num_mapped + len(self.physical.spare)

    @property
    def limit_pages(self) -> int | None:
        return None if self.limit is None else self.limit // self.group_bytes

    # ------------------------------------------------------------ book moves ----
    def _book_map(self, p: int, group: Any) -> None:
        self.groups[p] = group
        self.num_mapped += 1
        self.unmapped.add(p, -1)
        if not self.users[p]:
            self.cached.add(p)
        warmed = []
        for b in self.blocks_on(p):
            self.miss[b] -= 1
            if not self.miss[b] and not self.used[b]:
                warmed.append(b)
        self.free_blocks.warmed(warmed)

    def _book_unmap(self, p: int) -> Any:
        group, self.groups[p] = self.groups[p], None
        self.num_mapped -= 1
        self.unmapped.add(p, 1)
        self.cached.discard(p)
        self.fences.pop(p, None)
        on = self.blocks_on(p)
        self.free_blocks.cooled([b for b in on if not self.miss[b] and not self.used[b]])
        for b in on:
            self.miss[b] += 1
        self.free_blocks.compact()
        return group

    def _use(self, b: int) -> None:
        self.free_blocks.drop_warm(b)  # all its pages are (booked as) mapped
        self.used[b] = 1
        self.num_used += 1
        first, last = self.pages_of(b)
        for p in range(first, last + 1):
            self.users[p] += 1
            if self.users[p] == 1:
                self.cached.discard(p)
                self.free_blocks.touch(p)

    def _unuse(self, b: int, fence: Any = None) -> None:
        self.used[b] = 0
        self.num_used -= 1
        first, last = self.pages_of(b)
        for p in range(first, last + 1):
            self.users[p] -= 1
            if fence is not None:
                self.fences[p] = fence
            if not self.users[p]:
                self.cached.add(p)
                self.free_blocks.touch(p)
        self.free_blocks.add_warm(b)

    # -------------------------------------------------------------- alloc/free ----
    def alloc(self, n: int | None, ids: list[int] | None) -> tuple[list[int] | None, int]:
        """Lock held. Returns (block ids or None, bytes the shared budget could not give)."""
        self.check_open()
        count = n if ids is None else len(ids)
        if count > self.num_blocks - self.num_used:
            return None, 0
        picked: list[int] = []
        planned: list[int] = []  # pages to map
        new: list[int] = []  # the planned pages given new memory
        try:
            for i in range(count):
                b = self.free_blocks.pick() if ids is None else ids[i]
                first, last = self.pages_of(b)
                for p in range(first, last + 1):
                    if self.groups[p] is None:
                        self._book_map(p, _PLANNED)
                        planned.append(p)
                self._use(b)
                picked.append(b)
            ok, need, new = self._back(planned)
            if ok and new and self.zero_pages is not None:
                self.zero_pages(new)
        except BaseException:
            self._undo(picked, planned)
            if new:  # mapped but maybe not cleared: never hand that memory out
                try:
                    self.physical.release(self._unmap(new))
                except Exception:
                    pass
            raise
        if not ok:
            self._undo(picked, planned)
            return None, need
        self.peak_mapped = max(self.peak_mapped, self.num_mapped)
        return picked, 0

    def _back(self, planned: list[int]) -> tuple[bool, int, list[int]]:
        """Give physical groups to the planned pages: spare groups first, then the pool's own
        cached pages (moved), then new ones, created `grow` at a time within the limit and
        the budget (the extra ones stay spare). (False, bytes the budget could not give, [])
        when memory is short; then nothing was mapped and no new group is held. Else (True,
        0, the pages given memory never mapped before: spare or created groups)."""
        k = len(planned)
        if not k:
            return True, 0, []
        physical, lp = self.physical, self.limit_pages
        num_spare = len(physical.spare)
        cached = sorted(self.cached, reverse=True)  # the pool's own free memory, highest pages first
        s = min(k, num_spare)
        c = min(k - s, len(cached))
        n = k - s - c  # groups to create
        held = self.num_mapped - k + num_spare  # groups held before this call
        # groups to let go to stay within the limit: what is held after must fit
        drop = 0 if lp is None else max(0, held + n - lp)
        if drop > (num_spare - s) + (len(cached) - c):
            return False, 0, []  # the pool's own limit: a miss
        drop_spare = min(drop, num_spare - s)
        drop_cached = drop - drop_spare
        created: list[Any] = []
        if n:
            extra = max(0, self.grow - n)  # created beyond need, kept spare: fewer, larger creations
            if lp is not None:
                extra = max(0, min(extra, lp - (held + n - drop)))
            try:
                got = physical.create(n, extra)
            except OutOfPhysicalMemoryError:
                return False, 0, []  # the device refused new pages now: a shortage, not an error
            if got is None:
                return False, n * self.group_bytes, []  # the budget is asked to make this much free
            created = got
        unmapped: list[Any] = []
        spare: list[Any] = []
        try:
            unmapped = self._unmap(cached[:c + drop_cached])
            spare = physical.take_spare(s)
            groups = spare + unmapped[:c] + created[:n]
            physical.map([p * self.page_size for p in planned], groups)
        except BaseException:
            # Nothing of the map happened (it is all or nothing): give back what this call holds.
            physical.put_spare(spare)
            for held_groups in (created, unmapped):
                try:
                    physical.release(held_groups)
                except Exception:
                    pass  # kept in `unreleased`, retried at close
            raise
        for p, g in zip(planned, groups):
            self.groups[p] = g
        physical.put_spare(created[n:])
        let_go = unmapped[c:] + physical.take_spare(drop_spare)  # over the limit
        try:
            physical.release(let_go)
        except Exception:
            pass
        return True, 0, planned[:s] + planned[s + c:]

    def _undo(self, picked: list[int], planned: list[int]) -> None:
        for b in reversed(picked):
            self._unuse(b)
        for p in reversed(planned):
            if self.groups[p] is _PLANNED:
                self._book_unmap(p)

    def free(self, ids: list[int]) -> None:
        self.check_open()
        for b in ids:
            if not self.used[b]:
                raise UnknownBlockError(f"block {b} is not allocated (double free?)")
        fence = self.physical.fence()  # nothing changed if this raises
        for b in ids:
            self._unuse(b, fence)
        lp = self.limit_pages
        if lp is not None and self.num_held > lp and (self.cached or self.physical.spare):  # over the limit: give back
            try:
                self.give_back(self.num_held - lp)
            except Exception as e:  # the blocks are freed; the pages stay cached until trim() or an alloc
                warnings.warn(f"vattn: giving back pages over the pool's limit failed ({e}); "
                              "they stay mapped until trim()", RuntimeWarning, stacklevel=3)

    # ------------------------------------------------------------ giving back ----
    def _unmap(self, pages: list[int]) -> list[Any]:
        """Unmap cached pages (one call, after their fences), and the cached pages that would
        hold no warm block after (`FreeBlocks.useless`); returns their groups, `pages`' first."""
        if not pages:
            return []
        pages = pages + self.free_blocks.useless(pages, self.cached)
        self.physical.wait(self.fences.get(p) for p in pages)
        self.physical.unmap([p * self.page_size for p in pages])
        return [self._book_unmap(p) for p in pages]  # books change only after the unmap worked

    def give_back(self, count: int | None = None) -> int:
        """Release up to `count` groups the pool holds but no block uses (None: all): spare
        groups first, then cached pages (unmapped after their fences). Returns groups given back."""
        num_spare = len(self.physical.spare)
        n = num_spare if count is None else min(max(0, count), num_spare)
        try:
            self.physical.release_spare(n)
        except Exception:
            pass  # kept in `unreleased`
        pages = sorted(self.cached, reverse=True)
        if count is not None:
            pages = pages[:max(0, count - n)]
        groups = self._unmap(pages)  # maybe more than asked: pages left useless go too
        if groups:
            self.physical.release(groups)
        return n + len(groups)

    def reclaim_for_budget(self, nbytes: int) -> int:
        """The budget's callback: another pool is short of `nbytes`."""
        with self.lock:
            if self.closed:
                return 0
            try:
                return self.give_back(-(-nbytes // self.group_bytes)) * self.group_bytes
            except Exception:
                return 0

    def cached_bytes(self) -> int:
        """The budget's estimate of what `reclaim_for_budget` could give (read without the lock)."""
        return 0 if self.closed else (len(self.cached) + len(self.physical.spare)) * self.group_bytes

    def set_limit(self, limit: int | None) -> None:
        self.check_open()
        self.limit = limit
        lp = self.limit_pages
        if lp is not None and self.num_held > lp:
            self.give_back(self.num_held - lp)

    # ---------------------------------------------------------------- figures ----
    def available_blocks(self) -> int:
        """Blocks alloc can give now, counting the cached pages other pools of the budget
        would give back: the largest n for which `alloc(n)` succeeds, for every block size.

        ```
        alloc(n) picks every warm block first, then cold blocks by id (and the blocks their
        new pages make warm): the cold blocks it reaches are those before the first unmapped
        page that the room (spare groups + groups the limit and budget still allow) cannot map
          pages   [m m u m u u u u ...]     m mapped, u unmapped; room 3: pages up to q mapped
                           room: 1 2 3 q
          count = warm + cold blocks whose last page is before q
        ```
        Exact while every cached page holds a warm block (`_unmap` keeps it so; a failed
        backend call may leave a useless page behind: a lower bound then)."""
        new = None  # groups that may be created
        if self.limit is not None:
            new = max(0, self.limit_pages - self.num_held)
        budget = self.physical.budget
        if budget is not None and (b := budget.stats()).limit is not None:
            more = max(0, b.limit - b.used + budget.reclaimable(self.physical.budget_token)) // self.group_bytes
            new = more if new is None else min(new, more)
        free = self.num_blocks - self.num_used
        unmapped = self.num_pages - self.num_mapped
        if new is None or len(self.physical.spare) + new >= unmapped:
            return free  # every unmapped page can be backed
        q = self.unmapped.kth(len(self.physical.spare) + new + 1)  # the first unmapped page out of reach
        return min(free, self.free_blocks.reachable(q))

    def max_blocks(self) -> int:
        """The most blocks that can be in use at once, pinned ones included: all of them, or
        what the limit and the budget's limit can back (the other pools of the budget holding
        nothing): the blocks that lie wholly in the first pages that many (no other choice
        of pages holds more)."""
        pages = self.num_pages if self.limit is None else min(self.num_pages, self.limit_pages)
        budget = self.physical.budget
        if budget is not None and (limit := budget.stats().limit) is not None:
            pages = min(pages, limit // self.group_bytes)
        if pages >= self.num_pages:
            return self.num_blocks
        return min(self.num_blocks, pages * self.page_size // self.block_bytes)

    def stats(self) -> PoolStats:
        nb = self.num_buffers
        return PoolStats(
            num_blocks=self.num_blocks, block_bytes=self.block_bytes * nb, page_size=self.page_size,
            group_bytes=self.group_bytes, num_used_blocks=self.num_used, num_warm_blocks=self.free_blocks.num_warm,
            num_mapped_pages=self.num_mapped, num_cached_pages=len(self.cached),
            num_spare_pages=len(self.physical.spare), mapped_bytes=self.num_mapped * self.group_bytes,
            used_bytes=self.num_used * self.block_bytes * nb, peak_mapped_bytes=self.peak_mapped * self.group_bytes,
            limit=self.limit, available_blocks=self.available_blocks())

    def check_invariants(self) -> None:
        """Assert the books are consistent (tests, debugging). Lock held."""
        users = [0] * self.num_pages
        for b in range(self.num_blocks):
            first, last = self.pages_of(b)
            miss = sum(self.groups[p] is None for p in range(first, last + 1))
            assert self.miss[b] == miss, (b, self.miss[b], miss)
            if self.used[b]:
                assert miss == 0, f"block {b} in use on an unmapped page"
                for p in range(first, last + 1):
                    users[p] += 1
        assert users == self.users
        assert self.num_used == sum(self.used)
        mapped = {p for p in range(self.num_pages) if self.groups[p] is not None}
        assert _PLANNED not in self.groups
        assert len(mapped) == self.num_mapped
        assert self.cached == {p for p in mapped if not users[p]}
        unmapped = [int(self.groups[p] is None) for p in range(self.num_pages)]
        assert all(self.unmapped.prefix(p) == sum(unmapped[:p]) for p in (0, self.num_pages // 2, self.num_pages))
        self.free_blocks.check_invariants()
        held = [self.groups[p] for p in mapped] + self.physical.spare + self.physical.unreleased
        assert len({id(g) for g in held}) == len(held), "a group is in two places"
        assert self.physical.num_created == self.num_held, "groups created but neither mapped nor spare"

    # ---------------------------------------------------------------- closing ----
    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("this pool was closed; create a new vattn.ElasticPool")

    def close(self) -> None:
        """Unmap and release every page (after the device finished), leave the budget."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            mapped = [p for p in range(self.num_pages) if self.groups[p] is not None]
            errors = self.physical.close([p * self.page_size for p in mapped], [self.groups[p] for p in mapped],
                                      [self.fences.get(p) for p in mapped])
            self.groups = [None] * self.num_pages
            self.num_mapped = 0
            self.cached.clear()
        if errors:
            raise errors[0]
