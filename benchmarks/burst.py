"""Two models, one memory: a shared vattn `Budget` against two static halves, under a burst
aimed at one of them (transformers' continuous batching, `generate`-equal greedy outputs).

Model A gets a burst of requests, model B a trickle, both at t=0, through one
`ContinuousBatchingManager` each:

- `static`: transformers' own caches, the memory split in two fixed halves (each cache
  `num_blocks = total / 2`): A can keep only half the memory busy however long B idles;
- `shared`: both caches on vattn memory (`hf_cb.enable(model, budget=...)`) under one
  `vattn.Budget` of the same total bytes; each cache is sized (virtually) for the whole
  budget and maps what it uses, so A takes what B does not need and B still gets memory
  for its requests when they come.

Reports, per model and mode: requests served, the forward steps and the time to serve
them, requests served within the time the shared run took for A's burst, requests in
flight at most (A's scheduler), and KV memory held over time (the plot). On a GPU a
decode step costs about the same for 9 requests as for 16 (it is bound by reading the
weights), so steps are what more requests in flight save; on this repo's 2-CPU machine a
step's cost grows with its batch, so seconds show little of it. Greedy outputs of the two modes must
be equal. Writes benchmarks/results/burst_<device>.json and .png.

    OMP_NUM_THREADS=1 python benchmarks/burst.py [--requests 24] [--quick]
"""
from __future__ import annotations

import argparse
import copy
import os
import threading
import time
from typing import Any

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from _common import environment, print_table, save  # noqa: E402
from elastic import add_model_args, build_model, bursty_trace  # noqa: E402

MB = 1 << 20


def run_mode(mode: str, models: dict[str, Any], work: dict[str, list], args: argparse.Namespace) -> dict[str, Any]:
    from transformers import GenerationConfig

    import vattn
    from vattn.bench._models import cb_cache_bytes, cb_config
    from vattn.integrations import hf_cb

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=args.max_new)
    shared = mode == "shared"
    blocks = args.total_blocks if shared else args.total_blocks // 2
    cbc = cb_config(args.block_tokens, num_blocks=blocks, max_batch_tokens=args.max_batch_tokens,
                    allow_block_sharing=False)
    budget, handles = None, {}
    if shared:  # the same bytes as the two halves: data blocks and each cache's two trash blocks
        budget = vattn.Budget((args.total_blocks + 2 * hf_cb.TRASH_SECTORS) * args.block_bytes)
        handles = {n: hf_cb.enable(m, budget=budget, page_size=args.page_size) for n, m in models.items()}
    managers = {}
    for n, m in models.items():
        managers[n] = m.init_continuous_batching(generation_config=gen, continuous_batching_config=copy.deepcopy(cbc))
        managers[n].start()
    for n, mgr in managers.items():  # warm up (builds the caches)
        mgr.add_request(list(range(3, 35)), request_id=f"warm_{n}", max_new_tokens=4)
        while not (r := mgr.get_result(timeout=60)) or not r.is_finished():
            pass

    steps = {n: 0 for n in managers}  # forward steps each model ran for the burst

    def counting(n: str, step: Any) -> Any:
        def counted() -> None:
            steps[n] += 1
            step()
        return counted

    for n, mgr in managers.items():  # the loop calls self._generation_step() once a batch
        mgr._generation_step = counting(n, mgr._generation_step)

    def held(n: str) -> int:
        if shared:
            s = handles[n].stats()
            return s.held_bytes if s is not None else 0
        cache = managers[n].batch_processor.cache
        return cb_cache_bytes(cache)

    samples: list[tuple[float, int, int, int]] = []  # t, held A, held B, A's requests in flight
    stop = threading.Event()
    t0 = time.perf_counter()

    def sampler() -> None:
        while not stop.is_set():
            sched = managers["A"].batch_processor.scheduler
            samples.append((time.perf_counter() - t0, held("A"), held("B"), len(sched.active_requests)))
            time.sleep(0.01)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    for n, reqs in work.items():
        for k, (p, d) in enumerate(reqs):
            managers[n].add_request(p, request_id=f"{n}_{k}", max_new_tokens=d)
    finished: dict[str, dict[str, tuple[float, list[int]]]] = {n: {} for n in work}

    def collect(n: str) -> None:
        while len(finished[n]) < len(work[n]):
            r = managers[n].get_result(timeout=120)
            if r is None:
                raise RuntimeError(f"{mode}: model {n} returned nothing in 120 s")
            if r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"{mode}: request {r.request_id} failed: {r.error}")
                finished[n][r.request_id] = (time.perf_counter() - t0, r.generated_tokens, steps[n])

    collectors = [threading.Thread(target=collect, args=(n,)) for n in work]
    for c in collectors:
        c.start()
    for c in collectors:
        c.join()
    stop.set()
    thread.join()
    for mgr in managers.values():
        mgr.stop(block=True, keep_for_next_session=False)
        mgr.destroy()
    for m in models.values():
        hf_cb.disable(m)
    out: dict[str, Any] = {"mode": mode, "samples": samples, "budget_bytes": budget.limit if budget else None}
    for n in work:
        ids = [f"{n}_{k}" for k in range(len(work[n]))]
        out[n] = dict(done_at=sorted(finished[n][i][0] for i in ids), outputs=[finished[n][i][1] for i in ids],
                      done_at_step=sorted(finished[n][i][2] for i in ids),
                      served=len(ids), seconds=max(finished[n][i][0] for i in ids), steps=steps[n])
    out["A"]["max_in_flight"] = max(s[3] for s in samples)
    out["peak_held_MiB"] = max(s[1] + s[2] for s in samples) / MB
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=24, help="requests of the burst aimed at model A")
    ap.add_argument("--trickle", type=int, default=4, help="requests to model B at the same time")
    ap.add_argument("--total-blocks", type=int, default=96, help="blocks of memory for the two models together")
    add_model_args(ap, max_prompt=192, max_new=32)
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode")
    ap.add_argument("--quick", action="store_true", help="a burst of 12, 48 blocks, one run per mode")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.trickle, args.total_blocks, args.repeats = 12, 2, 48, 1
    head_dim = args.hidden // args.heads
    args.block_bytes = 2 * args.layers * args.kv_heads * head_dim * 4 * args.block_tokens  # K and V, fp32
    models = {}
    for n, seed in (("A", 0), ("B", 1)):
        models[n] = build_model(args)
        torch.manual_seed(seed)  # B: other weights
        if n == "B":
            for p in models[n].parameters():
                p.data.normal_(0, 0.2)
    trace_args = argparse.Namespace(**vars(args), bursts=2)
    trace_args.requests = max(args.requests, args.trickle)
    a_burst, b_burst = bursty_trace(trace_args)
    work = {"A": a_burst[:args.requests], "B": b_burst[:args.trickle]}
    all_runs: dict[str, list[dict]] = {"shared": [], "static": []}
    for k in range(args.repeats):  # alternating which mode goes first; the run of median time for A counts
        for mode in ("shared", "static") if k % 2 == 0 else ("static", "shared"):
            all_runs[mode].append(run_mode(mode, models, work, args))
            r = all_runs[mode][-1]
            print(f"  {mode:6}: A {r['A']['seconds']:.2f} s ({r['A']['max_in_flight']} in flight at most), "
                  f"B {r['B']['seconds']:.2f} s", flush=True)
    runs = {m: sorted(rs, key=lambda r: r["A"]["seconds"])[len(rs) // 2] for m, rs in all_runs.items()}
    same = all(runs["shared"][n]["outputs"] == runs["static"][n]["outputs"] for n in work)
    window = runs["shared"]["A"]["seconds"]  # the time the shared budget took for A's whole burst
    window_steps = runs["shared"]["A"]["steps"]  # and its steps
    rows = []
    for mode, r in runs.items():
        for n in work:
            r[n]["served_within_window"] = sum(t <= window for t in r[n]["done_at"])
            r[n]["served_within_window_steps"] = sum(k <= window_steps for k in r[n]["done_at_step"])
            r[n]["requests_per_s"] = r[n]["served"] / r[n]["seconds"]
            rows.append([mode, n, r[n]["served"], r[n]["steps"], r[n]["served_within_window_steps"], r[n]["seconds"],
                         r[n]["served_within_window"],
                         r[n]["requests_per_s"], r[n].get("max_in_flight", ""), r["peak_held_MiB"]])
    print(f"\nburst of {args.requests} to A, {args.trickle} to B; {args.total_blocks} blocks of "
          f"{args.block_bytes >> 10} KiB in all; same greedy tokens: {same}")
    print_table(["mode", "model", "served", "steps", f"served in {window_steps} steps", "seconds",
                 f"served in {window:.1f} s", "req/s", "A in flight",
                 "peak MiB (A+B)"], rows)
    ratios = {"A_requests_per_s_shared_over_static": runs["shared"]["A"]["requests_per_s"]
              / runs["static"]["A"]["requests_per_s"],
              "B_seconds_shared_over_static": runs["shared"]["B"]["seconds"] / runs["static"]["B"]["seconds"],
              "A_max_in_flight_shared_over_static": runs["shared"]["A"]["max_in_flight"]
              / runs["static"]["A"]["max_in_flight"],
              "A_steps_shared_over_static": runs["shared"]["A"]["steps"] / runs["static"]["A"]["steps"],
              "B_steps_shared_over_static": runs["shared"]["B"]["steps"] / runs["static"]["B"]["steps"]}
    print(ratios)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4), sharey=True)
    for ax, mode in zip(axes, ("static", "shared")):
        t, a, b, _ = zip(*runs[mode]["samples"])
        ax.stackplot(t, [x / MB for x in a], [x / MB for x in b], labels=["model A (burst)", "model B (trickle)"],
                     alpha=0.8)
        ax.set(xlabel="seconds", title=f"{mode}: A served {runs[mode]['A']['served_within_window_steps']} of "
               f"{args.requests} in {window_steps} steps, at most {runs[mode]['A']['max_in_flight']} at once")
        ax.legend(loc="upper right")
    axes[0].set_ylabel("KV memory held (MiB)")
    payload = {
        "environment": environment(args.device),
        "args": vars(args),
        "same_greedy_tokens": same,
        "window_s": window,
        "window_steps": window_steps,
        "ratios": ratios,
        "modes": {m: {"peak_held_MiB": r["peak_held_MiB"], "budget_bytes": r["budget_bytes"],
                      **{n: {k: v for k, v in r[n].items() if k != "outputs"} for n in work}}
                  for m, r in runs.items()},
        "memory_over_time": {m: r["samples"][::5] for m, r in runs.items()},
        "all_runs_A_seconds": {m: [r["A"]["seconds"] for r in rs] for m, rs in all_runs.items()},
        "all_runs_B_seconds": {m: [r["B"]["seconds"] for r in rs] for m, rs in all_runs.items()},
    }
    save(f"burst_{args.device.split(':')[0]}", payload, fig)
    if not same:
        raise SystemExit("the two modes generated different tokens")


if __name__ == "__main__":
    main()
