"""The engine's lock lets a waiting thread in between two iterations of a stepping loop.

A plain `threading.Lock` does not: the stepping thread takes it back before the waiter runs,
and an abort from another thread could wait out a whole `generate` (CI saw the abort find its
request finished)."""
from __future__ import annotations

import threading
import time

import pytest

from vattn.engine.turns import TurnLock

STEPS = 400
WORK = 2000  # an iteration's Python work, done holding the lock and the GIL (the engine's scheduling, postprocess)


def test_a_waiting_thread_gets_the_lock_within_one_iteration() -> None:
    """A thread that asks for the lock once, while another steps 400 times in a row, gets it
    after the iteration under way. (With a plain Lock it waited up to 287 iterations in 8 of
    30 tries; counted in iterations, never timed.)"""
    for _ in range(20):
        lock, steps = TurnLock(), [0]

        def loop() -> None:
            for _ in range(STEPS):
                with lock:
                    steps[0] += 1
                    sum(range(WORK))
                lock.hand_over()

        stepper = threading.Thread(target=loop)
        stepper.start()
        while steps[0] < 3:
            time.sleep(0.0001)
        seen = steps[0]
        with lock:
            waited = steps[0] - seen  # the stepper's iterations between our asking and our turn
        stepper.join(60)
        assert not stepper.is_alive() and steps[0] == STEPS
        assert waited <= 2, f"waited {waited} iterations of the stepping thread"


def test_hand_over_without_waiters_returns_at_once_and_the_lock_is_not_reentrant() -> None:
    lock = TurnLock()
    lock.hand_over()
    with lock:
        assert lock.locked()
        assert not lock._lock.acquire(blocking=False)
    assert not lock.locked()


def test_an_interrupted_waiter_is_not_waited_for() -> None:
    """A waiter whose acquire raises (KeyboardInterrupt in the main thread) leaves the count:
    the stepper's next hand_over does not wait for it forever."""
    lock = TurnLock()

    class Interrupted(BaseException):
        pass

    class Raising:
        def acquire(self, blocking: bool = True) -> bool:
            if not blocking:
                return False
            raise Interrupted

    real, lock._lock = lock._lock, Raising()
    with pytest.raises(Interrupted):
        with lock:
            pass
    lock._lock = real
    done = threading.Event()
    t = threading.Thread(target=lambda: (lock.hand_over(), done.set()))
    t.start()
    t.join(10)
    assert done.is_set()
