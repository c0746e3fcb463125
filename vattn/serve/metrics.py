"""`GET /metrics` of `vattn serve --engine vattn`: vLLM's metrics, `vattn:` for `vllm:`.

The same names, types, buckets and labels as vLLM v1 (`vllm/v1/metrics/loggers.py`), so that a
dashboard or alert written for vLLM reads this server with `vllm:` replaced by `vattn:`
(every query of vLLM's example Grafana dashboard finds its metric). Labels: `model_name`
(the served name), `engine` ("0": one engine), and `finished_reason` on
`request_success_total` ("stop", "length", "abort", "error").

| metric | type | what |
|---|---|---|
| `vattn:time_to_first_token_seconds` | histogram | arrival to the first token |
| `vattn:inter_token_latency_seconds` (and `time_per_output_token_seconds`, its old name) | histogram | between a request's steps that gave it tokens |
| `vattn:request_time_per_output_token_seconds` | histogram | per request: decode time / (tokens - 1) |
| `vattn:e2e_request_latency_seconds` | histogram | arrival to finish |
| `vattn:request_queue_time_seconds` | histogram | arrival to the start of the step that gave the first token |
| `vattn:request_prefill_time_seconds` | histogram | that step's time (a prompt computed in several chunks: the last one's) |
| `vattn:request_decode_time_seconds` / `request_inference_time_seconds` | histogram | first token to finish / prefill + decode |
| `vattn:request_prompt_tokens` / `request_generation_tokens` / `request_max_num_generation_tokens` / `request_params_n` / `request_params_max_tokens` | histogram | per finished request (1-2-5 buckets up to max_model_len) |
| `vattn:prompt_tokens_total` / `vattn:generation_tokens_total` | counter | tokens prefilled / generated |
| `vattn:request_success_total{finished_reason}` | counter | finished requests |
| `vattn:num_preemptions_total` | counter | preemptions |
| `vattn:prefix_cache_queries_total` / `prefix_cache_hits_total` | counter | prompt tokens looked up / found cached (every tier) |
| `vattn:kv_cache_usage_perc` (and `gpu_cache_usage_perc`, its old name) | gauge | KV bytes holding tokens over the bytes the cache may map, 0-1 (0 when idle) |
| `vattn:num_requests_running` / `num_requests_waiting` | gauge | sequences holding a slot / queued |
| `vattn:cache_config_info` | gauge (1) | the cache's settings as labels |
| `vattn:kv_mapped_bytes` / `kv_used_bytes` / `kv_limit_bytes` | gauge | vattn's own: pages mapped, bytes holding tokens, the limit |
| `vattn:offload_host_bytes` / `offload_disk_bytes`, `vattn:idle_trims_total` | gauge / counter | the offload tiers, idle give-backs |
| `vattn:requests_refused_total{code}` | counter | requests answered 4xx, by error code |

Token counters and histograms are observed by the engine's loop thread once per step per
request that got tokens (`on_step`); the engine's own figures are read on that thread
between steps when scraped (`engine_figures`).
"""
from __future__ import annotations

import threading
from typing import Any, Iterator

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE = "0"  # vLLM's `engine` label: the engine's index (one here)

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's `build_1_2_5_buckets`)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class ServeMetrics:
    """The server's registry (its own `CollectorRegistry`) and what fills it."""

    def __init__(self, model_name: str, max_model_len: int, cache_info: dict[str, str]) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.cache_info = cache_info
        self._lock = threading.Lock()
        self.refused: dict[str, int] = {}
        self.figures: dict[str, Any] = {}  # the engine's own, refreshed at each scrape (`engine_figures`)
        names = ["model_name", "engine"]
        labels = (model_name, ENGINE)

        def hist(name: str, doc: str, buckets: list) -> Any:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(*labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=self.registry).labels(*labels)

        self.ttft = hist("vattn:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.itl = hist("vattn:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.tpot_old = hist("vattn:time_per_output_token_seconds",
                             "Histogram of time per output token in seconds (the old name of inter_token_latency).",
                             ITL_BUCKETS)
        self.tpot = hist("vattn:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vattn:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        LATENCY_BUCKETS)
        self.queue = hist("vattn:request_queue_time_seconds", "Histogram of time spent waiting in the queue.",
                          LATENCY_BUCKETS)
        self.prefill = hist("vattn:request_prefill_time_seconds", "Histogram of time spent in the prefill phase.",
                            LATENCY_BUCKETS)
        self.decode = hist("vattn:request_decode_time_seconds", "Histogram of time spent in the decode phase.",
                           LATENCY_BUCKETS)
        self.inference = hist("vattn:request_inference_time_seconds",
                              "Histogram of time spent in the running phase.", LATENCY_BUCKETS)
        lengths = buckets_1_2_5(max_model_len)
        self.prompt_len = hist("vattn:request_prompt_tokens", "Number of prefill tokens processed.", lengths)
        self.gen_len = hist("vattn:request_generation_tokens", "Number of generation tokens processed.", lengths)
        self.max_gen_len = hist("vattn:request_max_num_generation_tokens",
                                "Histogram of maximum number of requested generation tokens.", lengths)
        self.params_n = hist("vattn:request_params_n", "Histogram of the n request parameter.", [1, 2, 5, 10, 20])
        self.params_max_tokens = hist("vattn:request_params_max_tokens",
                                      "Histogram of the max_tokens request parameter.", lengths)
        self.prompt_tokens = counter("vattn:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vattn:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vattn:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=self.registry)
        self.success = {r: success.labels(*labels, r) for r in ("stop", "length", "abort", "error")}
        self.registry.register(_EngineCollector(self))

    # ------------------------------------------------------------- loop thread ----
    def on_step(self, pairs: list, start: float, end: float) -> None:
        """Observe one step's outputs (on the engine's loop thread): `pairs` of (Handle,
        RequestOutput), `start` / `end` the step's perf_counter times."""
        generated = prompts = 0
        gaps: dict[float, int] = {}  # inter-token gap -> how many requests had it this step
        for handle, out in pairs:
            outs = out.outputs
            num = len(outs[0].token_ids) if len(outs) == 1 else sum(len(o.token_ids) for o in outs)
            new = num - handle.num_tokens
            if new > 0:
                if handle.num_tokens == 0:
                    m = out.metrics
                    self.ttft.observe((m.first_token_time or end) - m.arrival_time)
                    handle.prefill_s = end - start
                    prompts += len(out.prompt_token_ids)
                else:
                    gap = end - handle.last_token_time
                    gaps[gap] = gaps.get(gap, 0) + 1
                handle.num_tokens = num
                handle.last_token_time = end
                generated += new
            if out.finished:
                self._finished(handle, out, end)
        # the requests that decoded in the step before all have the same gap: one observation of
        # it with their count, not two histogram updates (a lock each) per request per step on the
        # thread that runs the engine (issue 36: per-token work there delays every stream)
        for gap, count in gaps.items():
            _observe(self.itl, gap, count)
            _observe(self.tpot_old, gap, count)
        if generated:
            self.generation_tokens.inc(generated)
        if prompts:
            self.prompt_tokens.inc(prompts)

    def _finished(self, handle: Any, out: Any, end: float) -> None:
        m = out.metrics
        reason = out.outputs[0].finish_reason or "abort"
        if len(out.outputs) > 1:  # one reason a request: the first that is not "stop"/"length" wins
            reasons = {o.finish_reason for o in out.outputs}
            reason = next((r for r in ("error", "abort", "length") if r in reasons), reason)
        self.success.get(reason, self.success["abort"]).inc()
        finished = m.finished_time or end
        self.e2e.observe(finished - m.arrival_time)
        self.prompt_len.observe(len(out.prompt_token_ids))
        lengths = [len(o.token_ids) for o in out.outputs]
        self.gen_len.observe(sum(lengths))
        self.max_gen_len.observe(max(lengths))
        self.params_n.observe(len(lengths))
        if m.first_token_time is not None:
            queued = max(0.0, m.first_token_time - m.arrival_time - handle.prefill_s)
            decode = finished - m.first_token_time
            self.queue.observe(queued)
            self.prefill.observe(handle.prefill_s)
            self.decode.observe(decode)
            self.inference.observe(handle.prefill_s + decode)
            if max(lengths) > 1:
                self.tpot.observe(decode / (max(lengths) - 1))

    def on_request(self, params: Any) -> None:
        """A request's parameters (event loop)."""
        self.params_max_tokens.observe(params.max_tokens)

    def on_refused(self, code: str | None) -> None:
        with self._lock:
            key = code or "invalid_request"
            self.refused[key] = self.refused.get(key, 0) + 1

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _observe(hist: Any, value: float, count: int) -> None:
    """`hist.observe(value)` `count` times, as one update where prometheus_client's Histogram
    has the internals it has had since 0.4 (`_sum`, `_buckets`, `_upper_bounds`); otherwise
    one observe each."""
    if count == 1:
        hist.observe(value)
        return
    try:
        total, buckets, bounds = hist._sum, hist._buckets, hist._upper_bounds
    except AttributeError:
        for _ in range(count):
            hist.observe(value)
        return
    total.inc(value * count)
    for i, bound in enumerate(bounds):
        if value <= bound:
            buckets[i].inc(count)
            break


def engine_figures(llm: Any) -> dict[str, Any]:
    """The engine's own figures, read on its loop thread between steps."""
    stats = llm.memory_stats()
    pc = llm.prefix_cache_stats()
    capacity = stats.max_pages * stats.group_bytes
    return {
        "running": len(llm.scheduler.running), "waiting": len(llm.scheduler.waiting),
        "usage": stats.used_bytes / capacity if capacity else 0.0,
        "mapped": stats.mapped_bytes, "used": stats.used_bytes, "capacity": capacity,
        "limit": llm.config.physical_memory,
        "preemptions": llm.num_preemptions, "idle_trims": llm.num_idle_trims,
        "queries": pc.num_query_tokens if pc else 0, "hits": pc.num_hit_tokens if pc else 0,
        "host": stats.host_bytes, "disk": stats.disk_bytes,
        "spec": llm.spec_decode_stats(),  # None without --speculative-config
    }


class _EngineCollector:
    """The gauges and engine counters, from the figures of the last scrape."""

    def __init__(self, metrics: ServeMetrics) -> None:
        self.m = metrics

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m, f = self.m, self.m.figures
        names, labels = ["model_name", "engine"], [m.model_name, ENGINE]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(labels, value)
            return c

        yield gauge("vattn:num_requests_running", "Number of requests in model execution batches.", f.get("running", 0))
        yield gauge("vattn:num_requests_waiting", "Number of requests waiting to be processed.", f.get("waiting", 0))
        usage = f.get("usage", 0.0)
        yield gauge("vattn:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield gauge("vattn:gpu_cache_usage_perc", "KV-cache usage (the old name of kv_cache_usage_perc).", usage)
        yield counter("vattn:num_preemptions", "Cumulative number of preemption from the engine.",
                      f.get("preemptions", 0))
        yield counter("vattn:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      f.get("queries", 0))
        yield counter("vattn:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                      f.get("hits", 0))
        info = GaugeMetricFamily("vattn:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=[*names, *m.cache_info])
        info.add_metric([*labels, *m.cache_info.values()], 1)
        yield info
        yield gauge("vattn:kv_mapped_bytes", "KV pages mapped now (bytes).", f.get("mapped", 0))
        yield gauge("vattn:kv_used_bytes", "Bytes of KV pages holding tokens of running requests.", f.get("used", 0))
        yield gauge("vattn:kv_capacity_bytes", "Bytes of KV pages the cache may map.", f.get("capacity", 0))
        if f.get("limit") is not None:
            yield gauge("vattn:kv_limit_bytes", "--memory-limit (bytes of KV pages).", f["limit"])
        yield gauge("vattn:offload_host_bytes", "Bytes the host offload tier holds.", f.get("host", 0))
        yield gauge("vattn:offload_disk_bytes", "Bytes the disk offload tier holds.", f.get("disk", 0))
        yield counter("vattn:idle_trims", "Times the idle engine gave its unused KV pages back.",
                      f.get("idle_trims", 0))
        spec = f.get("spec")
        if spec is not None:  # vLLM's speculative-decoding counters
            yield counter("vattn:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.num_drafts)
            yield counter("vattn:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens)
            yield counter("vattn:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                          spec.num_accepted_tokens)
        refused = CounterMetricFamily("vattn:requests_refused", "Requests answered 4xx, by error code.",
                                      labels=[*names, "code"])
        with m._lock:
            for code, n in sorted(m.refused.items()):
                refused.add_metric([*labels, code], n)
        yield refused
