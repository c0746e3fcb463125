"""The scheduler alone, on a fake cache: budgets, chunked prefill, preemption, random workloads."""
from __future__ import annotations

import pytest
from tests.helpers import FakeKV, fake_advance, make_seq
from hypothesis import given, settings
from hypothesis import strategies as st

from vattn.engine.scheduler import Scheduler, SchedulerConfig
from vattn.engine.sequence import SequenceStatus
from vattn.errors import FatalEngineError, InvalidConfigError


def test_scheduler_decodes_first_then_prefill_chunks() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), FakeKV(4))
    a, b = make_seq(0, 5, max_tokens=20), make_seq(1, 6, max_tokens=20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 5), (b, 6)]
    fake_advance(sched, out)
    long = make_seq(2, 100)
    sched.add(long)
    for i in range(7):  # two decodes every iteration, the long prompt in chunks of 14
        out = sched.schedule()
        assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1), (long, 14)]
        assert long.num_computed_tokens == 14 * i
        fake_advance(sched, out)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1), (long, 2)]
    assert sched.kv.steps[-1] == {a.slot: a.num_tokens, b.slot: b.num_tokens, long.slot: 100}


def test_scheduler_preempts_newest_and_aborts_what_cannot_fit_alone() -> None:
    kv = FakeKV(4, capacity=30)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    a, b, c = make_seq(0, 10), make_seq(1, 10), make_seq(2, 9)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a, b, c]
    fake_advance(sched, out)  # 11 + 11 + 10 tokens > 30: the next step must preempt c
    out = sched.schedule()
    assert out.preempted == [c] and [s.seq for s in out.scheduled] == [a, b]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and c.num_tokens == 10
    assert c.num_preemptions == 1 and c.slot is None and list(sched.waiting) == [c]
    fake_advance(sched, out)
    kv.capacity = 11
    out = sched.schedule()  # c is admitted again, then c and b (newest first) are preempted,
    assert out.preempted == [c, b] and out.finished == [a] and out.scheduled == []  # a alone (12) does not fit
    assert c.num_preemptions == 1 and b.num_preemptions == 1  # c had nothing computed this time
    assert a.finish_reason == "error" and a.status is SequenceStatus.FINISHED
    assert list(sched.waiting) == [b, c] and sched.running == []
    assert sorted(kv.free) == [0, 1, 2, 3]


def test_scheduler_respects_max_num_seqs_and_slots() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), FakeKV(3))
    seqs = [make_seq(i, 4) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    fake_advance(sched, out)
    sched.finish(seqs[0], "length")
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [seqs[1], seqs[2]]


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=10),
       slots=st.integers(1, 4), budget=st.integers(4, 48), capacity=st.integers(20, 120))
def test_scheduler_random_workloads_finish(lens: list, slots: int, budget: int, capacity: int) -> None:
    """Any workload ends: every request gets its tokens or (too big even alone) an error;
    the budget and the slots hold every iteration and no slot leaks."""
    kv = FakeKV(slots, capacity)
    sched = Scheduler(SchedulerConfig(max_num_seqs=min(slots, budget), max_num_batched_tokens=budget), kv)
    seqs = [make_seq(i, n, m) for i, (n, m, _) in enumerate(lens)]
    it = 0
    while any(not s.is_finished for s in seqs):
        for s, (_, _, arrival) in zip(seqs, lens):
            if arrival == it:
                sched.add(s)
        out = sched.schedule()
        assert out.num_batched_tokens <= budget and len(sched.running) <= slots
        fake_advance(sched, out)  # finishes those that reach max_tokens
        it += 1
        assert it < 2000
    for s in seqs:
        if s.finish_reason == "error":
            assert s.num_prompt_tokens + s.params.max_tokens > capacity
        else:
            assert s.num_output_tokens == s.params.max_tokens
    assert sorted(kv.free) == list(range(slots)) and not sched.has_unfinished()


def test_scheduler_config_validation() -> None:
    with pytest.raises(InvalidConfigError):
        SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=8)
    with pytest.raises(InvalidConfigError):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)



def test_waiting_queue_keeps_request_order() -> None:
    """New requests go to the back and preempted ones to the front in O(1); an id out of
    order (a test's or a client's own numbering) is put in place."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), FakeKV(4))
    for i in (3, 5, 9, 0, 7, 4):
        sched.add(make_seq(i, 4))
    assert [s.request_id for s in sched.waiting] == [0, 3, 4, 5, 7, 9]
    out = sched.schedule()
    fake_advance(sched, out)
    assert [s.seq.request_id for s in out.scheduled] == [0, 3, 4, 5]
    for s in sorted(sched.running, key=lambda s: -s.request_id):  # newest first, as victims go
        sched.preempt(s)
    assert [s.request_id for s in sched.waiting] == [0, 3, 4, 5, 7, 9]


class FakePrefix:
    """Maps up to `hit` tokens of any lookup (the fake cache has no data to get wrong)."""

    def __init__(self, hit: int) -> None:
        self.hit = hit

    def map_prefix(self, reqid: int, token_ids: list[int]) -> int:
        return min(self.hit, len(token_ids) - 1)

    def insert(self, reqid: int, token_ids: list[int]) -> None:
        pass


@settings(max_examples=80, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 6), st.integers(1, 4)),
                     min_size=1, max_size=8),
       slots=st.integers(1, 5), budget=st.integers(5, 48), capacity=st.integers(20, 160),
       mode=st.sampled_from(["recompute", "swap"]), hit=st.sampled_from([0, 8]))
def test_scheduler_random_workloads_with_samples_swaps_and_prefixes(
        reqs: list, slots: int, budget: int, capacity: int, mode: str, hit: int) -> None:
    """Parallel samples (fan-out, forks), swapping and prefix hits under random pressure:
    every sample ends with its tokens or (too big even alone) an error; the budget, the
    seats and the slots hold every iteration; nothing leaks (slots, host copies)."""
    kv = FakeKV(slots, capacity)
    config = SchedulerConfig(max_num_seqs=min(slots, budget), max_num_batched_tokens=budget, preemption_mode=mode)
    sched = Scheduler(config, kv, prefix_cache=FakePrefix(hit) if hit else None)
    seqs = [make_seq(i, n, m, n=k) for i, (n, m, _, k) in enumerate(reqs)]
    it = 0
    while any(not s.is_finished for seq in seqs for s in seq.samples):
        for s, (_, _, arrival, _) in zip(seqs, reqs):
            if arrival == it:
                sched.add(s)
        out = sched.schedule()
        assert out.num_batched_tokens <= budget and len(sched.running) <= config.max_num_seqs
        assert len({s.seq.slot for s in out.scheduled}) == len(out.scheduled)
        assert all(s.status.value == "running" for s in sched.running)
        fake_advance(sched, out)
        it += 1
        assert it < 3000
    for seq in seqs:
        assert len(seq.samples) == seq.params.n
        for s in seq.samples:
            if s.finish_reason == "error":
                assert s.num_prompt_tokens + s.params.max_tokens > capacity
            else:
                assert s.num_output_tokens == s.params.max_tokens and s.swap is None
    assert sorted(kv.free) == list(range(slots)) and not sched.has_unfinished() and not sched.requests
    if mode == "recompute":
        assert not kv.swaps


class _Fatal(FatalEngineError):
    """What a failed tensor-parallel collective raises (TensorParallelError derives from it)."""


def test_fatal_engine_errors_propagate_from_the_cache() -> None:
    """A FatalEngineError from the cache is no cache failure: no preemption, no failure
    counted, no fallback; it leaves schedule() as it is (a peer rank died, say)."""
    kv = FakeKV(4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    a = make_seq(0, 5, max_tokens=4, n=2)
    sched.add(a)
    fake_advance(sched, sched.schedule())  # a's prompt is computed: sample 1 waits for a fork

    def fatal(*_args):
        raise _Fatal("the group failed")

    kv.fork = fatal
    with pytest.raises(_Fatal):
        sched.schedule()
    del kv.fork
    kv.step = fatal
    with pytest.raises(_Fatal):
        sched.schedule()
    assert sched.num_preemptions == 0 and a.num_preemptions == 0
    assert all(s.num_failures == 0 for s in a.samples)
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens == 5


class PlanningKV(FakeKV):
    """FakeKV that can tell before a step whether it fits (`KVCache.can_step`)."""

    def can_step(self, seq_lens: dict[int, int]) -> bool:
        return self.capacity is None or sum(seq_lens.values()) <= self.capacity


class CountingPrefix(FakePrefix):
    """FakePrefix that counts its lookups as PrefixCache does (`uncount` takes one back) and
    records the `fits` it was given for each."""

    def __init__(self, hit: int, restorable: int = 0) -> None:
        super().__init__(hit)
        self.restorable = restorable  # tokens a lower tier holds past the device's `hit`
        self.num_query_tokens = 0
        self.counted: dict[int, int] = {}
        self.restored: list[int] = []  # tokens restored by each lookup

    def map_prefix(self, reqid: int, token_ids: list[int], fits=None) -> int:
        n = super().map_prefix(reqid, token_ids)
        top = min(n + self.restorable, len(token_ids) - 1)
        end = top if fits is None or fits(top) else n  # (all or nothing: enough for these tests)
        self.restored.append(end - n)
        self.num_query_tokens += len(token_ids)
        self.counted[reqid] = len(token_ids)
        return end

    def uncount(self, reqid: int) -> None:
        self.num_query_tokens -= self.counted.pop(reqid, 0)


def test_a_request_that_cannot_run_beside_the_running_ones_waits() -> None:
    """Admission is planned with the step: a waiting request whose lookup and first chunk do
    not fit beside the running sequences is left waiting (its lookup not counted, nothing
    restored), the running ones are never preempted for it, and it runs once they finish."""
    kv = PlanningKV(4, capacity=40)
    prefix = CountingPrefix(hit=0, restorable=16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, prefix_cache=prefix)
    a, b = make_seq(0, 20, max_tokens=4), make_seq(1, 24, max_tokens=2)
    sched.add(a)
    out = sched.schedule()
    fake_advance(sched, out)
    sched.add(b)  # 16 restorable + 8: with a's 21 tokens, more than 40
    for _ in range(3):
        out = sched.schedule()
        assert [s.seq for s in out.scheduled] == [a] and out.preempted == [] and list(sched.waiting) == [b]
        fake_advance(sched, out)
    assert a.is_finished and sched.num_preemptions == 0 and sched.num_admissions_held == 3
    assert prefix.restored == [16, 0, 0, 0] and prefix.num_query_tokens == 20  # a's lookup only
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, 8)] and prefix.restored[-1] == 16
    assert prefix.num_query_tokens == 44


def test_a_failed_step_sends_the_admission_back_before_preempting_a_running_sequence() -> None:
    """Without `can_step` (the step decides): an older request admitted again that the step
    cannot back goes back to waiting (no preemption, its lookup uncounted) instead of
    preempting the newer running sequence."""
    kv = FakeKV(4, capacity=30)
    prefix = CountingPrefix(hit=0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv, prefix_cache=prefix)
    old, new = make_seq(0, 10, max_tokens=8), make_seq(1, 10, max_tokens=8)
    sched.add(old)
    sched.add(new)
    fake_advance(sched, sched.schedule())
    sched.preempt(old)  # (as if memory had run short): it waits at the front, older than `new`
    queried = prefix.num_query_tokens
    kv.capacity = 21  # new's next decode (11 tokens) and old's 11 do not fit together
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [new] and out.preempted == [old]
    assert sched.num_unadmitted == 1 and sched.num_preemptions == 1 and new.num_preemptions == 0
    assert prefix.num_query_tokens == queried
