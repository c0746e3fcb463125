"""`vattn bench`: every benchmark runs on a tiny setting through the real command and writes
a result (JSON with the environment, and a plot); the GPU ones skip cleanly without a GPU."""
from __future__ import annotations

import json

import pytest
import torch

from vattn.cli import main

ENV_KEYS = {"device", "torch", "commit", "date"}
MiB = 1 << 20


def _load(folder, name: str) -> dict:
    payload = json.loads((folder / f"{name}.json").read_text())
    assert ENV_KEYS <= payload["environment"].keys()
    assert payload["benchmark"] == name.rsplit("_", 1)[0]
    assert (folder / f"{name}.png").stat().st_size > 1000
    return payload["result"]


def test_help_lists_the_benchmarks(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in ("fragmentation", "alloc", "kernel", "gpu"):
        assert name in out


def test_fragmentation_models_and_replay_agree(tmp_path) -> None:
    assert main(["bench", "fragmentation", "--synthetic", "lognormal", "--requests", "60", "--max-context-len", "1024",
                 "--models", "yi-6b", "llama-3-8b", "--tp", "1", "--replay-requests", "30",
                 "--replay-budget-tokens", "8192", "--slots", "8", "--out", str(tmp_path)]) == 0
    res = _load(tmp_path, "fragmentation_host")
    rows = {(r["model"], r["system"]): r for r in res["rows"]}
    assert len(rows) == 2 * 11
    llama = {s: rows["llama-3-8b", s] for s in ("static", "paged-16", "vattn-L-64K", "vattn-L-256K", "vattn-F-64K")}
    assert llama["static"]["waste_pct"] > llama["vattn-L-256K"]["waste_pct"] > llama["vattn-L-64K"]["waste_pct"]
    assert llama["vattn-F-64K"]["waste_pct"] == 0  # one 64 KiB token a page: nothing wasted
    assert llama["vattn-L-64K"]["tokens_per_page"] == 32 and rows["yi-6b", "vattn-L-64K"]["tokens_per_page"] == 64
    assert llama["static"]["fit"] < llama["paged-16"]["fit"]
    assert rows["llama-3-8b", "vattn-L-256K"]["fit_vs_ref"] == 1.0
    # the real allocator maps exactly what the closed form says, request by request
    assert res["replays"] and all(r["requests"] == 30 for r in res["replays"])
    for r in res["replays"]:
        assert r["measured_waste_pct"] == pytest.approx(r["model_waste_pct"], rel=0.05, abs=0.05), r


def test_fragmentation_hybrid_models(tmp_path) -> None:
    """Sliding-window and Mamba hybrids: per-kind pools and vattn's windows against one block
    size for all layers; the real allocator maps what the closed form says, kind by kind."""
    assert main(["bench", "fragmentation", "--hybrid", "--requests", "200", "--hybrid-requests", "40",
                 "--hybrid-contexts", "8192", "--hybrid-replay-requests", "3", "--out", str(tmp_path)]) == 0
    payload = json.loads((tmp_path / "fragmentation_hybrid_host.json").read_text())
    assert payload["benchmark"] == "fragmentation" and (tmp_path / "fragmentation_hybrid_host.png").exists()
    res = payload["result"]
    rows = {(r["model"], r["workload"], r["manager"]): r for r in res["rows"]}
    g3 = {m: rows["gemma-3-27b", "long-8K", m] for m in ("uniform-16", "pools", "vattn-L-64K", "vattn-L-2M",
                                                           "vattn-L-2M-keep")}
    assert g3["pools"]["mean_request_MiB"] == g3["vattn-L-64K"]["mean_request_MiB"]  # 16 tokens a page either way
    assert g3["uniform-16"]["fit"] < g3["vattn-L-2M"]["fit"] < g3["pools"]["fit"]
    assert g3["vattn-L-2M-keep"]["window_MiB"] > 2 * g3["vattn-L-2M"]["window_MiB"]
    assert rows["gemma-2-9b", "long-8K", "pools"]["fit_vs_uniform"] > 1.03  # a 4096-token window binds at 8K
    jamba = rows["jamba-1.5-mini", "long-8K", "pools"]
    assert jamba["tokens_per_page"] == 80 and jamba["state_MiB"] > 8  # a page holds one Mamba layer's state
    assert ("gemma-2-9b", "long-128K", "pools") not in rows  # past its context
    assert res["replays"]
    for r in res["replays"]:
        assert r["measured_full_MiB"] == pytest.approx(r["model_full_MiB"], rel=1e-9), r
        assert r["measured_window_MiB"] == pytest.approx(r["model_window_MiB"], rel=1e-9), r


def test_fragmentation_new_layer_kinds(tmp_path) -> None:
    """DeepSeek-V3's latent, Llama 4's chunks and GPT-OSS's 128-token windows: each manager's
    bytes at one iteration are the closed form's, and the rows at 128K follow from them."""
    import numpy as np

    from vattn.bench import _hybrid

    def held(model: str, manager: str, length: int) -> dict[str, int]:  # one decode taking it to `length`
        m = next(x for x in _hybrid.MANAGERS if x.name == manager)
        h = _hybrid.held(m, _hybrid.HYBRIDS[model], np.array([length]), np.array([length - 1]))
        return {k: int(v[0]) for k, v in h.items()}

    # DeepSeek-V3, 61 layers: 576 latent values a token (1,152 bytes) against 128 heads x (192 + 128)
    assert held("deepseek-v3", "pools", 1000)["full"] == 1008 * 1152 * 61  # 63 blocks of 16 latent rows
    assert held("deepseek-v3", "uniform-16", 1000)["full"] == 1008 * 128 * 320 * 2 * 61
    assert held("deepseek-v3", "vattn-L-64K", 1000)["full"] == -(-1000 * 1152 // 65536) * 65536 * 61  # one buffer
    # Llama 4 Scout: 36 chunked layers (8192) and 12 NoPE full ones, 8 KV heads x 128 (2,048 bytes K)
    tb = 8 * 128 * 2
    assert held("llama-4-scout", "pools", 10000)["window"] == (625 - 512) * 16 * 2 * tb * 36  # from 8192
    assert held("llama-4-scout", "vattn-L-64K", 10000)["window"] == (313 - 8192 * tb // 65536) * 65536 * 2 * 36
    assert held("llama-4-scout", "pools", 10000)["full"] == 10000 * 2 * tb * 12
    # GPT-OSS-120B: 18 window layers of 128 tokens, 18 full ones, 8 KV heads x 64 (1,024 bytes K)
    assert held("gpt-oss-120b", "pools", 1000)["window"] == (63 - 872 // 16) * 16 * 2 * 1024 * 18
    assert held("gpt-oss-120b", "vattn-L-2M", 1000)["window"] == 2 * MiB * 2 * 18  # 2,048 tokens a page
    assert held("gpt-oss-120b", "vattn-L-64K", 5000)["window"] == (79 - 4872 // 64) * 65536 * 2 * 18

    assert main(["bench", "fragmentation", "--hybrid", "--requests", "100", "--hybrid-requests", "30",
                 "--hybrid-contexts", "131072", "--hybrid-replay-requests", "0", "--hybrid-models", "deepseek-v3",
                 "llama-4-scout", "gpt-oss-120b", "--no-plot", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fragmentation_hybrid_host.json").read_text())["result"]
    rows = {(r["model"], r["manager"]): r for r in res["rows"] if r["workload"] == "long-128K"}
    assert len(rows) == 3 * len(_hybrid.MANAGERS)
    ds = {m: r for (model, m), r in rows.items() if model == "deepseek-v3"}
    assert ds["pools"]["fit_vs_uniform"] == pytest.approx(128 * 320 / 576)  # 71x: the latent, same blocks
    assert ds["vattn-L-64K"]["tokens_per_page"] == pytest.approx(65536 / 1152)
    assert ds["pools"]["fit"] >= ds["vattn-L-64K"]["fit"] >= ds["vattn-L-2M"]["fit"] > 60 * ds["uniform-16"]["fit"]
    for model in ("llama-4-scout", "gpt-oss-120b"):  # windows given back; keeping them costs about uniform's
        r = {m: x for (mo, m), x in rows.items() if mo == model}
        assert r["pools"]["fit"] > r["vattn-L-64K"]["fit"] > r["vattn-L-2M"]["fit"] > r["uniform-16"]["fit"]
        assert r["vattn-L-2M-keep"]["fit"] < r["uniform-16"]["fit"] * 1.01
        assert r["pools"]["full_MiB"] == r["uniform-16"]["full_MiB"]  # full layers: every token either way
    # vattn's chunked kind gives back from the query's chunk start, as the pools do: within its pages' rounding
    l4 = {m: x for (mo, m), x in rows.items() if mo == "llama-4-scout"}
    assert 1.0 <= l4["vattn-L-64K"]["window_MiB"] / l4["pools"]["window_MiB"] < 1.1


def test_fragmentation_trace_csv(tmp_path, capsys: pytest.CaptureFixture) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{100 + 37 * i},{5 + i}\n" for i in range(20)))
    assert main(["bench", "fragmentation", "--trace", str(trace), "--models", "yi-34b", "--tp", "2",
                 "--replay-requests", "10", "--replay-budget-tokens", "4096", "--slots", "4", "--no-plot",
                 "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "fragmentation_host.json").read_text())["result"]
    assert res["requests"] == 20 and res["max_context_len"] == 100 + 37 * 19 + 5 + 19
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,output\n10,5\n")
    assert main(["bench", "fragmentation", "--trace", str(bad), "--out", str(tmp_path)]) == 2
    assert "num_prefill_tokens" in capsys.readouterr().err


def test_alloc_maps_in_step_only_when_synchronous(tmp_path) -> None:
    assert main(["bench", "alloc", "--layers", "2", "--pages", "65536", "--max-groups", "4", "--reps", "2",
                 "--batch", "2", "--iters", "20", "--compute-ms", "0.1", "--out", str(tmp_path)]) == 0
    res = _load(tmp_path, "alloc_host")
    sync = [r for r in res["new_request"] if r["mode"] == "sync"]
    assert [r["new_groups"] for r in sync] == [1, 2, 4]
    assert all(r["groups_mapped_in_step"] == r["new_groups"] and r["GBps"] > 0 for r in sync)
    background = [r for r in res["new_request"] if r["mode"] == "background"]
    assert all(r["groups_mapped_in_step"] == 0 for r in background)  # the worker mapped the slot ahead
    assert [r["mode"] for r in res["decode"]] == ["on-demand", "sync pre-map", "background"]


def test_kernel_harness_on_the_cpu(tmp_path) -> None:
    assert main(["bench", "kernel", "--device", "cpu", "--batches", "2", "--contexts", "40", "--blocks", "16", "32",
                 "--out", str(tmp_path)]) == 0
    res = _load(tmp_path, "kernel_host")
    per_layer = [r for r in res["rows"] if r["layout"] == "per-layer"]
    assert {r["phase"] for r in per_layer} == {"decode", "prefill"}
    for r in res["rows"]:
        assert "error" not in r and "check_failed" not in r and r["equal_to_contiguous"], r
    assert all(r["paged16_kernel"].startswith("gather") and r["paged32_us"] > 0 for r in per_layer)
    assert not res["failures"]
    # what ran is what the figures are called: the gather stand-in is gather<bs>, never paged<bs>
    assert "decode gather16/virtual" in res["summary"] and not any("paged" in k for k in res["summary"])
    from vattn.bench import kernel

    headers, _ = kernel.table(res)
    assert "gather16 us" in headers and not any(h.startswith("paged") for h in headers)
    rows = [dict(paged16_kernel="aten._flash_attention_forward block_table"), dict(paged16_kernel="gather + x")]
    assert [kernel.block_label(rows[:1], 16), kernel.block_label(rows, 16)] == ["paged16", "paged|gather16"]


def test_kernel_skips_cases_over_the_memory_estimate(tmp_path) -> None:
    from vattn.bench import kernel

    assert kernel.per_layer_bytes(64, 32768, 3, cuda=True) == 80 << 30  # over 70 GiB: skipped on an 80 GB GPU
    assert main(["bench", "kernel", "--device", "cpu", "--batches", "2", "--contexts", "40", "--max-GiB", "0",
                 "--no-plot", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "kernel_host.json").read_text())["result"]
    assert {r["layout"] for r in res["rows"]} == {"fused"}
    assert any("per-layer B=2 T=40: needs about" in s for s in res["skipped"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip without a GPU")
@pytest.mark.parametrize("name", ["kernel", "gpu"], ids=["bench-kernel", "bench-gpu"])  # not the "gpu" marker
def test_gpu_benchmarks_skip_without_a_gpu(name: str, tmp_path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", name, "--out", str(tmp_path)]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_gpu_runs_its_parts_into_out(tmp_path) -> None:
    """The wiring of `vattn bench gpu`, with its CPU check of the kernel part."""
    assert main(["bench", "gpu", "--device", "cpu", "--parts", "kernel", "--budget-s", "300",
                 "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu_host.json").read_text())["result"]
    assert [(p["part"], p["status"]) for p in res["parts"]] == [("kernel", "passed")]
    assert "--budget-s" in res["parts"][0]["argv"] and not res["failures"]
    assert _load(tmp_path, "kernel_host")["rows"]


def test_alloc_vmm_calls_on_both_fake_drivers(monkeypatch: pytest.MonkeyPatch, fake_cuda) -> None:
    """`alloc --device cuda`'s driver-call timings through the C extension (tests/fake_cuda) and
    cuda-python (the recording driver of test_cuda_driver): every call timed, nothing left live."""
    import argparse
    import math

    import vattn
    from tests.vmem.test_cuda_driver import FakeDriver
    from vattn.bench import alloc
    from vattn.vmem.cuda import CudaBackend

    drivers: dict[str, FakeDriver] = {}

    def cache(args, driver, reps):
        if driver == "cext":
            backend = fake_cuda.backend()
        else:
            drivers[driver] = FakeDriver()
            backend = CudaBackend(0, "cuda-python", driver_module=drivers[driver], host_memory=True)
        return vattn.KVCache(num_layers=1, num_kv_heads=8, head_dim=128, dtype="float16", device="cpu",
                             max_batch_size=1, max_context_len=reps * 1024, backend=backend, prefetch=False)

    monkeypatch.setattr(alloc, "_vmm_cache", cache)
    rows = alloc.vmm_calls(argparse.Namespace(device="cuda"), reps=3)
    assert [r["driver"] for r in rows] == ["cext", "cuda-python"]
    for r in rows:
        assert "error" not in r, r
        assert all(r[k] > 0 for k in ("create", "map", "unmap", "release")), r
    assert math.isnan(rows[0]["set_access"]) and rows[1]["set_access"] > 0  # cext: map and access in one call
    fake = drivers["cuda-python"]
    assert sum(c[0] == "cuMemCreate" for c in fake.calls) == 3 and not fake.handles and not fake.mapped
    assert fake.current() == 0  # the caller's (no) context is current again


def test_the_saved_device_is_the_one_run_used(tmp_path) -> None:
    """overlap and throughput pick cuda inside run() when --device is not given: the file name
    and the environment follow what run used, not the default before it."""
    import argparse
    import types

    from vattn import bench

    mod = types.SimpleNamespace(NAME="fake", NEEDS_GPU=False, table=lambda r: (["x"], [[1]]), plot=lambda r: None)

    def run(args):  # as overlap/throughput do: the device is chosen here
        args.device = args.device or "cuda"
        return dict(device=args.device)

    mod.run = run
    payload = bench.execute(mod, "fake", argparse.Namespace(device=None, out=str(tmp_path), no_plot=True))
    assert payload["path"].endswith("fake_cuda.json") and payload["environment"]["device_kind"] == "cuda"
    mod.run = lambda args: {}  # no device in the result: args.device
    payload = bench.execute(mod, "fake", argparse.Namespace(device="cpu", out=str(tmp_path), no_plot=True))
    assert payload["path"].endswith("fake_host.json")

