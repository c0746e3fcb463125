"""The continuous-batching engine on tiny seeded Hugging Face models (CPU, float32).

Greedy outputs must match transformers' own `generate` (its default attention) token for
token, whatever the batching: staggered arrivals, both cache layouts, small pages, a
physical memory budget that forces preemptions, chunked prefill.
"""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.conftest import FakeClock  # noqa: E402
from tests.helpers import (  # noqa: E402
    FAMILIES,
    MAX_TOKENS,
    PAGE,
    PROMPT_LENS,
    assert_matches,
    build_model,
    greedy_params,
    hf_greedy,
    prompts,
    reference,
    run_online,
    tiny_config,
)

from vattn.engine import LLM, SamplingParams  # noqa: E402
from vattn.errors import ClosedError, ContextLengthError, InvalidConfigError, InvalidRequestError  # noqa: E402


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


def test_numpy_and_tensor_integers_are_ints() -> None:
    """Token ids, sampling and engine settings given as numpy integers or 0-d tensors."""
    ref = reference()
    with LLM(tiny_config(), seed=np.int64(0), page_size=np.int64(PAGE), max_batch_size=torch.tensor(4),
             max_num_batched_tokens=np.int32(64)) as llm:
        assert type(llm.config.max_batch_size) is int and type(llm.config.page_size) is int
        p0, p1, p2, p3 = prompts()[:4]
        forms = [[np.int64(t) for t in p0], np.array(p1, dtype=np.int32), [torch.tensor(t) for t in p2],
                 torch.tensor(p3)]
        params = [SamplingParams(temperature=0, max_tokens=np.int64(m)) for m in MAX_TOKENS[:4]]
        outs = llm.generate(forms, params)
        assert_matches(outs, ref[:4])
        assert [o.prompt_token_ids for o in outs] == prompts()[:4]
        assert all(type(t) is int for o in outs for t in o.prompt_token_ids)
        one = llm.generate([np.uint8(t) for t in p1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[1]))
        assert len(one) == 1 and one[0].token_ids == list(ref[1])
        two_d = llm.generate(np.array([p0[:4], p1[:4]]), SamplingParams(temperature=0, max_tokens=2))
        assert [o.prompt_token_ids for o in two_d] == [p0[:4], p1[:4]]


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


def test_idle_engine_gives_its_memory_back() -> None:
    """On a fake clock: not before idle_trim_s, then once per idle period, from the idle
    policy's thread (round 1) or from a step of the idle engine (round 2)."""
    ref = reference()
    clock = FakeClock()
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4, idle_trim_s=30,
             enable_prefix_caching=True) as llm:
        llm.idle.clock = clock
        trimmed, trim = threading.Event(), llm.runner.cache.trim

        def traced_trim():
            try:
                return trim()
            finally:
                trimmed.set()

        llm.runner.cache.trim = traced_trim
        for round in (1, 2):
            assert_matches(llm.generate(prompts(), greedy_params()), ref)
            st = llm.memory_stats()
            assert st.num_created_pages > 0 and st.num_pinned_pages > 0
            clock.advance(29.9)
            llm.step()  # idle, not long enough
            assert llm.num_idle_trims == round - 1 and not trimmed.is_set()
            clock.advance(0.1)
            if round == 1:
                llm.idle.wake()  # the thread looks at the moved clock: the trim is due
                assert trimmed.wait(30), "the idle engine kept its memory"
            llm.step()  # (round 1: waits for the thread's trim to finish) stepping an idle engine trims once
            assert llm.num_idle_trims == round
            st = llm.memory_stats()
            assert st.num_created_pages == 0 and st.num_pinned_pages == 0 and st.mapped_bytes == 0
            clock.advance(100)
            llm.step()  # and not again
            assert llm.num_idle_trims == round
            llm.cache.allocator.check_invariants()
            trimmed.clear()
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4) as llm:  # idle_trim_s=None
        llm.idle.clock = clock
        assert llm.idle.thread is None  # no delay, no thread
        assert_matches(llm.generate(prompts(), greedy_params()), ref)
        clock.advance(1e9)
        llm.step()
        assert llm.num_idle_trims == 0 and llm.memory_stats().num_created_pages > 0
    for bad in (-1, float("nan"), "1", True, 10**400):
        with pytest.raises(InvalidConfigError, match="idle_trim_s"):
            LLM(tiny_config(), idle_trim_s=bad)


@pytest.mark.parametrize("forever", [2**70, 1e300, threading.TIMEOUT_MAX * 2])
def test_idle_trim_past_what_a_timer_can_wait_means_never(forever: float) -> None:
    """threading.Timer raised OverflowError on its thread each time the engine went idle:
    such a delay is never, and no thread waits for it."""
    errors: list = []
    old_hook, threading.excepthook = threading.excepthook, errors.append
    try:
        with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4, idle_trim_s=forever) as llm:
            assert llm.config.idle_trim_s is None and llm.idle.thread is None
            clock = llm.idle.clock = FakeClock()
            assert_matches(llm.generate(prompts(), greedy_params()), reference())
            clock.advance(float(forever))
            llm.step()
            assert llm.num_idle_trims == 0 and llm.memory_stats().num_created_pages > 0
    finally:
        threading.excepthook = old_hook
    assert not errors, errors


# ---------------------------------------------------------------------- bad inputs ----
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
        with pytest.raises(InvalidRequestError, match="must be a SamplingParams, got dict"):
            llm.add_request(ps[0], {"max_tokens": 3})
        with pytest.raises(InvalidRequestError, match="sampling_params must be a SamplingParams .*got dict"):
            llm.generate(ps[:2], {"max_tokens": 3})
        with pytest.raises(InvalidRequestError, match="sampling_params"):
            llm.generate(ps[:2], [params[0]])
        for bad in (None, 5, 2.5, {1: [1, 2]}, {1, 2}, torch.tensor(3), b"abc"):
            with pytest.raises(InvalidRequestError, match="prompts must be a string, a list of token ids"):
                llm.generate(bad)
        for bad in ([[1, 2], None], [torch.ones(2, 2, dtype=torch.long)], [[1, 2.0]], [[True, 2]],
                    [[torch.tensor([1]), 2]]):
            with pytest.raises(InvalidRequestError, match="prompt"):
                llm.generate(bad)
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


# ---------------------------------------------------------------------------- CUDA ----
@pytest.mark.gpu
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


@pytest.mark.gpu
def test_config_model_is_made_on_the_gpu_in_the_run_dtype() -> None:
    from vattn.engine.config import EngineConfig
    from vattn.engine.loader import load_model

    host_state, gpu_state = torch.random.get_rng_state(), torch.cuda.get_rng_state()
    loaded = load_model(tiny_config(), EngineConfig(dtype="bfloat16", seed=0), torch.device("cuda"))
    params = list(loaded.model.parameters())
    assert {p.device.type for p in params} == {"cuda"} and {p.dtype for p in params} == {torch.bfloat16}
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(torch.random.get_rng_state(), host_state)  # seeding left both generators as they were
    assert torch.equal(torch.cuda.get_rng_state(), gpu_state)
    again = load_model(tiny_config(), EngineConfig(dtype="bfloat16", seed=0), torch.device("cuda"))
    assert all(torch.equal(a, b) for a, b in zip(params, again.model.parameters()))  # seeded


# ---------------------------------------------------------------------------- demo ----
def test_run_demo_small() -> None:
    from vattn.engine.demo import run_demo

    r = run_demo(num_requests=6, seed=0, device="cpu", max_batch_size=4, max_prompt=48, max_output=24,
                 physical_memory=1 << 20, page_size=PAGE, show_progress=False, verbose=False)
    assert r["num_requests"] == 6 and r["num_errors"] == 0 and r["errors"] == []
    assert r["output_tokens"] > 0 and r["output_throughput_tok_s"] > 0
    assert r["kv_mapped_mib_peak"] >= r["kv_used_mib_peak"] > 0
    for key in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "num_preemptions",
                "kv_fragmentation_pct_mean"):
        assert key in r


def test_demo_and_workload_need_at_least_one_request() -> None:
    from vattn.engine.demo import run_demo
    from vattn.workload import synthetic_requests

    for n in (0, -1):
        with pytest.raises(InvalidConfigError, match="positive int"):
            run_demo(num_requests=n, device="cpu", show_progress=False, verbose=False)
        with pytest.raises(InvalidConfigError, match="positive int"):
            synthetic_requests(n, 1024)
