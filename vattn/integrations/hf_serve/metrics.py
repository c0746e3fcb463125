"""`GET /metrics` of `vattn serve`: Prometheus text, read when scraped (nothing is counted on a
request's path but its refusal).

Names in the style of vLLM's `vllm:` metrics; where vLLM has the same figure the name mirrors
it (`vllm:kv_cache_usage_perc` -> `vattn:kv_cache_usage_perc`, `vllm:num_requests_running`,
`vllm:num_requests_waiting`); vattn's own memory figures are in bytes:

| metric | type | what |
|---|---|---|
| `vattn:kv_cache_usage_perc` | gauge | KV blocks in use over the blocks one cache can ever hold (its room under the limit), 0-1 |
| `vattn:kv_mapped_bytes` | gauge | KV pages mapped now (the memory held) |
| `vattn:kv_used_bytes` | gauge | bytes of the KV blocks in use |
| `vattn:kv_peak_mapped_bytes` | gauge | the most KV bytes mapped at once |
| `vattn:kv_limit_bytes` | gauge | `--memory-limit` (absent without one) |
| `vattn:num_requests_running` / `vattn:num_requests_waiting` | gauge | requests in the batch / queued |
| `vattn:requests_refused_total{code}` | counter | requests answered 4xx by the contract, by error code |
| `vattn:idle_trims_total` | counter | times the idle policy gave the KV memory back |
| `vattn:loop_restarts_total` | counter | batching loops restarted after they died |
| `vattn:caches_total` | counter | continuous-batching caches built on vattn memory |
| `vattn:budget_limit_bytes` / `vattn:budget_used_bytes` | gauge | the budget's limit and the bytes of all its members (`--budget`) |
| `vattn:budget_member_mapped_bytes{pid,label}` / `..._used_bytes` / `..._limit_bytes` | gauge | each member of a shared budget |
| `vattn:budget_member_refusals_total{pid,label}` | counter | pages a shared budget refused that member |
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Iterator

logger = logging.getLogger("vattn.serve")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """The figures of one server (`srv`: transformers' `Serve` with `.vattn`, the hf_cb
    handle): a prometheus_client collector in a registry of its own."""

    def __init__(self, srv: Any) -> None:
        self.srv = srv
        self._lock = threading.Lock()
        self.num_refused: dict[str, int] = {}
        self._registry = None

    def refused(self, code: str | None) -> None:
        with self._lock:
            key = code or "invalid_request"
            self.num_refused[key] = self.num_refused.get(key, 0) + 1

    def text(self) -> bytes:
        """The metrics in Prometheus' text format."""
        from prometheus_client import CollectorRegistry, generate_latest

        if self._registry is None:
            self._registry = CollectorRegistry(auto_describe=False)
            self._registry.register(_Collector(self))
        return generate_latest(self._registry)

    async def endpoint(self) -> Any:
        from fastapi.responses import Response

        return Response(self.text(), media_type=CONTENT_TYPE)


class _Collector:
    """prometheus_client's custom collector: every figure read at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        srv, handle = self.m.srv, getattr(self.m.srv, "vattn", None)

        def gauge(name: str, doc: str, value: float | None) -> Iterator[Any]:
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)

        pool = handle.pool if handle is not None else None
        stats = pool.stats() if pool is not None else None
        yield from gauge("vattn:kv_mapped_bytes", "KV pages mapped now (bytes)", stats.mapped_bytes if stats else 0)
        yield from gauge("vattn:kv_used_bytes", "bytes of the KV blocks in use", stats.used_bytes if stats else 0)
        yield from gauge("vattn:kv_peak_mapped_bytes", "the most KV bytes mapped at once",
                         stats.peak_mapped_bytes if stats else 0)
        limit = stats.limit if stats else getattr(handle, "memory_limit", None)
        yield from gauge("vattn:kv_limit_bytes", "the memory limit on KV pages (bytes)", limit)
        yield from gauge("vattn:kv_cache_usage_perc", "KV blocks in use over the blocks one cache can ever hold (0-1)",
                         _usage(pool, stats))
        running, waiting = _requests(srv)
        yield from gauge("vattn:num_requests_running", "requests in the batch", running)
        yield from gauge("vattn:num_requests_waiting", "requests queued for the batch", waiting)
        refused = CounterMetricFamily("vattn:requests_refused", "requests answered 4xx by the contract, by code",
                                      labels=["code"])
        with self.m._lock:
            for code, n in sorted(self.m.num_refused.items()):
                refused.add_metric([code], n)
        yield refused
        state = getattr(srv, "_generation_state", None)
        yield CounterMetricFamily("vattn:idle_trims", "times the idle policy gave the KV memory back",
                                  value=getattr(handle, "num_idle_trims", 0))
        yield CounterMetricFamily("vattn:loop_restarts", "batching loops restarted after they died",
                                  value=getattr(state, "num_restarts", 0))
        yield CounterMetricFamily("vattn:caches", "continuous-batching caches built on vattn memory",
                                  value=getattr(handle, "num_caches", 0))
        yield from _budget(getattr(handle, "budget", None))


def _usage(pool: Any, stats: Any) -> float | None:
    """Blocks in use over the most one cache can ever have in use (pinned trash blocks aside)."""
    if pool is None or stats is None:
        return None
    from vattn.integrations.hf_cb import TRASH_SECTORS

    room = pool.max_blocks() - TRASH_SECTORS
    return max(0, stats.num_used_blocks - TRASH_SECTORS) / room if room > 0 else 1.0


def _requests(srv: Any) -> tuple[int, int]:
    """(running, waiting) in transformers' batching loop: its scheduler's active and waiting
    requests, and those still in the loop's input queue."""
    manager = getattr(getattr(srv, "_generation_state", None), "_cb_manager", None)
    cb = getattr(manager, "_cb", None)
    scheduler = getattr(getattr(cb, "batch_processor", None), "scheduler", None)
    queued = getattr(cb, "input_queue", None)
    running = len(getattr(scheduler, "active_requests", ()) or ())
    waiting = len(getattr(scheduler, "waiting_requests", ()) or ()) + (queued.qsize() if queued is not None else 0)
    return running, waiting


def _budget(budget: Any) -> Iterator[Any]:
    if budget is None:
        return
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    s = budget.stats()
    limit = getattr(s, "budget_limit", s.limit)  # a shared budget's own limit, not this member's share of it
    if limit is not None:
        yield GaugeMetricFamily("vattn:budget_limit_bytes", "the budget's limit (bytes, all members)", value=limit)
    yield GaugeMetricFamily("vattn:budget_used_bytes", "bytes taken from the budget by all its members", value=s.used)
    name = getattr(budget, "name", None)
    if name is None:  # an in-process budget: its pools are this server's
        return
    from vattn.budget.shared import list_budgets

    labels = ["pid", "label"]
    mapped = GaugeMetricFamily("vattn:budget_member_mapped_bytes", "bytes each member took", labels=labels)
    used = GaugeMetricFamily("vattn:budget_member_used_bytes", "bytes each member has in use (mapped - cached)",
                             labels=labels)
    limits = GaugeMetricFamily("vattn:budget_member_limit_bytes", "each member's own limit (absent: none)",
                               labels=labels)
    refusals = CounterMetricFamily("vattn:budget_member_refusals", "pages the budget refused each member",
                                   labels=labels)
    for b in list_budgets(name):
        if b["path"] != str(budget.path):  # the same name on another device
            continue
        for m in b["members"]:
            key = [str(m["pid"]), m["label"]]
            mapped.add_metric(key, m["mapped"])
            used.add_metric(key, m["used"])
            if m.get("limit") is not None:
                limits.add_metric(key, m["limit"])
            refusals.add_metric(key, m["refusals"])
    yield from (mapped, used, limits, refusals)
