"""Fault injection: every backend call fails on demand, in turn, wherever the allocator makes
it (a step, reclamation, background pre-mapping, close). After each failure the books are
consistent, the live requests' data is intact (a page of theirs unmapped would fault this
process), the next calls work, and close gives every page and mapping back."""
from __future__ import annotations

import gc
import random
import sys
import warnings
from typing import Any

import pytest

import vattn
from tests.conftest import SMALL, check, fill, vattn_mappings
from vattn.vmem.host import HostBackend

CALLS = ("reserve", "create", "map", "unmap", "release", "fence", "wait")
# Allocator methods that name the phase a backend call belongs to (innermost first).
PHASES = ("map_ahead", "unmap_tails", "map_slots", "grow", "close", "step", "reserve_physical", "__init__")


class Injected(vattn.BackendError):
    pass


class FaultyBackend:
    """Wraps a backend; the `ordinal`-th call of `name` raises before doing anything (the
    backends' calls are all-or-nothing). Records in which allocator phase it fired. The host
    has no asynchronous work, so fences are tokens here: `wait` is called as on a GPU."""

    _FENCE = object()

    def __init__(self, inner: Any, name: str | None = None, ordinal: int = 0) -> None:
        self.inner, self.name, self.ordinal = inner, name, ordinal
        self.counts = dict.fromkeys(CALLS, 0)
        self.fired_in: str | None = None

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def _call(self, name: str) -> None:
        self.counts[name] += 1
        if name == self.name and self.counts[name] == self.ordinal:
            frame = sys._getframe(2)
            while frame is not None and frame.f_code.co_name not in PHASES:
                frame = frame.f_back
            self.fired_in = frame.f_code.co_name if frame is not None else "?"
            raise Injected(f"cu{name}", 999, "INJECTED")

    def reserve(self, *a):
        self._call("reserve")
        return self.inner.reserve(*a)

    def create(self, *a):
        self._call("create")
        return self.inner.create(*a)

    def map(self, *a):
        self._call("map")
        return self.inner.map(*a)

    def unmap(self, *a):
        self._call("unmap")
        return self.inner.unmap(*a)

    def release(self, *a):
        self._call("release")
        return self.inner.release(*a)

    def fence(self):
        self._call("fence")
        inner = self.inner.fence()
        return self._FENCE if inner is None else inner

    def wait(self, fence):
        self._call("wait")
        if fence is not self._FENCE:
            self.inner.wait(fence)


def _workload(c: vattn.KVCache, seed: int, iters: int = 60) -> int:
    """Random arrivals, growth and frees under a tight budget (reclamation and pre-mapping
    happen). Every API call may fail with the injected error; the data of the live
    requests is checked after every call. Returns the number of failed calls."""
    rng = random.Random(seed)
    live: dict[int, tuple[int, int]] = {}  # reqid -> (length, tag)
    failures, tag = 0, 0
    for _ in range(iters):
        try:
            if live and rng.random() < 0.25:
                r = rng.choice(sorted(live))
                c.free_reqid(r)
                del live[r]
            elif c.num_free_reqids and rng.random() < 0.4:
                tag += 1
                live[c.alloc_reqid()] = (0, tag)
            lens = {r: min(n + rng.choice([1, 1, 7, 40, 90]), 512) for r, (n, _) in live.items()}
            res = c.step(lens)
            for r in res.failed:  # not backed: the caller preempts
                c.free_reqid(r)
                del live[r]
            for r, (n, t) in list(live.items()):
                fill(c, r, n, lens[r], t)
                live[r] = (lens[r], t)
        except Injected:
            failures += 1
        for r, (n, t) in live.items():
            check(c, r, n, t)
        c.allocator.check_invariants()
    return failures


def _run(name: str | None, ordinal: int, background: bool, seed: int = 0) -> FaultyBackend:
    be = FaultyBackend(HostBackend(), name, ordinal)
    try:
        c = vattn.KVCache(**SMALL, backend=be, page_size=4096, physical_memory=40 * 2 * 2 * 4096,
                          background=background)
    except Injected:
        assert name == "reserve" and be.counts["create"] == 0
        be.inner.close()
        return be
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "background pre-mapping failed"
        _workload(c, seed)
        c.synchronize()
        c.allocator.check_invariants()
        try:
            c.close()
        except Injected:
            pass
    c.close()  # idempotent, also after a failed close
    assert be.inner._fd == -1 and be.inner._live == 0  # every page group released
    return be


@pytest.fixture(scope="module")
def call_counts() -> dict[bool, dict[str, int]]:
    """How often each call happens in a fault-free run (background and synchronous)."""
    return {bg: _run(None, 0, bg).counts for bg in (True, False)}


@pytest.mark.parametrize("background", [True, False], ids=["background", "sync"])
@pytest.mark.parametrize("name", CALLS)
def test_every_call_fails_in_turn(name, background, call_counts, phases_seen):
    gc.collect()
    base = vattn_mappings()
    n = call_counts[background][name]
    assert n > 0, f"the workload never calls {name}"
    ordinals = sorted({*range(1, min(n, 8) + 1), n // 3, n // 2, n - 1, n} - {0})
    for k in ordinals:
        be = _run(name, k, background)
        if be.fired_in is not None:
            phases_seen.add((name, be.fired_in))
    gc.collect()
    assert vattn_mappings() == base  # no mapping and no memfd left behind


@pytest.fixture(scope="module")
def phases_seen() -> set:
    return set()


def test_faults_reached_every_phase(phases_seen):
    # Runs after the parametrized test above (same module, definition order).
    if not phases_seen:
        pytest.skip("run with test_every_call_fails_in_turn")
    expected = {("map", "map_slots"), ("map", "map_ahead"), ("unmap", "unmap_tails"), ("unmap", "close"),
                ("create", "grow"), ("fence", "step"), ("fence", "close"), ("wait", "unmap_tails"),
                ("wait", "close"), ("release", "close"), ("reserve", "__init__")}
    assert expected <= phases_seen, expected - phases_seen
