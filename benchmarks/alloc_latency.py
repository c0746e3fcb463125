"""Cost of one page-group map and of one `step`, with and without background mapping.

Host backend by default (`--device cuda` for the GPU). Two experiments in one run:
1. map + unmap of one page group (one page in all 2 x num_layers buffers) per layout and
   page size: the batched C call versus one call per buffer;
2. `step` latency in a decode loop of `--batch` requests, with a model stand-in (a matmul
   of `--compute-ms`) between steps: on-demand (prefetch off), synchronous pre-mapping, and
   background pre-mapping, reported as ratios to on-demand.

    python benchmarks/alloc_latency.py [--device cpu] [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import vattn
from _common import environment, print_table, save

KB, MB = 1 << 10, 1 << 20


def _cfg(device: str, layout: str, page: int, **kw) -> dict:
    # Llama-3-8B-like per-GPU shape: 32 layers, 8 KV heads x 128, fp16 -> 2 KiB per token per buffer.
    return dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", device=device, page_size=page,
                layout=layout, **kw)


def bench_map(device: str, pages: list[int], reps: int) -> list[dict]:
    rows = []
    for layout in ("per-layer", "fused"):
        for page in pages:
            with vattn.KVCache(**_cfg(device, layout, page, max_batch_size=2, max_context_len=max(4096, reps * page // 1024)),
                               prefetch=False) as c:
                g, be, a = c.geometry, c.backend, c.allocator
                if reps > g.pages_per_slot:
                    reps_here = g.pages_per_slot
                else:
                    reps_here = reps
                groups = be.create(reps_here, g.num_buffers, page)
                offs = [g.page_offset(0, p) for p in range(reps_here)]
                t0 = time.perf_counter()
                for i in range(reps_here):
                    be.map(a.bases, offs[i:i + 1], groups[i:i + 1], page)
                t_map = (time.perf_counter() - t0) / reps_here
                t0 = time.perf_counter()
                for i in range(reps_here):
                    be.unmap(a.bases, offs[i:i + 1], page)
                t_unmap = (time.perf_counter() - t0) / reps_here
                # the same group mapped one buffer at a time (what a per-buffer API would cost)
                t0 = time.perf_counter()
                for i in range(reps_here):
                    for b in range(g.num_buffers):
                        be.map(a.bases[b:b + 1], offs[i:i + 1], [_one(groups[i], b)], page)
                t_per_buf = (time.perf_counter() - t0) / reps_here
                be.unmap(a.bases, offs, page)
                be.release(groups)
                rows.append(dict(layout=layout, page_KiB=page // KB, buffers=g.num_buffers,
                                 map_us=t_map * 1e6, unmap_us=t_unmap * 1e6,
                                 map_per_buffer_calls_us=t_per_buf * 1e6,
                                 us_per_page=t_map * 1e6 / g.num_buffers,
                                 map_GBps=g.group_bytes / t_map / 1e9))
    return rows


def _one(group, b):
    """The page of buffer b of a group, as a one-buffer group (host or CUDA)."""
    if hasattr(group, "fd"):
        return group._replace(offset=group.offset + b * group.stride, stride=0, num_buffers=1)
    return (group[b],)


def _compute(ms: float, device: str) -> None:
    """A stand-in for the model's forward: real work that releases the GIL."""
    x = torch.ones(256, 256, device=device)
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        x = x @ x * 0.001
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def bench_step(device: str, page: int, batch: int, iters: int, compute_ms: float) -> list[dict]:
    modes = [("on-demand", dict(prefetch=False, background=False)),
             ("sync pre-map", dict(prefetch=True, background=False)),
             ("background", dict(prefetch=True, background=True))]
    rows = []
    for name, kw in modes:
        with vattn.KVCache(**_cfg(device, "per-layer", page, max_batch_size=batch, max_context_len=8192), **kw) as c:
            slots = [c.alloc_reqid() for _ in range(batch)]
            lens = {s: 64 + 33 * i for i, s in enumerate(slots)}  # staggered: page crossings spread out
            # the whole pool exists before serving (creating pages is not what this measures)
            c.reserve_physical(c.geometry.group_bytes * (sum(c.geometry.pages_for(n + iters) for n in lens.values()) + 2))
            assert c.step(lens)
            times, mapped = [], 0
            for _ in range(iters):
                lens = {s: n + 1 for s, n in lens.items()}
                t0 = time.perf_counter()
                res = c.step(lens)
                times.append((time.perf_counter() - t0) * 1e6)
                assert res
                mapped += res.num_mapped
                _compute(compute_ms, device)
            times.sort()
            rows.append(dict(mode=name, page_KiB=page // KB, batch=batch, step_us_mean=statistics.fmean(times),
                             step_us_p50=times[len(times) // 2], step_us_p99=times[int(len(times) * 0.99)],
                             step_us_max=times[-1], groups_mapped_in_step=mapped))
    base = rows[0]["step_us_mean"]
    for r in rows:
        r["mean_vs_on_demand"] = r["step_us_mean"] / base
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--compute-ms", type=float, default=2.0)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    pages = [2 * MB, 4 * MB, 8 * MB] if cuda else [64 * KB, 256 * KB, 2 * MB]
    reps = 16 if args.quick else 64
    iters = 200 if args.quick else 500  # per-layer decode pages do not merge: ~2k host mappings per 32 tokens

    map_rows = bench_map(args.device, pages, reps)
    print("\none page-group map (all buffers of one page index)")
    print_table(["layout", "page KiB", "buffers", "map us", "unmap us", "1 call/buffer us", "us/page", "GB/s"],
                [[r["layout"], r["page_KiB"], r["buffers"], r["map_us"], r["unmap_us"], r["map_per_buffer_calls_us"],
                  r["us_per_page"], r["map_GBps"]] for r in map_rows])
    page = pages[0]
    step_rows = bench_step(args.device, page, args.batch, iters, args.compute_ms)
    print(f"\nstep() in a decode loop: batch {args.batch}, {page // KB} KiB pages, {args.compute_ms} ms compute between steps")
    print_table(["mode", "mean us", "p50 us", "p99 us", "max us", "groups mapped in step", "mean / on-demand"],
                [[r["mode"], r["step_us_mean"], r["step_us_p50"], r["step_us_p99"], r["step_us_max"],
                  r["groups_mapped_in_step"], r["mean_vs_on_demand"]] for r in step_rows])

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for layout in ("per-layer", "fused"):
        rs = [r for r in map_rows if r["layout"] == layout]
        ax1.plot([r["page_KiB"] for r in rs], [r["map_us"] for r in rs], "o-", label=f"{layout} ({rs[0]['buffers']} buffers)")
    ax1.set(xscale="log", yscale="log", xlabel="page size (KiB)", ylabel="map one page group (us)", title="page-group map")
    ax1.legend()
    ax2.bar([r["mode"] for r in step_rows], [r["step_us_p99"] for r in step_rows], color="tab:orange", alpha=0.5, label="p99")
    ax2.bar([r["mode"] for r in step_rows], [r["step_us_mean"] for r in step_rows], color="tab:blue", label="mean")
    ax2.set(ylabel="step latency (us)", title=f"step(), batch {args.batch}, {page // KB} KiB pages")
    ax2.legend()
    save(f"alloc_latency_{'cuda' if cuda else 'host'}",
         {"env": environment(args.device), "args": vars(args), "map": map_rows, "step": step_rows}, fig)


if __name__ == "__main__":
    main()
