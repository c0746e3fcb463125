"""Decode under CUDA graphs (vattn.engine.cuda_graphs): the sizes and the settings on any
machine; on a GPU, graphs agree with the eager engine and a failed capture runs eagerly."""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from tests.helpers import PROMPT_LENS, greedy_params, prompts, run_online, tiny_config  # noqa: E402

from vattn.engine import LLM, SamplingParams  # noqa: E402
from vattn.engine.config import EngineConfig  # noqa: E402
from vattn.engine.cuda_graphs import DecodeGraphs, capture_sizes, padded_size  # noqa: E402
from vattn.errors import InvalidConfigError  # noqa: E402


def test_capture_sizes_and_padding() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    sizes = capture_sizes(20)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20, None]
    with pytest.raises(InvalidConfigError):
        capture_sizes(0)


def test_cuda_graphs_setting_is_checked() -> None:
    with pytest.raises(InvalidConfigError, match="cuda_graphs"):
        EngineConfig(cuda_graphs="yes")
    with pytest.raises(InvalidConfigError, match="CUDA device"):
        LLM(tiny_config(), device="cpu", cuda_graphs=True)
    with LLM(tiny_config(), device="cpu") as llm:  # None: where they apply, and not on the host
        assert llm.runner.graphs is None
        out = llm.generate([[5, 6, 7]], greedy_params()[0])[0]
        assert len(out.token_ids) == greedy_params()[0].max_tokens


# ----------------------------------------------------------------------------- CUDA ----
class LogitsLog:
    """Records every sampled row's logits per request, in order (the engine's sampler input)."""

    def __init__(self, llm: LLM) -> None:
        self.rows: dict[int, list[torch.Tensor]] = {}
        sampler = llm.runner.sampler
        sample = sampler.sample

        def spy(logits, seq_ids, params, **history):
            for i, sid in enumerate(seq_ids):
                self.rows.setdefault(sid[0], []).append(logits[i].float().cpu())
            return sample(logits, seq_ids, params, **history)

        sampler.sample = spy


def _engine(**kw) -> LLM:
    args = dict(seed=0, device="cuda", dtype="float16", max_batch_size=8, page_size=2 << 20)
    return LLM(tiny_config(), **{**args, **kw})


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["per-layer", "fused"])
def test_graph_decodes_agree_with_eager(layout: str) -> None:
    # online arrivals and different lengths: prefills, mixed and decode-only iterations, and
    # decode batches of 1 to 6 sequences (padded to 1, 2, 4 and 8)
    runs, logs = {}, {}
    for graphs in (False, True):
        with _engine(layout=layout, cuda_graphs=graphs) as llm:
            logs[graphs] = LogitsLog(llm)
            runs[graphs] = [o.token_ids for o in run_online(llm, prompts(), greedy_params())]
            if graphs:
                g = llm.runner.graphs
                assert g is not None and g.disabled_reason is None, g and g.disabled_reason
                assert g.num_replays > 0
                assert len(g.captured_sizes) >= 3 and set(g.captured_sizes) <= set(capture_sizes(8)), g.captured_sizes
            else:
                assert llm.runner.graphs is None
            llm.cache.allocator.check_invariants()
    # the rows of every step agree until a near-tie flips a token (fp16, other launch shapes)
    for rid, eager_rows in logs[False].rows.items():
        for step, (a, b) in enumerate(zip(eager_rows, logs[True].rows[rid])):
            torch.testing.assert_close(b, a, atol=5e-2, rtol=2e-2, msg=f"request {rid} step {step}")
            if a.argmax() != b.argmax():
                break
    assert sum(a == b for a, b in zip(runs[False], runs[True])) >= len(PROMPT_LENS) - 1


@pytest.mark.gpu
def test_graphs_are_on_by_default_on_cuda() -> None:
    with _engine() as llm:
        assert isinstance(llm.runner.graphs, DecodeGraphs)
        outs = llm.generate(prompts()[:3], greedy_params()[:3])
        assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in greedy_params()[:3]]
        assert llm.runner.graphs.num_replays > 0


@pytest.mark.gpu
@pytest.mark.parametrize("when", ["always", "captured"])
def test_a_model_that_cannot_be_captured_runs_eagerly(monkeypatch, caplog, when: str) -> None:
    # a forward that reads a device value on the host, always or only while captured: the
    # driver invalidates the capture, and torch leaves the device's generator "capturing"
    forward = DecodeGraphs._forward

    def syncs(self, b):
        out = forward(self, b)
        if when == "always" or torch.cuda.is_current_stream_capturing():
            out.sum().item()
        return out

    with _engine(cuda_graphs=False) as llm:
        eager = [o.token_ids for o in llm.generate(prompts(), greedy_params())]
    monkeypatch.setattr(DecodeGraphs, "_forward", syncs)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=3)
    with caplog.at_level(logging.WARNING, logger="vattn.engine.cuda_graphs"), _engine(cuda_graphs=True) as llm:
        got = [o.token_ids for o in llm.generate(prompts(), greedy_params())]
        g = llm.runner.graphs
        assert g.disabled_reason is not None, "the capture should have failed"
        assert "capturing the decode" in g.disabled_reason, g.disabled_reason
        assert g.num_replays == 0 and g.captured_sizes == []
        # the engine and the device are still sound: random ops on the device, a sampled request
        assert torch.randn(4, device="cuda").isfinite().all()
        assert len(llm.generate([prompts()[0]], sampled)[0].token_ids) == 8
        more = llm.generate([prompts()[0]], greedy_params()[0])[0]
    assert got == eager  # the same eager kernels: the same tokens
    assert more.token_ids == eager[0]
    assert any("CUDA graphs are off" in r.getMessage() for r in caplog.records)


# ------------------------------------------------- the graph path's buffers, on the host ----
class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose "graph" is the eager forward on the static buffers: runs the
    padding, the buffers and the capture metadata through the host's SDPA kernel."""

    def usable(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def _capture(self, b: int, slots: list[int], starts: list[int]) -> bool:
        self._graphs[b] = self._metadata(b, slots, starts)
        self.capture_s[b] = 0.0
        return True

    def _replay(self, b: int) -> torch.Tensor:
        from vattn.attention import forward_context

        r, meta = self.target, self._graphs[b]
        cu_k, used, pos = self.cu_seqlens_k[:b + 1].tolist(), self.seqused_k[:b].tolist(), self.positions[:b].tolist()
        assert cu_k == sorted(cu_k) and used == [p + 1 for p in pos]  # what the varlen kernel reads
        assert cu_k[-1] == cu_k[-2] + used[-1] and self.cu_seqlens_q[:b + 1].tolist() == list(range(b + 1))
        meta.slot_ids, meta.positions = self.slot_ids[:b], self.positions[:b]  # what the buffers hold now
        meta.slots, meta.starts = self.slot_ids[:b].tolist(), (self.positions[:b]).tolist()
        meta._plans.clear()
        with forward_context(r.context(meta)):
            return self._forward(b)


def test_graph_buffers_and_padding_match_transformers_on_the_host() -> None:
    from tests.helpers import assert_matches, reference

    with LLM(tiny_config(), seed=0, device="cpu", max_batch_size=8, page_size=4096, cuda_graphs=False) as llm:
        g = llm.runner.graphs = EagerGraphs(llm.runner.graph_target(), 8)
        outs = run_online(llm, prompts(), greedy_params())
        assert g.num_replays > 0 and len(g.captured_sizes) >= 3  # batches of 1 to 6 padded to 1, 2, 4 and 8
        llm.cache.allocator.check_invariants()
    assert_matches(outs, reference())
