"""The engine's lock lets a waiting thread in between two iterations of a stepping loop.

A plain `threading.Lock` does not: the stepping thread takes it back before the waiter runs,
and an abort from another thread could wait out a whole `generate` (CI saw the abort find its
request finished)."""
from __future__ import annotations

import inspect
import sys
import threading
import time

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
    """A waiter interrupted while it waits (a KeyboardInterrupt landing on any line of
    `__enter__` up to its blocking acquire, where a waiting thread spends its time) leaves no
    trace: the stepper's next hand_over returns at once, not after its patience (here 60 s),
    and never hangs."""
    src, first = inspect.getsourcelines(TurnLock.__enter__)
    body = [(first + i, text.strip()) for i, text in enumerate(src)]
    last = next(n for n, text in body if text == "self._lock.acquire()")
    lines = [n for n, text in body if n <= last and text and text != "return self" and not text.startswith(("def", '"'))]
    assert len(lines) >= 5
    for at in lines:
        lock, release = TurnLock(patience_s=60), threading.Event()
        held = threading.Event()

        def stepper() -> None:  # holds the lock while the waiter is interrupted
            with lock:
                held.set()
                release.wait(10)

        t = threading.Thread(target=stepper)
        t.start()
        held.wait(10)

        def tracer(frame, event, arg, at=at):
            if frame.f_code is not TurnLock.__enter__.__code__:
                return None

            def local(frame, event, arg):
                if event == "line" and frame.f_lineno == at:
                    raise KeyboardInterrupt(f"at line {at}")
                return local
            return local

        sys.settrace(tracer)
        try:
            with lock:
                raise AssertionError(f"entered although interrupted at line {at}")
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        release.set()
        t.join(10)
        done = threading.Event()
        threading.Thread(target=lambda: (lock.hand_over(), done.set()), daemon=True).start()
        assert done.wait(10), f"hand_over hung after an interrupt at line {at} of __enter__"
        assert not lock._waiting and not lock.locked()
