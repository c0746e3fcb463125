"""The continuous-batching engine on tiny seeded Hugging Face models (CPU, float32).

Greedy outputs must match transformers' own `generate` (its default attention) token for
token, whatever the batching: staggered arrivals, both cache layouts, small pages, a
physical memory budget that forces preemptions, chunked prefill.
"""
from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config  # noqa: E402

from vattn.attention import AttentionMetadata, forward_context, get_forward_context, sdpa_attention  # noqa: E402
from vattn.engine import LLM, RequestOutput, SamplingParams  # noqa: E402
from vattn.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from vattn.engine.sequence import Sequence, SequenceStatus  # noqa: E402
from vattn.errors import (  # noqa: E402
    ClosedError,
    ContextLengthError,
    InvalidConfigError,
    InvalidRequestError,
    VattnError,
)

FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
PROMPT_LENS = (5, 17, 33, 48, 70, 3)
MAX_TOKENS = (12, 20, 8, 24, 16, 22)
ARRIVALS = (0, 0, 2, 3, 3, 7)  # the iteration at which each prompt is added
PAGE = 4096  # 32 tokens per page for the per-layer layout of the tiny models, 16 fused


def tiny_config(family: str = "llama", kv_heads: int = 2, **kw: Any) -> Any:
    return FAMILIES[family](vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                            initializer_range=0.2, **kw)


def build_model(config: Any, seed: int = 0) -> Any:
    """The weights `LLM(config, seed=seed)` builds."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=None)
def reference(family: str = "llama", kv_heads: int = 2, sliding_window: int | None = None) -> tuple:
    """transformers' greedy outputs for `prompts()` (cached per model)."""
    kw = {} if sliding_window is None else {"sliding_window": sliding_window}
    model = build_model(tiny_config(family, kv_heads, **kw))
    return tuple(tuple(hf_greedy(model, p, m)) for p, m in zip(prompts(), MAX_TOKENS))


def run_online(llm: LLM, prompt_list: list, params: list[SamplingParams],
               arrivals: tuple[int, ...] = ARRIVALS) -> list[RequestOutput]:
    """Add each prompt at its arrival iteration, step until all finish; outputs in prompt order."""
    index: dict[int, int] = {}
    done: dict[int, RequestOutput] = {}
    it = 0
    while len(done) < len(prompt_list):
        for i, a in enumerate(arrivals):
            if a == it:
                index[llm.add_request(prompt_list[i], params[i])] = i
        for out in llm.step():
            assert out.request_id in index
            if out.finished:
                done[index[out.request_id]] = out
        it += 1
        assert it < 5000, "the engine does not make progress"
    assert not llm.has_unfinished()
    return [done[i] for i in range(len(prompt_list))]


def assert_matches(outs: list[RequestOutput], ref: tuple) -> None:
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert out.token_ids == list(r), f"prompt {i}: {out.token_ids} != {list(r)}"
        assert out.finish_reason in ("stop", "length")
        assert out.finished and out.error is None


# ------------------------------------------------------------ greedy == transformers ----
@pytest.mark.parametrize("layout", ["per-layer", "fused"])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family: str, kv_heads: int, layout: str) -> None:
    with LLM(tiny_config(family, kv_heads), seed=0, max_batch_size=4, page_size=PAGE, layout=layout) as llm:
        assert llm.runner.model.config._attn_implementation == "vattn"
        assert llm.cache.geometry.pages_for(max(map(sum, zip(PROMPT_LENS, MAX_TOKENS)))) >= 3  # several pages
        outs = run_online(llm, prompts(), greedy_params())
        llm.cache.allocator.check_invariants()
    assert_matches(outs, reference(family, kv_heads))
    for out, p in zip(outs, prompts()):
        assert out.prompt_token_ids == p
        assert out.num_preemptions == 0
        assert out.metrics.time_to_first_token is not None and out.metrics.time_to_first_token >= 0
        if len(out.token_ids) > 1:
            assert out.metrics.time_per_output_token is not None


def test_sliding_window_matches_transformers() -> None:
    """Mistral with a window shorter than the sequences: keys outside it are not seen."""
    with LLM(tiny_config("mistral", 2, sliding_window=8), seed=0, max_batch_size=4, page_size=PAGE,
             max_num_batched_tokens=16) as llm:
        outs = run_online(llm, prompts(), greedy_params())
    assert_matches(outs, reference("mistral", 2, sliding_window=8))
    assert [o.token_ids for o in outs] != [list(r) for r in reference("mistral", 2)]


@pytest.mark.parametrize("layout", ["per-layer", "fused"])
def test_preemption_under_physical_memory_keeps_outputs(layout: str) -> None:
    # 160 tokens of KV in all; the longest request needs 94, the six together ~300.
    with LLM(tiny_config(), seed=0, max_batch_size=4, page_size=PAGE, layout=layout,
             physical_memory=80 << 10) as llm:
        outs = run_online(llm, prompts(), greedy_params())
        assert llm.num_preemptions > 0
        stats = llm.memory_stats()
        assert stats.num_created_pages * stats.group_bytes <= 80 << 10
        llm.cache.allocator.check_invariants()
    assert_matches(outs, reference())
    assert sum(o.num_preemptions for o in outs) == llm.num_preemptions > 0


@pytest.mark.parametrize("budget,memory", [(8, None), (16, 80 << 10)], ids=["chunked", "chunked+preempt"])
def test_chunked_prefill_matches(budget: int, memory: int | None) -> None:
    with LLM(tiny_config("qwen2", 2), seed=0, max_batch_size=4, max_num_seqs=3, page_size=PAGE,
             max_num_batched_tokens=budget, physical_memory=memory) as llm:
        seen_chunk = False
        orig = llm.scheduler.schedule

        def spy():
            nonlocal seen_chunk
            out = orig()
            assert out.num_batched_tokens <= budget
            assert len(llm.scheduler.running) <= 3
            seen_chunk |= any(0 < s.seq.num_computed_tokens and s.num_new_tokens > 1 for s in out.scheduled)
            return out

        llm.scheduler.schedule = spy
        outs = run_online(llm, prompts(), greedy_params())
    assert seen_chunk, "no prompt was split into chunks"
    assert_matches(outs, reference("qwen2", 2))


def test_generate_batch_and_prompt_forms() -> None:
    ref = reference()
    model = build_model(tiny_config())
    with LLM(model, page_size=PAGE, max_batch_size=3) as llm:
        outs = llm.generate(prompts(), greedy_params())
        assert_matches(outs, ref)
        one = llm.generate(prompts()[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[1]))
        assert len(one) == 1 and one[0].token_ids == list(ref[1])
        as_tensor = llm.generate([torch.tensor(prompts()[0])], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[0]))
        assert as_tensor[0].token_ids == list(ref[0])
        assert llm.generate([], SamplingParams()) == []
    # close() gave the model its attention back: transformers' generate works on it again
    assert model.config._attn_implementation == "sdpa"
    assert hf_greedy(model, prompts()[0], MAX_TOKENS[0]) == list(ref[0])


def test_online_steps_report_updates() -> None:
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4) as llm:
        assert llm.step() == [] and not llm.has_unfinished()
        rid = llm.add_request(prompts()[0], SamplingParams(temperature=0, max_tokens=5))
        seen = []
        while llm.has_unfinished():
            for out in llm.step():
                assert out.request_id == rid
                seen.append(out)
        assert [len(o.token_ids) for o in seen] == [1, 2, 3, 4, 5]
        assert [o.finished for o in seen] == [False] * 4 + [True]
        assert seen[-1].finish_reason == "length" and seen[-1].token_ids == list(reference()[0][:5])


def test_stop_tokens_and_eos() -> None:
    ref = list(reference()[3])  # 24 tokens
    stop = ref[5]
    first = ref.index(stop)
    with LLM(tiny_config(), seed=0, page_size=PAGE) as llm:
        out = llm.generate(prompts()[3], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop]))[0]
        assert out.finish_reason == "stop" and out.token_ids == ref[:first + 1]
        llm.eos_token_ids = frozenset([stop])  # as if it were the model's end-of-sequence token
        out = llm.generate(prompts()[3], SamplingParams(temperature=0, max_tokens=24))[0]
        assert out.finish_reason == "stop" and out.token_ids == ref[:first + 1]
        out = llm.generate(prompts()[3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        assert out.finish_reason == "length" and out.token_ids == ref


# ------------------------------------------------------------------------ sampling ----
def test_seeded_sampling_is_reproducible() -> None:
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=20, seed=1234)
    p = prompts()[2]
    with LLM(tiny_config(), seed=0, page_size=PAGE) as llm:
        alone = llm.generate(p, sp)[0].token_ids
        again = llm.generate(p, sp)[0].token_ids
        other_seed = llm.generate(p, SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=20,
                                                    seed=99))[0].token_ids
    assert alone == again and len(alone) == 20
    assert alone != other_seed
    # In a crowded, preempting batch next to unseeded and greedy requests: the same tokens.
    others = [SamplingParams(temperature=1.0, max_tokens=m) for m in MAX_TOKENS]
    others[2] = sp
    others[0] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[0])
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4, physical_memory=80 << 10) as llm:
        outs = run_online(llm, prompts(), others)
        assert llm.num_preemptions > 0
    assert outs[2].token_ids == alone
    assert outs[0].token_ids == list(reference()[0])


def test_unseeded_sampling_follows_engine_seed() -> None:
    sp = SamplingParams(temperature=1.0, top_p=0.8, max_tokens=16)
    runs = []
    for seed in (3, 3, 4):
        with LLM(tiny_config(), seed=0, page_size=PAGE) as llm:
            llm.runner.sampler.default_generator.manual_seed(seed)
            runs.append([o.token_ids for o in llm.generate(prompts()[:3], sp)])
    assert runs[0] == runs[1] != runs[2]


def test_top_k_one_is_greedy() -> None:
    with LLM(tiny_config(), seed=0, page_size=PAGE) as llm:
        out = llm.generate(prompts()[1], SamplingParams(temperature=0.7, top_k=1, max_tokens=MAX_TOKENS[1]))
    assert out[0].token_ids == list(reference()[1])


# ---------------------------------------------------------------------- bad inputs ----
@pytest.mark.parametrize("kwargs", [
    {"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_k": -2}, {"top_k": 2.5}, {"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": 2.0},
    {"stop_token_ids": [-1]}, {"stop_token_ids": 5}, {"seed": "x"}, {"ignore_eos": "yes"},
])
def test_bad_sampling_params(kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_bad_requests_leave_running_requests_intact() -> None:
    ps, params = prompts(), greedy_params()
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4, max_context_len=128) as llm:
        ids = [llm.add_request(ps[i], params[i]) for i in range(3)]
        for _ in range(3):
            llm.step()
        n = llm.scheduler.num_unfinished
        with pytest.raises(InvalidRequestError, match="empty"):
            llm.add_request([], params[0])
        with pytest.raises(InvalidRequestError, match="empty"):
            llm.generate([[]])
        with pytest.raises(ContextLengthError, match="max_context_len"):
            llm.add_request(ps[4], SamplingParams(temperature=0, max_tokens=100))  # 70 + 100 > 128
        with pytest.raises(InvalidRequestError, match="token ids"):
            llm.add_request([1, 2, 500], params[0])  # outside the vocabulary
        with pytest.raises(InvalidRequestError, match="token ids"):
            llm.add_request([1, "a"], params[0])
        with pytest.raises(InvalidRequestError, match="tokenizer"):
            llm.add_request("hello", params[0])
        with pytest.raises(InvalidRequestError):
            llm.add_request(ps[0], {"max_tokens": 3})
        with pytest.raises(InvalidRequestError, match="sampling_params"):
            llm.generate(ps[:2], [params[0]])
        with pytest.raises(ContextLengthError):  # one bad prompt: none of the batch is queued
            llm.generate([ps[5], ps[4]], [params[5], SamplingParams(max_tokens=100)])
        assert llm.scheduler.num_unfinished == n
        done = {}
        while llm.has_unfinished():
            for out in llm.step():
                if out.finished:
                    done[out.request_id] = out
        assert set(done) == set(ids)
    assert_matches([done[i] for i in ids], reference()[:3])


def test_request_that_cannot_fit_alone_finishes_with_error() -> None:
    # 64 tokens of KV in all: prompt 4 (70 tokens) can never be backed, prompt 0 (5 + 12) can.
    ps, params = prompts(), greedy_params()
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4, physical_memory=32 << 10) as llm:
        outs = run_online(llm, [ps[4], ps[0]], [params[4], params[0]], arrivals=(0, 0))
        assert llm.cache.stats().num_active == 0
    assert outs[0].finish_reason == "error" and outs[0].finished
    assert "physical memory" in outs[0].error and outs[0].token_ids == []
    assert outs[1].token_ids == list(reference()[0]) and outs[1].error is None


def test_bad_engine_config() -> None:
    cfg = tiny_config()
    with pytest.raises(InvalidConfigError, match="not a local checkpoint directory"):
        LLM("/no/such/model/dir")
    with pytest.raises(InvalidConfigError):
        LLM(42)
    with pytest.raises(InvalidConfigError, match="unknown engine argument"):
        LLM(cfg, max_batch=4)
    with pytest.raises(InvalidConfigError):
        LLM(cfg, max_batch_size=0)
    with pytest.raises(InvalidConfigError):
        LLM(cfg, layout="paged")
    with pytest.raises(InvalidConfigError, match="max_num_seqs"):
        LLM(cfg, max_batch_size=2, max_num_seqs=3)
    with pytest.raises(InvalidConfigError, match="max_num_batched_tokens"):
        LLM(cfg, max_batch_size=8, max_num_batched_tokens=4)
    with pytest.raises(InvalidConfigError, match="max_position_embeddings"):
        LLM(cfg, max_context_len=1024)
    with pytest.raises(InvalidConfigError):
        LLM(cfg, dtype="int8")
    with pytest.raises(InvalidConfigError):
        LLM(cfg, device="tpu")
    with pytest.raises(InvalidConfigError):
        LLM(cfg, attention="magic")
    with pytest.raises(InvalidConfigError):  # less than one page group
        LLM(cfg, page_size=PAGE, physical_memory=1024)


def test_closed_engine_raises() -> None:
    llm = LLM(tiny_config(), seed=0, page_size=PAGE)
    llm.close()
    llm.close()
    with pytest.raises(ClosedError):
        llm.add_request([1, 2, 3])
    with pytest.raises(ClosedError):
        llm.step()


# ------------------------------------------------------------- checkpoint directory ----
def word_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_load_checkpoint_directory(tmp_path: Any) -> None:
    model = build_model(tiny_config())
    with_tok, without_tok = tmp_path / "with_tokenizer", tmp_path / "ids_only"
    model.save_pretrained(with_tok)
    word_tokenizer().save_pretrained(with_tok)
    model.save_pretrained(without_tok)
    ref = reference()
    text_prompt = " ".join(f"w{t}" for t in prompts()[1])
    with LLM(str(with_tok), page_size=PAGE) as llm:
        assert llm.tokenizer is not None
        out = llm.generate(text_prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS[1]))[0]
        assert out.prompt == text_prompt and out.prompt_token_ids == prompts()[1]
        assert out.token_ids == list(ref[1])
        expected = " ".join(f"w{t}" for t in ref[1] if t >= 3)
        assert out.text == expected
        with pytest.raises(InvalidRequestError, match="empty"):
            llm.add_request("")
    with LLM(without_tok, page_size=PAGE, layout="fused") as llm:
        assert llm.tokenizer is None
        with pytest.raises(InvalidRequestError, match="tokenizer"):
            llm.generate("w5 w6")
        out = llm.generate(prompts()[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[1]))[0]
        assert out.token_ids == list(ref[1]) and out.text is None


# ----------------------------------------------------------------- scheduler, alone ----
class FakeResult:
    def __init__(self, failed: tuple[int, ...]) -> None:
        self.failed = failed

    def __bool__(self) -> bool:
        return not self.failed


class FakeKV:
    """Slots and a token capacity; fails the newest slots that do not fit, like KVCache."""

    def __init__(self, num_slots: int, capacity: int | None = None) -> None:
        self.free = list(range(num_slots))
        self.capacity = capacity
        self.steps: list[dict[int, int]] = []

    @property
    def num_free_reqids(self) -> int:
        return len(self.free)

    def alloc_reqid(self) -> int:
        return self.free.pop(0)

    def free_reqid(self, reqid: int) -> None:
        assert reqid not in self.free
        self.free.append(reqid)

    def step(self, seq_lens: dict[int, int]) -> FakeResult:
        self.steps.append(dict(seq_lens))
        if self.capacity is None or sum(seq_lens.values()) <= self.capacity:
            return FakeResult(())
        return FakeResult((max(seq_lens),))


def fake_advance(out: Any, token: int = 7) -> None:
    """What the engine's postprocess does with the counts."""
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.token_ids.append(token)


def make_seq(i: int, n: int, max_tokens: int = 8) -> Sequence:
    return Sequence(i, list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens), 0.0)


def test_scheduler_decodes_first_then_prefill_chunks() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16), FakeKV(4))
    a, b = make_seq(0, 5), make_seq(1, 6)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 5), (b, 6)]
    fake_advance(out)
    long = make_seq(2, 100)
    sched.add(long)
    for i in range(7):  # two decodes every iteration, the long prompt in chunks of 14
        out = sched.schedule()
        assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1), (long, 14)]
        assert long.num_computed_tokens == 14 * i
        fake_advance(out)
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
    fake_advance(out)  # 11 + 11 + 10 tokens > 30: the next step must preempt c
    out = sched.schedule()
    assert out.preempted == [c] and [s.seq for s in out.scheduled] == [a, b]
    assert c.status is SequenceStatus.WAITING and c.num_computed_tokens == 0 and c.num_tokens == 10
    assert c.num_preemptions == 1 and c.slot is None and sched.waiting == [c]
    fake_advance(out)
    kv.capacity = 11
    out = sched.schedule()  # c is admitted again, then c and b (newest first) are preempted,
    assert out.preempted == [c, b] and out.aborted == [a] and out.scheduled == []  # a alone (12) does not fit
    assert c.num_preemptions == 1 and b.num_preemptions == 1  # c had nothing computed this time
    assert a.finish_reason == "error" and a.status is SequenceStatus.FINISHED
    assert sched.waiting == [b, c] and sched.running == []
    assert sorted(kv.free) == [0, 1, 2, 3]


def test_scheduler_respects_max_num_seqs_and_slots() -> None:
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), FakeKV(3))
    seqs = [make_seq(i, 4) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == seqs[:2]
    fake_advance(out)
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
        fake_advance(out)
        for s in out.scheduled:
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                sched.finish(s.seq, "length")
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


# ------------------------------------------------------------------ attention kernel ----
@pytest.mark.parametrize("window", [None, 3])
def test_sdpa_attention_on_cache_rows_matches_full_causal(window: int | None) -> None:
    """A decode, a fresh prompt and a later chunk in one batch equal causal attention over
    each whole sequence; GQA (4 query heads on 2 KV heads)."""
    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hkv, D = 4, 24, 4, 2, 8
    k_cache, v_cache = torch.zeros(B, T, Hkv, D), torch.zeros(B, T, Hkv, D)
    full_len = {0: 9, 2: 7, 3: 12}
    k_full = {s: torch.randn(n, Hkv, D, generator=g) for s, n in full_len.items()}
    v_full = {s: torch.randn(n, Hkv, D, generator=g) for s, n in full_len.items()}
    q_full = {s: torch.randn(n, Hq, D, generator=g) for s, n in full_len.items()}
    starts = {0: 8, 2: 0, 3: 5}  # decode, whole prompt, chunk of 7
    for s, start in starts.items():
        k_cache[s, :start], v_cache[s, :start] = k_full[s][:start], v_full[s][:start]
    slots = sorted(full_len)
    meta = AttentionMetadata.build(slots, [starts[s] for s in slots],
                                   [full_len[s] - starts[s] for s in slots], T, torch.device("cpu"))
    q = torch.cat([q_full[s][starts[s]:] for s in slots])
    k_cache[meta.slot_ids, meta.positions] = torch.cat([k_full[s][starts[s]:] for s in slots])
    v_cache[meta.slot_ids, meta.positions] = torch.cat([v_full[s][starts[s]:] for s in slots])
    out = sdpa_attention(q, k_cache, v_cache, meta, 0.3, window)
    refs = []
    for s in slots:
        n = full_len[s]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = (j <= i) & ((j > i - window) if window else True)
        o = torch.nn.functional.scaled_dot_product_attention(
            q_full[s].transpose(0, 1), k_full[s].repeat_interleave(2, 1).transpose(0, 1),
            v_full[s].repeat_interleave(2, 1).transpose(0, 1), attn_mask=mask, scale=0.3)
        refs.append(o.transpose(0, 1)[starts[s]:])
    torch.testing.assert_close(out, torch.cat(refs))


def test_forward_context_is_cleared() -> None:
    with pytest.raises(VattnError):
        get_forward_context()
    meta = AttentionMetadata.build([0], [0], [1], 8, torch.device("cpu"))
    with pytest.raises(RuntimeError):
        with forward_context(object()) as ctx:  # type: ignore[arg-type]
            assert get_forward_context() is ctx
            raise RuntimeError
    with pytest.raises(VattnError):
        get_forward_context()
    assert meta.context_lens == [1]


# -------------------------------------------------------------------- CUDA kernels ----
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("fused", [False, True], ids=["per-layer", "fused"])
@pytest.mark.parametrize("kernel", ["torch_flash", "flash_attn"])
def test_cuda_kernels_match_sdpa_on_slot_rows(kernel: str, fused: bool, window: int | None) -> None:
    """The CUDA kernels read slot rows with a padded slot stride (and the fused layout's
    token stride) like per-request SDPA, and never touch a token past a context length:
    those hold NaN here."""
    from vattn.attention import flash_attn_attention, flash_attn_available, torch_flash_attention

    if kernel == "flash_attn" and not flash_attn_available():
        pytest.skip("flash_attn is not installed")
    fn = flash_attn_attention if kernel == "flash_attn" else torch_flash_attention
    B, T, slot_tokens, L, Hq, Hkv, D = 4, 100, 128, 3, 8, 2, 64
    dev, dt = torch.device("cuda"), torch.float16
    shape = (B, slot_tokens, L, Hkv, D) if fused else (B, slot_tokens, Hkv, D)
    k_buf = torch.full(shape, float("nan"), device=dev, dtype=dt)
    v_buf = torch.full(shape, float("nan"), device=dev, dtype=dt)
    k_cache = k_buf[:, :T, 1] if fused else k_buf[:, :T]  # [B, T, H_kv, D]
    v_cache = v_buf[:, :T, 1] if fused else v_buf[:, :T]
    slots, starts, lens = [0, 2, 3], [37, 0, 20], [1, 50, 30]  # a decode, a prompt, a chunk
    for s, start, n in zip(slots, starts, lens):
        k_cache[s, :start + n] = torch.randn(start + n, Hkv, D, device=dev, dtype=dt)
        v_cache[s, :start + n] = torch.randn(start + n, Hkv, D, device=dev, dtype=dt)
    meta = AttentionMetadata.build(slots, starts, lens, slot_tokens, dev)
    q = torch.randn(sum(lens), Hq, D, device=dev, dtype=dt)
    ref = sdpa_attention(q, k_cache, v_cache, meta, D ** -0.5, window)
    out = fn(q, k_cache, v_cache, meta, D ** -0.5, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=5e-3, rtol=5e-3)


@pytest.mark.gpu
@needs_cuda
def test_engine_on_cuda_matches_sdpa_kernel() -> None:
    import importlib.util

    if importlib.util.find_spec("vattn.vmem.cuda") is None:
        pytest.skip("vattn has no CUDA backend yet")
    runs = {}
    for kernel in ("sdpa", None):
        with LLM(tiny_config(), seed=0, device="cuda", dtype="float16", page_size=2 << 20, layout="fused",
                 attention=kernel) as llm:
            runs[kernel] = [o.token_ids for o in run_online(llm, prompts(), greedy_params())]
            if kernel is None:
                assert llm.runner.kernel.name in ("flash_attn", "torch_flash"), "the CUDA kernel fell back"
    # fp16 kernels may flip a near-tie argmax: most sequences must agree exactly
    assert sum(a == b for a, b in zip(runs["sdpa"], runs[None])) >= len(PROMPT_LENS) - 1


# ---------------------------------------------------------------------------- demo ----
def test_run_demo_small() -> None:
    from vattn.engine.demo import run_demo

    r = run_demo(num_requests=6, seed=0, device="cpu", max_batch_size=4, max_prompt=48, max_output=24,
                 physical_memory=1 << 20, page_size=PAGE, show_progress=False, verbose=False)
    assert r["num_requests"] == 6 and r["num_errors"] == 0
    assert r["output_tokens"] > 0 and r["output_throughput_tok_s"] > 0
    assert r["kv_mapped_mib_peak"] >= r["kv_used_mib_peak"] > 0
    for key in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "num_preemptions",
                "kv_fragmentation_pct_mean"):
        assert key in r
