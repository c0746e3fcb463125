"""An `LLM(...)` that raises leaves nothing behind: no budget participant, no thread, no
mapped page, no module of the model patched, the model's attention as it was.

Each refusal is raised by the real code: `cuda_graphs=True` on the CPU and
`attention="flash_attn_4"` without the package (refused before the cache is made), and
`offload_bytes` more than the host has for a swap-only engine (refused by the cache's host
store, after the cache exists: the runner closes what it built), an `offload_dir` that is a
file (refused by the prefix cache's disk tier: the engine closes its runner).
"""
from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.conftest import vattn_mappings  # noqa: E402
from tests.engine.test_model_support import hybrid_config  # noqa: E402
from tests.helpers import PAGE, build_model, tiny_config  # noqa: E402

import vattn  # noqa: E402
from vattn.attention import flash_attn_4_available  # noqa: E402
from vattn.engine import LLM  # noqa: E402
from vattn.engine.loader import seeded_model  # noqa: E402
from vattn.errors import InvalidConfigError  # noqa: E402
from vattn.integrations.hf import state_mixers  # noqa: E402

REFUSALS = {  # by name: (LLM's settings, given a file that is no directory; the refusal)
    "cuda_graphs": (lambda file: dict(cuda_graphs=True), "cuda_graphs=True: they need a CUDA device"),
    "flash_attn_4": (lambda file: dict(attention="flash_attn_4"), "needs FlashAttention 4"),
    # refused after the cache exists: by the cache's host store (the runner), by the prefix cache's disk tier (LLM)
    "offload_bytes": (lambda file: dict(preemption_mode="swap", offload_bytes=1 << 60),
                      "more than the host has available"),
    "offload_dir": (lambda file: dict(enable_prefix_caching=True, offload_bytes=1 << 20, offload_dir=file / "kv",
                                      offload_dir_bytes=1 << 20), "not a directory this process can write"),
}


def make_model(kind: str) -> Any:
    if kind == "bamba":  # a state model: its Mamba2 mixers are bound to the cache's state rows
        return seeded_model(hybrid_config("bamba"), 0)
    return build_model(tiny_config())


def mixers(model: Any) -> list[Any]:
    return state_mixers(model) if model.config.model_type == "bamba" else []


@pytest.mark.parametrize("kind", ["llama", "bamba"])
@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_refused_engine_leaves_nothing_behind(kind: str, refusal: str, tmp_path: Path) -> None:
    settings, match = REFUSALS[refusal]
    (tmp_path / "file").write_text("x")
    config = settings(tmp_path / "file")
    if refusal == "flash_attn_4" and flash_attn_4_available():
        pytest.skip("FlashAttention 4 is installed here")
    model = make_model(kind)
    attention = model.config._attn_implementation
    budget = vattn.Budget(1 << 22)
    gc.collect()
    threads, mappings = set(threading.enumerate()), vattn_mappings()

    with pytest.raises(InvalidConfigError, match=match):
        LLM(model, device="cpu", max_batch_size=2, max_context_len=128, page_size=PAGE, budget=budget,
            background=True, **config)

    assert budget.stats().num_participants == 0 and budget.used == 0  # at once, not when collected
    gc.collect()
    assert set(threading.enumerate()) == threads
    assert vattn_mappings() == mappings
    assert model.config._attn_implementation == attention
    assert all("forward" not in m.__dict__ for m in mixers(model)), "a state mixer is still bound to the cache"
    # the model serves an engine made after the refusal, which gives everything back when closed
    with LLM(model, device="cpu", max_batch_size=2, max_context_len=128, page_size=PAGE, budget=budget) as llm:
        assert budget.stats().num_participants == 1
        assert len(llm.generate([[5, 6, 7]], vattn.SamplingParams(max_tokens=2))[0].token_ids) == 2
    assert budget.stats().num_participants == 0 and model.config._attn_implementation == attention


def test_a_close_whose_first_step_fails_still_gives_the_memory_back() -> None:
    """Closing runs every step of the runner's close: the graphs' close raising (a CUDA
    error, say) does not keep the cache's memory and budget participant until the garbage
    collector finds them; the error is still raised."""
    budget = vattn.Budget(1 << 22)
    llm = LLM(build_model(tiny_config()), device="cpu", max_batch_size=2, max_context_len=128, page_size=PAGE,
              budget=budget)
    out = llm.generate([[5, 6, 7]], vattn.SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2 and budget.used > 0

    class FailingGraphs:  # the graphs of a GPU whose close meets a device error
        def close(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    llm.runner.graphs = FailingGraphs()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        llm.close()
    assert budget.stats().num_participants == 0 and budget.used == 0  # without a gc: closed, not collected
