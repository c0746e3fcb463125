"""A synthetic serving workload that drives the allocator alone (no model).

Requests of mixed prompt and output lengths arrive over time; each iteration admits what
fits, calls `step`, preempts the newest on failure, writes one token (or a whole prompt)
of real K/V data into every layer, and retires finished requests. Used by `vattn demo
--synthetic` and by the allocator benchmarks.
"""
from __future__ import annotations

import csv
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from vattn.cache import KVCache
from vattn.checks import as_int
from vattn.errors import InvalidConfigError
from vattn.report import latency_stats


@dataclass
class _Req:
    rid: int
    prompt: int
    output: int
    arrival: int  # iteration
    slot: int = -1
    done: int = 0  # tokens written
    preemptions: int = 0


@dataclass
class WorkloadReport:
    iterations: int
    requests: int
    tokens_written: int
    preemptions: int
    step_ms: list[float] = field(repr=False)
    peak_mapped_bytes: int = 0
    peak_used_bytes: int = 0
    mean_fragmentation: float = 0.0
    pages_mapped: int = 0
    pages_unmapped: int = 0
    slot_reuses: int = 0
    mean_running: float = 0.0  # requests backed per iteration
    mean_running_saturated: float = 0.0  # the same, over iterations where requests had to wait
    seconds: float = 0.0

    def summary(self) -> dict[str, Any]:
        ms = latency_stats(self.step_ms)
        return {
            "iterations": self.iterations, "requests": self.requests, "tokens_written": self.tokens_written,
            "preemptions": self.preemptions,
            "step_ms_p50": ms["p50"], "step_ms_p99": ms["p99"], "step_ms_mean": ms["mean"], "step_ms_max": ms["max"],
            "peak_mapped_MiB": self.peak_mapped_bytes / 2**20, "peak_used_MiB": self.peak_used_bytes / 2**20,
            "mean_fragmentation": self.mean_fragmentation, "pages_mapped": self.pages_mapped,
            "pages_unmapped": self.pages_unmapped, "slot_reuses": self.slot_reuses,
            "mean_running": self.mean_running, "mean_running_saturated": self.mean_running_saturated,
            "seconds": self.seconds,
        }


def synthetic_requests(n: int, max_context_len: int, seed: int = 0, arrivals_per_iter: float = 0.5) -> list[_Req]:
    """Mixed lengths: log-normal prompts and outputs, clipped to fit max_context_len."""
    n = as_int(n, "the number of requests", InvalidConfigError, low=1)
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(n):
        prompt = min(max(1, int(rng.lognormvariate(5.0, 1.0))), max_context_len // 2)
        output = min(max(1, int(rng.lognormvariate(4.0, 0.8))), max_context_len - prompt)
        t += rng.expovariate(arrivals_per_iter)
        reqs.append(_Req(i, prompt, output, int(t)))
    return reqs


def trace_requests(path: str, n: int, max_context_len: int, seed: int = 0,
                   arrivals_per_iter: float = 0.5) -> list[_Req]:
    """The first `n` rows of a trace CSV with `num_prefill_tokens` and `num_decode_tokens`
    columns (rows longer than max_context_len are clipped), Poisson arrivals."""
    n = as_int(n, "the number of requests", InvalidConfigError, low=1)
    rng = random.Random(seed)
    reqs, t = [], 0.0
    with open(path, newline="") as f:
        for i, row in enumerate(csv.DictReader(f)):
            if i == n:
                break
            prompt = min(max(1, int(row["num_prefill_tokens"])), max_context_len - 1)
            output = min(max(1, int(row["num_decode_tokens"])), max_context_len - prompt)
            t += rng.expovariate(arrivals_per_iter)
            reqs.append(_Req(i, prompt, output, int(t)))
    return reqs


def _next_lens(running: list[_Req]) -> dict[int, int]:
    """slot -> length this iteration: the whole prompt first (again after a preemption), then one token."""
    return {r.slot: (r.prompt if r.done == 0 else r.done + 1) for r in running}


def _admit(cache: KVCache, waiting: deque[_Req], running: list[_Req], used_slots: set[int],
           report: WorkloadReport) -> None:
    """Give waiting requests a slot each while the cache has free ones (counting slots reused)."""
    while waiting and cache.num_free_reqids:
        r = waiting.popleft()
        r.slot = cache.alloc_reqid()
        report.slot_reuses += r.slot in used_slots
        used_slots.add(r.slot)
        running.append(r)


def _step(cache: KVCache, running: list[_Req], waiting: deque[_Req], report: WorkloadReport) -> dict[int, int]:
    """Step the running requests (prefill: the whole prompt, plus generated tokens after a
    preemption; decode: one token), preempting the newest until the step fits (a preempted
    request recomputes from scratch later, first in line). Returns the lengths stepped."""
    lens = _next_lens(running)
    while not cache.step(lens):
        if len(running) == 1:
            raise InvalidConfigError(
                f"request {running[0].rid} alone needs more pages than the cache has; raise physical_memory")
        victim = running.pop()  # newest first
        cache.free_reqid(victim.slot)
        if victim.done:  # one admitted this iteration lost nothing: not a preemption
            victim.preemptions += 1
            report.preemptions += 1
        victim.done, victim.slot = 0, -1
        waiting.appendleft(victim)
        lens = _next_lens(running)
    return lens


def run_workload(cache: KVCache, requests: list[_Req], write_data: bool = True, progress: Any = None) -> WorkloadReport:
    """Serve `requests` on `cache` with continuous batching; returns figures and step latencies."""
    if not requests:
        raise InvalidConfigError("no requests to serve; give at least one")
    c = cache.config
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    waiting: deque[_Req] = deque()
    running: list[_Req] = []
    step_ms: list[float] = []
    frags: list[float] = []
    running_counts: list[int] = []
    saturated_counts: list[int] = []
    report = WorkloadReport(0, len(requests), 0, 0, step_ms)
    be = cache.backend
    mapped0, unmapped0 = be.num_pages_mapped, be.num_pages_unmapped
    used_slots: set[int] = set()
    token = torch.ones(c.num_kv_heads, c.head_dim, dtype=c.dtype, device=c.torch_device)  # [H, D]
    t0 = time.perf_counter()
    it = 0
    while pending or waiting or running:
        while pending and pending[0].arrival <= it:
            waiting.append(pending.popleft())
        _admit(cache, waiting, running, used_slots, report)
        s0 = time.perf_counter()
        lens = _step(cache, running, waiting, report)
        step_ms.append((time.perf_counter() - s0) * 1e3)
        running_counts.append(len(running))
        if waiting:
            saturated_counts.append(len(running))
        for r in running:
            n = lens[r.slot]
            if write_data:
                for layer in range(c.num_layers):
                    cache.k_cache(layer)[r.slot, r.done:n] = token
                    cache.v_cache(layer)[r.slot, r.done:n] = token
            report.tokens_written += n - r.done
            r.done = n
        st = cache.stats()
        report.peak_mapped_bytes = max(report.peak_mapped_bytes, st.mapped_bytes)
        report.peak_used_bytes = max(report.peak_used_bytes, st.used_bytes)
        if st.active_bytes:
            frags.append(st.fragmentation)
        for r in [r for r in running if r.done >= r.prompt + r.output - 1]:
            running.remove(r)
            cache.free_reqid(r.slot)
            if progress is not None:
                progress.update(1)
        it += 1
    report.iterations = it
    report.seconds = time.perf_counter() - t0
    report.mean_fragmentation = statistics.fmean(frags) if frags else 0.0
    report.mean_running = statistics.fmean(running_counts) if running_counts else 0.0
    report.mean_running_saturated = statistics.fmean(saturated_counts) if saturated_counts else 0.0
    report.pages_mapped = be.num_pages_mapped - mapped0
    report.pages_unmapped = be.num_pages_unmapped - unmapped0
    return report
