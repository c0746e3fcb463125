"""Soak test: the engine serving for many minutes must not grow its memory, mappings or fds.

Requests arrive as a Poisson process (real time) at the engine of the demo's small built-in
model, under a `physical_memory` budget tight enough that requests get preempted; a share
of the clients go away at a random time and their requests are aborted with
`LLM.abort_request` (waiting, running, or already finished: a no-op). Every
`--sample-every` seconds the process's resident memory (VmRSS of /proc/self/status), its
number of memory mappings (lines of /proc/self/maps), its open file descriptors
(/proc/self/fd) and the KV bytes the cache has mapped are recorded. After `--minutes` no
more requests arrive and the ones in flight finish.

    OMP_NUM_THREADS=1 python benchmarks/soak.py [--minutes 10] [--rate 6] [--abort-share 0.2]

"Flat" (the verdict): after a warm-up (the first 10% of the run), the maximum over the
second half of the samples is at most the maximum over the first half plus a slack:
RSS + 2% + 4 MiB; mappings + 2% + the most mappings the KV pages can split into (2 per
mapped page of the budget: pages come and go as requests do); fds and KV mapped + 0. A
leak per request shows up as a second-half maximum above the first. The run also requires 0 requests
ending in "error", and at the end: every slot free, no sampler state left, the
allocator's books consistent, mapped KV bytes within the budget.

Writes benchmarks/results/soak_<device>.json (environment, config, summary, time series)
and .png. torch runs on one thread (OMP_NUM_THREADS=1 unless set): its two default
threads stall on the 2-CPU machine this was written on.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from _common import environment, print_table, save  # noqa: E402

from vattn.engine import LLM, SamplingParams  # noqa: E402
from vattn.engine.demo import demo_model_config  # noqa: E402

MIB = 1 << 20
WARMUP_SHARE = 0.1


@dataclass(frozen=True)
class SoakConfig:
    """minutes: arrival time (then the requests in flight finish); rate: requests per second
    (Poisson); abort_share: share of requests whose client goes away after an exponential
    time of mean abort_after_s; lengths: uniform ranges of prompt and output tokens."""

    minutes: float = 10.0
    rate: float = 3.5
    abort_share: float = 0.2
    abort_after_s: float = 1.5
    min_prompt: int = 16
    max_prompt: int = 256
    min_output: int = 16
    max_output: int = 128
    max_batch_size: int = 8
    page_size: int = 64 << 10
    physical_memory: int = 4 << 20
    sample_every_s: float = 1.0
    seed: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not self.minutes > 0 or not self.rate > 0 or not 0 <= self.abort_share <= 1:
            raise SystemExit("soak: --minutes and --rate must be > 0 and --abort-share in [0, 1]")


def process_figures() -> dict[str, float]:
    """RSS (MiB), memory mappings and open file descriptors of this process."""
    rss_kib = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
                break
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return {"rss_mib": rss_kib / 1024, "maps": maps, "fds": len(os.listdir("/proc/self/fd"))}


def run(config: SoakConfig) -> dict[str, Any]:
    """Serve the random workload for config.minutes; returns the summary and the time series."""
    rng = random.Random(config.seed)
    model = demo_model_config()
    llm = LLM(model, seed=config.seed, device=config.device, max_batch_size=config.max_batch_size,
              max_context_len=config.max_prompt + config.max_output, page_size=config.page_size,
              physical_memory=config.physical_memory, max_num_batched_tokens=512)
    counts = {"arrived": 0, "finished": 0, "aborted": 0, "aborted_waiting": 0, "errored": 0, "abort_calls": 0,
              "abort_noops": 0, "prompt_tokens": 0, "output_tokens": 0}
    # the most VMAs the KV pages can make: each mapped page may split a reservation in two
    kv_maps_bound = 2 * llm.cache.geometry.num_buffers * llm.memory_stats().max_pages
    slack = {"rss_mib": (0.02, 4.0), "maps": (0.02, kv_maps_bound), "fds": (0.0, 0), "kv_mapped_mib": (0.0, 0.0)}
    errors: list[str] = []
    series: list[dict[str, float]] = []
    abort_at: dict[int, float] = {}  # request id -> when its client goes away

    def sample(t: float) -> None:
        st = llm.memory_stats()
        series.append({"t_s": round(t, 3), **process_figures(), "kv_mapped_mib": st.mapped_bytes / MIB,
                       "running": len(llm.scheduler.running), "waiting": len(llm.scheduler.waiting),
                       "finished": counts["finished"], "aborted": counts["aborted"], "errored": counts["errored"],
                       "preemptions": llm.num_preemptions, "output_tokens": counts["output_tokens"]})

    def add() -> None:
        prompt = [rng.randrange(model.vocab_size) for _ in range(rng.randint(config.min_prompt, config.max_prompt))]
        greedy = rng.random() < 0.5
        params = SamplingParams(temperature=0.0 if greedy else 0.8, top_p=0.95, ignore_eos=True,
                                max_tokens=rng.randint(config.min_output, config.max_output),
                                seed=None if greedy else rng.randrange(2**32))
        rid = llm.add_request(prompt, params)
        counts["arrived"] += 1
        if rng.random() < config.abort_share:
            abort_at[rid] = time.perf_counter() + rng.expovariate(1 / config.abort_after_s)

    def collect(outs: list) -> None:
        for out in outs:
            if not out.finished:
                continue
            counts["output_tokens"] += len(out.token_ids)
            counts["prompt_tokens"] += len(out.prompt_token_ids)
            if out.finish_reason == "abort":
                counts["aborted"] += 1
            elif out.finish_reason == "error":
                counts["errored"] += 1
                errors.append(out.error)
            else:
                counts["finished"] += 1

    try:
        start = time.perf_counter()
        end = start + 60 * config.minutes
        next_arrival = start + rng.expovariate(config.rate)
        next_sample = start
        iterations = 0
        while True:
            now = time.perf_counter()
            if now >= next_sample:
                sample(now - start)
                next_sample += config.sample_every_s
            arriving = now < end
            while arriving and next_arrival <= now:
                add()
                next_arrival += rng.expovariate(config.rate)
            due = [rid for rid, t in abort_at.items() if t <= now]  # some finished already: no-ops
            if due:
                counts["abort_calls"] += len(due)
                waiting = {s.request_id for s in llm.scheduler.waiting}
                done = llm.abort_request(due)
                counts["aborted_waiting"] += sum(rid in waiting for rid in done)
                counts["abort_noops"] += len(due) - len(done)
                for rid in due:
                    abort_at.pop(rid)
            if llm.has_unfinished():
                collect(llm.step())
                iterations += 1
            elif not arriving:
                break
            else:
                time.sleep(max(0.0, min(next_arrival, next_sample) - time.perf_counter()))
        wall = time.perf_counter() - start
        sample(wall)
        checks = {
            "slots_free": llm.cache.num_free_reqids == config.max_batch_size,
            "no_sampler_state": not llm.runner.sampler.generators,
            "scheduler_empty": not llm.scheduler.has_unfinished(),
            "kv_within_budget": llm.memory_stats().mapped_bytes <= config.physical_memory,
        }
        try:
            llm.cache.allocator.check_invariants()
            checks["books_consistent"] = True
        except AssertionError:
            checks["books_consistent"] = False
        kernel = llm.runner.kernel.name
    finally:
        llm.close()

    summary = {
        **counts, "iterations": iterations, "wall_s": wall, "arrival_s": 60 * config.minutes,
        "preemptions": series[-1]["preemptions"], "output_tok_s": counts["output_tokens"] / wall,
        "total_tok_s": (counts["output_tokens"] + counts["prompt_tokens"]) / wall, "attention_kernel": kernel,
        "torch_threads": torch.get_num_threads(), "errors": errors[:10], "checks": checks,
        "kv_maps_bound": kv_maps_bound, "flat": flatness(series, slack),
    }
    return {"summary": summary, "series": series}


def flatness(series: list[dict[str, float]], slack: dict[str, tuple[float, float]]) -> dict[str, dict[str, Any]]:
    """Per metric: the first-half and second-half maxima after the warm-up, and whether the
    second is within `slack` (relative, absolute) of the first."""
    t_end = series[-1]["t_s"]
    steady = [s for s in series if s["t_s"] >= WARMUP_SHARE * t_end]
    if len(steady) < 2:
        steady = series[-2:]
    half = len(steady) // 2
    out = {}
    for key, (rel, abs_) in slack.items():
        first = max(s[key] for s in steady[:half])
        second = max(s[key] for s in steady[half:])
        limit = first * (1 + rel) + abs_
        out[key] = {"first_half_max": first, "second_half_max": second, "limit": limit, "flat": second <= limit}
    return out


def report(config: SoakConfig, result: dict[str, Any]) -> bool:
    """Print the table and the verdict lines; returns whether the run passed."""
    s, series = result["summary"], result["series"]
    rows = []
    for key, label in (("rss_mib", "RSS (MiB)"), ("maps", "memory mappings"), ("fds", "open fds"),
                       ("kv_mapped_mib", "KV mapped (MiB)")):
        values = [x[key] for x in series]
        f = s["flat"][key]
        rows.append([label, values[0], values[-1], max(values), f["first_half_max"], f["second_half_max"],
                     f["limit"], "flat" if f["flat"] else "GROWS"])
    print(f"\nsoak: {s['wall_s'] / 60:.1f} min on {config.device} ({s['attention_kernel']}), "
          f"{config.rate} req/s, budget {config.physical_memory / MIB:.0f} MiB, {len(series)} samples")
    print_table(["metric", "start", "end", "max", "max 1st half", "max 2nd half", "limit", "verdict"], rows)
    print()
    print_table(["requests arrived", "finished", "aborted (waiting)", "errored", "abort no-ops", "preemptions",
                 "iterations", "output tok/s", "total tok/s"],
                [[s["arrived"], s["finished"], f"{s['aborted']} ({s['aborted_waiting']})", s["errored"],
                  s["abort_noops"], s["preemptions"], s["iterations"], s["output_tok_s"], s["total_tok_s"]]])
    flat = all(f["flat"] for f in s["flat"].values())
    print(f"\nverdict: RSS / mappings / fds / KV mapped {'flat' if flat else 'NOT flat'} "
          f"(after a {WARMUP_SHARE:.0%} warm-up, the 2nd half's max <= the 1st half's max + 2% + 4 MiB for RSS, "
          f"+ 2% + {s['kv_maps_bound']} (2 per page of the KV budget) for mappings, + 0 for fds and KV)")
    print(f"verdict: {s['errored']} requests ended in error" + (f": {s['errors'][:3]}" if s["errored"] else ""))
    ok_checks = all(s["checks"].values())
    print(f"verdict: end state {'clean' if ok_checks else 'NOT clean'} {s['checks']}")
    passed = flat and s["errored"] == 0 and ok_checks and s["preemptions"] > 0 and s["aborted"] > 0
    if not (s["preemptions"] > 0 and s["aborted"] > 0):
        print("verdict: the run had no preemptions or no aborts: lower --physical-memory or raise --rate / "
              "--abort-share, or run longer")
    print(f"verdict: {'PASS' if passed else 'FAIL'}")
    return passed


def plot(config: SoakConfig, result: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = result["series"]
    t = [x["t_s"] / 60 for x in series]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7), sharex=True)
    panels = [("rss_mib", "RSS (MiB)"), ("maps", "memory mappings"), ("fds", "open fds"),
              ("kv_mapped_mib", "KV mapped (MiB)")]
    for ax, (key, label) in zip(axes.flat, panels):
        ax.plot(t, [x[key] for x in series], lw=1)
        ax.set(ylabel=label, title=label)
        ax.axvline(WARMUP_SHARE * t[-1], color="grey", ls=":", lw=1)
    axes.flat[3].axhline(config.physical_memory / MIB, color="red", ls="--", lw=1, label="budget")
    axes.flat[3].legend()
    ax = axes.flat[4]
    for key in ("running", "waiting"):
        ax.plot(t, [x[key] for x in series], lw=1, label=key)
    ax.set(ylabel="requests", title="requests in the engine")
    ax.legend()
    ax = axes.flat[5]
    for key in ("finished", "aborted", "preemptions", "errored"):
        ax.plot(t, [x[key] for x in series], lw=1, label=key)
    ax.set(ylabel="count", title="cumulative")
    ax.legend()
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    s = result["summary"]
    fig.suptitle(f"vattn engine soak ({config.device}): {s['wall_s'] / 60:.1f} min, {s['arrived']} requests, "
                 f"{s['output_tok_s']:.0f} output tok/s")
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    d = SoakConfig()
    ap.add_argument("--minutes", type=float, default=d.minutes, help="arrival time in minutes (default: 10)")
    ap.add_argument("--rate", type=float, default=d.rate, help="requests per second, Poisson (default: 3.5)")
    ap.add_argument("--abort-share", type=float, default=d.abort_share,
                    help="share of requests whose client goes away (default: 0.2)")
    ap.add_argument("--physical-memory", type=int, default=d.physical_memory,
                    help="KV page budget in bytes (default: 4 MiB: preemptions happen)")
    ap.add_argument("--max-batch-size", type=int, default=d.max_batch_size, help="cache slots (default: 8)")
    ap.add_argument("--sample-every", type=float, default=d.sample_every_s, help="seconds between samples")
    ap.add_argument("--seed", type=int, default=d.seed, help="seed of arrivals, lengths, aborts and weights")
    ap.add_argument("--device", default=d.device, help="cpu (host backend, default) or cuda")
    ap.add_argument("--out", default=None, help="results name (default: soak_host or soak_cuda)")
    args = ap.parse_args()
    config = SoakConfig(minutes=args.minutes, rate=args.rate, abort_share=args.abort_share,
                        physical_memory=args.physical_memory, max_batch_size=args.max_batch_size,
                        sample_every_s=args.sample_every, seed=args.seed, device=args.device)
    result = run(config)
    passed = report(config, result)
    import transformers

    env = {**environment(config.device), "transformers": transformers.__version__,
           "python_impl": platform.python_implementation(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    name = args.out or f"soak_{'cuda' if config.device.startswith('cuda') else 'host'}"
    save(name, {"env": env, "config": asdict(config), "passed": passed, **result}, plot(config, result))
    raise SystemExit(0 if passed else 1)


if __name__ == "__main__":
    main()
