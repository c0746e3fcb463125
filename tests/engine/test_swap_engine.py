"""Preemption by swapping (`LLM(..., preemption_mode="swap")`): a sequence preempted for
memory copies its computed tokens to host memory and comes back with them, without
recomputing; greedy outputs equal recomputation's and transformers' own."""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.helpers import (  # noqa: E402
    PAGE,
    FakeKV,
    assert_matches,
    fake_advance,
    greedy_params,
    make_seq,
    prompts,
    reference,
    run_online,
    tiny_config,
)

from vattn.engine import LLM, SamplingParams  # noqa: E402
from vattn.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from vattn.errors import InvalidConfigError, OutOfPhysicalMemoryError  # noqa: E402


def spy(llm: LLM) -> dict[str, Any]:
    counts: dict[str, Any] = {"tokens": 0, "out": 0, "in": [], "bytes": 0}
    schedule, swap_out, swap_in = llm.scheduler.schedule, llm.cache.swap_out, llm.cache.swap_in

    def counting_schedule() -> Any:
        out = schedule()
        counts["tokens"] += out.num_batched_tokens
        return out

    def counting_out(reqid: int, n: int) -> Any:
        handle = swap_out(reqid, n)
        counts["out"] += 1
        counts["bytes"] += handle.nbytes
        return handle

    def counting_in(handle: Any) -> int:
        slot = swap_in(handle)
        counts["in"].append(handle.copied_in)
        return slot

    llm.scheduler.schedule = counting_schedule
    llm.cache.swap_out, llm.cache.swap_in = counting_out, counting_in
    return counts


@pytest.mark.parametrize("budget", [1024, 16], ids=["whole-prompts", "chunked"])
@pytest.mark.parametrize("layout", ["per-layer", "fused"])
def test_swap_and_recompute_give_the_same_greedy_tokens(layout: str, budget: int) -> None:
    runs = {}
    for mode in ("recompute", "swap"):
        with LLM(tiny_config(), seed=0, page_size=PAGE, layout=layout, max_batch_size=4,
                 physical_memory=80 << 10, max_num_batched_tokens=budget, preemption_mode=mode) as llm:
            counts = spy(llm)
            outs = run_online(llm, prompts(), greedy_params())
            assert llm.num_preemptions > 0
            assert sum(o.num_preemptions for o in outs) == llm.num_preemptions
            assert llm.cache.num_free_reqids == 4
            llm.cache.allocator.check_invariants()
        assert_matches(outs, reference())
        runs[mode] = counts
        assert llm.config.preemption_mode == mode
    assert runs["recompute"]["out"] == 0 and runs["recompute"]["in"] == []
    swap = runs["swap"]
    assert swap["out"] > 0 and len(swap["in"]) >= swap["out"] and swap["bytes"] > 0
    assert swap["tokens"] < runs["recompute"]["tokens"]  # nothing is computed twice


def test_a_swapped_sequence_whose_slot_nobody_took_comes_back_without_a_copy() -> None:
    ps, params = prompts(), greedy_params()
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4, preemption_mode="swap") as llm:
        counts = spy(llm)
        ids = [llm.add_request(p, sp) for p, sp in zip(ps[:3], params[:3])]
        done = {}
        for it in range(200):
            if it in (3, 6):  # what a shortage of memory does, with memory to spare
                victim = max(llm.scheduler.running, key=lambda s: s.seq_id)
                llm.scheduler.preempt(victim)
                assert victim.swap is not None and victim.slot is None
            done.update({o.request_id: o for o in llm.step() if o.finished})
            if not llm.has_unfinished():
                break
        assert counts["out"] == 2 and counts["in"] == [False, False]
        llm.cache.allocator.check_invariants()
    assert_matches([done[i] for i in ids], reference()[:3])
    assert [done[i].num_preemptions for i in ids] == [0, 0, 2]


def test_swap_keeps_seeded_sampling_and_parallel_samples() -> None:
    ps = prompts()
    sp = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=m, seed=10 + i, n=1 + i % 3, ignore_eos=True)
          for i, m in enumerate((12, 20, 8, 24, 16, 22))]
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=16) as llm:
        want = llm.generate(ps, sp)
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=5, physical_memory=80 << 10,
             preemption_mode="swap") as llm:
        counts = spy(llm)
        forks = []
        fork = llm.cache.fork
        llm.cache.fork = lambda *a: forks.append(a) or fork(*a)
        outs = run_online(llm, ps, sp)
        assert llm.scheduler.num_swapped_out > 0 and counts["out"] > 0
        assert forks  # samples share their prompt's pages in swap mode too
        llm.cache.allocator.check_invariants()
    assert [[o.token_ids for o in out.outputs] for out in outs] == [[o.token_ids for o in w.outputs] for w in want]


def test_bad_preemption_mode() -> None:
    with pytest.raises(InvalidConfigError, match="preemption_mode"):
        LLM(tiny_config(), preemption_mode="disk")


# A swap-in that has to copy never writes into pages its new slot shares with a running request
# or with the prefix cache: the slot drops them first.
def test_cache_swap_in_copy_keeps_a_forked_live_request_intact() -> None:
    import vattn
    from tests.conftest import SMALL, check, fill

    with vattn.KVCache(**{**SMALL, "device": "cpu", "page_size": 4096, "prefetch": False}) as c:
        b, p = c.alloc_reqid(), c.alloc_reqid()
        assert c.step({b: 64, p: 64})
        fill(c, b, 0, 64, 2)
        fill(c, p, 0, 64, 1)
        c.free_reqid(c.fork(p, 64))  # a finished sample: its free slot still maps p's pages
        h = c.swap_out(b, 64)
        d = c.alloc_reqid()  # takes b's old slot: the swap-in has to copy
        assert c.step({d: 64})
        c.swap_in(h)
        assert h.copied_in
        check(c, p, 64, 1)  # p is running: its pages must be intact


def test_cache_swap_in_copy_keeps_pinned_prefix_pages_intact() -> None:
    import vattn
    from tests.conftest import SMALL, check, fill

    with vattn.KVCache(**{**SMALL, "device": "cpu", "page_size": 4096, "prefetch": False}) as c:
        b, a = c.alloc_reqid(), c.alloc_reqid()
        assert c.step({a: 64, b: 64})
        fill(c, a, 0, 64, 1)
        fill(c, b, 0, 64, 2)
        handles = c.pin(a, 2)
        c.free_reqid(a)
        h = c.swap_out(b, 64)
        d = c.alloc_reqid()
        assert c.step({d: 64})
        c.swap_in(h)
        assert h.copied_in
        e = c.alloc_reqid()
        assert c.map_pinned(e, handles) == 64
        check(c, e, 64, 1)  # the prefix cache's pages must hold a's tokens


# ------------------------------------------------------------ the scheduler alone ----
def decode_until_preempted(sched: Scheduler) -> Any:
    for _ in range(100):
        out = sched.schedule()
        if out.preempted:
            return out
        fake_advance(sched, out)
    raise AssertionError("no preemption")


def test_scheduler_swaps_out_and_back_in() -> None:
    kv = FakeKV(3, capacity=40)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, preemption_mode="swap"), kv)
    a, b = make_seq(0, 10, max_tokens=30), make_seq(1, 8, max_tokens=30)
    sched.add(a)
    sched.add(b)
    out = decode_until_preempted(sched)  # 10 + k + 8 + k > 40
    assert out.preempted == [b] and b.swap is not None and b.num_computed_tokens == 0
    computed = b.num_tokens - 1
    assert kv.swaps == [("out", 1, computed)] and b.num_preemptions == 1 and sched.num_swapped_out == 1
    kv.capacity = 100
    out = sched.schedule()  # b swaps back in with its tokens computed: one decode
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1)]
    assert kv.swaps[-1] == ("in", b.slot, computed) and b.num_computed_tokens == computed
    fake_advance(sched, out)
    assert b.swap is None  # it ran: the host copy is stale


def test_scheduler_swap_in_waits_for_memory_or_recomputes_when_nothing_runs() -> None:
    kv = FakeKV(3, capacity=40)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, preemption_mode="swap"), kv)
    a, b, c = make_seq(0, 10, max_tokens=30), make_seq(1, 8, max_tokens=30), make_seq(2, 4, max_tokens=30)
    sched.add(a)
    sched.add(b)
    decode_until_preempted(sched)
    sched.add(c)
    kv.swap_in_error = OutOfPhysicalMemoryError("injected")
    out = sched.schedule()  # b cannot come back: it waits, and c behind it too (FCFS)
    assert [s.seq for s in out.scheduled] == [a] and list(sched.waiting) == [b, c]
    fake_advance(sched, out)
    sched.abort([0])
    out = sched.schedule()  # nothing runs that could free memory: b recomputes
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(b, b.num_tokens), (c, 4)]
    assert b.swap is None


def test_scheduler_keeps_the_host_copy_of_a_sequence_preempted_before_it_ran() -> None:
    kv = FakeKV(3, capacity=40)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64, preemption_mode="swap"), kv)
    a, b = make_seq(0, 10, max_tokens=30), make_seq(1, 8, max_tokens=30)
    sched.add(a)
    sched.add(b)
    decode_until_preempted(sched)
    handle = b.swap
    out = sched.schedule()  # b swaps in, does not fit, and is sent back before it ran
    assert out.preempted == [b] and b.swap is handle
    assert [op for op, _, _ in kv.swaps] == ["out", "in"] and b.num_preemptions == 1
    sched.abort([1])
    assert b.swap is None and sorted(kv.free) == [1, 2]


def test_a_handle_swapped_in_then_freed_before_any_write_can_be_swapped_in_again() -> None:
    """What the scheduler relies on when a sequence swapped in is preempted before it ran:
    freeing the slot and swapping the same handle in again gives back the same tokens."""
    import vattn
    from tests.conftest import SMALL, check, fill

    with vattn.KVCache(**{**SMALL, "device": "cpu", "page_size": 4096, "prefetch": False}) as c:
        a = c.alloc_reqid()
        assert c.step({a: 100})
        fill(c, a, 0, 100, 1)
        h = c.swap_out(a, 100)
        r = c.swap_in(h)
        c.free_reqid(r)  # preempted again before it ran
        b = c.alloc_reqid()  # someone else takes the slot and writes over it
        assert c.step({b: 200})
        fill(c, b, 0, 200, 2)
        r = c.swap_in(h)
        assert h.copied_in is True
        check(c, r, 100, 1)
        check(c, b, 200, 2)
        c.allocator.check_invariants()
