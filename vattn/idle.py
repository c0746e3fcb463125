"""The idle policy, written once: give memory back after `delay` seconds without work.

Every owner of pages that goes idle uses it: the engine (`LLM(idle_trim_s=)`), transformers'
continuous batching (`hf_cb.enable(idle_trim_s=)`, `vattn serve --idle-trim-s`), and the vLLM
and SGLang integrations (`VATTN_VLLM_IDLE_TRIM_S`, `VATTN_SGLANG_IDLE_TRIM_S`). An owner says
when work begins (`note_busy`), when it runs out (`note_idle`) or that a moment of work just
happened (`touch`); `due()` says whether the trim is owed, once per idle period
(`note_trimmed`):

    work ──note_busy──▶ busy ──note_idle──▶ idle since t ──(t + delay)──▶ due ──note_trimmed──▶ done
                          ▲                                                                      │
                          └─────────────────────────── note_busy / touch ◀───────────────────────┘

Owners whose engine calls them while idle (vLLM's and SGLang's idle hooks) ask `due()` there;
owners nobody calls while idle (`LLM`, `hf_cb`) `start` a thread that calls them back at the
deadline. Time is read from `clock` (`time.monotonic` unless a test passes a stand-in), so
the policy is tested by moving a fake clock, not by sleeping.

The rule for a delay (`delay_seconds`): seconds >= 0, 0 at once; None means never, and so do
infinity and more seconds than a timer can wait (`threading.TIMEOUT_MAX`, about 292 years); a
negative number means never where the setting says so (environment variables, the integrations'
settings) and is an error otherwise (`LLM`); NaN and anything not a number are errors.
"""
from __future__ import annotations

import math
import threading
import time
import weakref
from typing import Any, Callable

from vattn.errors import InvalidConfigError

MAX_DELAY = threading.TIMEOUT_MAX  # longer means never (a timer's wait raises OverflowError past it)
MAX_WAIT_S = 3600.0  # the thread looks at the clock at least this often (a clock may jump)


def delay_seconds(value: Any, name: str = "idle_trim_s", *, negative_means_never: bool = True) -> float | None:
    """`value` by the idle-trim rule (see the module docstring): seconds >= 0, or None for never."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:  # NaN
        never = "None or negative: never" if negative_means_never else "None: never"
        raise InvalidConfigError(f"{name} must be a number of seconds ({never}), got {value!r}")
    if value < 0:
        if negative_means_never:
            return None
        raise InvalidConfigError(f"{name} must be None or a number of seconds >= 0, got {value!r}")
    if value > MAX_DELAY:  # an int too large for a float, infinity, or past what a timer can wait
        return None
    return float(value)


class IdleTrim:
    """One owner's idle policy: whether its trim is due, and optionally a thread that calls
    the owner back when it is.

    `delay`: seconds without work before the trim (None: never; by `delay_seconds`). `clock`:
    seconds, monotonic (tests pass a stand-in they move). State, read freely: `idle_since`
    (the clock when the current idle period began; None while busy) and `trimmed` (this
    period's trim is done). Calls may come from any thread: `note_busy` and `touch` (the
    owners' hot paths) are plain assignments unless the deadline comes nearer, and a trim
    run twice by a race is harmless (it finds nothing left to give)."""

    def __init__(self, delay: float | None = None, clock: Callable[[], float] = time.monotonic, *,
                 name: str = "vattn-idle-trim") -> None:
        self.clock = clock
        self.name = name  # the thread's
        self.idle_since: float | None = None
        self.trimmed = False
        self.thread: threading.Thread | None = None
        self._delay = delay
        self._cond = threading.Condition()  # wakes the thread when the deadline comes nearer
        self._stop: threading.Event | None = None  # the running thread's
        self._run_lock = threading.Lock()  # one callback at a time (the thread and `poll` callers)
        self._trim: Callable[[], Callable[[], Any] | None] | None = None
        self._retry_s = 1.0

    # ------------------------------------------------------------------ state ----
    @property
    def delay(self) -> float | None:
        return self._delay

    @delay.setter
    def delay(self, value: float | None) -> None:
        if value != self._delay:
            self._delay = value
            self.wake()

    def note_busy(self) -> None:
        """Work began: not idle; the next idle period may trim again."""
        self.idle_since, self.trimmed = None, False

    def note_idle(self) -> None:
        """No work is left: idle from now, unless idle already."""
        if self.idle_since is None:
            self.idle_since = self.clock()
            self.wake()

    def touch(self) -> None:
        """A moment of work (a block handed out or given back): idle again from now, and the
        idle period that follows may trim again."""
        nearer = self.idle_since is None or self.trimmed  # the deadline was none: it comes nearer
        self.idle_since, self.trimmed = self.clock(), False
        if nearer:
            self.wake()

    def note_trimmed(self) -> None:
        """This idle period's trim is done (or was tried): none again until work."""
        self.trimmed = True

    def rearm(self) -> None:
        """The trim is owed again in this idle period (a lower limit left more to give)."""
        if self.trimmed:
            self.trimmed = False
            self.wake()

    def deadline(self) -> float | None:
        """The clock at which the trim is due; None: not idle, trimmed already, or never."""
        since, delay = self.idle_since, self._delay
        if delay is None or since is None or self.trimmed:
            return None
        return since + delay

    def seconds_left(self) -> float | None:
        """Seconds until the trim is due (0: due now); None: no trim is coming."""
        at = self.deadline()
        return None if at is None else min(MAX_DELAY, max(0.0, at - self.clock()))

    def due(self) -> bool:
        """Whether the trim is owed now: idle for `delay`, not trimmed this period."""
        return self.seconds_left() == 0.0

    # ---------------------------------------------------------------- the thread ----
    def start(self, trim: Callable[[], Any], retry_s: float | None = None) -> None:
        """Run a thread (named `name`, a daemon) that calls `trim()` whenever the trim is due;
        `trim` decides (it may decline, e.g. while requests are in flight) and calls
        `note_trimmed`. Declined, it is called again every `retry_s` while due (default:
        delay / 4, within [0.02, 1] s). A bound method is held weakly: the thread ends with
        its owner. No-op while a thread runs; `stop` ends it."""
        with self._cond:
            if self.thread is not None and self.thread.is_alive() and self._stop is not None \
                    and not self._stop.is_set():
                return
            self._trim = _weak(trim, self.stop)
            self._retry_s = retry_s if retry_s is not None else max(0.02, min(1.0, (self._delay or 4.0) / 4))
            self._stop = stop = threading.Event()  # an old thread keeps its own (set) event and ends
            self.thread = threading.Thread(target=self._run, args=(stop,), name=self.name, daemon=True)
            self.thread.start()

    def stop(self) -> None:
        """End the thread (it exits at once, or after a callback in progress). No join: an
        owner may stop it while holding the lock its callback takes."""
        with self._cond:
            if self._stop is not None:
                self._stop.set()
            self._cond.notify_all()

    def wake(self) -> None:
        """Make the thread look at the clock again now (the deadline came nearer, or a test
        moved its clock)."""
        with self._cond:
            self._cond.notify_all()

    def poll(self) -> bool:
        """What the thread does at the deadline, on the caller's thread: call the owner's
        `trim` if the trim is due (one caller at a time). Returns whether it called it."""
        with self._run_lock:
            trim = self._trim() if self._trim is not None else None
            if trim is None or not self.due():
                return False
            trim()
            return True

    def _wait_s(self) -> float | None:
        """How long the thread sleeps before it looks again (None: until woken; 0: now)."""
        left = self.seconds_left()
        return None if left is None else min(left, MAX_WAIT_S)

    def _run(self, stop: threading.Event) -> None:
        declined = False
        while True:
            with self._cond:
                if stop.is_set():
                    return
                wait = self._retry_s if declined else self._wait_s()
                if wait is None or wait > 0:
                    self._cond.wait(wait)
                    declined = False
                    continue
            if stop.is_set():
                return
            self.poll()
            declined = self.due()  # the owner declined (busy): ask again after retry_s


def _weak(fn: Callable[[], Any], on_gone: Callable[[], None]) -> Callable[[], Callable[[], Any] | None]:
    """A reference to `fn` that does not keep a bound method's object alive (it then calls
    `on_gone` when the object goes)."""
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):
        ref = weakref.WeakMethod(fn)
        weakref.finalize(fn.__self__, on_gone)
        return ref
    return lambda: fn
