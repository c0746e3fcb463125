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
