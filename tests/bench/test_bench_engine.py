"""`vattn bench overlap` and `vattn bench throughput` on tiny settings: they run the real engine
and transformers, write JSON with the environment and a PNG; no speed is asserted."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from vattn import bench  # noqa: E402
from vattn.integrations.hf_cb import memory_problem  # noqa: E402

# transformers' continuous batching cannot run here (5.17-5.20 on a host without psutil): the
# benchmarks leave it out and say why; everything else is checked as usual
CB_PROBLEM = memory_problem()

ENV_KEYS = {"device", "device_kind", "python", "torch", "vattn", "kernel", "commit", "date"}
TINY_MODEL = ["--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--device", "cpu"]


def _load(tmp_path: Path, name: str) -> dict:
    data = json.loads((tmp_path / f"{name}_host.json").read_text())
    assert ENV_KEYS <= set(data["environment"]), data["environment"]
    assert data["benchmark"] == name.split("_")[0]
    assert (tmp_path / f"{name}_host.png").stat().st_size > 1000
    return data["result"]


def test_throughput_compares_with_transformers_and_agrees(tmp_path: Path) -> None:
    argv = ["throughput", *TINY_MODEL, "--vocab", "256", "--intermediate", "128", "--requests", "5",
            "--prompt-len", "4", "30", "--output-len", "2", "9", "--equal-requests", "2", "--equal-prompt", "12",
            "--equal-output", "4", "--max-batch-size", "3", "--max-num-batched-tokens", "48", "--out", str(tmp_path),
            "--systems", "vattn", "vattn_async", "hf_generate", "hf_cb"]
    assert bench.main(argv) == 0
    r = _load(tmp_path, "throughput")
    assert r["greedy_agreement"] is True
    assert set(r["workloads"]) == {"mixed", "equal"}
    baselines = {"hf_generate"} | ({"hf_cb"} if not CB_PROBLEM else set())
    assert r.get("skipped", {}) == ({"hf_cb": CB_PROBLEM} if CB_PROBLEM else {})
    for w in r["workloads"].values():
        assert set(w["systems"]) == {"vattn", "vattn_async"} | baselines
        assert w["agreement_with_hf_generate"]["vattn"]["equal"] and w["agreement_with_hf_generate"]["vattn_async"]["equal"]
        assert [w["systems"][s]["engine"]["async_scheduling"] for s in ("vattn", "vattn_async")] == [False, True]
        assert CB_PROBLEM or w["agreement_with_hf_generate"]["hf_cb"]["equal"]
        for s in w["systems"].values():
            assert s["prefill_tok_s"] > 0 and s["output_tok_s"] > 0 and s["total_cpu_s"] > 0
        engine = w["systems"]["vattn"]["engine"]
        assert engine["iterations"] > 0 and engine["kernel"] == "sdpa"
        assert 0 <= engine["forward_ms"] <= engine["step_ms"]
        assert set(w["vattn_over"]) == {"vattn_async"} | baselines


def test_overlap_maps_at_page_boundaries_only_when_synchronous(tmp_path: Path) -> None:
    argv = ["overlap", *TINY_MODEL, "--head-dim", "16", "--batch", "2", "--page-size", "4096", "--iters", "40",
            "--warmup", "2", "--stagger", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    r = _load(tmp_path, "overlap")
    assert r["tokens_per_page"] == 4096 // (2 * 16 * 4)
    assert set(r["modes"]) == {"sync", "background"}
    assert r["boundary_iterations"]  # staggered: each request crosses once in the window
    sync = next(run for run in r["runs"] if run["mode"] == "sync")
    assert len(sync["latency_ms"]) == len(sync["step_ms"]) == 40
    mapped_at = [i for i, n in enumerate(sync["mapped_groups"]) if n]
    assert mapped_at == r["boundary_iterations"]  # on demand: exactly where a request enters a new page
    assert r["modes"]["sync"]["iterations_mapping"] == len(mapped_at)
    assert r["modes"]["background"]["iterations_mapping"] <= len(mapped_at)


def test_overlap_quick_and_budget(tmp_path: Path) -> None:
    """--quick: one page's worth of timed iterations; --budget-s: no new mode once it is spent
    (the first always runs)."""
    argv = ["overlap", *TINY_MODEL, "--head-dim", "16", "--batch", "2", "--page-size", "4096", "--warmup", "2",
            "--quick", "--budget-s", "0", "--no-plot", "--out", str(tmp_path)]
    assert bench.main(argv) == 0
    r = json.loads((tmp_path / "overlap_host.json").read_text())["result"]
    assert r["timed_iterations"] == r["tokens_per_page"] == 4096 // (2 * 16 * 4)
    assert list(r["modes"]) == ["sync"] and [x["mode"] for x in r["runs"]] == ["sync"]
    assert r["skipped"] == ["background repeat 0: time budget spent"]


def test_e2e_part_runs_all_systems_on_the_cpu(tmp_path: Path) -> None:
    """The end-to-end part of `vattn bench gpu` on the CPU (tiny model): every system decodes,
    agrees with generate, and has both decode figures (continuous batching: one manager)."""
    assert bench.main(["gpu", "--device", "cpu", "--quick", "--parts", "e2e", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "e2e_host.json").read_text())["result"]
    assert not r["failures"] and r["results"]
    cb = [] if CB_PROBLEM else ["hf_continuous_batching"]
    assert r["skipped"] == ([f"hf_continuous_batching: {CB_PROBLEM}"] if CB_PROBLEM else [])
    for res in r["results"]:
        assert set(res["systems"]) == {"vattn", "vattn_eager", "vattn_async", "hf_generate", *cb}, res["errors"]
        for s in res["systems"].values():
            assert s["decode_tok_s"] > 0 and s["decode_tok_s_in_run"] > 0, s
        for system in ("vattn", "vattn_eager", "vattn_async", *cb):
            assert res[f"{system}_vs_hf_generate"]["token_match"] == 1.0
        assert res["vattn_vs_vattn_eager"]["equal"] and res["vattn_vs_vattn_async"]["equal"]
        assert [res["systems"][s]["async_scheduling"] for s in ("vattn", "vattn_async")] == [False, True]
        for system in ("vattn", "vattn_eager", "vattn_async"):  # the engine's time outside the forward, per decode step
            eo = res["systems"][system]["engine_overhead"]
            assert eo["iterations"] == r["max_tokens"] - 1 and 0 < eo["outside_share"] < 1, eo
            assert 0 < eo["outside_ms_median"] < eo["step_ms_median"]
