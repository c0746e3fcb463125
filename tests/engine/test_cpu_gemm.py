"""The host's linear layers on oneDNN with packed weights (`vattn.engine.cpu_gemm`, the
engine's default on the host): tokens equal transformers' `generate` (whose `F.linear` is
MKL's), the layers put back at close, every refusal clear."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.helpers import assert_matches, greedy_params, prompts, reference, run_online, tiny_config  # noqa: E402
from vattn.engine import LLM  # noqa: E402
from vattn.engine.cpu_gemm import MIN_ROWS, onednn_available, pack_linears  # noqa: E402
from vattn.errors import InvalidConfigError  # noqa: E402

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")


def packed(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "forward" in m.__dict__]


@needs_onednn
@pytest.mark.parametrize("setting", ["auto", "onednn", "default"])
def test_engine_tokens_equal_generate_and_layers_come_back(setting):
    with LLM(tiny_config("llama", 2), seed=0, max_batch_size=4, cpu_linear=setting) as llm:
        model = llm.runner.model
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        assert packed(model) == ([] if setting == "default" else linears)  # lm_head too
        outs = run_online(llm, prompts(), greedy_params())
    assert_matches(outs, reference("llama", 2))
    assert packed(model) == []  # close() put F.linear back


@needs_onednn
def test_packed_forward_equals_f_linear_and_keeps_one_row_on_gemv():
    lin = torch.nn.Linear(64, 96).eval()
    ref = {rows: lin(torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))) for rows in (1, 2, 9)}
    p = pack_linears(torch.nn.Sequential(lin), torch.float32, torch.device("cpu"), "auto")
    assert p is not None and p.bytes == 64 * 96 * 4
    with torch.no_grad():
        for rows, want in ref.items():
            got = lin(torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)))
            if rows < MIN_ROWS:
                assert torch.equal(got, want)  # F.linear itself
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    p.unpack()
    assert "forward" not in lin.__dict__


def test_refusals():
    with pytest.raises(InvalidConfigError, match="cpu_linear"):
        LLM(tiny_config("llama", 2), cpu_linear="mkl")
    assert pack_linears(torch.nn.Linear(4, 4), torch.float16, torch.device("cpu"), "auto") is None  # stays F.linear
    with pytest.raises(InvalidConfigError, match="float32 or bfloat16"):
        pack_linears(torch.nn.Linear(4, 4).half(), torch.float16, torch.device("cpu"), "onednn")


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(64, n) for n in (64, 32, 32))
        self.o_proj = torch.nn.Linear(64, 64)
        with torch.no_grad():
            for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))


def _matmuls(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "mkldnn::_linear_pointwise")


@needs_onednn
def test_siblings_of_one_input_run_as_one_matmul():
    """q/k/v (and gate/up) called on the same tensor: one oneDNN matmul, each its own columns;
    a call on another input computes afresh; o_proj stays alone."""
    m = _Attention().eval()
    x, y = torch.randn(5, 64), torch.randn(7, 64)
    want = {name: getattr(m, name)(x) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    p = pack_linears(m, torch.float32, torch.device("cpu"), "auto")
    assert p is not None and p.fused == 1 and len(p.modules) == 4
    with torch.no_grad():
        got: dict[str, torch.Tensor] = {}
        assert _matmuls(lambda: got.update((n, getattr(m, n)(x)) for n in ("q_proj", "k_proj", "v_proj"))) == 1
        for name, out in got.items():
            torch.testing.assert_close(out, want[name], rtol=1e-5, atol=1e-4)
        assert _matmuls(lambda: got.update(k=m.k_proj(y), v=m.v_proj(y), k2=m.k_proj(y))) == 2  # k again: afresh
        torch.testing.assert_close(got["k"], torch.nn.functional.linear(y, m.k_proj.weight, m.k_proj.bias),
                                   rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got["k2"], got["k"])
        torch.testing.assert_close(m.o_proj(x), want["o_proj"], rtol=1e-5, atol=1e-4)
    p.unpack()
    assert not any("forward" in lin.__dict__ for lin in m.children())
