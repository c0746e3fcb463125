"""`Coordinator`: the slot allocator's API over every layer kind of a cache, and its
threading (one lock over the books; one pre-mapping worker, stopped around every call that
moves pages), composed of parts with one job each. Plain Python.

```
Coordinator       alloc_reqid / free_reqid / step, fork, pins, swap, trim, budget, close
 |- slots         Slots        slots, lengths, fences, the lock           (books.py)
 |- kinds         one manager per layer kind, the class its spec's type names
 |   |            (registry.MANAGERS: kinds.py, states.py): each a SlotBooks (its pages),
 |   |            a Mapper (its movements) and what the kind decides differently
 |   '- snapshots Snapshots    the state kind's rows for the prefix cache (snapshots.py)
 |- layer         PageLayer    every kind's page groups on one budget      (vattn/pages.py)
 |- plans         StepPlan     every kind planned before any maps          (plan.py)
 |- premapper     Premapper    one background worker for every kind        (premap.py)
 '- sharing, swap fork, pins, prefixes; park / resume                      (sharing.py, swap.py)
```
A step is all or nothing across the kinds: a slot is served in every kind or in none, and a
slot that fails keeps exactly the lengths and pages it had (a kind's give-back behind its
queries is part of the plan). Unmapping waits for the device: a step records a fence (a CUDA event on
the current stream) for every slot the previous iteration ran, and a slot's pages are
unmapped only after its fence. A slot freed after an iteration still gets that iteration's
fence (`ran` is not cleared by free_reqid).

The budget is in bytes: `max_bytes` caps the page groups every kind created (one page of
every buffer of the cache is `unit_bytes`; `max_pages` counts those units). With a shared
`vattn.Budget` the page layer also takes every group's bytes from it.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from vattn.allocator import memory, sharing, swap
from vattn.allocator.books import MemoryStats, Slots, SlotBooks, as_index
from vattn.allocator.kinds import KindManager, KindSpec
from vattn.allocator.mapper import carry_out
from vattn.allocator.plan import StepPlan, StepResult, normalize, plan_backing, plan_step, short_and_edge
from vattn.allocator.premap import Premapper, map_ahead, premap
from vattn.allocator.registry import manager_for
from vattn.errors import InvalidRequestError, NoFreeSlotError
from vattn.pages import PageLayer

if TYPE_CHECKING:  # the books import no torch: sizes are ints by the time they get here
    from vattn.allocator.snapshots import Snapshots
    from vattn.vmem.base import Backend


_BACKED = StepResult()  # (frozen: one for every step that maps nothing)


class Coordinator:
    """Books and page movement for one cache, every layer kind. Used through `vattn.KVCache`.

    Cost grows with the work, not the capacity: a `step` that maps nothing touches only the
    requests it names (one pass over them), and the slot `alloc_reqid` hands out next comes
    from a heap.
    """

    def __init__(self, backend: Backend, kinds: Sequence[KindSpec], *, num_slots: int, max_len: int,
                 max_bytes: int, background: bool, prefetch: bool, prefetch_tokens: int = 1,
                 budget: Any = None) -> None:
        """`kinds`: the cache's layer kinds, the first one's pages the warm slot's measure
        (full attention when there is one). `max_bytes`: the budget of every kind's page
        groups. `budget`: a `vattn.Budget` shared with other caches and pools: every group
        created is taken from it, others may ask for our cached pages, and a step it refused
        asks them next time."""
        if not kinds:
            raise ValueError("a cache has one layer kind or more")
        self.backend = backend
        self.background = background
        self.prefetch = prefetch
        # look-ahead: a slot within this many tokens of its next page pre-maps it
        self.prefetch_tokens = prefetch_tokens
        self.worker_error: BaseException | None = None
        self.slots = slots = Slots(num_slots, max_len)
        self.layer = PageLayer(backend, kinds[0].geometry.page_size, budget=budget, reclaim=self._give_back,
                               cached=self._cached_bytes)
        # one manager per kind, of the class its spec's type names (`registry.MANAGERS`)
        self.kinds: list[KindManager] = [manager_for(spec).create(spec, self.layer.add_kind(spec.bases), slots,
                                                                  primary=i == 0) for i, spec in enumerate(kinds)]
        self._books = [kind.books for kind in self.kinds]
        self._mappers = [kind.mapper for kind in self.kinds]
        self._local = any(kind.gives_back for kind in self.kinds)  # pages go back behind some kind's queries
        self._stepped = [kind for kind in self.kinds if kind.sees_steps]  # (what `_finish_step` tells)
        state = next((kind for kind in self.kinds if kind.snapshots is not None), None)
        self._snapshots = state.snapshots if state is not None else None
        if state is not None:  # (its rows are backed within the budget of every kind)
            state.snapshots.bind(self._quiet, functools.partial(_back_row, self._carry, self._books,
                                                                self.kinds.index(state)))
        self._pinned = sharing.pinned_kinds(self.kinds)
        self.unit_bytes = sum(b.geometry.group_bytes for b in self._books)  # one page of every buffer
        self.max_bytes = max_bytes
        self.premapper = Premapper(slots.lock, lambda job: map_ahead(self._mappers, job, self.max_bytes,
                                                                     self.premapper), self._record_worker_error)

    @property
    def books(self) -> SlotBooks:
        """The first kind's books (its pages; the slots' books through it)."""
        return self._books[0]

    @property
    def geometry(self) -> Any:
        return self._books[0].geometry

    # ------------------------------------------------------------------ slots ----
    def alloc_reqid(self) -> int:
        """A free slot: the warm one (most pages of the first kind mapped)."""
        slots = self.slots
        with slots.lock:
            slots.check_open()
            if not slots.free_slots:
                raise NoFreeSlotError(
                    f"all {slots.num_slots} slots are in use; free_reqid() one or raise max_batch_size")
            slot = slots.warm_slot()
            swap.take(slots, self.kinds, slot)
            return slot

    def free_reqid(self, reqid: int) -> None:
        slots = self.slots
        with slots.lock:
            slots.check_open()
            slot = slots.check_active(reqid)
            slots.free(slot)
            for kind in self.kinds:
                kind.freed(slot)

    def num_tokens(self, reqid: int) -> int:
        """The tokens `reqid` holds: its longest step length since alloc (what fork, pin and
        swap_out may take)."""
        with self.slots.lock:
            return self.slots.max_lens[self.slots.check_active(reqid)]

    def allocation(self, slot: int) -> int | None:
        """Which allocation holds `slot` now (a number never given again), None while it is free."""
        return self.slots.active.get(slot)

    @property
    def num_free_slots(self) -> int:
        return len(self.slots.free_slots)

    def first_pages(self, slot: int) -> list[int]:
        """Per kind, the first page `slot` still maps (pages before it were given back)."""
        with self.slots.lock:
            return [kind.first_page(slot) for kind in self.kinds]

    # ------------------------------------------------------------------- step ----
    def step(self, seq_lens: Sequence[int] | Mapping[int, int]) -> StepResult:
        slots, books, layer, ahead = self.slots, self._books, self.layer, self.prefetch_tokens
        short_bytes = layer.take_budget_short()
        if short_bytes:  # the budget refused us last time: ask the others (never under our lock)
            layer.budget.reclaim(short_bytes, requester=layer.budget_token)
        if self.premapper.busy:  # the worker is mapping: a step that needs nothing new runs beside it
            with slots.lock:
                slots.check_open()
                lens, short, edge = normalize(slots, books, seq_lens, ahead)
                if not (short or _moves(self.kinds, lens)):
                    slots.fence_ran(layer.fence())
                    return self._finish_step(lens, _BACKED, edge)
        with self._quiet():  # the worker stopped after its batch in flight
            lens, short, edge = normalize(slots, books, seq_lens, ahead)
            local = self._local
            if local:
                for kind in self.kinds:
                    kind.check_reads(lens)
            slots.fence_ran(layer.fence())
            if (local or _shared(books)) and sharing.unshare_new_owners(self.kinds, lens):
                short, edge = short_and_edge(books, lens, ahead)
            result = _BACKED
            if short or (local and _gives_back(self.kinds, lens)):
                plan, mapped, unmapped = self._carry(lambda limit: plan_step(self.kinds, lens, short, limit))
                result = StepResult(plan.failed, mapped, unmapped, out_of_memory=plan.limit < self.max_bytes)
                for s in plan.failed:  # not backed: this iteration will not run them
                    del lens[s]
            for kind in self.kinds:
                if kind.books.dirty_slots:
                    kind.mapper.zero_dirty(lens)
            return self._finish_step(lens, result, edge if not short else None)

    def can_step(self, seq_lens: Sequence[int] | Mapping[int, int]) -> bool:
        """Whether `step(seq_lens)` would back every slot, planned from the books alone
        (nothing maps, nothing moves): the scheduler asks before it admits a request or
        restores a prefix into it, so that neither takes the pages the running requests need
        this iteration. An estimate where a sliding window must first unshare pages a new
        owner writes (the step plans those moves itself); a device that refuses pages the
        budget allows is seen only by the step."""
        with self.slots.lock:
            self.slots.check_open()
            lens, short, _ = normalize(self.slots, self._books, seq_lens, 0)
            if not (short or (self._local and _gives_back(self.kinds, lens))):
                return True
            return not plan_step(self.kinds, lens, short, self.max_bytes).failed

    def _carry(self, make_plan: Callable[[int], StepPlan]) -> tuple[StepPlan, int, int]:
        return carry_out(self._mappers, make_plan, self.max_bytes)

    def _finish_step(self, lens: dict[int, int], result: StepResult, edge: list[int] | None) -> StepResult:
        """The books of the iteration `lens` runs (lock held), and what to pre-map next."""
        slots = self.slots
        ml, prev, older, moved = slots.max_lens, slots.prev_lens, slots.older_lens, slots.moved_at
        started: list[tuple[int, int, int]] | None = [] if self._stepped else None
        slots.num_steps += 1
        step = slots.num_steps
        for s, n in lens.items():
            m = ml[s]
            if n > m:
                if not m:  # a new request's first length
                    slots.eager_tokens = n if not slots.eager_tokens else 0.8 * slots.eager_tokens + 0.2 * n
                ml[s] = n
                older[s] = prev[s]  # (what revert_step restores)
                prev[s] = m
                moved[s] = step
                if started is not None:
                    started.append((s, m, n))
        slots.ran = lens
        if started:  # (a step that runs beside the worker has no snapshot due: `_moves`)
            for kind in self._stepped:
                for s, m, n in started:
                    kind.after_step(s, m, n, lens)
        if result and self.prefetch:
            self._premap(edge)
        return result

    def revert_step(self, reqids: Sequence[int]) -> None:
        """The last step's iteration will not run for these slots (another tensor-parallel
        rank could not back them): their lengths go back to what they were before it, as if
        they had failed here too (the pages it mapped stay, as pre-mapped pages; the pages it
        gave back behind a window are those any iteration from the same start gives back;
        the snapshot rows it planned are wanted again). Slots the last step did not move are
        left alone."""
        with self.slots.lock:
            for s in self.slots.revert(reqids):
                for kind in self.kinds:
                    kind.reverted(s)

    def _premap(self, edge: list[int] | None) -> None:
        """Pre-map what the next iterations want (`premap`); `edge`: slots near a page (None: find them)."""
        if edge is None:
            edge = short_and_edge(self._books, self.slots.ran, self.prefetch_tokens)[1]
        error = premap(self.premapper, self._books, self._mappers, edge, self.prefetch_tokens, self.max_bytes,
                       self.background)
        if error is not None:  # pre-mapping is best effort; the next step maps on demand
            self._record_worker_error(error)

    def _record_worker_error(self, e: BaseException) -> None:
        if self.worker_error is None:
            warnings.warn(f"vattn: background pre-mapping failed ({e}); step() maps on demand",
                          RuntimeWarning, stacklevel=2)
        self.worker_error = e

    def synchronize(self) -> None:
        """Wait until the background pre-mapping of the last step is done."""
        with self.slots.lock:
            self.premapper.wait()

    # ---------------------------------------------------------------- sharing ----
    def fork(self, reqid: int, num_tokens: int) -> int:
        """See `KVCache.fork`."""
        with self._quiet():
            return sharing.fork(self.slots, self.kinds, self._carry, reqid, num_tokens, self.layer.fence())

    def can_fork(self, reqid: int, num_tokens: int) -> bool:
        """Whether `fork(reqid, num_tokens)` finds what the child reads in every kind (a
        sliding window may have moved past it; recurrent states are right at one length)."""
        with self.slots.lock:
            slot = self.slots.check_active(reqid)
            num_tokens = as_index(num_tokens, "num_tokens")
            return all(kind.can_fork(slot, num_tokens) for kind in self.kinds)

    def pin(self, reqid: int, num_pages: int) -> list[sharing.Handle]:
        """See `KVCache.pin`."""
        with self.slots.lock:
            self.slots.check_open()
            return sharing.pin(self.slots, self._pinned, reqid, num_pages)

    def num_pinned(self, handles: Sequence[sharing.Handle]) -> int:
        """How many of `handles`, from the first, are still pinned; marks them most recently used."""
        with self.slots.lock:
            return sharing.num_pinned(self._pinned, handles)

    def is_pinned(self, handles: Sequence[sharing.Handle]) -> bool:
        """Whether every one of `handles` is still pinned (a cached block's pages)."""
        return sharing.is_pinned(self._pinned, handles)

    def map_pinned(self, reqid: int, handles: Sequence[sharing.Handle]) -> int:
        """See `KVCache.map_pinned`."""
        with self._quiet():
            return sharing.map_pinned(self.slots, self._pinned, reqid, handles, self.layer.fence())

    def truncate_pinned(self, reqid: int, num_tokens: int) -> int:
        """See `KVCache.truncate_pinned`."""
        with self._quiet():
            return sharing.truncate_pinned(self.slots, self._pinned, reqid, num_tokens)

    def extend_prefix(self, reqid: int, num_tokens: int) -> tuple[int, list[tuple[int, int]]]:
        """See `KVCache.extend_prefix`."""
        with self._quiet():
            return sharing.extend_prefix(self.slots, self.kinds, self._carry, reqid, num_tokens, self.layer.fence())

    def drop_prefix(self, reqid: int) -> None:
        """See `KVCache.drop_prefix`."""
        with self._quiet():
            slot = self.slots.check_active(reqid)
            self.slots.fence_ran(self.layer.fence())
            sharing.drop_prefix(self.slots, self.kinds, slot)

    def first_reads(self, num_tokens: int) -> list[int]:
        """Per K/V kind (a pin handle's), the first page the query after `num_tokens` tokens reads."""
        return [kind.first_read(num_tokens) for kind in self._pinned]

    @property
    def pins(self) -> OrderedDict[Any, int]:
        """The first K/V kind's pinned groups -> the generation of their pin, least recently
        used first (read only; what a handle's first pair names)."""
        return self._pinned[0].books.pins

    # --------------------------------------------------------------- swapping ----
    def check_swap_out(self, reqid: int, num_tokens: int) -> None:
        """InvalidRequestError where a kind cannot park `reqid` at `num_tokens` (recurrent
        states are right at their slot's length only)."""
        with self.slots.lock:
            slot = self.slots.check_active(reqid)
            for kind in self.kinds:
                kind.check_swap_out(slot, num_tokens)

    def park(self, reqid: int) -> tuple[int, tuple[int, ...]]:
        """`free_reqid`, remembering (slot, the kinds' epochs): while a kind's pages of the
        slot stay untouched (no new owner, no page taken), `resume` gets them back with their
        data, with no copy. Its pages stay mapped until device work enqueued before this call
        finished."""
        with self.slots.lock:
            self.slots.check_open()
            return swap.park(self.slots, self.kinds, reqid, self.layer.fence())

    def resume(self, slot: int, epochs: Sequence[int], num_tokens: int,
               first_pages: Sequence[int] | None = None) -> tuple[int, tuple[bool, ...]]:
        """See `swap.resume`: (slot, per kind whether its data must be copied in)."""
        firsts = list(first_pages) if first_pages is not None else [0] * len(self.kinds)
        with self._quiet():
            return swap.resume(self.slots, self.kinds, self._carry, slot, epochs, num_tokens, firsts,
                               self.layer.fence())

    # -------------------------------------------------------------- snapshots ----
    @property
    def snapshots(self) -> Snapshots:
        """The recurrent-state kind's snapshots (`vattn.allocator.snapshots.Snapshots`);
        InvalidRequestError for a cache without recurrent states."""
        if self._snapshots is None:
                raise InvalidRequestError("this cache keeps no recurrent states (state_bytes=0): it has no snapshots")
        return self._snapshots

    # ----------------------------------------------------------------- memory ----
    def trim(self) -> int:
        """Give back now every page no live token needs (free slots, pre-mapped tails, pinned
        prefix pages no slot maps, kept snapshots): unmap and release them. Returns the page
        groups released."""
        with self._quiet():
            self.slots.fence_ran(self.layer.fence())
            return memory.trim(self.kinds)

    def reserve_physical(self, nbytes: int) -> int:
        """Create page groups in every kind until at least `nbytes` of physical memory
        exist (each kind its share: as many groups as `nbytes` holds of one page of every
        buffer). Returns groups created."""
        nbytes = as_index(nbytes, "nbytes")
        if nbytes < 0:
            raise InvalidRequestError(f"nbytes must be >= 0, got {nbytes}")
        with self._quiet():
            return memory.reserve(self.kinds, -(-nbytes // self.unit_bytes), self.max_bytes, nbytes)

    @property
    def max_pages(self) -> int:
        """The physical budget in units of one page of every buffer (`set_max_pages` changes it)."""
        return max(1, self.max_bytes // self.unit_bytes)

    def set_max_pages(self, n: int) -> None:
        """Set the physical budget to `n` units of one page of every buffer (e.g. the minimum
        over tensor-parallel ranks). `n` is an int >= 1 whose bytes hold the groups that exist
        now (`trim()` first to go lower); a unit is `unit_bytes`. Raises InvalidRequestError."""
        n = as_index(n, "max_pages")
        with self._quiet():
            created = self.layer.created_bytes
            if n < 1 or n * self.unit_bytes < created:
                raise InvalidRequestError(
                    f"max_pages must be >= 1 and >= the {-(-created // self.unit_bytes)} page groups that exist "
                    f"now, got {n}; trim() first to give unused pages back")
            self.max_bytes = n * self.unit_bytes

    def _give_back(self, nbytes: int) -> int:
        """The shared budget asks for memory (another cache is short): release spare groups,
        then cached pages, up to `nbytes`. Never raises. Returns the bytes given back."""
        try:
            with self._quiet():
                return memory.give_back(self.kinds, self.slots, self.layer, nbytes)
        except Exception:  # closed
            return 0

    def _cached_bytes(self) -> int:
        """The budget's estimate, without the lock, of what `_give_back` could give now."""
        return sum(b.cached_groups() * b.geometry.group_bytes for b in self._books)

    # ---------------------------------------------------------------- figures ----
    def stats(self) -> MemoryStats:
        """The memory figures (see `vattn.allocator.memory.stats`)."""
        with self.slots.lock:
            self.slots.check_open()
            return memory.stats(self.kinds, self.max_bytes, self.layer.created_bytes, self.max_pages)

    def check_invariants(self) -> None:
        """Assert the books are consistent (for tests and debugging)."""
        with self.slots.lock:
            self.slots.check_invariants()
            for kind in self.kinds:
                kind.check_invariants()
            assert self.layer.created_bytes <= self.max_bytes, "more pages than the budget"

    # ---------------------------------------------------------------- closing ----
    def close(self) -> None:
        """Stop the worker, unmap and release every page (after the device finished)."""
        if self.premapper.is_worker():
            # The garbage collector ran the cache's finalizer on the worker thread, which
            # cannot join itself (and may hold the lock): close from another thread.
            threading.Thread(target=self.close, name="vattn-close", daemon=True).start()
            return
        slots = self.slots
        self.premapper.cancel = True
        with slots.lock:
            if slots.closed:
                return
            self.premapper.quiesce()
            slots.closed = True
            self.premapper.close()
        self.premapper.join()
        # Every page is given back even when a driver call fails on the way; the first
        # error is raised at the end.
        with slots.lock:
            errors = self.layer.close(memory.unbook(self._books))
        if errors:
            raise errors[0]

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Hold the lock with the worker stopped (after its batch in flight) and the cache
        open: what every call that changes pages needs."""
        self.premapper.cancel = True  # before taking the lock: the worker stops at its next batch
        with self.slots.lock:
            self.slots.check_open()
            self.premapper.quiesce()
            self.slots.check_open()  # close() may have run while we waited
            yield


def _shared(books: Sequence[SlotBooks]) -> bool:
    """Whether some kind's slot may map a group another slot shares (lock held)."""
    for b in books:
        if b.shared_slots:
            return True
    return False


def _moves(kinds: Sequence[KindManager], lens: dict[int, int]) -> bool:
    """Whether the step must stop the worker though no slot is short: some kind has pages
    to move (`KindManager.moves`: shared with a new owner, to clear, to give back, holes
    where a new owner reads, snapshots to plan; lock held)."""
    for kind in kinds:
        if kind.moves(lens):
            return True
    return False


def _gives_back(kinds: Sequence[KindManager], lens: dict[int, int]) -> bool:
    """Whether the step gives pages back behind some kind's queries (lock held)."""
    for kind in kinds:
        if kind.gives_back_now(lens):
            return True
    return False


def _back_row(carry: Callable[[Callable[[int], StepPlan]], tuple[StepPlan, int, int]], books: Sequence[SlotBooks],
              k: int, row: int, first: int, count: int, lens: Mapping[int, int]) -> bool:
    """Map `count` pages of kind `k`'s `row` from page `first` within the budget of every
    kind (a snapshot row; lock held, worker stopped). False when memory is short."""
    needs: list[list[tuple[int, int, int]]] = [[] for _ in books]
    needs[k] = [(row, first, count)]
    plan, _, _ = carry(lambda limit: plan_backing(books, needs, lens, limit))
    return not plan.failed


__all__ = ["Coordinator", "KindSpec"]
