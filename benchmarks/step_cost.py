"""Cost of a `step` that maps nothing, against the batch and the number of slots.

The books' cost must grow with the work (the requests a step names), not the capacity
(`max_batch_size`): a no-op step at batch 64 within ~20 us here, the same with 64 or 4096
slots. Also the cost of `alloc_reqid` + `free_reqid` (the warm slot comes from a heap).

    OMP_NUM_THREADS=1 python benchmarks/step_cost.py [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import statistics
import time

import vattn
from _common import environment, print_table, save


def measure(slots: int, batch: int, reps: int, background: bool) -> dict:
    with vattn.KVCache(num_layers=2, num_kv_heads=2, head_dim=16, max_batch_size=slots, max_context_len=512,
                       dtype="float32", device="cpu", page_size=4096, background=background) as c:
        rs = [c.alloc_reqid() for _ in range(batch)]
        lens = {r: 100 for r in rs}
        c.step(lens)
        c.synchronize()
        for _ in range(100):  # warm-up: everything mapped, the worker idle
            c.step(lens)
        samples = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(reps):
                c.step(lens)
            samples.append((time.perf_counter() - t) / reps * 1e6)
        c.free_reqid(rs[-1])  # one free slot to churn through
        t = time.perf_counter()
        for _ in range(reps):
            c.free_reqid(c.alloc_reqid())
        churn = (time.perf_counter() - t) / reps * 1e6
    return dict(slots=slots, batch=batch, background=background, noop_step_us=statistics.median(samples),
                alloc_free_us=churn)


def zero_cost(zero: bool, reps: int, page_size: int = 64 << 10) -> dict:
    """A request of 1000 tokens reusing a freed slot's pages, with and without
    zero_reused_pages: the cost of clearing them (Llama-3-8B-like layer: 8 x 128 fp16)."""
    with vattn.KVCache(num_layers=8, num_kv_heads=8, head_dim=128, max_batch_size=2, max_context_len=4096,
                       dtype="float16", device="cpu", page_size=page_size, prefetch=False,
                       zero_reused_pages=zero) as c:
        r = c.alloc_reqid()
        c.step({r: 1000})  # map once: later requests reuse these pages
        c.free_reqid(r)
        t = time.perf_counter()
        for _ in range(reps):
            r = c.alloc_reqid()
            c.step({r: 1000})
            c.free_reqid(r)
        dt = (time.perf_counter() - t) / reps
        pages = c.geometry.pages_for(1000)
        return dict(zero_reused_pages=zero, us_per_request=dt * 1e6, pages=pages,
                    cleared_MiB=pages * c.geometry.group_bytes / 2**20 if zero else 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    p.add_argument("--out", default=None, help="directory for the JSON and PNG (default benchmarks/results)")
    args = p.parse_args()
    reps = 200 if args.quick else 2000
    rows = []
    for slots in ((64, 1024) if args.quick else (64, 1024, 4096)):
        for batch in (1, 16, 64):
            for bg in (False, True):
                rows.append(measure(slots, batch, reps, bg))
    print_table(["slots", "batch", "background", "no-op step us", "alloc+free us"],
                [[r["slots"], r["batch"], r["background"], r["noop_step_us"], r["alloc_free_us"]] for r in rows])
    zero = [zero_cost(z, 20 if args.quick else 100) for z in (False, True)]
    print_table(["zero_reused_pages", "us per request (1000 tokens)", "pages", "MiB cleared"],
                [[z["zero_reused_pages"], z["us_per_request"], z["pages"], z["cleared_MiB"]] for z in zero])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for slots in sorted({r["slots"] for r in rows}):
        pts = [r for r in rows if r["slots"] == slots and not r["background"]]
        ax.plot([r["batch"] for r in pts], [r["noop_step_us"] for r in pts], marker="o", label=f"{slots} slots")
    ax.set_xlabel("active requests (batch)")
    ax.set_ylabel("no-op step (us)")
    ax.set_title("step cost grows with the batch, not the slots")
    ax.legend()
    save("step_cost_host", {"env": environment("cpu"), "omp_num_threads": __import__("os").environ.get("OMP_NUM_THREADS"),
                            "rows": rows, "zero_reused_pages": zero}, fig, out=args.out)


if __name__ == "__main__":
    main()
