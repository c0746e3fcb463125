"""Two `vllm serve` (vLLM's CPU build, its API server, EngineCore and worker processes) with
vattn's plugin on one `VATTN_BUDGET` move memory between them (issue 41, item 3): a burst at
A, then one at B, as `benchmarks/multi_server.py --server vllm` runs them (its functions start
the servers, send the bursts and sample each server's worker pages and the budget's books).
B's burst does not fit beside what A kept after its own, so A's scheduler gives back pages no
block holds and B maps them: the books show A shrink while B grows, the two never past the
budget's limit, and every answer is stock vLLM's (`VATTN_VLLM=0`, the same bursts).

`slow`: four vLLM servers start (two with the plugin, two stock), 1-2.5 minutes on 2 CPUs.
Skipped without a python with vLLM (`VATTN_VLLM_PYTHON`, default `/tmp/venv-vllmcpu/bin/python`:
docs/benchmarks.md, "vLLM's CPU build")."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integrations.test_vllm_real import vllm_python

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MB = 1 << 20


@pytest.fixture(scope="module")
def multi_server():
    py = vllm_python()
    if py is None:
        pytest.skip("no python with vLLM (set VATTN_VLLM_PYTHON; default /tmp/venv-vllmcpu/bin/python)")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import multi_server
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return multi_server, py


def test_two_vllm_serve_on_one_budget_move_memory_and_answer_as_stock(multi_server, tmp_path, monkeypatch):
    ms, py = multi_server
    monkeypatch.setenv("VATTN_VLLM_PYTHON", py)
    # 8 requests a burst, each 2 blocks of 2 MiB (a 50-90-token chat prompt and 96 tokens: over
    # 128); 40 MiB in all: A's burst maps about 34 MiB with the null block, so B's needs A's pages
    args = ms.options(["--server", "vllm", "--quick", "--modes", "shared", "stock", "--gap-s", "1"])
    assert args.requests == 8 and args.total_bytes == 40 * MB
    prompts = ms.make_prompts(args)
    ckpts = ms.checkpoints(args, tmp_path)
    shared = ms.run_mode("shared", ckpts, prompts, args, tmp_path)
    stock = ms.run_mode("stock", ckpts, prompts, args, tmp_path)

    runs = {"shared": shared, "stock": stock}
    for n in ("A", "B"):  # every request answered, each as stock vLLM answered it
        assert shared[n]["served"] == stock[n]["served"] == 8, (shared[n]["errors"], stock[n]["errors"])
        assert ms.equal_answers(runs, "stock", "shared")[n] == 8
    samples = shared["samples"]
    (a_burst, a_end), (b_burst, b_end) = [(b["start"], b["end"]) for b in shared["bursts"]]
    # the books: A's peak during its burst, then during B's burst A below it and B above its own
    # level at A's peak (memory moved from A to B); the sum never past the limit
    # a sample: (seconds, A's and B's physical pages, their mapped bytes in the books, their cached)
    a_peak, b_at_a_peak = max((s for s in samples if a_burst <= s[0] <= a_end), key=lambda s: s[3])[3:5]
    during_b = [s for s in samples if b_burst <= s[0] <= b_end]
    a_low = min(s[3] for s in during_b)
    b_high = max(s[4] for s in during_b)
    assert a_peak > 24 * MB, f"A's burst mapped {a_peak / MB:.1f} MiB only"
    assert a_low < a_peak - 8 * MB, f"A kept {a_low / MB:.1f} of {a_peak / MB:.1f} MiB while B burst"
    assert b_high > b_at_a_peak + 16 * MB, f"B grew from {b_at_a_peak / MB:.1f} to {b_high / MB:.1f} MiB only"
    assert max(s[3] + s[4] for s in samples) <= args.total_bytes
    # and the workers' physical pages followed the books (within the idle loop's poll)
    assert max(s[2] for s in during_b) > 16 * MB and min(s[1] for s in during_b) < a_peak - 8 * MB
