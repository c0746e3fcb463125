"""`TurnLock`: the engine's lock, handed over in turn to the threads that wait for it.

A thread that steps in a loop (`LLM.generate`, a server's `step()` loop) releases the
engine's lock between two iterations and takes it again at once. A plain `threading.Lock`
is not fair: the releasing thread takes it back before a waiter the release woke runs, so an
`abort_request` or `add_request` from another thread can wait out the whole generate (the
abort then finds its request finished). With `TurnLock` the stepping thread calls
`hand_over()` after each iteration: every thread already waiting gets the lock before the
stepper takes it again.

```
stepper:  [step] hand_over: waits ....... | [step] [step]
other:        arrives -> blocked   [abort]
```
Plain Python (no torch).
"""
from __future__ import annotations

import itertools
import threading
from typing import Any


class TurnLock:
    """A non-reentrant lock (`with lock:`) whose holder can let the waiting threads in.

    Uncontended, entering costs one `Lock.acquire(blocking=False)`; only a thread that has to
    wait is counted (under a second, short-held lock)."""

    def __init__(self, patience_s: float = 1.0) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._tickets = itertools.count()
        self._waiting: set[int] = set()  # a ticket per thread waiting for the lock
        # the longest hand_over waits: a waiter that a third thread's long hold keeps out
        # costs the stepper no more (a backstop: nothing can make a waiter wait for it)
        self.patience_s = patience_s

    def __enter__(self) -> TurnLock:
        if self._lock.acquire(blocking=False):
            return self
        ticket = next(self._tickets)
        try:
            with self._cond:
                self._waiting.add(ticket)
            self._lock.acquire()
        finally:  # also on a KeyboardInterrupt anywhere in here: no longer waiting
            with self._cond:
                self._waiting.discard(ticket)
                self._cond.notify_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def hand_over(self) -> None:
        """Wait (not holding the lock) until every thread that was waiting for it has had
        it, at most `patience_s`. Returns at once when nobody waits."""
        if not self._waiting:  # read without the lock: one that arrives later is let in next time
            return
        with self._cond:
            due = set(self._waiting)
            self._cond.wait_for(lambda: due.isdisjoint(self._waiting), self.patience_s)
