"""The compiled forward (`EngineConfig.compile`, vattn.engine.compile): attention one opaque
custom op, the rest of the model compiled by inductor around it. Greedy tokens equal eager's
and transformers' `generate` in float32 on the CPU; a batch of another size does not compile
again; what the op declares (its mutations, its fake) is what it does.

Compiling is slow on a small host: the default suite builds two compiled models (Llama, and
Mistral with a sliding window); the other layouts, features and the compile cache across
processes are `slow`. Every compiled test starts from `torch._dynamo.reset()`, so that what it
counts is its own (code compiled by an earlier test for the same shapes would be reused).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from tests.conftest import REPO  # noqa: E402
from tests.helpers import (PAGE, assert_matches, build_model, greedy_params, hf_greedy, prompts,  # noqa: E402
                           reference, run_online, tiny_config)

from vattn.attention import AttentionKernel, AttentionMetadata, ForwardContext, forward_context  # noqa: E402
from vattn.engine import LLM, SamplingParams  # noqa: E402
from vattn.engine.compile import COMPILE_MODES, CompiledForward, _Inductor  # noqa: E402
from vattn.engine.config import EngineConfig  # noqa: E402
from vattn.errors import InvalidConfigError  # noqa: E402


@pytest.fixture
def fresh_dynamo():
    """No code compiled by an earlier test; none left for a later one."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _engine(config=None, **kw) -> LLM:
    args = dict(seed=0, max_batch_size=8, page_size=PAGE, max_num_batched_tokens=32, compile=True)
    return LLM(config if config is not None else tiny_config(), **{**args, **kw})


def _batch(n: int) -> list[list[int]]:
    """n prompts of 4 to 16 tokens."""
    return [p[:4 + 2 * i] for i, p in enumerate((prompts() * 2)[:n])]


def _tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


# ------------------------------------------------------------------- the setting ----
def test_compile_setting_is_checked() -> None:
    assert EngineConfig().compile is False  # off by default
    for ok in (True, False, *COMPILE_MODES):
        EngineConfig(compile=ok)
    with pytest.raises(InvalidConfigError, match="captures CUDA graphs itself"):
        EngineConfig(compile="reduce-overhead")  # inductor's own CUDA graphs: vattn's cuda_graphs capture instead
    for bad in ("fast", 1, None):
        with pytest.raises(InvalidConfigError, match="compile must be"):
            EngineConfig(compile=bad)


def test_models_with_recurrent_states_are_refused() -> None:
    from tests.engine.test_model_support import hybrid_config

    with pytest.raises(InvalidConfigError, match="recurrent states"):
        LLM(hybrid_config("bamba"), seed=0, max_batch_size=2, page_size=PAGE, compile=True)
    with LLM(hybrid_config("bamba"), seed=0, max_batch_size=2, page_size=PAGE) as llm:  # eagerly, as before
        assert llm.runner.compiled is None
        assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))[0].token_ids) == 3


# ------------------------------------------------------------------------ the op ----
def test_the_op_declares_what_it_does() -> None:
    """opcheck: the schema's mutations are the op's (it writes K/V into both caches and nothing
    else), the fake gives the real output's shape and strides, and it runs under AOT dispatch
    with dynamic shapes. Plain tensors as caches: opcheck clones its inputs, which a vattn
    cache (mostly unmapped) would not survive; the engine tests run the op on vattn memory."""
    slots, starts, lens = [0, 2, 3], [0, 4, 6], [5, 3, 1]
    meta = AttentionMetadata.build(slots, starts, lens, 64, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, 16, generator=g) for h in (4, 2, 2))  # [T, H, D]
    k_cache, v_cache = torch.randn(4, 64, 2, 16, generator=g), torch.randn(4, 64, 2, 16, generator=g)
    with forward_context(ForwardContext([k_cache], [v_cache], meta, AttentionKernel("sdpa"))):
        torch.library.opcheck(torch.ops.vattn.attention.default, (q, k, v, k_cache, v_cache, 0.25, None))
        torch.library.opcheck(torch.ops.vattn.attention.default, (q, k, v, k_cache, v_cache, 0.25, 4))
        out = torch.ops.vattn.attention(q, k, v, k_cache, v_cache, 0.25, None)
        ref = AttentionKernel("sdpa").forward(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.25)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert out.is_contiguous()
    torch.testing.assert_close(k_cache[meta.slot_ids, meta.positions], k)  # the new K/V are in the caches


# ------------------------------------------------------------------- the engine ----
def test_compiled_engine_equals_eager_and_generate(fresh_dynamo) -> None:
    """Llama. Batches of 2, 3, 5 and 7 prompts (each prefilled in one iteration, then decoded
    together) run on the one graph their first call compiled: no batch size compiles again, and
    the model never broke its graph. Then online arrivals, prompt chunks of 32 tokens beside
    decodes, decode batches of 1 to 6: a few more graphs (sizes 0 and 1 are dynamo's special
    cases), the same tokens as the eager engine. Every token equals generate's."""
    params = SamplingParams(temperature=0, max_tokens=4)
    with _engine(max_num_batched_tokens=128) as llm:
        c = llm.runner.compiled
        assert isinstance(c, CompiledForward) and c.num_compiles == 0
        batches = {}
        for n in (2, 3, 5, 7):
            batches[n] = _tokens(llm.generate(_batch(n), params))
            assert c.num_compiles == 1, f"the batch of {n} compiled again ({c.num_compiles} compiles)"
        assert c.num_graphs == 1 and c.compile_s > 0 and c.disabled_reason is None, c.disabled_reason
    with _engine(compile=False) as llm:
        eager = _tokens(run_online(llm, prompts(), greedy_params()))
    with _engine() as llm:
        outs = run_online(llm, prompts(), greedy_params())
        c = llm.runner.compiled
        assert c.disabled_reason is None and c.num_compiles <= 3, (c.num_compiles, c.disabled_reason)
        assert c.num_graphs == c.num_compiles  # one graph a compile: no graph break
        llm.cache.allocator.check_invariants()
    assert _tokens(outs) == eager
    assert_matches(outs, reference())
    model = build_model(tiny_config())
    for n, tokens in batches.items():
        assert tokens == [hf_greedy(model, p, 4) for p in _batch(n)], n


def test_sliding_window_compiled(fresh_dynamo) -> None:
    """Mistral with an 8-token window (the op's sliding_window argument), chunked prefill."""
    with _engine(tiny_config("mistral", sliding_window=8)) as llm:
        outs = run_online(llm, prompts(), greedy_params())
        c = llm.runner.compiled
        assert c.disabled_reason is None and c.num_compiles >= 1 and c.num_graphs == c.num_compiles
    assert_matches(outs, reference("mistral", sliding_window=8))


def test_a_compile_that_fails_runs_eagerly(fresh_dynamo, monkeypatch, caplog) -> None:
    """inductor raising turns compiling off for the engine, with a warning; the iteration and
    every later one run eagerly, with the same tokens."""
    def broken(self, gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(_Inductor, "__call__", broken)
    with caplog.at_level(logging.WARNING, logger="vattn.engine.compile"), _engine() as llm:
        outs = llm.generate(prompts()[:3], greedy_params()[:3])
        c = llm.runner.compiled
        assert c.disabled_reason is not None and "no compiler here" in c.disabled_reason, c.disabled_reason
        assert c.num_compiles == 0
    assert any("torch.compile is off" in r.getMessage() for r in caplog.records)
    assert_matches(outs, reference()[:3])


# ----------------------------------------------------------------------------- CUDA ----
@pytest.mark.gpu
def test_compiled_decodes_under_cuda_graphs_agree_with_eager(fresh_dynamo) -> None:
    """On a GPU (fp16, torch_flash): CUDA graphs capture the compiled forward; the tokens are
    those of the eager engine but where a near-tie flips one (other kernels, fp16)."""
    runs = {}
    for compiled in (False, True):
        with _engine(device="cuda", dtype="float16", page_size=2 << 20, compile=compiled) as llm:
            runs[compiled] = _tokens(run_online(llm, prompts(), greedy_params()))
            g, c = llm.runner.graphs, llm.runner.compiled
            assert g is not None and g.disabled_reason is None and g.num_replays > 0, g and g.disabled_reason
            assert (c is not None) is compiled and (c is None or c.disabled_reason is None), c and c.disabled_reason
    assert sum(a == b for a, b in zip(runs[False], runs[True])) >= len(runs[False]) - 1


# -------------------------------------------------------------------------- slow ----
@pytest.mark.slow
def test_fused_layout_and_gqa_compiled(fresh_dynamo) -> None:
    with _engine(tiny_config("qwen2", kv_heads=1), layout="fused") as llm:
        outs = run_online(llm, prompts(), greedy_params())
        assert llm.runner.compiled.disabled_reason is None
    assert_matches(outs, reference("qwen2", kv_heads=1))


@pytest.mark.slow
def test_compiled_with_prefix_caching_preemption_and_samples(fresh_dynamo) -> None:
    """Shared pages under the compiled forward: prefix hits, n=3 forks, recomputation for memory
    (four page groups for four 56-token requests)."""
    common = prompts()[4][:40]
    batch = [common + p[:6] for p in prompts()[:4]]
    params = SamplingParams(temperature=0, max_tokens=10)
    kw = dict(enable_prefix_caching=True, physical_memory=4 * PAGE * 4)
    with _engine(compile=False, **kw) as llm:
        eager = _tokens(llm.generate(batch, params)) + [[s.token_ids for s in llm.generate(batch[0], SamplingParams(
            temperature=0, max_tokens=6, n=3))[0].outputs]]
    with _engine(**kw) as llm:
        got = _tokens(llm.generate(batch, params)) + [[s.token_ids for s in llm.generate(batch[0], SamplingParams(
            temperature=0, max_tokens=6, n=3))[0].outputs]]
        stats = llm.prefix_cache_stats()
        assert stats.num_hit_tokens > 0 and stats.num_query_tokens > sum(map(len, batch))  # hits, and recomputes
        assert llm.runner.compiled.disabled_reason is None
    assert got == eager


@pytest.mark.slow
def test_compiled_forward_in_the_graph_path(fresh_dynamo) -> None:
    """The decode-graph path (static buffers, padding, logits_to_keep=0) calls the compiled
    forward, as CUDA graphs capture it on a GPU: run on the host with the eager stand-in of
    tests/engine/test_cuda_graphs.py."""
    from tests.engine.test_cuda_graphs import EagerGraphs

    with _engine(cuda_graphs=False) as llm:
        g = llm.runner.graphs = EagerGraphs(llm.runner.graph_target(), 8)
        outs = run_online(llm, prompts(), greedy_params())
        assert g.num_replays > 0 and llm.runner.compiled.disabled_reason is None
    assert_matches(outs, reference())


_CHILD = """
import json, sys, torch
torch.set_num_threads(1)
from torch._dynamo.utils import counters
from tests.helpers import PAGE, tiny_config
from vattn.engine import LLM, SamplingParams
with LLM(tiny_config(), seed=0, max_batch_size=4, page_size=PAGE, compile=True) as llm:
    out = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0, max_tokens=4))
    c = llm.runner.compiled
    print(json.dumps(dict(tokens=[o.token_ids for o in out], compiles=c.num_compiles, seconds=c.compile_s,
                          hits=counters["inductor"]["fxgraph_cache_hit"])))
"""


@pytest.mark.slow
def test_compiled_code_is_cached_across_processes(tmp_path) -> None:
    """Inductor's FX graph cache in TORCHINDUCTOR_CACHE_DIR: a second process with the same
    model shapes takes its compiled graphs from the cache."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    runs = [json.loads(subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=REPO, capture_output=True,
                                      text=True, check=True, timeout=600).stdout.strip().splitlines()[-1])
            for _ in range(2)]
    assert runs[0]["hits"] == 0 and runs[0]["compiles"] >= 1
    assert runs[1]["hits"] == runs[1]["compiles"] == runs[0]["compiles"]
    assert runs[0]["tokens"] == runs[1]["tokens"]


@pytest.mark.slow
def test_e2e_bench_compiled_on_the_cpu(tmp_path) -> None:
    """The end-to-end benchmark's compiled system (tiny model): its tokens equal eager vattn's
    and generate's, its compile time, the bandwidth bound and the interleaved steps are recorded."""
    from vattn import bench

    argv = ["--device", "cpu", "--quick", "--models", "llama-3.2-1b", "--batches", "3", "--compile",
            "--engine-overhead", "--rounds", "1", "--skip-hf-cb"]
    mod = bench.module("e2e")
    r = bench.execute(mod, "e2e", bench.module_args(mod, argv, out=str(tmp_path)))["result"]
    assert not r["failures"], r["failures"]
    res = r["results"][0]
    assert res["vattn_vs_vattn_compiled"]["equal"] and res["vattn_compiled_vs_hf_generate"]["token_match"] == 1.0
    cc = res["systems"]["vattn_compiled"]["compile"]
    assert cc["disabled"] is None and cc["compiles"] >= 1 and cc["compile_s"] > 0
    assert r["copy_GBps"] > 0 and res["bound"]["bound_ms"] > 0
    assert res["bound"]["vattn_compiled"]["step_over_bound"] > 0
    il = res["interleaved"]  # the two engines in turn: a pair of decode steps per token but the first
    assert il["steps"] == r["max_tokens"] - 1 and il["step_ratio_median"] > 0 and il["disabled"] is None


def test_gpu_run_compiles_the_e2e_part_on_cuda() -> None:
    """`vattn bench gpu` asks its e2e part for the compiled system on CUDA (not in the CPU
    harness check: compiling takes minutes there); the bound's bytes of a decode step."""
    import argparse

    from vattn import bench
    from vattn.bench import _e2e_measure, gpu

    mod = bench.module("e2e")
    for device, compiled in (("cuda", True), ("cpu", False)):
        argv = gpu._argv(mod, "e2e", argparse.Namespace(device=device, quick=True), None)
        assert ("--compile" in argv) is compiled and "--engine-overhead" in argv, argv
    model = build_model(tiny_config())  # untied: the input embedding is left out (a step reads 3 of its rows)
    nbytes = _e2e_measure.decode_bytes(model, B=3, context=10.5)
    params = sum(p.numel() for p in model.parameters()) - 128 * 64
    assert nbytes == dict(weights=4.0 * params, kv=3 * 10.5 * 2 * 2 * 2 * 16 * 4)  # B x ctx x K,V x layers x H_kv x D x 4


def test_past_the_recompile_limit_a_compiled_call_raises_instead_of_running_eagerly() -> None:
    """`vattn.compiling.raise_past_recompile_limit`, which the compiled forward and the flex
    decode run under: their callers then fall back visibly (a warning), never silently."""
    from vattn.compiling import raise_past_recompile_limit

    torch._dynamo.reset()
    f = torch.compile(lambda x: x * 2, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=1):
        f(torch.ones(2))
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit), raise_past_recompile_limit():
            f(torch.ones(3))  # a second graph for a function allowed one
        assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))  # outside it: eagerly, as dynamo does
    torch._dynamo.reset()
