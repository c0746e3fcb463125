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
                            "rows": rows}, fig, out=args.out)


if __name__ == "__main__":
    main()
