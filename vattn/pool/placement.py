"""Where the elastic pool's next block goes: its free blocks by warmth (page-aware placement).
Plain Python; `BlockBooks` (`books.py`) owns one and tells it which blocks warm up and cool down.

Every free block is *warm* (all its pages mapped; in `warm[first page]`) or *cold* (in
`cold`, a lazy min-heap of block ids). `pick` packs blocks into pages that already hold
blocks in use first, then into the other mapped pages, and maps new pages last, lowest
block first (so that the pool's used memory stays low and dense).
"""
from __future__ import annotations

import heapq
from typing import Iterable


class Counts:
    """Counts per index with prefix sums and the k-th search in O(log n) (a Fenwick tree)."""

    def __init__(self, counts: list[int]) -> None:
        self.n = n = len(counts)
        t = [0] + counts
        for i in range(1, n + 1):  # build in O(n)
            j = i + (i & -i)
            if j <= n:
                t[j] += t[i]
        self.t = t
        self.top = 1 << n.bit_length() >> 1 if n else 0  # the highest power of two <= n

    def add(self, i: int, delta: int) -> None:
        t, i = self.t, i + 1
        while i <= self.n:
            t[i] += delta
            i += i & -i

    def prefix(self, i: int) -> int:
        """The sum of the counts of [0, i)."""
        t, total = self.t, 0
        while i > 0:
            total += t[i]
            i -= i & -i
        return total

    def kth(self, k: int) -> int:
        """The smallest index j with prefix(j + 1) >= k (k >= 1); n when the total is below k."""
        t, pos, step = self.t, 0, self.top
        while step:
            if pos + step <= self.n and t[pos + step] < k:
                pos += step
                k -= t[pos]
            step >>= 1
        return pos


class BlockPages:
    """Where blocks lie on pages: `num_blocks` blocks of `block_bytes` on pages of `page_size`
    (per buffer); a block may be smaller than a page or span several."""

    def __init__(self, num_blocks: int, block_bytes: int, page_size: int) -> None:
        self.num_blocks, self.block_bytes, self.page_size = num_blocks, block_bytes, page_size
        self.num_pages = -(-num_blocks * block_bytes // page_size)

    def pages_of(self, block: int) -> tuple[int, int]:
        """First and last page of `block`."""
        return block * self.block_bytes // self.page_size, ((block + 1) * self.block_bytes - 1) // self.page_size

    def pages_under(self, blocks: Iterable[int]) -> set[int]:
        """Every page that holds part of one of `blocks`."""
        return {p for b in blocks for p in range(self.pages_of(b)[0], self.pages_of(b)[1] + 1)}

    def blocks_on(self, page: int) -> range:
        """The blocks that lie (partly) on `page`."""
        p, bb = self.page_size, self.block_bytes
        return range(page * p // bb, min(self.num_blocks, ((page + 1) * p - 1) // bb + 1))


class FreeBlocks:
    """The pool's free blocks, warm (by first page) or cold (a heap), and the pick of the next
    one. It reads the books' `users` (blocks in use per page), `used` (per block) and `miss`
    (unmapped pages per block), shared lists the books change in place, and changes none of them."""

    def __init__(self, geometry: BlockPages, users: list[int], used: bytearray, miss: list[int]) -> None:
        """Every block free and cold (no page mapped)."""
        self.geometry = geometry
        self.num_blocks = num_blocks = geometry.num_blocks
        self.block_bytes, self.page_size = geometry.block_bytes, geometry.page_size
        self.users, self.used, self.miss = users, used, miss
        self.warm: dict[int, dict[int, None]] = {}  # first page -> warm free blocks starting there
        self.num_warm = 0
        self.busy_warm: set[int] = set()  # pages with blocks in use and warm free blocks starting there
        self.idle_warm: set[int] = set()  # pages with no block in use and warm free blocks
        self.cold = list(range(num_blocks))  # heap (lazy: stale entries are skipped when popped)
        ends = [0] * geometry.num_pages  # for available_blocks: cold blocks by their last page
        for b in range(num_blocks):
            ends[self._last(b)] += 1
        self.cold_ends = Counts(ends)

    def _last(self, b: int) -> int:
        return ((b + 1) * self.block_bytes - 1) // self.page_size

    def touch(self, p: int) -> None:
        """Page `p`'s warm blocks or its blocks in use changed: file it as busy or idle."""
        if p in self.warm:
            (self.busy_warm if self.users[p] else self.idle_warm).add(p)
            (self.idle_warm if self.users[p] else self.busy_warm).discard(p)
        else:
            self.busy_warm.discard(p)
            self.idle_warm.discard(p)

    def add_warm(self, b: int) -> None:
        f = b * self.block_bytes // self.page_size
        self.warm.setdefault(f, {})[b] = None
        self.num_warm += 1
        self.touch(f)

    def drop_warm(self, b: int) -> None:
        f = b * self.block_bytes // self.page_size
        d = self.warm[f]
        del d[b]
        if not d:
            del self.warm[f]
        self.num_warm -= 1
        self.touch(f)

    def warmed(self, blocks: Iterable[int]) -> None:
        """Cold free `blocks` had their last page mapped: they are warm now."""
        ends: dict[int, int] = {}  # last page -> blocks that left the cold ones (one count update per page)
        for b in blocks:
            self.add_warm(b)
            last = self._last(b)
            ends[last] = ends.get(last, 0) + 1
        for q, k in ends.items():
            self.cold_ends.add(q, -k)

    def cooled(self, blocks: Iterable[int]) -> None:
        """Warm free `blocks` lose a page (about to be unmapped): they are cold now."""
        ends: dict[int, int] = {}
        for b in blocks:
            self.drop_warm(b)
            heapq.heappush(self.cold, b)
            last = self._last(b)
            ends[last] = ends.get(last, 0) + 1
        for q, k in ends.items():
            self.cold_ends.add(q, k)

    def compact(self) -> None:
        """Drop the heap's stale entries when they are too many (a sorted list is a heap)."""
        if len(self.cold) > 4 * self.num_blocks + 64:
            self.cold = [b for b in range(self.num_blocks) if not self.used[b] and self.miss[b]]

    def pick(self) -> int | None:
        """The next free block to hand out: packed into partly used pages first."""
        for pages in (self.busy_warm, self.idle_warm):
            if pages:
                return next(iter(self.warm[next(iter(pages))]))
        while self.cold:
            b = heapq.heappop(self.cold)
            if not self.used[b] and self.miss[b]:
                return b
        return None

    def reachable(self, q: int) -> int:
        """Free blocks an alloc reaches mapping no page from `q` on: the warm ones and the
        cold ones that end before `q`."""
        return self.num_warm + self.cold_ends.prefix(q)

    def useless(self, pages: list[int], cached: set[int]) -> list[int]:
        """The `cached` pages that hold no warm block once `pages` are unmapped (each block on
        them misses a page): memory no alloc could use without mapping more. Only blocks that
        span pages leave such pages behind."""
        g = self.geometry
        gone, out, todo = set(pages), [], list(pages)
        while todo:
            p = todo.pop()
            on = g.blocks_on(p)
            if not on:
                continue
            near = range(g.pages_of(on[0])[0], g.pages_of(on[-1])[1] + 1)  # the pages its blocks touch
            for q in near:
                if q in gone:
                    continue
                if q in cached and not any(self._warm_without(b, gone) for b in g.blocks_on(q)):
                    gone.add(q)
                    out.append(q)
                    todo.append(q)
        return out

    def _warm_without(self, b: int, gone: set[int]) -> bool:
        """Whether free block b stays warm once the pages in `gone` are unmapped."""
        if self.used[b] or self.miss[b]:
            return False
        first, last = b * self.block_bytes // self.page_size, self._last(b)
        return not any(q in gone for q in range(first, last + 1))

    def check_invariants(self) -> None:
        """Assert the free blocks agree with the books' lists (tests, debugging)."""
        ends = [0] * len(self.users)
        for b in range(self.num_blocks):
            if self.used[b]:
                continue
            if self.miss[b]:
                assert b in self.cold, f"cold block {b} not in the heap"
                ends[self._last(b)] += 1
            else:
                assert b in self.warm.get(b * self.block_bytes // self.page_size, ()), f"warm block {b} not booked"
        assert self.num_warm == sum(len(d) for d in self.warm.values())
        assert self.busy_warm == {p for p in self.warm if self.users[p]}
        assert self.idle_warm == {p for p in self.warm if not self.users[p]}
        n = len(ends)
        assert [self.cold_ends.prefix(p + 1) - self.cold_ends.prefix(p) for p in range(n)] == ends
