"""`vattn bench paper`: each of the vAttention paper's figures runs at its `--quick` size on the
host through the real command and writes its JSON (with the environment) and PNG. The checks
are on structure and on values computed deterministically, never on timings."""
from __future__ import annotations

import argparse
import json
import math
import random

import pytest
import torch

import vattn
from vattn.bench import paper, paper_common, paper_engines
from vattn.cli import main

ENV_KEYS = {"device", "torch", "commit", "date"}


def _load(folder, n: int) -> dict:
    payload = json.loads((folder / f"paper_fig{n}_host.json").read_text())
    assert ENV_KEYS <= payload["environment"].keys()
    assert payload["benchmark"] == f"paper_fig{n}"
    assert (folder / f"paper_fig{n}_host.png").stat().st_size > 1000
    res = payload["result"]
    assert res["figure"] == n and res["paper_experiment"] == paper.PAPER[n][0] and res["headline"]
    for axis in res["scaled"].values():  # every scaled axis says the paper's value and the one used
        assert {"paper", "used"} <= axis.keys() and axis["paper"] != axis["used"]
    return res


def _check_decode(row: dict, system: str, iterations: int) -> None:
    """Figure 7's numbers of one engine: finite, positive, from `iterations` decode iterations."""
    tok_s, mean, ms = row[f"{system}_decode_tok_s"], row[f"{system}_decode_tok_s_mean"], row[f"{system}_iteration_ms"]
    assert all(math.isfinite(x) and x > 0 for x in (tok_s, mean, ms)), row
    assert row[f"{system}_decode_iterations"] == iterations, row


def test_help_lists_paper(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    assert e.value.code == 0
    assert "paper" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "paper", "--figure", "5"])  # not one of the paper's eight


def test_kernel_figures(tmp_path) -> None:
    assert main(["bench", "paper", "--quick", "--figure", "2", "3", "6", "--out", str(tmp_path)]) == 0
    index = json.loads((tmp_path / "paper_host.json").read_text())["result"]
    assert set(index["figures"]) == {"2", "3", "6"} and not index["failures"]
    assert index["figures"]["3"]["file"] == "paper_fig3_host.json"  # beside the index, wherever that is
    f2, f3, f6 = _load(tmp_path, 2), _load(tmp_path, 3), _load(tmp_path, 6)
    assert [r["context"] for r in f2["rows"]] == f2["scaled"]["contexts"]["used"]
    assert f2["scaled"]["contexts"]["paper"] == [1024, 2048, 4096, 8192, 16384, 32768]
    for res in (f2, f3, f6):
        assert not res["failures"]
        for r in res["rows"]:  # the same SDPA reads the same values from the virtual cache and plain memory
            assert r["equal_to_contiguous"] and r["virtual_us"] > 0
        for label in res["paged_labels"].values():  # the host has no paged kernel and says so
            assert label.startswith(paper.HOST_PAGED)
        assert all(r[f"paged{bs}_kernel"].startswith("gather") for r in res["rows"] for bs in res["paged_labels"])
    assert f3["blocks"] == [16, 32, 64, 128] and [r["batch"] for r in f3["rows"]] == [1, 4]
    assert all(r["phase"] == "decode" for r in f3["rows"]) and all(r["phase"] == "prefill" for r in f2["rows"])
    for r in f6["rows"]:
        assert r["virtual_tok_s"] == pytest.approx(r["context"] / (r["virtual_us"] * 1e-6))


def test_fig4_allocation_bandwidth(tmp_path) -> None:
    assert main(["bench", "paper", "--quick", "--figure", "4", "--out", str(tmp_path)]) == 0
    res = _load(tmp_path, 4)
    rows = res["rows"]
    assert [r["batch"] for r in rows] == [1, 4, 16] and res["scaled"]["batches"]["paper"][-1] == 300
    per_iter = [r["bytes_per_iteration"] for r in rows]
    assert per_iter == [b * res["token_bytes"] for b in (1, 4, 16)]  # the need grows with the batch
    assert per_iter == sorted(per_iter) and len(set(per_iter)) == 3
    for r in rows:
        assert r["prompt"] + r["new_tokens"] == 900
        assert r["needed_MBps"] == pytest.approx(r["decode_tok_s"] * res["token_bytes"] / 1e6)
    assert [a["page_KiB"] for a in res["available"]] == [64, 256, 2048]  # the page-size sweep
    for a in res["available"]:
        assert a["GBps"] > 0 and all(x["mode"] == "sync" for x in a["rows"])


def test_fig11_overlap_page_sweep(tmp_path) -> None:
    assert main(["bench", "paper", "--quick", "--figure", "11", "--out", str(tmp_path)]) == 0
    res = _load(tmp_path, 11)
    pages = sorted({r["page_KiB"] for r in res["rows"]})
    assert pages == [64, 256]
    for r in res["rows"]:
        assert r["tokens_per_page"] == r["page_KiB"] * 1024 // (16 * 128 * 4)  # 16 KV heads x 128, fp32
        assert r["boundary_iterations"] and len(r["series_ms"]) == r["iterations"]
        if r["mode"] == "sync":  # without pre-mapping every page is mapped inside step, on the critical path
            assert r["iterations_mapping_in_step"] >= 1
    assert {r["mode"] for r in res["rows"]} == {"sync", "background"}


def test_engine_figures_vattn_only(tmp_path) -> None:
    assert main(["bench", "paper", "--quick", "--no-paged-engine", "--figure", "7", "8", "9",
                 "--out", str(tmp_path)]) == 0
    f7, f8, f9 = _load(tmp_path, 7), _load(tmp_path, 8), _load(tmp_path, 9)
    for res in (f7, f8, f9):
        assert res["systems"] == ["vattn"] and any("--no-paged-engine" in n for n in res["notes"])
    assert [r["batch"] for r in f7["rows"]] == [1, 4]
    for r in f7["rows"]:  # timed per decode iteration inside the run: a real figure, never nan
        _check_decode(r, "vattn", r["new_tokens"] - 1)
    assert [r["context"] for r in f8["rows"]] == [512, 1024]
    assert f8["rows"][0]["prompt_tokens"] < f8["rows"][1]["prompt_tokens"]  # prompts scaled to the context
    assert all(r["vattn_requests_per_min"] > 0 and r["requests"] == 4 for r in f8["rows"])
    assert [r["fraction_of_capacity"] for r in f9["rows"]] == [0.5, 0.9]
    for r in f9["rows"]:  # every request finished, latency from its arrival
        assert len(r["latencies_s"]) == f9["requests"] and all(x > 0 for x in r["latencies_s"])


def test_one_png(tmp_path) -> None:
    assert main(["bench", "paper", "--quick", "--one-png", "--figure", "2", "--out", str(tmp_path)]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["paper_host.json", "paper_host.png"]
    res = json.loads((tmp_path / "paper_host.json").read_text())["result"]
    assert res["figures"]["2"]["result"]["rows"] and "image" not in res["figures"]["2"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_gpu_fails_clearly(tmp_path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "paper", "--device", "cuda", "--quick", "--figure", "11", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU and none is available" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    with pytest.raises(vattn.InvalidConfigError, match="needs a CUDA GPU"):
        paper.run(paper.argparse.Namespace(device="cuda", figure=[2], quick=True))


@pytest.mark.slow
def test_engine_figures_against_the_paged_engine(tmp_path) -> None:
    if paper.hf_cb_problem():
        pytest.skip(paper.hf_cb_problem())
    assert main(["bench", "paper", "--quick", "--figure", "7", "9", "--out", str(tmp_path)]) == 0
    f7, f9 = _load(tmp_path, 7), _load(tmp_path, 9)
    assert f7["systems"] == ["vattn", "hf_cb"]
    for r in f7["rows"]:
        _check_decode(r, "vattn", r["new_tokens"] - 1)
        _check_decode(r, "hf_cb", r["new_tokens"] - 2)  # the last forward has no next one to end it
        assert math.isfinite(r["vattn_over_paged"]) and r["vattn_over_paged"] > 0
    assert {r["system"] for r in f9["rows"]} == {"vattn", "hf_cb"}


def test_fig7_decode_timed_per_iteration() -> None:
    """Both engines' decode figures come from the iterations after the last prefill, each timed
    on its own (vattn: step(); the paged engine: forward start to the next forward's start): 3
    requests of 6 new tokens give 5 decode iterations of 3 tokens each (the paged engine's last
    one has no end mark), so the figures are finite and positive on a loaded host too."""
    args = argparse.Namespace(device="cpu", seed=0)
    model, shape = paper_common.model(args, paper_common.CUDA_ENGINE_MODEL, dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32), {})
    rng = random.Random(0)
    reqs = [(paper_common.seed_tokens(40, shape["vocab_size"], rng), 6) for _ in range(3)]
    v = paper_engines.decode_vattn(model, reqs, args, 256)
    assert v["decode_iterations"] == 5 and v["decode_tok_s"] == pytest.approx(3 / (v["iteration_ms"] / 1e3))
    assert all(math.isfinite(v[k]) and v[k] > 0 for k in ("decode_tok_s", "decode_tok_s_mean", "iteration_ms"))
    if paper.hf_cb_problem():
        pytest.skip(paper.hf_cb_problem())
    h = paper_engines.decode_hf_cb(model, reqs, paper_common.engine_args(3, 256))
    assert h["decode_iterations"] == 4
    assert all(math.isfinite(h[k]) and h[k] > 0 for k in ("decode_tok_s", "decode_tok_s_mean", "iteration_ms"))
    with pytest.raises(RuntimeError, match="no decode-only iteration"):  # one new token: nothing to time
        paper_engines.decode_vattn(model, [(p, 1) for p, _ in reqs], args, 256)
