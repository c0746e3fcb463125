"""Asynchronous scheduling (`EngineConfig.async_scheduling`): the engine launches iteration N+1
before it takes N's outputs, N's sampled tokens feeding N+1's inputs on the device. On the host
the device is synchronous, so these tests check what the setting must never change: greedy (and
seeded) outputs token for token equal to synchronous scheduling, for every feature the engine
has (a parametrized matrix on tiny seeded models; the larger part under `slow`), and what it
changes on purpose: outputs come one step later, a request that stops drops the token computed
for it meanwhile, and one that reaches max_tokens costs no extra token."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.engine.test_engine_reliability import POISON, fail_forward  # noqa: E402
from tests.engine.test_model_support import hybrid_config, memory_cap  # noqa: E402
from tests.engine.test_prefix_caching_engine import (  # noqa: E402
    SYSTEM_ARRIVALS, system_params, system_prompts)
from tests.engine.test_sliding_window import BATCHED, family_config  # noqa: E402
from tests.helpers import (  # noqa: E402
    ARRIVALS, MAX_TOKENS, PAGE, assert_matches, greedy_params, prompts, reference, run_online, tiny_config)
from vattn.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from vattn.errors import ClosedError, InvalidConfigError  # noqa: E402

Workload = tuple[list[list[int]], list[SamplingParams], tuple[int, ...]]


def make_llm(config: Any = None, **kw: Any) -> LLM:
    """An engine of 4 slots, scheduling asynchronously unless `async_scheduling=False`."""
    args = dict(seed=0, page_size=PAGE, max_batch_size=4, async_scheduling=True)
    return LLM(tiny_config() if config is None else config, **{**args, **kw})


# ------------------------------------------------------------------ the setting ----
def test_the_setting_is_checked_and_on_where_the_device_runs_beside_the_host() -> None:
    with pytest.raises(InvalidConfigError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")
    assert not EngineConfig(device="cpu").uses_async_scheduling()  # the host: nothing to hide
    assert EngineConfig(device="cuda").uses_async_scheduling()  # (a config: no GPU needed to read it)
    assert not EngineConfig(device="cuda", tensor_parallel_size=2).uses_async_scheduling()
    assert EngineConfig(device="cpu", async_scheduling=True).uses_async_scheduling()
    assert not EngineConfig(device="cuda", async_scheduling=False).uses_async_scheduling()
    with LLM(tiny_config(), seed=0, page_size=PAGE) as llm:
        assert not llm.async_scheduling
    with make_llm() as llm:
        assert llm.async_scheduling


# -------------------------------------------------------------------- the engine ----
def test_step_returns_the_outputs_of_the_iteration_before() -> None:
    """Each step launches an iteration and takes the outputs of the one before; a decode's
    input is the token sampled before, read on the device; the request's last token
    (max_tokens) is not followed by another iteration."""
    p, ref = prompts()[0], list(reference()[0])
    with make_llm() as llm:
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=3))
        seen = []
        while llm.has_unfinished():
            seen.append([(o.token_ids, o.finished) for o in llm.step()])
        assert seen == [[], [(ref[:1], False)], [(ref[:2], False)], [(ref[:3], True)]]
        assert llm.runner.num_fed_tokens == 2  # both decodes read their token on the device
        assert llm.scheduler.num_computed_tokens == len(p) + 2  # as synchronous scheduling: no extra token
        assert llm.cache.num_free_reqids == llm.config.max_batch_size
    with make_llm(async_scheduling=False) as llm:
        llm.add_request(p, SamplingParams(temperature=0, max_tokens=3))
        assert [o.token_ids for o in llm.step()] == [ref[:1]]  # synchronous: its own iteration's
        assert llm.runner.num_fed_tokens == 0


def stop_workload() -> Workload:
    """The standard prompts, each stopping at a token of its own greedy output (the first time
    it appears), or at max_tokens: stops come while other requests run and wait."""
    ref = reference()
    params = [SamplingParams(temperature=0, max_tokens=m, stop_token_ids=[r[len(r) // 2]] if i % 3 else [])
              for i, (m, r) in enumerate(zip(MAX_TOKENS, ref))]
    return prompts(), params, ARRIVALS


def test_a_request_that_stops_drops_the_token_computed_meanwhile() -> None:
    """A request that stops on a token was already in the next iteration: that iteration's
    token for it is dropped (one extra token computed, none kept), its slot is free. One that
    reaches max_tokens is not scheduled past it: no extra token."""
    plist, params, arrivals = stop_workload()
    runs = {}
    for on in (False, True):
        with make_llm(max_batch_size=3, async_scheduling=on) as llm:
            outs = run_online(llm, plist, params, arrivals)
            runs[on] = ([(o.token_ids, o.finish_reason) for o in outs], llm.scheduler.num_computed_tokens)
            assert llm.cache.num_free_reqids == 3 and llm.runner.sampler.generators == {}
            llm.cache.allocator.check_invariants()
    assert runs[True][0] == runs[False][0]
    stopped = [t for t, why in runs[True][0] if why == "stop"]
    assert len(stopped) >= 3, "the workload must stop requests on tokens"
    assert runs[True][1] == runs[False][1] + len(stopped)


def test_an_abort_while_an_iteration_runs_frees_the_slot_and_drops_its_token() -> None:
    p, ref = prompts()[1], list(reference()[1])
    with make_llm() as llm:
        rid = llm.add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        for _ in range(3):
            llm.step()  # two tokens taken, the third in flight
        assert llm.abort_request(rid) == [rid]
        assert llm.cache.num_free_reqids == llm.config.max_batch_size  # at once
        (out,) = llm.step()  # nothing to launch: the iteration in flight is taken, its token dropped
        assert out.finish_reason == "abort" and out.token_ids == ref[:2]
        assert not llm.has_unfinished() and not llm._in_flight
        # n = 3, aborted while the iteration that samples its prompt (for every sample) runs
        rid = llm.add_request(p, SamplingParams(temperature=0, max_tokens=5, n=3))
        assert llm.step() == [] and llm.abort_request(rid) == [rid]
        (out,) = llm.step()
        assert [(c.token_ids, c.finish_reason) for c in out.outputs] == [([], "abort")] * 3
        assert not llm.has_unfinished() and not llm.scheduler.waiting and llm.cache.num_free_reqids == 4
        assert_matches(llm.generate(prompts()[:3], greedy_params()[:3]), reference()[:3])


def test_close_with_an_iteration_in_flight() -> None:
    llm = make_llm()
    llm.add_request(prompts()[0], SamplingParams(temperature=0, max_tokens=8))
    llm.step()
    llm.step()
    assert llm._in_flight
    llm.close()
    with pytest.raises(ClosedError):
        llm.step()


def test_generate_and_a_request_added_while_one_is_in_flight() -> None:
    """generate steps the engine itself; requests added between steps join the next launch."""
    with make_llm() as llm:
        assert_matches(llm.generate(prompts(), greedy_params()), reference())
        rid = llm.add_request(prompts()[2], greedy_params()[2])
        llm.step()
        outs = llm.generate(prompts()[:2], greedy_params()[:2])  # the online request runs beside them
        assert_matches(outs, reference()[:2])
        rest = [o for o in llm.step() if o.request_id == rid] if llm.has_unfinished() else []
        while llm.has_unfinished():
            rest = [o for o in llm.step() if o.request_id == rid] or rest
        assert rest[-1].finished and rest[-1].token_ids == list(reference()[2])


# ------------------------------------------------------------------- failures ----
def test_failures_inside_an_iteration_end_the_same_requests_as_synchronously(monkeypatch: Any) -> None:
    """A request whose sampling raises at its third token, and one whose forward always raises
    (in its batch, then alone): they fail with the same tokens and errors as synchronously, the
    others keep theirs, and the engine serves on."""
    ps = prompts()[:3] + [[5, POISON, 7, 9], prompts()[4]]
    params = greedy_params()[:3] + [SamplingParams(temperature=0, max_tokens=5),
                                    SamplingParams(temperature=0.9, max_tokens=10, seed=11)]
    runs = {}
    for on in (False, True):
        with make_llm(async_scheduling=on) as llm:
            fail_forward(llm, monkeypatch, lambda i, ids: bool((ids == POISON).any()))
            real, count = llm.runner.sampler.draw, [0]

            def draw(probs: Any, sid: Any, p: SamplingParams, _real: Callable = real) -> Any:
                count[0] += 1
                if count[0] == 3:
                    raise RuntimeError("injected sampling failure")
                return _real(probs, sid, p)

            monkeypatch.setattr(llm.runner.sampler, "draw", draw)
            outs = run_online(llm, ps, params, (0, 0, 2, 2, 3))
            runs[on] = [(o.token_ids, o.finish_reason, o.error) for o in outs]
            monkeypatch.undo()
            assert llm.cache.num_free_reqids == 4 and llm.runner.sampler.generators == {}
            assert_matches(llm.generate(prompts()[:2], greedy_params()[:2]), reference()[:2])
    assert runs[True] == runs[False]
    assert runs[True][3][1] == "error" and "alone" in runs[True][3][2]
    assert runs[True][4][1] == "error" and "injected sampling failure" in runs[True][4][2]
    assert len(runs[True][4][0]) == 2
    assert [t for t, _, _ in runs[True][:3]] == [list(r) for r in reference()[:3]]


def test_a_request_that_cannot_fit_even_alone_ends_with_the_same_tokens() -> None:
    """The scheduler fails a request that cannot run alone while its last token is in flight:
    it is finished once that token is taken, with the tokens it has synchronously."""
    runs = {}
    for on in (False, True):
        with make_llm(tiny_config("qwen2", 4), async_scheduling=on, preemption_mode="swap",
                      physical_memory=80 << 10) as llm:
            outs = run_online(llm, prompts(), greedy_params())
            runs[on] = [(o.token_ids, o.finish_reason, o.error) for o in outs]
            assert llm.cache.num_free_reqids == 4
    assert runs[True] == runs[False]
    failed = [r for r in runs[True] if r[1] == "error"]
    assert failed and all("even when it runs alone" in e for _, _, e in failed) and all(t for t, _, _ in failed)


# --------------------------------------------------- every feature, async = sync ----
def standard() -> Workload:
    return prompts(), greedy_params(), ARRIVALS


def no_eos() -> Workload:  # the state models' configs have no EOS
    return prompts(), [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS], ARRIVALS


def system() -> Workload:
    return [list(p) for p in system_prompts()], system_params(), SYSTEM_ARRIVALS


def samples() -> Workload:
    """n > 1: greedy samples (forks of the prompt's slot), and seeded ones at temperature 0.8."""
    params = [SamplingParams(temperature=0, max_tokens=m, n=3) if i % 2 else
              SamplingParams(temperature=0.8, top_p=0.9, max_tokens=m, n=2, seed=i) for i, m in enumerate(MAX_TOKENS)]
    return prompts(), params, ARRIVALS


def seeded() -> Workload:
    params = [SamplingParams(temperature=1.0, top_k=20, max_tokens=m, seed=100 + i) for i, m in enumerate(MAX_TOKENS)]
    return prompts(), params, ARRIVALS


MODELS: dict[str, Callable[[], Any]] = {
    "llama": tiny_config, "qwen2-mha": lambda: tiny_config("qwen2", 4),
    "gemma3": lambda: family_config("gemma3"), "mistral": lambda: family_config("mistral"),
    "bamba": lambda: hybrid_config("bamba"), "qwen3_next": lambda: hybrid_config("qwen3_next"),
}
SLOW = pytest.mark.slow
# id: (model, engine arguments, workload)
MATRIX = [
    pytest.param("llama", {}, standard, id="llama"),
    pytest.param("llama", dict(max_num_batched_tokens=16, physical_memory=80 << 10), standard,
                 id="chunked-prefill,recompute"),
    pytest.param("llama", dict(enable_prefix_caching=True, preemption_mode="swap", physical_memory=128 << 10),
                 system, id="prefix-caching,swap"),
    pytest.param("llama", dict(max_batch_size=6, physical_memory=120 << 10), samples, id="n>1,forks"),
    pytest.param("llama", {}, stop_workload, id="stop-tokens"),
    pytest.param("gemma3", dict(max_num_batched_tokens=BATCHED, prefetch=False), standard, id="sliding-window"),
    pytest.param("bamba", dict(max_num_seqs=3, max_num_batched_tokens=16), no_eos, id="recurrent-state"),
    # the larger matrix
    pytest.param("llama", dict(layout="fused", max_num_batched_tokens=16), standard, id="fused,chunked", marks=SLOW),
    pytest.param("qwen2-mha", dict(preemption_mode="swap", physical_memory=112 << 10), standard, id="mha,swap",
                 marks=SLOW),
    pytest.param("llama", dict(enable_prefix_caching=True, layout="fused", physical_memory=120 << 10,
                               max_num_batched_tokens=32), system, id="prefix-caching,fused,recompute", marks=SLOW),
    pytest.param("llama", dict(enable_prefix_caching=True, max_batch_size=6), samples, id="prefix-caching,n>1",
                 marks=SLOW),
    pytest.param("llama", {}, seeded, id="seeded-sampling", marks=SLOW),
    pytest.param("llama", dict(background=False, prefetch=False), standard, id="no-premapping", marks=SLOW),
    pytest.param("mistral", dict(max_num_batched_tokens=BATCHED, enable_prefix_caching=True,
                                 preemption_mode="swap", physical_memory=112 << 10), system,
                 id="sliding-window,prefix-caching,swap", marks=SLOW),
    pytest.param("bamba", dict(max_batch_size=6, physical_memory=memory_cap("bamba", 24, rows=4),
                               preemption_mode="swap"), samples, id="recurrent-state,n>1,swap", marks=SLOW),
    pytest.param("qwen3_next", dict(enable_prefix_caching=True, max_num_batched_tokens=16), system,
                 id="recurrent-state,prefix-caching", marks=SLOW),
    pytest.param("llama", dict(compile=True), standard, id="compile", marks=SLOW),
]


def serve(model: str, kw: dict[str, Any], workload: Callable[[], Workload], on: bool) -> tuple[list, dict]:
    """The workload online (helpers.run_online) on a fresh engine; each request's samples
    (tokens, finish reason, error) and the engine's figures. Nothing may be left over."""
    plist, params, arrivals = workload()
    with make_llm(MODELS[model](), async_scheduling=on, **kw) as llm:
        outs = run_online(llm, plist, params, arrivals)
        assert llm.cache.num_free_reqids == llm.config.max_batch_size, "a slot leaked"
        assert llm.runner.sampler.generators == {}, "a sampler's generator leaked"
        assert not llm._in_flight
        llm.cache.allocator.check_invariants()
        pc = llm.prefix_cache_stats()
        figures = dict(fed=llm.runner.num_fed_tokens, preemptions=llm.num_preemptions,
                       swapped=llm.scheduler.num_swapped_out, hits=pc.num_hit_tokens if pc else 0)
    return [[(c.token_ids, c.finish_reason, c.error) for c in o.outputs] for o in outs], figures


@pytest.mark.parametrize("model,kw,workload", MATRIX)
def test_outputs_equal_synchronous_scheduling(model: str, kw: dict[str, Any], workload: Callable) -> None:
    sync, sync_figures = serve(model, kw, workload, False)
    outs, figures = serve(model, kw, workload, True)
    assert outs == sync
    assert all(why in ("stop", "length") for o in outs for _, why, _ in o)
    assert figures["fed"] > 0 and sync_figures["fed"] == 0
    wanted = dict(preemptions="physical_memory" in kw, swapped=kw.get("preemption_mode") == "swap",
                  hits=kw.get("enable_prefix_caching", False))
    for name, want in wanted.items():  # the case's features were exercised, in both modes
        assert not want or (figures[name] > 0 and sync_figures[name] > 0), (name, figures, sync_figures)


# ----------------------------------------------------------- tensor parallelism ----
def _tp_async(rank: int, ports: list[int]) -> dict[str, Any]:
    """A spawned rank (tests.engine.test_tp.spawn): the standard workload and preemptions,
    asynchronous and synchronous, on two ranks."""
    from tests.engine.test_tp import TP, online

    out = {}
    for on in (False, True):
        with LLM(tiny_config(), **{**TP, "max_batch_size": 4, "physical_memory": 48 << 10,
                                   "async_scheduling": on}) as llm:
            out[on] = (online(llm), llm.num_preemptions, llm.runner.num_fed_tokens)
    return out


@SLOW
def test_tensor_parallel_outputs_equal_synchronous_scheduling(tmp_path: Path) -> None:
    """Under tensor parallelism async scheduling is off by default (rank 0's tokens reach the
    other ranks on the host, so nothing hides); asked for, it serves the same tokens."""
    from tests.engine.test_tp import spawn

    (r0, r1), codes = spawn(f"{__name__}:_tp_async", tmp_path)
    assert codes == [0, 0]
    assert r0[True][0] == r0[False][0] == [list(r) for r in reference()]
    assert r0[True][1] > 0 and r1[True][1] == r0[True][1]  # preempted, the same on both ranks
    assert r0[True][2] > 0 and r1[True][2] == r0[True][2]


# ---------------------------------------------------------------------- CUDA ----
def test_the_kernels_metadata_comes_in_one_copy() -> None:
    """The varlen kernels' int32 tensors, copied to the device in one copy (through pinned
    memory on CUDA: it does not wait for the iteration in flight), built here on the host."""
    from vattn.attention import AttentionMetadata

    meta = AttentionMetadata.build([1, 3, 4], [5, 0, 7], [1, 4, 1], 100, torch.device("cpu"))
    t = meta.cuda_tensors()
    assert {k: v.tolist() for k, v in t.items()} == {
        "cu_seqlens_q": [0, 1, 5, 6], "cu_seqlens_k": [100, 300, 400, 408], "seqused_k": [6, 4, 8], "slots": [1, 3, 4]}
    assert all(v.dtype == torch.int32 and v.is_contiguous() for v in t.values())
    assert meta.slot_ids.tolist() == [1, 3, 3, 3, 3, 4] and meta.positions.tolist() == [5, 0, 1, 2, 3, 7]


def test_graph_buffers_take_tokens_in_flight_from_the_device() -> None:
    """What a CUDA graph's replay reads (its static buffers, filled here on the host's device):
    rows whose token is in flight take it from the previous iteration's tokens, others the
    host's, and padding rows repeat the last row."""
    from vattn.engine.cuda_graphs import DecodeGraphs, GraphTarget

    target = GraphTarget(logits=None, kernel=None, k_caches=[], v_caches=[], device=torch.device("cpu"),
                         slot_tokens=100, max_context_len=64, synchronize=lambda: None)
    graphs = DecodeGraphs(target, 8)
    fed = torch.tensor([50, 51, 52])  # [S'] the previous iteration's sampled tokens
    graphs._fill([0, 2, 5], [10, 11, 12], [7, 0, 0], 4, [(1, 2), (2, 0)], fed)
    assert graphs.input_ids[0, :4].tolist() == [7, 52, 50, 50]
    assert graphs.positions[:4].tolist() == [10, 11, 12, 12]
    assert graphs.seqused_k[:4].tolist() == [11, 12, 13, 13]
    graphs._fill([3], [4], [9], 2)  # no token in flight
    assert graphs.input_ids[0, :2].tolist() == [9, 9]



@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_decodes_read_their_tokens_on_the_device(graphs: bool) -> None:
    """On a GPU (pending: run by the GPU suite): async scheduling is on by default; with and
    without CUDA graphs its tokens equal synchronous scheduling's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = dict(seed=0, device="cuda", dtype="float16", max_batch_size=8, page_size=2 << 20, cuda_graphs=graphs)
    runs = {}
    for on in (None, False):
        with LLM(tiny_config(), async_scheduling=on, **args) as llm:
            assert llm.async_scheduling == (on is None)
            runs[on] = [o.token_ids for o in run_online(llm, prompts(), greedy_params())]
            assert (llm.runner.num_fed_tokens > 0) == (on is None)
            if graphs:
                assert llm.runner.graphs.num_replays > 0 and llm.runner.graphs.disabled_reason is None
    assert runs[None] == runs[False]
