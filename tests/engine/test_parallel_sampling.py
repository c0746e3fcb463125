"""Parallel sampling (`SamplingParams(n=...)`): one prefill, then the request forks into n
samples. Greedy samples equal transformers' greedy output; seeded sample i draws what a
request with seed + i draws alone; preemption, chunked prefill, a shortage of slots and
aborts keep that true."""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.helpers import (  # noqa: E402
    MAX_TOKENS,
    PAGE,
    PROMPT_LENS,
    FakeKV,
    fake_advance,
    make_seq,
    prompts,
    reference,
    run_online,
    tiny_config,
)

from vattn.engine import LLM, SamplingParams  # noqa: E402
from vattn.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from vattn.engine.sampling_params import MAX_N  # noqa: E402
from vattn.engine.sequence import SequenceStatus  # noqa: E402
from vattn.errors import InvalidRequestError  # noqa: E402

NS = (3, 1, 4, 2, 2, 3)  # samples per prompt


def spy(llm: LLM) -> dict[str, int]:
    """Count the tokens the engine computes and the forks it makes."""
    counts = {"tokens": 0, "forks": 0}
    schedule, fork = llm.scheduler.schedule, llm.cache.fork

    def counting_schedule() -> Any:
        out = schedule()
        counts["tokens"] += out.num_batched_tokens
        return out

    def counting_fork(reqid: int, num_tokens: int) -> int:
        counts["forks"] += 1
        return fork(reqid, num_tokens)

    llm.scheduler.schedule = counting_schedule
    llm.cache.fork = counting_fork
    return counts


def greedy_n() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, n=n) for m, n in zip(MAX_TOKENS, NS)]


def assert_greedy_samples(outs: list, ref: tuple = None) -> None:
    ref = reference() if ref is None else ref
    for out, r, n in zip(outs, ref, NS):
        assert out.finished and len(out.outputs) == n
        assert [o.index for o in out.outputs] == list(range(n))
        for o in out.outputs:
            assert o.token_ids == list(r) and o.finish_reason in ("stop", "length") and o.error is None


def test_greedy_samples_match_transformers_with_one_prefill() -> None:
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=16) as llm:
        counts = spy(llm)
        outs = run_online(llm, prompts(), greedy_n())
        assert llm.num_preemptions == 0
        llm.cache.allocator.check_invariants()
    assert_greedy_samples(outs)
    # each prompt computed once; every sample computes its own tokens but the last
    assert counts["forks"] == sum(NS) - len(NS)
    lens = [len(r) for r in reference()]
    assert counts["tokens"] == sum(p + n * (m - 1) for p, n, m in zip(PROMPT_LENS, NS, lens))
    for out in outs:  # the single-completion fields are sample 0's
        assert out.token_ids == out.outputs[0].token_ids and out.finish_reason == out.outputs[0].finish_reason
        assert out.metrics.num_output_tokens == sum(len(o.token_ids) for o in out.outputs)


@pytest.mark.parametrize("layout", ["per-layer", "fused"])
@pytest.mark.parametrize("setting", ["preempt", "chunked+preempt", "few-slots"])
def test_greedy_samples_under_pressure(setting: str, layout: str) -> None:
    """A budget that forces preemptions (samples recompute or fork again), prompts split into
    chunks, and fewer slots than samples (they wait, then fork or recompute)."""
    kw: dict[str, Any] = {
        "preempt": dict(max_batch_size=6, physical_memory=96 << 10),
        "chunked+preempt": dict(max_batch_size=6, physical_memory=96 << 10, max_num_batched_tokens=16),
        "few-slots": dict(max_batch_size=2),
    }[setting]
    with LLM(tiny_config(), seed=0, page_size=PAGE, layout=layout, **kw) as llm:
        counts = spy(llm)
        outs = run_online(llm, prompts(), greedy_n())
        if setting != "few-slots":
            assert llm.num_preemptions > 0
        assert counts["forks"] > 0
        assert llm.cache.num_free_reqids == llm.config.max_batch_size
        llm.cache.allocator.check_invariants()
    assert_greedy_samples(outs)


def seeded(seed: int, n: int = 1, **kw: Any) -> SamplingParams:
    args = dict(temperature=0.9, top_p=0.95, max_tokens=14, ignore_eos=True)
    return SamplingParams(**{**args, **kw}, seed=seed, n=n)


def test_seeded_samples_are_independent_runs_with_seed_plus_index() -> None:
    ps = prompts()
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=8) as llm:
        alone = [llm.generate(ps[2], seeded(100 + i))[0].token_ids for i in range(4)]
        together = llm.generate(ps[2], seeded(100, n=4))[0]
        again = llm.generate(ps[2], seeded(100, n=4))[0]
        top_k = llm.generate([ps[1], ps[1]], [seeded(-5, n=2, top_k=7), seeded(2**64 - 4, top_k=7)])
    assert [o.token_ids for o in together.outputs] == alone
    assert len(set(map(tuple, alone))) > 1  # the samples differ
    assert [o.token_ids for o in again.outputs] == alone
    assert top_k[0].outputs[1].token_ids == top_k[1].token_ids  # -5 + 1 == 2**64 - 4 (mod 2**64)
    # crowded, preempting, few slots: the same tokens
    params = [seeded(100, n=4, max_tokens=30)] + [seeded(7 + i, n=n, max_tokens=30) for i, n in enumerate(NS[1:])]
    batch = [ps[2]] + ps[1:]
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=5, physical_memory=64 << 10) as llm:
        outs = run_online(llm, batch, params)
        assert llm.num_preemptions > 0
    assert [o.token_ids[:14] for o in outs[0].outputs] == alone


def test_samples_stop_on_their_own_and_the_request_when_all_did() -> None:
    p = prompts()[3]
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=8) as llm:
        free = [llm.generate(p, seeded(50 + i, max_tokens=40))[0].token_ids for i in range(5)]
        stop = max(set(free[0]), key=free[0].count)  # a token some samples produce, at different places
        alone = [llm.generate(p, seeded(50 + i, max_tokens=40, stop_token_ids=[stop]))[0] for i in range(5)]
        rid = llm.add_request(p, seeded(50, n=5, max_tokens=40, stop_token_ids=[stop]))
        seen = []
        while llm.has_unfinished():
            seen += [o for o in llm.step() if o.request_id == rid]
    final = seen[-1]
    assert [o.finished for o in seen] == [False] * (len(seen) - 1) + [True]
    assert [o.token_ids for o in final.outputs] == [a.token_ids for a in alone]
    assert [o.finish_reason for o in final.outputs] == [a.finish_reason for a in alone]
    assert alone[0].finish_reason == "stop" and len({len(a.token_ids) for a in alone}) > 1
    # a sample that finished is reported, unchanged, while its siblings go on
    lens = [len(o.token_ids) for o in final.outputs]
    shortest = lens.index(min(lens))
    done_early = [o for o in seen if o.outputs[shortest].finished]
    assert len(done_early) > 1 and all(o.outputs[shortest] == final.outputs[shortest] for o in done_early)


def test_max_tokens_one_and_more_samples_than_slots() -> None:
    ps, ref = prompts(), reference()
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=1) as llm:
        one = llm.generate(ps[0], SamplingParams(temperature=0, max_tokens=1, n=3))[0]
        many = llm.generate(ps[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[1], n=3))[0]
        llm.cache.allocator.check_invariants()
    assert [o.token_ids for o in one.outputs] == [list(ref[0][:1])] * 3  # finished when sampled
    assert [o.finish_reason for o in one.outputs] == ["length"] * 3
    assert [o.token_ids for o in many.outputs] == [list(ref[1])] * 3  # one slot: they recompute in turn


def test_abort_a_request_aborts_every_sample() -> None:
    ps = prompts()
    long = SamplingParams(temperature=0.8, max_tokens=60, ignore_eos=True, n=3, seed=1)
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4, max_num_batched_tokens=32) as llm:
        before = llm.add_request(ps[4], long)  # aborted before its prompt (70 tokens) is sampled
        outs = {o.request_id: o for o in llm.step()}
        assert [s.status for s in llm.scheduler.requests[before][1:]] == [SequenceStatus.PENDING] * 2
        assert llm.abort_request(before) == [before]
        after = llm.add_request(ps[0], long)
        while sum(s.request_id == after and s.num_output_tokens >= 2 for s in llm.scheduler.running) < 3:
            outs.update({o.request_id: o for o in llm.step()})
        assert {s.request_id for s in llm.scheduler.running} == {after}
        assert llm.abort_request([after, after]) == [after]
        outs.update({o.request_id: o for o in llm.step()})
        assert not llm.has_unfinished()
        assert llm.cache.num_free_reqids == 4 and llm.runner.sampler.generators == {}
        llm.cache.allocator.check_invariants()
    assert [o.finish_reason for o in outs[before].outputs] == ["abort"] * 3
    assert all(o.token_ids == [] for o in outs[before].outputs)
    assert [o.finish_reason for o in outs[after].outputs] == ["abort"] * 3
    assert all(len(o.token_ids) >= 2 for o in outs[after].outputs) and outs[after].finished


def test_each_sample_has_its_text() -> None:
    class Words:
        def encode(self, text: str) -> list[int]:
            return [int(w) for w in text.split()]

        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return " ".join(map(str, ids))

    p = prompts()[1]
    with LLM(tiny_config(), tokenizer=Words(), seed=0, page_size=PAGE) as llm:
        out = llm.generate(" ".join(map(str, p)), seeded(3, n=3))[0]
    assert [o.text for o in out.outputs] == [" ".join(map(str, o.token_ids)) for o in out.outputs]
    assert out.text == out.outputs[0].text


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True, MAX_N + 1, 10**6])
def test_bad_n(n: Any) -> None:
    with pytest.raises(InvalidRequestError, match=r"n must be an int in \[1, 1024\]"):
        SamplingParams(n=n)
    assert SamplingParams(n=MAX_N).n == MAX_N


# ------------------------------------------------------------ the scheduler alone ----
def test_scheduler_fans_out_then_forks_into_free_slots() -> None:
    kv = FakeKV(3)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=8), kv)
    a = make_seq(0, 10, max_tokens=5, n=4)
    sched.add(a)
    b = make_seq(1, 3, max_tokens=5)
    sched.add(b)
    kids = a.samples[1:]
    assert [s.status for s in kids] == [SequenceStatus.PENDING] * 3 and list(sched.waiting) == [a, b]
    out = sched.schedule()  # the prompt in two chunks: no fan-out yet
    assert [(s.seq, s.num_new_tokens, s.fan_out) for s in out.scheduled] == [(a, 8, ())]
    fake_advance(sched, out)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens, s.fan_out) for s in out.scheduled] == [(a, 2, tuple(kids)), (b, 3, ())]
    fake_advance(sched, out, token=9)
    assert [s.token_ids[-1] for s in a.samples] == [9] * 4
    assert list(sched.waiting) == kids  # before nothing: they arrived with request 0
    out = sched.schedule()  # one slot left: one sample forks from a, the others wait
    assert kv.forks == [(a.slot, 10, kids[0].slot)]
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1), (kids[0], 1)]
    assert kids[0].num_computed_tokens == 10 and list(sched.waiting) == kids[1:]
    fake_advance(sched, out)
    for _ in range(3):
        fake_advance(sched, sched.schedule())
    assert b.is_finished and a.is_finished  # max_tokens; kids[0] had its first token from a's row
    assert kids[0].is_finished
    out = sched.schedule()  # no sibling holds the prompt any more: the others recompute it
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(kids[1], 8)]
    assert len(kv.forks) == 1
    while sched.has_unfinished():
        fake_advance(sched, sched.schedule())
    assert all(s.num_output_tokens == 5 for s in a.samples) and sorted(kv.free) == [0, 1, 2]


def test_a_failed_sample_makes_its_request_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sample that fails (here its sampling raises) is an error of the request too, naming
    the sample: never hidden behind sample 0's "length" (issue 30)."""
    from vattn.engine.sampler import Sampler

    real = Sampler.draw

    def failing(self: Sampler, probs: Any, seq_id: tuple[int, int], p: SamplingParams) -> Any:
        if seq_id[1] == 2:
            raise RuntimeError("injected")
        return real(self, probs, seq_id, p)

    monkeypatch.setattr(Sampler, "draw", failing)
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4) as llm:
        out = llm.generate(prompts()[1], SamplingParams(temperature=0.8, seed=5, max_tokens=6, n=3))[0]
    assert [o.finish_reason for o in out.outputs] == ["length", "length", "error"]
    assert out.finish_reason == "error" and out.error.startswith(f"sample 2 of request {out.request_id}: ")
    assert "injected" in out.error and out.token_ids == out.outputs[0].token_ids and len(out.token_ids) == 6
