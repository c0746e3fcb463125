"""`vattn bench offload` on tiny settings: every system serves the multi-turn chat with
transformers' tokens, the restart hits disk, the restore bandwidth is measured; JSON with the
environment and a PNG are written. No speed is asserted (the targets are the benchmark's)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from vattn import bench  # noqa: E402
from vattn.bench import offload  # noqa: E402

MODEL = ["--device", "cpu", "--turns", "2", "--first", "40", "--message", "20", "--answer", "4", "--page-size", "4096",
         "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128",
         "--vocab", "256", "--max-num-batched-tokens", "64"]
TINY = [*MODEL, "--users", "4", "--concurrency", "2", "--device-tokens", "128", "--bandwidth-blocks", "3"]


def test_offload_bench_serves_every_system_with_generates_tokens(tmp_path: Path) -> None:
    assert bench.main(["offload", *TINY, "--shape", "chat", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "offload_host.json").read_text())
    assert {"device", "torch", "commit", "date"} <= set(data["environment"])
    assert (tmp_path / "offload_host.png").stat().st_size > 1000
    assert not data["result"]["failures"]
    r = data["result"]["shapes"]["chat"]
    assert set(r["systems"]) == set(offload.SYSTEMS)
    for s in [*r["systems"].values(), r["cold"], r["restart"]]:
        assert s["agreement"]["equal"] and s["ttft_p50_ms"] > 0 and s["output_tok_s"] > 0
        assert s["step_p99_ms"] >= s["step_p50_ms"] > 0
    s = r["systems"]
    assert s["no_prefix"]["prefill_computed"] >= s["device"]["prefill_computed"] >= s["host"]["prefill_computed"]
    assert s["host"]["hits_host"] > 0 and s["host+disk"]["hits_disk"] > 0 and s["host_small"]["hits_disk"] == 0
    assert r["restart"]["hits_disk"] > 0 and r["restart"]["prefill_computed"] < r["cold"]["prefill_computed"]
    bw = data["result"]["bandwidth"]
    assert bw["bytes"] == 3 * bw["block_bytes"] and bw["restore_GBps"] > 0 and bw["copy_GBps"] > 0
    assert set(r["ratios"]) >= {"prefill_host_over_device", "ttft_p50_device_over_host",
                                "ttft_p50_host_over_unlimited", "step_p99_disk_over_host_small"}
    assert "restore_over_copy" in data["result"]["bandwidth_ratios"]


def test_offload_bench_pressure_shape(tmp_path: Path) -> None:
    """More requests in flight than device memory holds (about two conversations): requests
    wait and are preempted; the host tier never computes more than device-only, and every
    prompt is counted once per admission (queried: the prompts, and again only after a
    preemption)."""
    assert bench.main(["offload", *MODEL, "--shape", "pressure", "--users", "4", "--concurrency", "4",
                       "--device-tokens", "192", "--systems", "device", "host", "unlimited", "--bandwidth-blocks", "0",
                       "--no-plot", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "offload_host.json").read_text())["result"]
    assert not r["failures"] and set(r["shapes"]) == {"pressure"} and "restart" not in r["shapes"]["pressure"]
    s = r["shapes"]["pressure"]["systems"]
    prompts = sum(40 + t * (20 + 4) for t in range(2)) * 4  # (first, then history + message: 2 turns of 4 users)
    assert s["device"]["preemptions"] + s["host"]["preemptions"] > 0 or s["device"]["queried"] > prompts
    for name in ("device", "host", "unlimited"):
        assert s[name]["agreement"]["equal"]
        assert prompts <= s[name]["queried"] <= prompts + s[name]["preemptions"] * 100  # (a prompt < 100 tokens)
    assert s["host"]["prefill_computed"] <= s["device"]["prefill_computed"]
