"""Random step / fork / free / swap / prefix pins / snapshots over every layer kind (full
attention, a sliding window, recurrent states; per-layer layout) under a tight budget,
against a simple model (issue 30). After every rule: a slot a step failed kept its length
and its pages, every page a live slot can read holds what was written there (the host
faults on an unmapped page), the books agree, and the pages are the budget's."""
from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import vattn
from tests.alloc.test_state_machine import INDEX, pick
from tests.conftest import fill

B, L, PAGE, W = 3, 96, 4096, 12  # 1 head x 128 dims x fp32 = 512 B a token: 8 tokens a page, 12 pages a slot
TPP = PAGE // 512
UNIT = 2 * 2 * PAGE + PAGE  # one page of every buffer: K and V of the full and the window layer, the states
STATE_BYTES = 3000  # one page of states a slot


def readable(n: int, layer: int) -> tuple[int, int]:
    """The tokens of a slot of length n that its next query reads, in `layer` (0: full, 1: window)."""
    return (0, n) if layer == 0 else (max(0, n - W + 1), n)


class KindsMachine(RuleBasedStateMachine):
    background = False

    def __init__(self) -> None:
        super().__init__()
        self.budget = vattn.Budget(10 * UNIT)
        self.cache = vattn.KVCache(num_layers=2, num_kv_heads=1, head_dim=128, max_batch_size=B, max_context_len=L,
                                   dtype="float32", device="cpu", page_size=PAGE, layer_windows=(None, W),
                                   physical_memory=12 * UNIT, background=self.background, prefetch=True,
                                   prefetch_tokens=4, state_bytes=STATE_BYTES, num_snapshots=2, budget=self.budget)
        self.alloc = self.cache.allocator
        self.rows = self.cache.state_rows()  # [B + 2, PAGE] uint8
        self.lens: dict[int, int] = {}  # active reqid -> tokens written (and backed)
        self.segs: dict[int, list[tuple[int, int, int]]] = {}  # reqid -> (start, end, tag) it holds
        self.state: dict[int, int | None] = {}  # reqid -> the byte its state row holds (None: unknown)
        self.restoring: dict[int, int] = {}  # reqid -> the byte its first step restores from a snapshot
        self.tag = 0
        self.swapped: list[tuple] = []  # (handle, segs, state byte)
        self.pinned: list[tuple] = []  # (handles, segs they hold)
        self.snapshots: list[tuple] = []  # (snapshot handle, the byte it holds)

    def teardown(self) -> None:
        for r in list(self.lens):
            self.cache.free_reqid(r)
        self.cache.trim()
        assert self.alloc.layer.created_bytes == 0 and self.budget.used == 0  # every page went back
        self.cache.close()
        assert self.budget.used == 0

    def _new_tag(self) -> int:
        self.tag += 1
        return self.tag

    def _admit(self, r: int, n: int, segs: list, state: int | None) -> None:
        assert r not in self.lens and 0 <= r < B
        self.lens[r], self.segs[r], self.state[r] = n, segs, state

    def _forget(self, r: int) -> None:
        del self.lens[r], self.segs[r], self.state[r]
        self.restoring.pop(r, None)

    @initialize(lens=st.lists(st.integers(min_value=1, max_value=L), min_size=1, max_size=B))
    def start(self, lens: list[int]) -> None:
        """Requests of these lengths (those the budget holds) to start from."""
        for n in lens:
            self.alloc_reqid()
            self.step([True] * B, [n if r == max(self.lens) else 0 for r in range(B)])

    # Every draw has the same bounds whatever the state and no rule has a precondition (see
    # tests/alloc/test_state_machine.py): a rule that does not apply does nothing.
    @rule()
    def alloc_reqid(self) -> None:
        if len(self.lens) == B:
            with pytest.raises(vattn.NoFreeSlotError):
                self.cache.alloc_reqid()
            return
        self._admit(self.cache.alloc_reqid(), 0, [], None)

    @rule(i=INDEX)
    def free_reqid(self, i: int) -> None:
        if self.lens:
            r = pick(sorted(self.lens), i)
            self.cache.free_reqid(r)
            self._forget(r)

    @rule(scheduled=st.lists(st.booleans(), min_size=B, max_size=B),
          grow=st.lists(st.integers(min_value=0, max_value=40), min_size=B, max_size=B))
    def step(self, scheduled: list[bool], grow: list[int]) -> None:
        new = {r: min(L, n + grow[r]) for r, n in self.lens.items() if scheduled[r] and n + grow[r] > 0}
        kinds = self.alloc.kinds
        before = {r: [(k.books.slot_pages[r][:k.geometry.pages_for(self.lens[r])], k.books.lead[r]) for k in kinds]
                  for r in new if self.lens[r]}
        res = self.cache.step(new)
        assert set(res.failed) <= set(new)
        for r, n in new.items():
            if r in res.failed:  # it moved nowhere: its length, its pages in every kind
                assert self.alloc.num_tokens(r) == self.lens[r]
                if r in before:
                    assert [(k.books.slot_pages[r][:k.geometry.pages_for(self.lens[r])], k.books.lead[r])
                            for k in kinds] == before[r], r
                continue
            assert self.alloc.num_tokens(r) == max(n, self.lens[r])
            if r in self.restoring and n > self.lens[r]:  # its first step copied the snapshot in
                assert int(self.rows[r, 0]) == self.restoring.pop(r)
            if n > self.lens[r]:
                tag = self._new_tag()
                fill(self.cache, r, self.lens[r], n, tag)
                self.segs[r].append((self.lens[r], n, tag))
                self.rows[r, :STATE_BYTES] = tag % 251  # what the state layers write
                self.state[r] = tag % 251
                self.lens[r] = n

    @rule(i=INDEX, short=st.booleans())
    def fork(self, i: int, short: bool) -> None:
        # (a prefix mapped into a slot brings no states: it can be forked once it ran)
        parents = sorted(r for r, n in self.lens.items() if n > 1 and self.state[r] is not None and r not in self.restoring)
        if len(self.lens) == B or not parents:
            return
        parent = pick(parents, i)
        n = self.lens[parent]
        if short:  # recurrent states are right at their slot's length only
            assert not self.cache.can_fork(parent, n - 1)
            with pytest.raises(vattn.InvalidRequestError, match="recurrent states"):
                self.cache.fork(parent, n - 1)
            return
        assert self.cache.can_fork(parent, n)
        try:
            child = self.cache.fork(parent, n)
        except vattn.OutOfPhysicalMemoryError:
            return
        self._admit(child, n, list(self.segs[parent]), self.state[parent])

    @rule(i=INDEX)
    def swap_out(self, i: int) -> None:
        held = sorted(r for r, n in self.lens.items() if n and r not in self.restoring)
        if not held:
            return
        r = pick(held, i)
        if self.state[r] is None:  # a prefix mapped into it brings no states: nothing to park before it ran
            with pytest.raises(vattn.InvalidRequestError, match="no recurrent states yet"):
                self.cache.swap_out(r, self.lens[r])
            return
        handle = self.cache.swap_out(r, self.lens[r])
        self.swapped.append((handle, self.segs[r], self.state[r]))
        self._forget(r)

    @rule(i=INDEX)
    def swap_in(self, i: int) -> None:
        if not self.swapped:
            return
        handle, segs, state = pick(self.swapped, i)
        try:
            r = self.cache.swap_in(handle)
        except (vattn.NoFreeSlotError, vattn.OutOfPhysicalMemoryError):
            return
        self.swapped.remove((handle, segs, state))
        self._admit(r, handle.num_tokens, list(segs), state)

    @rule(i=INDEX)
    def pin(self, i: int) -> None:
        held = sorted(r for r, n in self.lens.items() if n >= TPP)
        if held:
            r = pick(held, i)
            k = self.lens[r] // TPP
            self.pinned.append((self.cache.pin(r, k), [(a, min(b, k * TPP), t) for a, b, t in self.segs[r]
                                                       if a < k * TPP]))

    @rule(i=INDEX)
    def map_pinned(self, i: int) -> None:
        if not self.pinned or len(self.lens) == B:
            return
        handles, segs = pick(self.pinned, i)
        r = self.cache.alloc_reqid()
        n = self.cache.map_pinned(r, handles)
        assert n % TPP == 0 and n <= len(handles) * TPP
        self._admit(r, n, [(a, min(b, n), t) for a, b, t in segs if a < n], None)  # (no states: unknown)

    @rule(i=INDEX)
    def snapshot(self, i: int) -> None:
        held = sorted(r for r, n in self.lens.items() if n and self.state[r] is not None)
        if held:
            r = pick(held, i)
            row = self.cache.snapshots.capture(r)
            if row is not None:
                assert int(self.rows[row, 0]) == self.state[r]
                self.snapshots.append((self.cache.snapshots.pin(row), self.state[r]))

    @rule(i=INDEX)
    def restore_snapshot(self, i: int) -> None:
        if not self.snapshots or len(self.lens) == B:
            return
        handle, value = pick(self.snapshots, i)
        r = self.cache.alloc_reqid()
        self._admit(r, 0, [], None)
        if self.cache.snapshots.restore(r, handle):
            self.restoring[r] = value
        else:
            assert not self.cache.snapshots.is_pinned(handle)  # evicted for memory: a miss

    @invariant()
    def books_agree_and_what_is_read_is_there(self) -> None:
        self.alloc.check_invariants()
        self.cache.synchronize()  # (the worker takes a group's bytes from the budget before it books the group)
        assert self.alloc.layer.created_bytes == self.budget.used <= 10 * UNIT
        for r, n in self.lens.items():
            for layer in (0, 1):
                lo, hi = readable(n, layer)
                for a, b, tag in self.segs[r]:
                    a, b = max(a, lo), min(b, hi)
                    if a < b:
                        pos = torch.arange(a, b, dtype=torch.float32)
                        val = (tag * 1000 + layer * 100 + pos % 97)[:, None, None]
                        assert torch.equal(self.cache.k_cache(layer)[r, a:b], val.expand(b - a, 1, 128)), (r, layer)
                        assert torch.equal(self.cache.v_cache(layer)[r, a:b], -val.expand(b - a, 1, 128)), (r, layer)
            if n and self.state[r] is not None and r not in self.restoring:
                assert int(self.rows[r, :STATE_BYTES].min()) == int(self.rows[r, :STATE_BYTES].max()) == self.state[r]


class BackgroundKindsMachine(KindsMachine):
    background = True


TestKinds = KindsMachine.TestCase
TestKinds.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)
TestKindsBackground = BackgroundKindsMachine.TestCase
TestKindsBackground.settings = settings(max_examples=30, stateful_step_count=60, deadline=None)


@pytest.mark.parametrize("machine", [KindsMachine, BackgroundKindsMachine], ids=["sync", "background"])
@pytest.mark.parametrize("seed", range(3))
def test_long_random_traces(machine: type[KindsMachine], seed: int) -> None:
    """The same rules in long seeded runs (hypothesis's runs are short; these reach full
    slots, forks of forks, evicted snapshots and prefixes)."""
    import random

    rng = random.Random(seed)
    m = machine()
    rules = [m.alloc_reqid, m.free_reqid, m.step, m.fork, m.swap_out, m.swap_in, m.pin, m.map_pinned, m.snapshot,
             m.restore_snapshot]
    try:
        for _ in range(300):
            rule = rng.choice(rules)
            if rule == m.step:
                m.step([rng.random() < 0.7 for _ in range(B)], [rng.randrange(41) for _ in range(B)])
            elif rule == m.fork:
                m.fork(rng.randrange(1 << 16), rng.random() < 0.2)
            elif rule == m.alloc_reqid:
                m.alloc_reqid()
            else:
                rule(rng.randrange(1 << 16))
            m.books_agree_and_what_is_read_is_there()
    finally:
        m.teardown()
