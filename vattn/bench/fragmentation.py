"""Memory wasted and requests that fit: vattn against static reservation and paged blocks.

A request-length trace (`--trace CSV` with `num_prefill_tokens` and `num_decode_tokens`
columns; by default the 28K-request arXiv summarization trace in benchmarks/data/) or a
synthetic one (`--synthetic`) is served with continuous batching: a request holds its
prompt, then grows one token per iteration until its last token. For every model shape
(the vAttention paper's Yi-6B, Llama-3-8B, Yi-34B, fp16, tensor-parallel 1 and 2: one
worker holds its share of the KV heads) and every memory manager:

- `static`: a max-length reservation per request (Orca / FasterTransformer), sized for
  `--max-context-len` (default: the trace's longest request, the most favourable choice);
- `paged-16`, `paged-128`: vLLM's blocks of 16 and 128 tokens;
- `vattn-L-<page>`: vattn per-layer (a page holds page / (heads x head_dim x 2) tokens of
  one layer), and `vattn-F-<page>`: fused (a page holds tokens of all layers), at 64 KiB,
  128 KiB, 256 KiB and 2 MiB pages.

COMPUTED (closed form, exact for every request of the trace; milliseconds): the bytes each
manager holds for a request of length l (static: max_len tokens; paged: l rounded up to a
block; vattn: ceil(l x token bytes of a buffer / page) pages in every buffer). From a
histogram of the lengths every running request has at every iteration:
- `waste %`: mapped bytes holding no token, summed over all (request, iteration) pairs,
  over mapped bytes: the internal fragmentation of the running batch, time-averaged;
- `worst MiB`: the most any request of the trace wastes at any length (per GPU);
- `fit`: requests that fit `--budget-gib` of KV memory per GPU in the steady state
  (budget / mean bytes per running request; static: budget / one reservation), and
  `fit x`: that as a ratio to `--reference` (default vattn per-layer 256 KiB, the paper's
  recommended page); `mem x`: mean bytes per request as a ratio to it.

MEASURED (the real allocator, host backend): for every vattn configuration of
`--replay-model` (default Llama-3-8B, TP-1) whose page holds at least 8 tokens (a smaller
page wastes less than that and would cost a host mapping every few tokens), the first `--replay-requests` requests of the
trace (0: all of them) go through a real `vattn.KVCache` with `--slots` slots and a physical
budget of `--replay-budget-tokens` tokens: continuous batching, `step` before every
iteration, newest requests preempted (recomputed) when `step` cannot back them, deferred
reclamation and pre-mapping as in serving. The cache keeps the configuration's tokens per
page and layout but shrinks a token (heads x head_dim; per-layer with one layer, whose
waste does not depend on the layer count) so that the host's 4 KiB pages can represent it
in little memory. Reported from `cache.stats()` after every step: the measured waste %
(bytes mapped to running requests but holding no token, over those bytes), the requests
running while others wait, preemptions, and the closed form's waste for the same requests
next to it: the check that the model above is the allocator's arithmetic.

    vattn bench fragmentation [--trace CSV | --synthetic lognormal] [--replay-requests 0]

HYBRID (`--hybrid`, saved as fragmentation_hybrid_<device>): models that mix full-attention,
sliding-window and Mamba layers (Gemma-2, Gemma-3, Jamba), or keep other than K and V per head
(DeepSeek-V3's latent, Llama 4's chunked local attention, GPT-OSS's alternating 128-token
windows with sinks) at their real shapes on long contexts, vattn with sliding-window pages
given back against one block size for every layer (vLLM's behaviour before its hybrid
allocator) and per-kind pools (its hybrid KV cache manager); see `vattn.bench._hybrid`.

    vattn bench fragmentation --hybrid [--hybrid-contexts 8192 32768 131072]
"""
from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from vattn.errors import InvalidConfigError

from ._common import TRACE, progress

NAME = "fragmentation"
HELP = "memory wasted and requests that fit: vattn vs static reservation and paged blocks (trace replay)"
NEEDS_GPU = False

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
# layers, KV heads, head dim (fp16): the vAttention paper's models
MODELS: dict[str, tuple[int, int, int]] = {"yi-6b": (32, 4, 128), "llama-3-8b": (32, 8, 128), "yi-34b": (60, 8, 128)}
PAGES = (64 * KB, 128 * KB, 256 * KB, 2 * MB)
HOST_PAGE = 4096  # the host backend's granularity (replays)
MIN_REPLAY_TOKENS = 8  # replays of fewer tokens a page would need a host mapping (of vm.max_map_count) per token or two


@dataclass(frozen=True)
class Shape:
    """One worker's share of a model's KV cache: `tp` workers split the KV heads."""

    model: str
    tp: int
    layers: int
    kv_heads: int
    head_dim: int
    elem: int = 2  # fp16

    @property
    def label(self) -> str:
        return f"{self.model} TP{self.tp}"

    @property
    def layer_token_bytes(self) -> int:
        """One token of one layer's K (or V) on this worker."""
        return self.kv_heads // self.tp * self.head_dim * self.elem

    @property
    def token_bytes_all(self) -> int:
        """One token's K and V of every layer on this worker."""
        return 2 * self.layers * self.layer_token_bytes


def shape(model: str, tp: int) -> Shape:
    layers, heads, dim = MODELS[model]
    if tp < 1 or heads % tp:
        raise InvalidConfigError(f"{model} has {heads} KV heads: tensor parallelism {tp} does not divide them; "
                                 "give --tp 1 or 2 (or another divisor)")
    return Shape(model, tp, layers, heads, dim)


@dataclass(frozen=True)
class System:
    """A memory manager's rule for the bytes a request of length l holds."""

    name: str
    kind: str  # static | paged | vattn
    granule: int = 0  # paged: tokens per block; vattn: page bytes
    layout: str = ""  # vattn: per-layer | fused

    def buffer_token_bytes(self, s: Shape) -> int:
        """vattn: bytes of one token in one buffer (a layer's, or all layers' when fused)."""
        return s.layer_token_bytes * (s.layers if self.layout == "fused" else 1)

    def tokens_per_page(self, s: Shape) -> float:
        if self.kind == "static":
            return float("nan")
        return float(self.granule) if self.kind == "paged" else self.granule / self.buffer_token_bytes(s)

    def mapped(self, lengths: np.ndarray, s: Shape, max_len: int) -> np.ndarray:
        """Bytes held (per worker) by requests of these lengths."""
        if self.kind == "static":
            return np.full(lengths.shape, max_len * s.token_bytes_all, dtype=np.int64)
        if self.kind == "paged":
            return -(-lengths // self.granule) * self.granule * s.token_bytes_all
        buffers = 2 * s.layers if self.layout == "per-layer" else 2
        return -(-lengths * self.buffer_token_bytes(s) // self.granule) * self.granule * buffers


def _page_label(page: int) -> str:
    return f"{page // MB}M" if page >= MB else f"{page // KB}K"


SYSTEMS = ([System("static", "static"), System("paged-16", "paged", 16), System("paged-128", "paged", 128)]
           + [System(f"vattn-L-{_page_label(p)}", "vattn", p, "per-layer") for p in PAGES]
           + [System(f"vattn-F-{_page_label(p)}", "vattn", p, "fused") for p in PAGES])
BY_NAME = {s.name: s for s in SYSTEMS}


# ------------------------------------------------------------------------- trace ----
def load_requests(args: argparse.Namespace) -> tuple[list[tuple[int, int]], str]:
    """(prompt, decode) per request, and where they came from. Lengths are clipped to
    --max-context-len when it is given (a prompt to max_len - 1, the decode to the rest)."""
    from vattn.workload import synthetic_requests, trace_requests

    cap = args.max_context_len or 1 << 30
    if args.synthetic:
        n = args.requests or 2000
        if args.synthetic == "lognormal":
            reqs = synthetic_requests(n, args.max_context_len or 8192, seed=args.seed)
        else:  # uniform prompt and output lengths, each up to half the context
            rng = np.random.default_rng(args.seed)
            half = (args.max_context_len or 8192) // 2
            return [(int(p), int(d)) for p, d in rng.integers(1, half + 1, size=(n, 2))], f"synthetic uniform, {n}"
        return [(r.prompt, r.output) for r in reqs], f"synthetic {args.synthetic}, {n} requests"
    path = Path(args.trace or TRACE)
    if not path.is_file():
        raise InvalidConfigError(f"trace {path} does not exist; give --trace CSV (columns num_prefill_tokens, "
                                 "num_decode_tokens) or --synthetic lognormal")
    with open(path, newline="") as f:
        header = f.readline().strip().split(",")
    missing = {"num_prefill_tokens", "num_decode_tokens"} - set(header)
    if missing:
        raise InvalidConfigError(f"trace {path} lacks the column(s) {', '.join(sorted(missing))} (it has "
                                 f"{', '.join(header)}); give a CSV with num_prefill_tokens and num_decode_tokens")
    reqs = trace_requests(str(path), args.requests or 1 << 62, cap)
    return [(r.prompt, r.output) for r in reqs], f"{path.name}, {len(reqs)} requests"


def length_histogram(requests: list[tuple[int, int]], max_len: int) -> np.ndarray:
    """count[l]: (request, iteration) pairs at length l. A request with prompt p and d output
    tokens runs d iterations at lengths p, p + 1, ..., p + d - 1 (the last token's K/V is
    never stored)."""
    diff = np.zeros(max_len + 2, dtype=np.int64)
    a = np.array(requests, dtype=np.int64).reshape(-1, 2)
    np.add.at(diff, a[:, 0], 1)
    np.add.at(diff, a[:, 0] + a[:, 1], -1)
    return np.cumsum(diff)[:max_len + 1]


def model_row(system: System, s: Shape, hist: np.ndarray, max_len: int, budget: int) -> dict[str, Any]:
    """The closed-form figures of one manager on one shape."""
    lengths = np.nonzero(hist)[0]
    cnt = hist[lengths]
    mapped = system.mapped(lengths, s, max_len)
    used = lengths * s.token_bytes_all
    total = int((cnt * mapped).sum())
    mean = total / int(cnt.sum())
    fit = budget // (max_len * s.token_bytes_all) if system.kind == "static" else int(budget // mean)
    return dict(model=s.model, tp=s.tp, system=system.name, tokens_per_page=system.tokens_per_page(s),
                waste_pct=100 * (total - int((cnt * used).sum())) / total,
                worst_waste_MiB=float((mapped - used).max()) / MB, mean_request_MiB=mean / MB, fit=int(fit))


# ------------------------------------------------------------------------ replay ----
def replay_cache_args(system: System, s: Shape) -> dict[str, Any]:
    """A small host KVCache with the configuration's layout and tokens per page: page and
    token shrunk by the same factor (a page a multiple of the host's 4 KiB)."""
    layers = s.layers if system.layout == "fused" else 1  # per-layer waste does not depend on the layer count
    ratio = Fraction(system.granule, system.buffer_token_bytes(s))  # tokens per page
    for m in range(1, 1025):
        token = Fraction(HOST_PAGE * m) / ratio  # bytes of a token in one buffer
        if token.denominator == 1 and int(token) % (2 * layers) == 0:
            return dict(num_layers=layers, num_kv_heads=1, head_dim=int(token) // (2 * layers), dtype="float16",
                        page_size=HOST_PAGE * m, layout=system.layout)
    raise InvalidConfigError(f"no host page represents {system.name} on {s.label} ({ratio} tokens a page)")


def replay(system: System, s: Shape, requests: list[tuple[int, int]], slots: int, budget_tokens: int,
           max_len: int, bar: Any = None) -> dict[str, Any]:
    """Serve `requests` through a real KVCache (host backend) and measure what it maps."""
    import vattn

    kw = replay_cache_args(system, s)
    with vattn.KVCache(**kw, max_batch_size=slots, max_context_len=max_len, device="cpu", background=False,
                       physical_memory=budget_tokens * _token_bytes_all(kw)) as cache:
        waiting: deque[tuple[int, int]] = deque(requests)  # (prompt or recompute length, tokens still to produce)
        running: dict[int, list[int]] = {}  # slot -> [length, final length]
        active = used = iters = preempted = 0
        running_sum = saturated_sum = saturated = 0
        room = budget_tokens  # tokens the next iteration may admit (the scheduler's estimate; step decides)
        t0 = time.perf_counter()
        while waiting or running:
            lens = {slot: n + 1 for slot, (n, _) in running.items()}
            new = _admit(cache, waiting, running, lens, room)
            failed = set(cache.step(lens).failed)
            if failed & running.keys():  # the running come first: admit nobody, preempt the newest until all fit
                _requeue(cache, new, lens, waiting)
                new, failed = [], set()
                preempted += _preempt_until_fit(cache, lens, running, waiting, system.name, budget_tokens)
            for slot, req in new:
                if slot not in failed:
                    running[slot] = [req[0] - 1, req[0] + req[1] - 1]
            _requeue(cache, [(slot, req) for slot, req in new if slot in failed], lens, waiting)
            st = cache.stats()
            active += st.active_bytes
            used += st.used_bytes
            iters += 1
            # admission like vLLM's: prompts that fit the free tokens (plus what finishes now); growth that
            # then does not fit preempts
            room = st.free_tokens + sum(r[1] for r in running.values() if r[0] + 1 >= r[1])
            running_sum += len(running)
            if waiting:
                saturated += 1
                saturated_sum += len(running)
            for slot, r in list(running.items()):
                r[0] = lens[slot]
                if r[0] >= r[1]:
                    del running[slot]
                    cache.free_reqid(slot)
                    if bar is not None:
                        bar.update(1)
        seconds = time.perf_counter() - t0
    return dict(model=s.model, tp=s.tp, system=system.name, requests=len(requests), slots=slots,
                budget_tokens=budget_tokens, page_size=kw["page_size"], head_dim=kw["head_dim"],
                layers=kw["num_layers"], iterations=iters,
                measured_waste_pct=100 * (active - used) / active if active else 0.0,
                running_saturated=saturated_sum / saturated if saturated else float("nan"),
                running_mean=running_sum / iters, preemptions=preempted, seconds=seconds)


def _admit(cache: Any, waiting: deque[tuple[int, int]], running: dict[int, list[int]], lens: dict[int, int],
           room: int) -> list[tuple[int, tuple[int, int]]]:
    """Take waiting requests in order while their prompts fit `room` tokens (the first one
    anyway when nothing runs): a slot each, its prompt length in `lens`. Returns (slot, request)."""
    new: list[tuple[int, tuple[int, int]]] = []
    while waiting and cache.num_free_reqids and (waiting[0][0] <= room or not running and not new):
        slot, req = cache.alloc_reqid(), waiting.popleft()
        new.append((slot, req))
        lens[slot] = req[0]
        room -= req[0]
    return new


def _requeue(cache: Any, new: list[tuple[int, tuple[int, int]]], lens: dict[int, int],
             waiting: deque[tuple[int, int]]) -> None:
    """Requests of `new` not admitted now: their slots freed, first in line next time (in order)."""
    for slot, req in reversed(new):
        cache.free_reqid(slot)
        del lens[slot]
        waiting.appendleft(req)


def _preempt_until_fit(cache: Any, lens: dict[int, int], running: dict[int, list[int]],
                       waiting: deque[tuple[int, int]], name: str, budget_tokens: int) -> int:
    """Step `lens` again, preempting the newest running request (it recomputes what it has,
    later) until the step fits. Returns the requests preempted."""
    preempted = 0
    while not cache.step(lens):
        if len(running) == 1:
            raise InvalidConfigError(f"{name}: one request alone does not fit {budget_tokens} "
                                     "tokens; raise --replay-budget-tokens")
        slot = next(reversed(running))
        n, end = running.pop(slot)
        del lens[slot]
        cache.free_reqid(slot)
        waiting.appendleft((n + 1, end - n))
        preempted += 1
    return preempted


def _token_bytes_all(kw: dict[str, Any]) -> int:
    return 2 * kw["num_layers"] * kw["num_kv_heads"] * kw["head_dim"] * 2


# ------------------------------------------------------------------------- bench ----
def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", default=None, metavar="CSV",
                     help="request lengths: a CSV with num_prefill_tokens and num_decode_tokens columns "
                     "(default: benchmarks/data/arxiv_summarization.csv, 28K requests)")
    src.add_argument("--synthetic", choices=["lognormal", "uniform"], default=None,
                     help="synthetic lengths instead of a trace (--requests of them, default 2000)")
    p.add_argument("--requests", type=int, default=0, help="use the first N requests (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of --synthetic")
    p.add_argument("--max-context-len", type=int, default=0,
                   help="tokens a static reservation holds (default: the trace's longest request)")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS),
                   help="model shapes (default: all three)")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel degrees (default: 1 2)")
    p.add_argument("--budget-gib", type=float, default=32.0, help="KV memory per GPU for 'fit' (default: 32)")
    p.add_argument("--reference", default="vattn-L-256K", choices=list(BY_NAME), help="the ratios' denominator")
    p.add_argument("--replay-model", default="llama-3-8b", choices=list(MODELS),
                   help="the shape whose vattn configurations the real allocator replays (default: llama-3-8b)")
    p.add_argument("--replay-tp", type=int, default=1, help="its tensor-parallel degree (default: 1)")
    p.add_argument("--replay-requests", type=int, default=2000,
                   help="requests replayed through the real allocator per configuration (0: all; default 2000)")
    p.add_argument("--replay-budget-tokens", type=int, default=131072,
                   help="the replays' physical budget in tokens (default: 131072)")
    p.add_argument("--slots", type=int, default=128, help="the replays' max_batch_size (default: 128)")
    from . import _hybrid

    h = p.add_argument_group("hybrid models (--hybrid)")
    h.add_argument("--hybrid", action="store_true",
                   help="models with sliding-window, chunked, latent or Mamba layers instead: memory per request "
                   "and requests that fit, vattn vs one block size for all layers and per-kind pools "
                   "(fragmentation_hybrid_<device>)")
    h.add_argument("--hybrid-models", nargs="+", default=list(_hybrid.HYBRIDS), choices=list(_hybrid.HYBRIDS),
                   help="hybrid model shapes (default: all)")
    h.add_argument("--hybrid-contexts", type=int, nargs="+", default=[8192, 32768, 131072],
                   help="long-context workloads' context lengths, besides the arXiv trace (default: 8192 32768 "
                   "131072)")
    h.add_argument("--hybrid-requests", type=int, default=2000, help="requests per long workload (default: 2000)")
    h.add_argument("--hybrid-replay-model", default="gemma-3-27b", choices=_hybrid.REPLAYABLE,
                   help="the shape the real allocator replays (default: gemma-3-27b)")
    h.add_argument("--hybrid-replay-requests", type=int, default=16,
                   help="long requests the real allocator serves per page size (default: 16)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "hybrid", False):
        return run_hybrid(args)
    requests, source = load_requests(args)
    if not requests:
        raise InvalidConfigError("the trace has no requests; give a non-empty --trace or --synthetic")
    max_len = args.max_context_len or max(p + d for p, d in requests)
    hist = length_histogram(requests, max_len)
    budget = int(args.budget_gib * GB)
    t0 = time.perf_counter()
    rows = []
    for model in args.models:
        for tp in args.tp:
            s = shape(model, tp)
            rs = [model_row(system, s, hist, max_len, budget) for system in SYSTEMS]
            ref = next(r for r in rs if r["system"] == args.reference)
            for r in rs:
                r["fit_vs_ref"] = r["fit"] / ref["fit"] if ref["fit"] else float("nan")
                r["mem_vs_ref"] = r["mean_request_MiB"] / ref["mean_request_MiB"]
            rows += rs
    model_s = time.perf_counter() - t0

    s = shape(args.replay_model, args.replay_tp)
    n = args.replay_requests or len(requests)
    sub = requests[:n]
    sub_hist = length_histogram(sub, max_len)
    if args.replay_budget_tokens < 2 * max_len:
        raise InvalidConfigError(f"--replay-budget-tokens {args.replay_budget_tokens} must hold two of the longest "
                                 f"requests ({2 * max_len} tokens)")
    replays = []
    # a page of under MIN_REPLAY_TOKENS tokens wastes at most that; replaying it would take a host mapping per token
    vattn_systems = [x for x in SYSTEMS if x.kind == "vattn" and x.tokens_per_page(s) >= MIN_REPLAY_TOKENS]
    skipped = [x.name for x in SYSTEMS if x.kind == "vattn" and x.tokens_per_page(s) < MIN_REPLAY_TOKENS]
    with progress(total=n * len(vattn_systems), desc="replay", unit="req") as bar:
        for system in vattn_systems:
            r = replay(system, s, sub, args.slots, args.replay_budget_tokens, max_len, bar)
            m = model_row(system, s, sub_hist, max_len, budget)  # the closed form on the same requests
            r["model_waste_pct"] = m["waste_pct"]
            r["model_fit"] = args.replay_budget_tokens * s.token_bytes_all / (m["mean_request_MiB"] * MB)
            replays.append(r)
    return dict(source=source, requests=len(requests), max_context_len=max_len, budget_gib=args.budget_gib,
                reference=args.reference, token_iterations=int(hist.sum()),
                mean_length=float((np.arange(len(hist)) * hist).sum() / hist.sum()),
                rows=rows, replays=replays, replay_skipped=skipped, model_seconds=model_s,
                replay_seconds=sum(r["seconds"] for r in replays))


def run_hybrid(args: argparse.Namespace) -> dict[str, Any]:
    """The hybrid models' figures (`vattn.bench._hybrid`)."""
    from . import _hybrid

    t0 = time.perf_counter()
    rows = _hybrid.computed_rows(args)
    model_s = time.perf_counter() - t0
    replays = _hybrid.replay(args) if args.hybrid_replay_requests else []
    return dict(hybrid=True, file_name="fragmentation_hybrid", budget_gib=args.budget_gib, rows=rows,
                replays=replays, model_seconds=model_s, replay_seconds=sum(r["seconds"] for r in replays),
                shapes={k: vars(v) for k, v in _hybrid.HYBRIDS.items() if k in args.hybrid_models})


def hybrid_table(result: dict[str, Any]) -> tuple[list[str], list[list]]:
    headers = ["model", "workload", "manager", "tok/page", "MiB/req", "full", "window", "state", "worst MiB", "fit",
               "fit x", "mem x"]
    rows = [[r["model"], r["workload"], r["manager"], r["tokens_per_page"], r["mean_request_MiB"], r["full_MiB"],
             r["window_MiB"], r["state_MiB"], r["worst_request_MiB"], round(r["fit"], 1), r["fit_vs_uniform"],
             r["mem_vs_uniform"]] for r in result["rows"]]
    for r in result["replays"]:
        rows.append([r["model"], r["workload"], r["manager"], "", r["measured_full_MiB"] + r["measured_window_MiB"],
                     f"{r['measured_full_MiB']:.1f} | {r['model_full_MiB']:.1f}",
                     f"{r['measured_window_MiB']:.1f} | {r['model_window_MiB']:.1f}", "", "", "", "", ""])
    print(f"\nHybrid models: mean MiB per running request (time-averaged over every iteration of the workload; "
          f"full / window / state: by layer kind), requests that fit {result['budget_gib']:g} GiB, ratios to "
          f"uniform-16 (one block size for every layer, no window, a latent layer's K and V expanded per head; "
          f"window: sliding or chunked layers). '(replay)' rows: the real allocator, measured | "
          f"computed. Computed in {result['model_seconds']:.2f} s, replays {result['replay_seconds']:.0f} s.")
    return headers, rows


def hybrid_plot(result: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    cases = list(dict.fromkeys((r["model"], r["workload"]) for r in rows))
    names = list(dict.fromkeys(r["manager"] for r in rows))
    fig, ax = plt.subplots(figsize=(15, 4.8))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        by = {(r["model"], r["workload"]): r for r in rows if r["manager"] == name}
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(cases))]
        ax.bar(xs, [by[c]["fit_vs_uniform"] for c in cases], width, label=name)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(yscale="log", ylabel="requests that fit / uniform-16 (log)",
           title=f"hybrid models: requests that fit {result['budget_gib']:g} GiB (memory per request, time-averaged)")
    ratios = [r["fit_vs_uniform"] for r in rows]
    ax.set_ylim(0.6 * min(ratios), 8 * max(ratios))  # room for the legend above the bars
    ax.set_xticks(range(len(cases)), [f"{m}\n{w}" for m, w in cases], rotation=45, ha="right", fontsize=7)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return fig


def table(result: dict[str, Any]) -> tuple[list[str], list[list]]:
    """One row per (model, TP, manager) (computed), then the replays (measured)."""
    if result.get("hybrid"):
        return hybrid_table(result)
    headers = ["model", "TP", "manager", "tok/page", "waste %", "worst MiB", "MiB/req", "fit", "fit x", "mem x",
               "measured waste %", "running (saturated)", "preempt"]
    rows = [[f"{r['model']}", r["tp"], r["system"], r["tokens_per_page"], r["waste_pct"], r["worst_waste_MiB"],
             r["mean_request_MiB"], r["fit"], r["fit_vs_ref"], r["mem_vs_ref"], "", "", ""] for r in result["rows"]]
    for r in result["replays"]:
        rows.append([f"{r['model']} (replay)", r["tp"], r["system"], "", r["model_waste_pct"], "", "",
                     round(r["model_fit"], 1), "", "", r["measured_waste_pct"], r["running_saturated"],
                     r["preemptions"]])
    print(f"\n{result['source']}: {result['token_iterations']:,} (request, iteration) pairs, mean length "
          f"{result['mean_length']:.0f}, static reservation {result['max_context_len']} tokens; 'fit' in "
          f"{result['budget_gib']:g} GiB per GPU; ratios to {result['reference']}. Rows 'computed' are the closed "
          f"form over the whole trace; '(replay)' rows: the real allocator (host) on {result['replays'][0]['requests']} "
          f"requests in {result['replays'][0]['budget_tokens']} tokens (waste % computed | measured; fit computed | "
          f"running measured). Computed in {result['model_seconds']:.2f} s, replays {result['replay_seconds']:.0f} s.")
    return headers, rows


def plot(result: dict[str, Any]) -> Any:
    if result.get("hybrid"):
        return hybrid_plot(result)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    shapes = list(dict.fromkeys((r["model"], r["tp"]) for r in rows))
    names = [s.name for s in SYSTEMS]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 4.8))
    width = 0.8 / len(shapes)
    for i, (model, tp) in enumerate(shapes):
        rs = {r["system"]: r for r in rows if r["model"] == model and r["tp"] == tp}
        xs = [j + (i - (len(shapes) - 1) / 2) * width for j in range(len(names))]
        ax1.bar(xs, [max(rs[n]["waste_pct"], 1e-3) for n in names], width, label=f"{model} TP{tp}")
        ax2.bar(xs, [rs[n]["fit_vs_ref"] for n in names], width, label=f"{model} TP{tp}")
    ax1.set(yscale="log", ylabel="memory wasted (% of mapped, time-averaged; 0 at 0.001)",
            title=f"internal fragmentation ({result['source']})")
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set(ylabel=f"requests that fit / {result['reference']}",
            title=f"requests that fit {result['budget_gib']:g} GiB per GPU")
    for ax in (ax1, ax2):
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
        ax.legend(fontsize=7, ncol=2)
    return fig
