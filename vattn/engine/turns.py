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

import threading
from typing import Any


class TurnLock:
    """A non-reentrant lock (`with lock:`) whose holder can let the waiting threads in.

    Uncontended, entering costs one `Lock.acquire(blocking=False)`; only a thread that has to
    wait is counted (under a second, short-held lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._arrived = 0  # threads that had to wait, counted when they started waiting
        self._entered = 0  # of those, the ones that got the lock (or gave up: an interrupt)

    def __enter__(self) -> TurnLock:
        if self._lock.acquire(blocking=False):
            return self
        with self._cond:
            self._arrived += 1
        try:
            self._lock.acquire()
        finally:  # a KeyboardInterrupt in acquire: no longer waiting, nobody waits for it
            with self._cond:
                self._entered += 1
                self._cond.notify_all()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def hand_over(self) -> None:
        """Wait (not holding the lock) until every thread that was waiting for it has had
        it. Returns at once when nobody waits."""
        if self._entered == self._arrived:  # read without the lock: one that arrives later is let in next time
            return
        with self._cond:
            due = self._arrived
            self._cond.wait_for(lambda: self._entered >= due)
