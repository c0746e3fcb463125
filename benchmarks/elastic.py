"""Elastic KV memory under transformers' continuous batching: its own cache vs vattn memory.

Serves a bursty trace (bursts of requests, idle gaps between them) through one
`ContinuousBatchingManager` per mode, on a seeded model built from a config:

- `own`: transformers' `PagedAttentionCache` with its one `torch.zeros` cache tensor;
- `vattn`: the same cache on an `ElasticPool` (`vattn.integrations.hf_cb.enable`):
  sectors mapped when handed out, given back when free; in each idle gap the driver
  calls `trim(manager)` (prefix-sharing blocks evicted, free pages unmapped).

Reports throughput (generated tokens per busy second), process CPU time per token (the
steadier figure on a shared machine), request latency and time to first token, each as a
ratio vattn / own (median run of `--repeats`), and memory over time (the cache tensor's bytes
for `own`, mapped bytes for `vattn`, sampled every 10 ms). Greedy outputs of the two
modes must be equal. Writes benchmarks/results/elastic_<device>.json and .png.

    OMP_NUM_THREADS=1 python benchmarks/elastic.py [--device cpu|cuda] [--bursts 3] [--quick]
"""
from __future__ import annotations

import argparse
import copy
import csv
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from _common import environment, print_table, save  # noqa: E402

TRACE = Path(__file__).resolve().parent / "data" / "arxiv_summarization_1k.csv"
MB = 1 << 20


def build_model(args: argparse.Namespace) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=4096, initializer_range=0.2)
    torch.manual_seed(0)
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    return AutoModelForCausalLM.from_config(config, dtype=dtype).to(args.device).eval()


def bursty_trace(args: argparse.Namespace) -> list[list[tuple[list[int], int]]]:
    """Bursts of (prompt ids, new tokens): lengths from the arXiv trace, scaled down by 16."""
    with open(TRACE) as f:
        rows = list(csv.DictReader(f))
    g = torch.Generator().manual_seed(1)
    bursts, i = [], 0
    for _ in range(args.bursts):
        burst = []
        for _ in range(args.requests):
            r = rows[i % len(rows)]
            i += 1
            p = min(max(int(r["num_prefill_tokens"]) // 16, 16), args.max_prompt)
            d = min(max(int(r["num_decode_tokens"]) // 4, 8), args.max_new)
            burst.append((torch.randint(3, args.vocab, (p,), generator=g).tolist(), d))
        bursts.append(burst)
    return bursts


def run_mode(model: Any, mode: str, bursts: list, args: argparse.Namespace) -> dict[str, Any]:
    from transformers import GenerationConfig

    from vattn.bench._models import cb_cache_bytes, cb_config, cb_results
    from vattn.integrations import hf_cb

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=args.max_new)
    cbc = cb_config(args.block_tokens, num_blocks=args.num_blocks, max_batch_tokens=args.max_batch_tokens)
    handle = hf_cb.enable(model, page_size=args.page_size) if mode == "vattn" else None
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=copy.deepcopy(cbc))
    manager.start()
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    t0 = time.perf_counter()

    def memory() -> int:
        if handle is not None:
            s = handle.stats()
            return s.mapped_bytes if s is not None else 0
        cache = getattr(getattr(manager, "batch_processor", None), "cache", None)
        return cb_cache_bytes(cache) if cache is not None else 0

    def sampler() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter() - t0, memory()))
            time.sleep(0.01)

    def serve(burst: list, tag: str) -> tuple[list[Any], float, float]:
        start, cpu = time.perf_counter(), time.process_time()
        ids = [manager.add_request(p, request_id=f"{tag}_{k}", max_new_tokens=d, record_timestamps=True)
               for k, (p, d) in enumerate(burst)]
        done = cb_results(manager, ids, timeout_s=60)
        return [done[i] for i in ids], time.perf_counter() - start, time.process_time() - cpu

    serve([(list(range(3, 35)), 8)], "warmup")
    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    outputs, busy, cpu, latency, ttft, marks = [], 0.0, 0.0, [], [], []
    for b, burst in enumerate(bursts):
        marks.append(("burst", time.perf_counter() - t0))
        outs, secs, cpu_secs = serve(burst, f"b{b}")
        busy += secs
        cpu += cpu_secs
        for o in outs:
            outputs.append(o.generated_tokens)
            latency.append(o.lifespan[1] - o.created_time)
            if o.timestamps:
                ttft.append(o.timestamps[0] - o.created_time)
        marks.append(("idle", time.perf_counter() - t0))
        if handle is not None:
            handle.trim(manager)  # idle: give the memory back
        time.sleep(args.gap)
    stop.set()
    thread.join()
    peak = max(m for _, m in samples)
    idle = samples[-1][1]  # at the end of the last idle gap
    manager.stop(block=True, keep_for_next_session=False)
    manager.destroy()
    if handle is not None:
        handle.disable()
    tokens = sum(len(o) for o in outputs)
    return dict(mode=mode, outputs=outputs, tokens=tokens, busy_s=busy, throughput=tokens / busy,
                cpu_ms_per_token=1e3 * cpu / tokens,
                latency_mean=statistics.mean(latency), latency_p50=statistics.median(latency),
                latency_p99=sorted(latency)[int(0.99 * (len(latency) - 1))],
                ttft_mean=statistics.mean(ttft) if ttft else float("nan"),
                peak_MiB=peak / MB, idle_MiB=idle / MB,
                mean_MiB=statistics.mean(m for _, m in samples) / MB, samples=samples, marks=marks)


def add_model_args(ap: argparse.ArgumentParser, max_prompt: int, max_new: int) -> None:
    """The seeded model's shape, the trace's lengths and transformers' cache geometry (shared with burst.py)."""
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--max-prompt", type=int, default=max_prompt)
    ap.add_argument("--max-new", type=int, default=max_new)
    ap.add_argument("--block-tokens", type=int, default=32, help="tokens a transformers block (its page_size)")
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=None, help="vattn page bytes (default: the backend's)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--bursts", type=int, default=3)
    ap.add_argument("--requests", type=int, default=12, help="requests per burst")
    ap.add_argument("--gap", type=float, default=1.0, help="idle seconds between bursts")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode (alternating); the median run counts")
    add_model_args(ap, max_prompt=256, max_new=48)
    ap.add_argument("--num-blocks", type=int, default=256, help="transformers' cache size, in blocks")
    ap.add_argument("--quick", action="store_true", help="2 bursts of 6, one run per mode")
    args = ap.parse_args()
    if args.quick:
        args.bursts, args.requests, args.repeats, args.gap = 2, 6, 1, 0.5
    model = build_model(args)
    bursts = bursty_trace(args)
    runs: dict[str, list[dict]] = {"own": [], "vattn": []}
    for _ in range(args.repeats):
        for mode in ("own", "vattn"):
            runs[mode].append(run_mode(model, mode, bursts, args))
            r = runs[mode][-1]
            print(f"  {mode:5}: {r['tokens']} tokens in {r['busy_s']:.2f} s busy ({r['cpu_ms_per_token']:.2f} ms CPU "
                  f"a token), peak {r['peak_MiB']:.1f} MiB", flush=True)
    # the run of median throughput (the machine may be shared: CPU time per token is the steadier figure)
    best = {m: sorted(rs, key=lambda r: r["throughput"])[len(rs) // 2] for m, rs in runs.items()}
    same = all(r["outputs"] == runs["own"][0]["outputs"] for rs in runs.values() for r in rs)
    own, va = best["own"], best["vattn"]
    ratios = {k: va[k] / own[k] for k in ("throughput", "cpu_ms_per_token", "latency_mean", "latency_p99", "ttft_mean",
                                          "peak_MiB", "mean_MiB", "idle_MiB")}
    ratios["cpu_ms_per_token_min"] = (min(r["cpu_ms_per_token"] for r in runs["vattn"])
                                      / min(r["cpu_ms_per_token"] for r in runs["own"]))
    print(f"\n{args.bursts} bursts x {args.requests} requests, gap {args.gap} s, {args.layers} layers, "
          f"device {args.device}, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}; same greedy tokens: {same}")
    keys = ["throughput", "cpu_ms_per_token", "latency_mean", "latency_p50", "latency_p99", "ttft_mean", "peak_MiB",
            "mean_MiB", "idle_MiB"]
    print_table(["mode", "tok/s", "CPU ms/tok", "latency s", "p50", "p99", "TTFT s", "peak MiB", "mean MiB", "idle MiB"],
                [[m] + [best[m][k] for k in keys] for m in ("own", "vattn")]
                + [["vattn/own"] + [ratios.get(k, va[k] / own[k]) for k in keys]])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [2, 1]})
    for m, style in (("own", "-"), ("vattn", "-")):
        t, b = zip(*best[m]["samples"])
        ax1.plot(t, [x / MB for x in b], style, label=f"{m}")
    ax1.set(xlabel="seconds", ylabel="KV memory (MiB)", title="KV memory over a bursty trace")
    ax1.legend()
    names = ["throughput", "cpu_ms_per_token", "latency_mean", "latency_p99", "ttft_mean"]
    ax2.bar(names, [ratios[k] for k in names])
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set(ylabel="vattn / own", title="cost of elastic memory")
    ax2.tick_params(axis="x", rotation=20)
    payload = {
        "environment": environment(args.device),
        "args": vars(args),
        "same_greedy_tokens": same,
        "ratios_vattn_over_own": ratios,
        "modes": {m: {k: v for k, v in best[m].items() if k not in ("outputs", "samples")} for m in best},
        "memory_over_time": {m: best[m]["samples"][::5] for m in best},
        "all_runs_throughput": {m: [r["throughput"] for r in rs] for m, rs in runs.items()},
        "all_runs_cpu_ms_per_token": {m: [r["cpu_ms_per_token"] for r in rs] for m, rs in runs.items()},
    }
    import transformers

    payload["environment"]["transformers"] = transformers.__version__
    save(f"elastic_{args.device.split(':')[0]}", payload, fig)
    if not same:
        raise SystemExit("the two modes generated different tokens")


if __name__ == "__main__":
    main()
