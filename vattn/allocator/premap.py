"""Background pre-mapping: after each step, map what the next iterations will want (the next
page of every running request near its end, pages for the request that gets the warm slot)
on a worker thread, batch by batch, while the model runs. Plain Python.

The worker only ever maps spare (or newly created) groups into slots; only `step` unmaps.
It holds the books' lock to plan and to commit each batch but not across the driver call,
so other callers wait for bookkeeping only; a call that moves pages stops the job after the
batch in flight (`Premapper.quiesce`).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Sequence

from vattn.errors import OutOfPhysicalMemoryError

if TYPE_CHECKING:
    from vattn.allocator.books import SlotBooks
    from vattn.allocator.mapper import Mapper

Job = list[tuple[int, int, int]]  # (kind, slot, pages it should have there)

_WORKER_BATCH = 16  # groups the worker maps per lock hold, at most
_WORKER_CALLS = 64  # buffers x groups the worker maps per lock hold, about (at least one group)


def worker_batch(num_buffers: int) -> int:
    """Groups the worker maps per lock hold: about `_WORKER_CALLS` driver calls, so that a
    step that must stop the worker waits for few (a 32-layer per-layer group is 64 calls,
    ~2.8 ms on an H100)."""
    return max(1, min(_WORKER_BATCH, _WORKER_CALLS // num_buffers))


def plan_premap(kinds: Sequence[SlotBooks], edge: list[int], ahead: int) -> Job:
    """What the next iterations will want, in every kind: `ahead` more tokens for every
    running request that is that close to a page (`edge`), then pages for the request that
    gets the warm slot (a running mean of new requests' first lengths). Only what is not
    mapped yet."""
    slots = kinds[0].slots
    max_len, lens = slots.max_len, slots.ran
    warm = slots.warm_slot() if slots.free_slots and slots.eager_tokens else None
    job: Job = []
    for k, books in enumerate(kinds):
        g, pages = books.geometry, books.slot_pages
        want = [(s, g.pages_for(min(lens[s] + ahead, max_len))) for s in edge]
        if warm is not None and not books.holes(warm):  # (holes: its next request empties it first)
            want.append((warm, g.pages_for(min(int(slots.eager_tokens), max_len))))
        job += [(k, s, t) for s, t in want if t > len(pages[s])]
    return job


def premap(premapper: Premapper, kinds: Sequence[SlotBooks], mappers: Sequence[Mapper], edge: list[int], ahead: int,
           limit: int, background: bool) -> Exception | None:
    """After a step: hand what the next iterations will want (`plan_premap`) to the worker, or
    map it now without one (`background=False`: the same books, the tests rely on that).
    Returns the error of mapping now (best effort), or None."""
    job = plan_premap(kinds, edge, ahead)
    if not job or premapper.busy:  # busy: a step beside the worker; the next one plans again
        return None
    if background:
        premapper.submit(job)
        return None
    try:
        map_ahead(mappers, job, limit)
    except Exception as e:
        return e
    return None


def map_ahead(mappers: Sequence[Mapper], job: Job, limit: int, worker: Premapper | None = None) -> None:
    """Map spare (or newly created, within `limit` bytes) groups into the job's slots, a
    kind's `worker_batch` at a time; never reclaims. Lock held on entry. On the `worker` it is released
    around each driver call: nothing else changes `slot_pages` meanwhile (only calls that
    stop the worker first do), and the batch's groups sit in `in_flight` until committed."""
    background = worker is not None
    for k, s, target in job:
        mapper = mappers[k]
        books = mapper.books
        g, physical = books.geometry, books.physical
        batch = worker_batch(g.num_buffers)
        while not (background and worker.stopped):
            have = len(books.slot_pages[s])
            n = min(target - have, batch)
            if n <= 0:
                break
            if len(physical.spare) < n:
                try:
                    mapper.grow(n - len(physical.spare), background, limit=limit)
                except OutOfPhysicalMemoryError:
                    pass  # a shortage now: pre-map what is spare; step tries again later
                n = min(n, len(physical.spare))
                if n == 0 or (background and worker.stopped):
                    return
            groups = physical.take_spare(n)
            offsets = [g.page_offset(s, have + i) for i in range(n)]
            books.in_flight = groups
            try:
                with books.unlocked(background):
                    physical.map(offsets, groups)
            except BaseException:
                physical.spare.extend(reversed(groups))  # the map was atomic
                raise
            finally:
                books.in_flight = []
            books.slot_pages[s].extend(groups)
            books.refs.update(dict.fromkeys(groups, 1))
            books.pages_changed(s)
            books.note_dirty([s] * n, groups)


class Premapper:
    """One worker thread that carries out the jobs it is given, one at a time.

    Its interface is small: `run(job)` is called with `lock` held (it may drop it around
    driver calls, and stops between batches once `stopped`); `on_error(e)` hears what a job
    raised. `quiesce` (lock held) stops the job after the batch in flight and waits for it;
    `cancel` may be set without the lock (a caller that wants the lock soon tells the worker
    to stop early).
    """

    def __init__(self, lock: threading.Lock, run: Callable[[Job], None],
                 on_error: Callable[[BaseException], None]) -> None:
        self.cv = threading.Condition(lock)
        self.job: Job = []
        self.busy = False
        self.cancel = False
        self.closed = False
        self.thread: threading.Thread | None = None
        self._run = run
        self._on_error = on_error

    def submit(self, job: Job) -> None:
        """Start `job` on the worker thread (lock held)."""
        self.job, self.cancel, self.busy = job, False, True
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name="vattn-premap", daemon=True)
            self.thread.start()
        self.cv.notify_all()

    def quiesce(self) -> None:
        """Stop the job after its current batch and wait for it (lock held)."""
        self.cancel = True
        while self.busy:
            self.cv.wait()

    def wait(self) -> None:
        """Wait until the job is done, without stopping it (lock held)."""
        while self.busy:
            self.cv.wait()

    @property
    def stopped(self) -> bool:
        return self.cancel or self.closed

    def is_worker(self) -> bool:
        return self.thread is not None and threading.current_thread() is self.thread

    def close(self) -> None:
        """End the thread once its job stopped (lock held; `join` after releasing it)."""
        self.closed = True
        self.cv.notify_all()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def _loop(self) -> None:
        with self.cv:
            while not self.closed:
                if not self.busy:
                    self.cv.wait()
                    continue
                try:
                    self._run(self.job)
                except Exception as e:  # step() will meet the same error synchronously
                    self._on_error(e)
                self.job, self.busy = [], False
                self.cv.notify_all()
