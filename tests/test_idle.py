"""The idle policy (`vattn.idle`), on a fake clock: when the trim is due, once per idle
period, the thread that calls its owner back, and the rule every owner reads a delay by."""
from __future__ import annotations

import gc
import math
import threading

import pytest

from tests.conftest import FakeClock
from vattn.errors import InvalidConfigError
from vattn.idle import MAX_DELAY, MAX_WAIT_S, IdleTrim, delay_seconds


@pytest.mark.parametrize("value, never_ok, expected", [
    (30, True, 30.0), (0, True, 0.0), (0.25, False, 0.25), (None, True, None), (-1, True, None),
    (-0.5, True, None), (math.inf, True, None), (math.inf, False, None), (2**70, False, None),
    (10**400, True, None), (MAX_DELAY, False, MAX_DELAY), (MAX_DELAY * 2, False, None),
])
def test_one_rule_for_a_delay(value, never_ok, expected):
    assert delay_seconds(value, negative_means_never=never_ok) == expected


@pytest.mark.parametrize("value", [math.nan, "1", True, [1], -1])
def test_a_bad_delay_says_what_it_must_be(value):
    with pytest.raises(InvalidConfigError, match=r"idle_trim_s must be .*seconds"):
        delay_seconds(value, negative_means_never=False)
    if value != -1:
        with pytest.raises(InvalidConfigError, match=r"VATTN_X must be a number of seconds \(None or negative"):
            delay_seconds(value, "VATTN_X")


def test_due_once_per_idle_period():
    clock = FakeClock(1000.0)
    idle = IdleTrim(5.0, clock)
    assert idle.seconds_left() is None and not idle.due()  # busy until told otherwise
    idle.note_idle()
    assert idle.deadline() == 1005.0 and idle.seconds_left() == 5.0
    clock.advance(4.9)
    idle.note_idle()  # idle already: the period does not restart
    assert not idle.due() and idle.seconds_left() == pytest.approx(0.1)
    clock.advance(0.1)
    assert idle.due() and idle.seconds_left() == 0.0
    idle.note_trimmed()
    clock.advance(100)
    assert not idle.due() and idle.deadline() is None  # once per period
    idle.rearm()  # (a lower limit): owed again, in the same period
    assert idle.due()
    idle.note_trimmed()
    idle.note_busy()
    clock.advance(100)
    assert idle.idle_since is None and not idle.due()
    idle.note_idle()
    clock.advance(5)
    assert idle.due()  # a new period trims again
    idle.note_trimmed()
    idle.touch()  # a moment of work: idle again from now, owed again after the delay
    assert idle.idle_since == clock.now and idle.seconds_left() == 5.0
    idle.delay = None
    clock.advance(1e9)
    assert not idle.due() and idle.seconds_left() is None  # never


def test_the_thread_calls_back_at_the_deadline_and_only_then():
    clock = FakeClock(1000.0)
    idle = IdleTrim(30.0, clock)
    calls, called = [], threading.Event()

    def trim():
        calls.append(clock.now)
        idle.note_trimmed()
        called.set()

    idle.start(trim)
    try:
        idle.note_idle()
        assert not idle.poll() and not calls  # not due: nobody is called
        clock.advance(30)
        idle.wake()  # the thread looks at the (moved) clock again
        assert called.wait(30), "the thread did not call back at the deadline"
        assert calls == [1030.0]
        called.clear()
        idle.touch()
        clock.advance(30)
        idle.wake()
        assert called.wait(30)
        assert calls == [1030.0, 1060.0]  # one call per idle period
        assert not idle.poll()
    finally:
        idle.stop()
    idle.thread.join(10)
    assert not idle.thread.is_alive()


def test_a_declined_trim_is_asked_again_and_start_runs_one_thread():
    clock = FakeClock(1000.0)
    idle = IdleTrim(1.0, clock)
    asked, done = [], threading.Event()

    def trim():  # declines the first time (a request in flight), trims the second
        asked.append(1)
        if len(asked) == 2:
            idle.note_trimmed()
            done.set()

    idle.start(trim, retry_s=0.01)
    first = idle.thread
    idle.start(trim)  # running already: no second thread
    assert idle.thread is first
    idle.note_idle()
    clock.advance(1)
    idle.wake()
    assert done.wait(30) and len(asked) == 2
    idle.stop()
    first.join(10)
    assert not first.is_alive()
    idle.start(trim)  # after stop: a new thread
    assert idle.thread is not first and idle.thread.is_alive()
    idle.stop()


def test_the_thread_ends_with_its_owner():
    """A bound method is held weakly: an owner nobody closes is collected, its thread ends."""

    class Owner:
        def __init__(self) -> None:
            self.idle = IdleTrim(30.0, FakeClock(1000.0))
            self.idle.start(self.trim)

        def trim(self) -> None:
            self.idle.note_trimmed()

    owner = Owner()
    thread = owner.idle.thread
    assert thread.is_alive()
    del owner
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_the_thread_never_waits_longer_than_a_timer_can():
    """A delay past what `threading` can wait made the engine's timer thread raise
    OverflowError; the thread waits at most MAX_WAIT_S and looks again."""
    clock = FakeClock(1000.0)
    idle = IdleTrim(MAX_DELAY, clock)
    idle.note_idle()
    assert idle._wait_s() == MAX_WAIT_S
    clock.now = -1e300  # a clock that jumped back
    assert idle.seconds_left() == MAX_DELAY and idle._wait_s() == MAX_WAIT_S
