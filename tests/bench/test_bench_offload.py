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

TINY = ["--device", "cpu", "--users", "4", "--turns", "2", "--first", "40", "--message", "20", "--answer", "4",
        "--concurrency", "2", "--device-tokens", "128", "--page-size", "4096", "--layers", "2", "--hidden", "64",
        "--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "256", "--bandwidth-blocks", "3",
        "--max-num-batched-tokens", "64"]


def test_offload_bench_serves_every_system_with_generates_tokens(tmp_path: Path) -> None:
    assert bench.main(["offload", *TINY, "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "offload_host.json").read_text())
    assert {"device", "torch", "commit", "date"} <= set(data["environment"])
    assert (tmp_path / "offload_host.png").stat().st_size > 1000
    r = data["result"]
    assert set(r["systems"]) == set(offload.SYSTEMS) and not r["failures"]
    for s in [*r["systems"].values(), r["cold"], r["restart"]]:
        assert s["agreement"]["equal"] and s["ttft_p50_ms"] > 0 and s["output_tok_s"] > 0
    s = r["systems"]
    assert s["no_prefix"]["prefill_computed"] >= s["device"]["prefill_computed"] >= s["host"]["prefill_computed"]
    assert s["host"]["hits_host"] > 0 and s["host+disk"]["hits_disk"] > 0
    assert r["restart"]["hits_disk"] > 0 and r["restart"]["prefill_computed"] < r["cold"]["prefill_computed"]
    bw = r["bandwidth"]
    assert bw["bytes"] == 3 * bw["block_bytes"] and bw["restore_GBps"] > 0 and bw["copy_GBps"] > 0
    assert set(r["ratios"]) >= {"prefill_host_over_device", "ttft_p50_device_over_host",
                                "ttft_p50_host_over_unlimited", "restore_over_copy"}
