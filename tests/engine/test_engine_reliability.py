"""Failures inside an iteration and client aborts never poison the engine.

Faults are injected into the sampler, the model's forward and the cache's `step`. After
each: the requests the failure belongs to finish with "error" (or recompute), the others
keep transformers' greedy tokens, no slot or sampler state leaks, the allocator's books
hold, and later calls serve correct tokens.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.helpers import (  # noqa: E402
    MAX_TOKENS,
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
from vattn.engine.scheduler import MAX_FAILURES, Scheduler, SchedulerConfig  # noqa: E402
from vattn.engine.sequence import SequenceStatus  # noqa: E402
from vattn.errors import BackendError, InvalidRequestError  # noqa: E402

POISON = 0  # a token in no prompt and no reference output of the tiny llama


def make_llm(**kw: Any) -> LLM:
    return LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4, **kw)


def assert_healthy(llm: LLM) -> None:
    """Nothing left over, the books hold, and the engine still gives the right tokens."""
    for _ in range(2):
        assert not llm.scheduler.has_unfinished()
        assert llm.cache.num_free_reqids == llm.config.max_batch_size, "a slot leaked"
        assert llm.runner.sampler.generators == {}, "a request's generator leaked"
        llm.cache.allocator.check_invariants()
        assert_matches(llm.generate(prompts()[:3], greedy_params()[:3]), reference()[:3])


def fail_forward(llm: LLM, monkeypatch: Any, when: Any, exc: BaseException | None = None) -> list[bool]:
    """Make the model's forward raise when `when(call_index, input_ids)`; returns, as the
    calls happen, whether each raised."""
    model = llm.runner.model
    real = model.forward
    calls: list[bool] = []

    def forward(*args: Any, **kw: Any) -> Any:
        ids = kw["input_ids"]
        calls.append(bool(when(len(calls), ids)))
        if calls[-1]:
            raise exc if exc is not None else RuntimeError("injected forward failure")
        return real(*args, **kw)

    monkeypatch.setattr(model, "forward", forward)
    return calls


# ------------------------------------------------------------------------ sampling ----
def test_a_request_whose_sampling_raises_fails_alone(monkeypatch: Any) -> None:
    ps = prompts()
    seeded = SamplingParams(temperature=0.9, top_k=20, max_tokens=10, seed=7)
    with make_llm() as llm:
        alone = llm.generate(ps[2], seeded)[0].token_ids
        # A seed that slipped past validation: torch.Generator raises OverflowError/ValueError.
        bad = SamplingParams(temperature=0.9, max_tokens=10)
        object.__setattr__(bad, "seed", 2**70)
        # A second request whose sampling raises on its third token.
        real = llm.runner.sampler.draw
        counts = {"n": 0}

        def draw(probs: Any, sid: Any, p: SamplingParams) -> Any:
            if p.seed == 11:
                counts["n"] += 1
                if counts["n"] == 3:
                    raise RuntimeError("injected sampling failure")
            return real(probs, sid, p)

        monkeypatch.setattr(llm.runner.sampler, "draw", draw)
        params = greedy_params()[:2] + [seeded, bad, SamplingParams(temperature=0.9, max_tokens=10, seed=11)]
        outs = llm.generate([ps[0], ps[1], ps[2], ps[3], ps[4]], params)
        assert_matches(outs[:2], reference()[:2])
        assert outs[2].token_ids == alone and outs[2].finish_reason == "length"
        assert outs[3].finish_reason == "error" and "Overflow" in outs[3].error and outs[3].token_ids == []
        assert outs[4].finish_reason == "error" and "injected sampling failure" in outs[4].error
        assert len(outs[4].token_ids) == 2 and outs[4].finished
        monkeypatch.undo()
        assert_healthy(llm)


# ------------------------------------------------------------------- model forward ----
def test_a_poisoned_request_fails_its_batch_then_alone(monkeypatch: Any) -> None:
    """The forward raises whenever the poisoned prompt is in the batch: the batch is rerun
    one request at a time, the others keep their tokens, the poisoned one errors."""
    assert all(POISON not in r for r in reference()) and all(POISON not in p for p in prompts())
    with make_llm() as llm:
        calls = fail_forward(llm, monkeypatch, lambda i, ids: bool((ids == POISON).any()))
        ps = prompts()[:3] + [[5, POISON, 7, 9]]
        outs = run_online(llm, ps, greedy_params()[:3] + [SamplingParams(temperature=0, max_tokens=5)],
                          arrivals=(0, 0, 2, 2))
        assert_matches(outs[:3], reference()[:3])
        assert outs[3].finish_reason == "error" and outs[3].token_ids == []
        assert "injected forward failure" in outs[3].error and "alone" in outs[3].error
        assert sum(calls) == 2  # its batch, then alone
        monkeypatch.undo()
        assert_healthy(llm)


def test_a_transient_forward_failure_costs_a_rerun_not_a_request(monkeypatch: Any) -> None:
    with make_llm(physical_memory=80 << 10) as llm:  # with preemptions too
        calls = fail_forward(llm, monkeypatch, lambda i, ids: i in (3, 9))
        outs = run_online(llm, prompts(), greedy_params())
        assert_matches(outs, reference())
        assert sum(calls) == 2
        assert llm.num_preemptions > 0
        monkeypatch.undo()
        assert_healthy(llm)


def test_a_broken_forward_fails_requests_and_the_engine_recovers(monkeypatch: Any) -> None:
    with make_llm() as llm:
        fail_forward(llm, monkeypatch, lambda i, ids: True)
        outs = llm.generate(prompts(), greedy_params())
        assert [o.finish_reason for o in outs] == ["error"] * len(outs)
        assert all("injected forward failure" in o.error for o in outs)
        monkeypatch.undo()
        assert_healthy(llm)


# ---------------------------------------------------------------------- cache.step ----
def fail_cache_step(llm: LLM, monkeypatch: Any, when: Any) -> list[int]:
    """Make `llm.cache.step` raise a BackendError when `when(call_index)`."""
    real = llm.cache.step
    calls: list[int] = []

    def step(seq_lens: Any) -> Any:
        calls.append(len(calls))
        if when(calls[-1]):
            raise BackendError("cuMemMap", 2, "CUDA_ERROR_OUT_OF_MEMORY", "injected")
        return real(seq_lens)

    monkeypatch.setattr(llm.cache, "step", step)
    return calls


def test_a_transient_cache_failure_recomputes_the_iteration(monkeypatch: Any) -> None:
    with make_llm(physical_memory=80 << 10) as llm:
        fail_cache_step(llm, monkeypatch, lambda i: i in (4, 12, 30))
        outs = run_online(llm, prompts(), greedy_params())
        assert_matches(outs, reference())
        llm.cache.allocator.check_invariants()
        monkeypatch.undo()
        assert_healthy(llm)


def test_a_broken_cache_fails_requests_after_a_retry_and_the_engine_recovers(monkeypatch: Any) -> None:
    with make_llm() as llm:
        ps = prompts()
        rid = llm.add_request(ps[0], greedy_params()[0])
        for _ in range(3):
            llm.step()  # rid is decoding when the cache breaks
        calls = fail_cache_step(llm, monkeypatch, lambda i: True)
        outs = llm.generate(ps[1:4], greedy_params()[1:4])
        assert [o.finish_reason for o in outs] == ["error"] * 3
        assert all("BackendError" in o.error and "cuMemMap" in o.error and "2 times" in o.error for o in outs)
        assert len(calls) == MAX_FAILURES  # every request was retried once, then failed
        final = [o for o in llm.step() if o.request_id == rid]  # generate kept the other one's output
        assert final and final[0].finish_reason == "error" and len(final[0].token_ids) == 3
        monkeypatch.undo()
        assert_healthy(llm)


def test_scheduler_requeues_then_fails_on_cache_errors() -> None:
    class BrokenKV(FakeKV):
        broken = False

        def step(self, seq_lens: dict[int, int]) -> Any:
            if self.broken:
                raise BackendError("cuMemMap", 2, "CUDA_ERROR_OUT_OF_MEMORY")
            return super().step(seq_lens)

    kv = BrokenKV(3)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64), kv)
    a, b, c = make_seq(0, 5), make_seq(1, 6), make_seq(2, 7)
    for s in (a, b):
        sched.add(s)
    fake_advance(sched, sched.schedule())
    sched.add(c)
    kv.broken = True
    out = sched.schedule()  # a, b decoding and c new: all go back to the queue
    assert out.scheduled == [] and out.finished == [] and out.preempted == [a, b, c]
    assert list(sched.waiting) == [a, b, c] and sorted(kv.free) == [0, 1, 2]
    assert a.num_computed_tokens == 0 and a.num_tokens == 6 and sched.num_preemptions == 0
    kv.broken = False
    out = sched.schedule()  # they recompute; a completed iteration resets the count
    fake_advance(sched, out)  # a completed iteration resets the failure count
    assert [s.seq for s in out.scheduled] == [a, b, c] and a.num_failures == 0
    kv.broken = True
    assert sched.schedule().preempted == [a, b, c]
    out = sched.schedule()
    assert out.finished == [a, b, c] and not sched.has_unfinished()
    assert all(s.finish_reason == "error" and "BackendError" in s.error for s in (a, b, c))
    assert sorted(kv.free) == [0, 1, 2]


def test_a_tokenizer_that_cannot_decode_loses_no_tokens() -> None:
    class BrokenTokenizer:
        def encode(self, text: str) -> list[int]:
            return [int(w) for w in text.split()]

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            raise ValueError("injected decode failure")

    p = prompts()[1]
    with LLM(tiny_config(), tokenizer=BrokenTokenizer(), seed=0, page_size=PAGE) as llm:
        out = llm.generate(" ".join(map(str, p)), SamplingParams(temperature=0, max_tokens=MAX_TOKENS[1]))[0]
    assert out.text is None and out.token_ids == list(reference()[1]) and out.prompt_token_ids == p


# -------------------------------------------------------------- interrupted calls ----
def test_an_interrupted_generate_keeps_other_requests_final_outputs(monkeypatch: Any) -> None:
    """generate reads the final outputs of requests added online; when it is interrupted
    they stay for the next step(), and its own requests are aborted."""
    ps, params = prompts(), greedy_params()
    with make_llm(physical_memory=32 << 10) as llm:  # 64 tokens: prompt 4 (70 + 16) never fits
        too_big = llm.add_request(ps[4], params[4])
        small = llm.add_request(ps[0], params[0])
        small_seq = next(s for s in llm.scheduler.waiting if s.request_id == small)
        fail_forward(llm, monkeypatch, lambda i, ids: small_seq.is_finished, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            llm.generate(ps[1:3], params[1:3])  # small finishes in this call, then the interrupt
        assert llm.scheduler.running == [] and not llm.scheduler.waiting
        assert llm.cache.num_free_reqids == llm.config.max_batch_size
        assert llm.has_unfinished()  # final outputs wait for the next step
        outs = {o.request_id: o for o in llm.step()}
        assert set(outs) == {too_big, small}
        assert outs[too_big].finish_reason == "error" and "physical memory" in outs[too_big].error
        assert outs[small].token_ids == list(reference()[0])
        assert not llm.has_unfinished()
        monkeypatch.undo()
        assert_healthy(llm)


def test_an_interrupted_step_leaves_the_engine_consistent(monkeypatch: Any) -> None:
    with make_llm() as llm:
        calls = fail_forward(llm, monkeypatch, lambda i, ids: i in (0, 5), KeyboardInterrupt())
        ids = [llm.add_request(p, sp) for p, sp in zip(prompts()[:3], greedy_params()[:3])]
        done = {}
        while llm.has_unfinished():
            try:
                done.update({o.request_id: o for o in llm.step() if o.finished})
            except KeyboardInterrupt:
                pass
        assert sum(calls) == 2
        assert_matches([done[i] for i in ids], reference()[:3])
        monkeypatch.undo()
        assert_healthy(llm)


# --------------------------------------------------------------------------- aborts ----
def test_abort_waiting_and_running_requests() -> None:
    ps, params = prompts(), greedy_params()
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=2) as llm:
        ids = [llm.add_request(p, sp) for p, sp in zip(ps[:4], params[:4])]
        for _ in range(4):
            llm.step()
        running = [s.request_id for s in llm.scheduler.running]
        assert running == ids[:2] and [s.request_id for s in llm.scheduler.waiting] == ids[2:]
        assert llm.cache.num_free_reqids == 0
        assert llm.abort_request(ids[1]) == [ids[1]]  # running: its slot is free at once
        assert llm.cache.num_free_reqids == 1
        assert llm.abort_request(np.array([ids[3], 999, ids[1]])) == [ids[3]]  # waiting; unknown; done
        outs = {o.request_id: o for o in llm.step()}
        for rid, n in ((ids[1], 4), (ids[3], 0)):
            assert outs[rid].finished and outs[rid].finish_reason == "abort" and outs[rid].error is None
            assert outs[rid].token_ids == list(reference()[rid][:n])
        done = {}
        while llm.has_unfinished():
            done.update({o.request_id: o for o in llm.step() if o.finished})
        assert_matches([done[ids[0]], done[ids[2]]], (reference()[0], reference()[2]))
        assert llm.abort_request(ids) == [] and llm.abort_request([]) == []
        for bad in ("1", [1, "x"], 1.0, [True], {1: 2}):
            with pytest.raises(InvalidRequestError, match="request"):
                llm.abort_request(bad)
        assert llm.runner.sampler.generators == {}
        assert_healthy(llm)


def test_abort_from_another_thread_during_generate() -> None:
    ps = prompts()
    long = SamplingParams(temperature=0.8, max_tokens=400, ignore_eos=True, seed=3)
    with make_llm() as llm:
        first = llm._next_id  # generate numbers its requests from here, in prompt order
        result: list = []
        worker = threading.Thread(target=lambda: result.extend(
            llm.generate([ps[0], ps[5], ps[1]], [greedy_params()[0], long, greedy_params()[1]])))
        worker.start()
        target = first + 1
        deadline = time.monotonic() + 60
        while not any(s.request_id == target and s.num_output_tokens >= 3 for s in list(llm.scheduler.running)):
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.001)
        assert llm.abort_request(target) == [target]
        worker.join(60)
        assert not worker.is_alive()
        assert result[1].finish_reason == "abort" and 3 <= len(result[1].token_ids) < 400
        assert_matches([result[0], result[2]], (reference()[0], reference()[1]))
        assert_healthy(llm)


def test_finished_sequences_cannot_be_aborted_again() -> None:
    kv = FakeKV(2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16), kv)
    a, b = make_seq(0, 3), make_seq(1, 3)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    sched.finish(a, "length")  # as if it had reached max_tokens
    assert sched.abort([0, 1, 5]) == [b]
    assert a.finish_reason == "length" and b.finish_reason == "abort" and b.status is SequenceStatus.FINISHED
    assert sched.abort([1]) == [] and sorted(kv.free) == [0, 1]
