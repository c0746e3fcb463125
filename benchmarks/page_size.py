"""Page-size experiment: what the page size (and layout) costs in memory and mapping work.

Serves a request trace (arXiv summarization, 1k requests committed in benchmarks/data/)
through the allocator with continuous batching and preemption, once per page size and
layout, under one physical-memory budget, and reports for each:
internal fragmentation (mapped to running requests but holding no token), peak mapped
memory, how many requests ran at once, preemptions, page groups mapped / unmapped, and
`step` latency. Ratios are against the smallest page of the per-layer layout.

    python benchmarks/page_size.py [--device cpu|cuda] [--requests 300] [--quick]

On the host backend the memory is real (memfd pages); the model shape is a Llama-3-8B
with 8 of its 32 layers so that the run fits a small machine (fragmentation of the
per-layer layout does not depend on the layer count; for `fused` it does: see --layers).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import vattn
from _common import environment, print_table, save
from vattn.workload import run_workload, trace_requests

KB, MB = 1 << 10, 1 << 20
TRACE = Path(__file__).resolve().parent / "data" / "arxiv_summarization_1k.csv"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--physical-memory", type=int, default=3 << 30, help="bytes of pages, all configs")
    ap.add_argument("--arrivals", type=float, default=0.2, help="requests per iteration (Poisson)")
    ap.add_argument("--quick", action="store_true", help="100 requests")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    n = 100 if args.quick else args.requests
    if cuda:
        configs = [("per-layer", 2 * MB), ("per-layer", 4 * MB), ("per-layer", 8 * MB), ("fused", 2 * MB), ("fused", 4 * MB)]
    else:
        configs = [("per-layer", 64 * KB), ("per-layer", 128 * KB), ("per-layer", 256 * KB), ("per-layer", 2 * MB),
                   ("fused", 256 * KB), ("fused", 2 * MB)]
    max_len = 8192
    rows = []
    for layout, page in configs:
        reqs = trace_requests(str(TRACE), n, max_len, seed=0, arrivals_per_iter=args.arrivals)
        with vattn.KVCache(num_layers=args.layers, num_kv_heads=8, head_dim=128, max_batch_size=args.max_batch_size,
                           max_context_len=max_len, dtype="float16", device=args.device, page_size=page,
                           layout=layout, physical_memory=args.physical_memory) as cache:
            g = cache.geometry
            rep = run_workload(cache, reqs, write_data=False)
            s = rep.summary()
        rows.append(dict(layout=layout, page_KiB=page // KB, tokens_per_page=page / g.token_bytes, **s))
        print(f"  {layout:9} {page // KB:5} KiB: {s['iterations']} iterations, {s['seconds']:.1f} s", flush=True)
    base = rows[0]
    for r in rows:
        r["fragmentation_vs_base"] = r["mean_fragmentation"] / base["mean_fragmentation"] if base["mean_fragmentation"] else float("nan")
        r["iterations_vs_base"] = r["iterations"] / base["iterations"]
        r["step_mean_vs_base"] = r["step_ms_mean"] / base["step_ms_mean"]
    print(f"\n{n} trace requests, {args.layers} layers x 8 KV heads x 128 fp16, budget {args.physical_memory / 2**30:.1f} GiB")
    print_table(["layout", "page KiB", "tok/page", "frag %", "peak mapped MiB", "running (saturated)", "preempt",
                 "iterations", "mapped", "unmapped", "step ms mean", "step ms p99", "frag x", "iters x"],
                [[r["layout"], r["page_KiB"], r["tokens_per_page"], 100 * r["mean_fragmentation"], r["peak_mapped_MiB"],
                  r["mean_running_saturated"], r["preemptions"], r["iterations"], r["pages_mapped"], r["pages_unmapped"],
                  r["step_ms_mean"], r["step_ms_p99"], r["fragmentation_vs_base"], r["iterations_vs_base"]] for r in rows])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    labels = [f"{r['layout']}\n{r['page_KiB']} KiB" for r in rows]
    ax1.bar(labels, [100 * r["mean_fragmentation"] for r in rows])
    ax1.set(ylabel="internal fragmentation (%)", title="mapped but empty, running requests")
    ax2.bar(labels, [r["mean_running_saturated"] for r in rows])
    ax2.set(ylabel="requests running while others wait", title=f"batch under a {args.physical_memory / 2**30:.1f} GiB budget")
    ax3.bar(labels, [r["step_ms_mean"] * 1e3 for r in rows], label="mean")
    ax3.set(ylabel="step() latency (us)", title=f"step() ({args.device})")
    for ax in (ax1, ax2, ax3):
        ax.tick_params(axis="x", labelsize=7)
    save(f"page_size_{'cuda' if cuda else 'host'}", {"env": environment(args.device), "args": vars(args), "rows": rows}, fig)


if __name__ == "__main__":
    main()
