"""The paper's engine figures (7, 8, 9) for `vattn bench paper`: `vattn.LLM` against a paged
engine, transformers' continuous batching (its paged cache, the `generate_batch` manager).

Figure 7's decode tokens/s come from the decode iterations themselves, timed inside one run
(`decode_vattn`, `decode_hf_cb`): every request is admitted at once and each iteration after
the last prefill is timed on its own, so the figure is the median over those iterations of
the tokens an iteration produced over its seconds (a load spike on a shared host moves a few
iterations, not the figure). Figures 8 and 9 time whole runs: requests per minute, and each
request's latency under Poisson arrivals."""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

from . import _common
from ._common import progress
from ._models import cb_results
from .paper_common import (CUDA_ENGINE_MODEL, HOST_ENGINE_MODEL, PAGED_ENGINE, dtype_of, engine_args,
                           hf_cb_problem, is_cuda, pick, seed_tokens)
from .paper_common import model as model_of

Requests = list[tuple[list[int], int]]  # (prompt token ids, new tokens)


# -------------------------------------------------------- decode timed per iteration ----
def decode_figures(iterations: list[tuple[int, float]], engine: str) -> dict[str, Any]:
    """Decode tokens/s from the decode-only iterations' (tokens, seconds): the median of each
    iteration's tokens / seconds (`decode_tok_s`), and their sums' ratio (`decode_tok_s_mean`)."""
    its = [(n, s) for n, s in iterations if s > 0]
    if not its:
        raise RuntimeError(f"{engine}: no decode-only iteration was timed (every request needs at least 2 new "
                           "tokens: raise the new tokens per request)")
    return dict(decode_tok_s=statistics.median(n / s for n, s in its),
                decode_tok_s_mean=sum(n for n, _ in its) / sum(s for _, s in its),
                iteration_ms=1e3 * statistics.median(s for _, s in its), decode_iterations=len(its))


def decode_vattn(model: Any, reqs: Requests, args: argparse.Namespace, max_num_batched_tokens: int) -> dict[str, Any]:
    """`vattn.LLM` on `reqs` (all admitted at once), every `step()` timed: once each request has
    its first token, each step is a decode-only iteration (its tokens: what the outputs grew
    by). Decode tokens/s (`decode_figures`), the bytes the cache mapped while decoding."""
    from vattn import LLM, SamplingParams

    B = len(reqs)
    llm = LLM(model, device=args.device, dtype=dtype_of(args), max_batch_size=B,
              max_context_len=max(len(p) + n for p, n in reqs), max_num_batched_tokens=max_num_batched_tokens)
    try:
        llm.generate([reqs[0][0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        have = {llm.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)): 0 for p, n in reqs}
        iterations: list[tuple[int, float]] = []
        mapped0 = t_decode = None
        while llm.has_unfinished():
            decoding = all(have.values())
            if decoding and t_decode is None:  # the prefill is over: what the decode maps from here
                _common.sync(args.device)
                mapped0, t_decode = llm.cache.stats().mapped_bytes, time.perf_counter()
            t = time.perf_counter()
            outs = llm.step()
            seconds = time.perf_counter() - t
            grew = 0
            for o in outs:
                grew += len(o.token_ids) - have.get(o.request_id, 0)
                have[o.request_id] = len(o.token_ids)
            if decoding:
                iterations.append((grew, seconds))
        _common.sync(args.device)
        decode_s = time.perf_counter() - t_decode if t_decode is not None else float("nan")
        mapped = llm.cache.stats().mapped_bytes - mapped0 if mapped0 is not None else 0
    finally:
        llm.close()
    return dict(**decode_figures(iterations, "vattn.LLM"), mapped_while_decoding_MB=mapped / 1e6,
                mapped_MBps=mapped / decode_s / 1e6)


def decode_hf_cb(model: Any, reqs: Requests, eargs: argparse.Namespace) -> dict[str, Any]:
    """transformers' continuous batching on `reqs` (all added at once), every model forward
    stamped by a forward pre-hook: an iteration lasts from its forward's start to the next
    one's (the manager's scheduling, sampling and update included); a decode-only iteration
    is one whose query tokens are all sampled (one token per request), after the last
    forward that still ran a prompt chunk. Decode tokens/s (`decode_figures`)."""
    import torch
    from transformers import GenerationConfig

    from ._models import cb_config

    max_len = max(len(p) + n for p, n in reqs)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(n for _, n in reqs))
    cbc = cb_config(256, num_blocks=eargs.max_batch_size * -(-max_len // 256) + 4,
                    max_batch_tokens=eargs.max_num_batched_tokens, max_requests_per_batch=eargs.max_batch_size,
                    use_cuda_graph=False)
    forwards: list[tuple[float, int, int]] = []  # (start, query tokens, sampled tokens)

    def stamp(module: Any, args: Any, kwargs: dict) -> None:
        ids, keep = kwargs.get("input_ids"), kwargs.get("logits_indices", kwargs.get("logits_to_keep"))
        sampled = keep.numel() if isinstance(keep, torch.Tensor) else -1
        forwards.append((time.perf_counter(), ids.shape[-1] if ids is not None else -2, sampled))

    def wait(ids: list[str]) -> None:
        cb_results(manager, ids)

    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    manager.start()
    hook = None
    try:
        wait([manager.add_request(reqs[0][0][:8], request_id="warm-up", max_new_tokens=2)])
        hook = model.register_forward_pre_hook(stamp, with_kwargs=True)
        wait([manager.add_request(p, request_id=f"d{i}", max_new_tokens=n) for i, (p, n) in enumerate(reqs)])
    finally:
        if hook is not None:
            hook.remove()
        manager.stop(block=True, timeout=30)
        if str(getattr(model.config, "_attn_implementation", "")).startswith("paged"):
            model.set_attn_implementation("sdpa")  # continuous batching switched it to its paged attention
    last_prompt = max((i for i, (_, q, n) in enumerate(forwards) if q != n), default=-1)
    iterations = [(forwards[i][2], forwards[i + 1][0] - forwards[i][0]) for i in range(last_prompt + 1,
                                                                                        len(forwards) - 1)]
    return decode_figures(iterations, "transformers' continuous batching")


def fig7(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    """Decode tokens/s against the batch at one context, each engine's decode iterations timed."""
    batches = pick(args, [1, 2, 4, 8, 16, 32], [1, 2, 4, 8, 16, 32], [1, 8, 32], [1, 2, 4, 8, 16], [1, 4],
                   scaled, "batches")
    ctx = pick(args, 16384, 16384, 4096, 1024, 256, scaled, "context")
    new = 32 if is_cuda(args) or not args.quick else 16  # decode iterations per run: new - 1
    model, shape = model_of(args, CUDA_ENGINE_MODEL, HOST_ENGINE_MODEL, scaled)
    notes: list[str] = []
    systems = _systems(args, notes)
    rng = random.Random(args.seed)
    rows = []
    for B in progress(batches, desc="fig7", unit="batch"):
        reqs = [(seed_tokens(ctx - new, shape["vocab_size"], rng), new) for _ in range(B)]
        eargs = engine_args(B, min(B * ctx, 8192))
        row: dict[str, Any] = dict(batch=B, context=ctx, new_tokens=new)
        for s in systems:
            d = (decode_vattn(model, reqs, args, eargs.max_num_batched_tokens) if s == "vattn"
                 else decode_hf_cb(model, reqs, eargs))
            row.update({f"{s}_{k}": v for k, v in d.items() if k.startswith(("decode", "iteration"))})
        if "hf_cb" in systems:
            row["vattn_over_paged"] = row["vattn_decode_tok_s"] / row["hf_cb_decode_tok_s"]
        rows.append(row)
    top = rows[-1]
    if "hf_cb" in systems:
        ratios = [r["vattn_over_paged"] for r in rows]
        headline = (f"decode tok/s vattn / paged engine: {min(ratios):.2f}-{max(ratios):.2f}x over batch "
                    f"{rows[0]['batch']}-{top['batch']} at {ctx} tokens (vattn {top['vattn_decode_tok_s']:.0f} "
                    f"against {top['hf_cb_decode_tok_s']:.0f} tok/s at batch {top['batch']})")
    else:
        headline = f"vattn decode tok/s {top['vattn_decode_tok_s']:.0f} at batch {top['batch']} x {ctx} tokens"
    return dict(systems=systems, paged_engine=PAGED_ENGINE, rows=rows, notes=notes, headline=headline,
                timing="per decode iteration inside one run: the median of tokens / seconds over the iterations "
                       "after the last prefill (vattn: step(); the paged engine: forward start to forward start)")


# --------------------------------------------------------------- figures 8 and 9 ----
def _systems(args: argparse.Namespace, notes: list[str]) -> list[str]:
    problem = hf_cb_problem() if not args.no_paged_engine else "--no-paged-engine"
    if problem:
        notes.append(f"the paged engine (transformers' continuous batching) left out: {problem}")
        return ["vattn"]
    return ["vattn", "hf_cb"]


def _serve(system: str, model: Any, reqs: list, args: argparse.Namespace, eargs: argparse.Namespace) -> dict:
    from . import throughput

    if system == "vattn":
        return throughput.run_vattn(model, reqs, eargs, args.device, dtype_of(args))
    return throughput.run_hf_cb(model, reqs, eargs, args.device)


def _trace(args: argparse.Namespace, n: int, scale: float, max_new: int, vocab: int) -> list[tuple[list[int], int]]:
    """The first `n` arXiv requests, prompts scaled by `scale` (the paper's long contexts from the
    trace's shape), outputs capped at `max_new`; random token ids (seeded)."""
    from vattn.workload import trace_requests

    rng = random.Random(args.seed)
    reqs = trace_requests(str(_common.TRACE), n, 1 << 30)
    return [(seed_tokens(max(1, round(r.prompt * scale)), vocab, rng), max(2, min(max_new, r.output))) for r in reqs]


TRACE_LONGEST_PROMPT = 4096  # the arXiv trace's prompts are at most 4054 tokens: scaled to the context


def fig8(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    """Requests per minute on the arXiv trace, prompts scaled to each context."""
    paper = [65536, 131072, 196608]
    ctxs = pick(args, paper, paper, [65536], [1024, 2048, 3072], [512, 1024], scaled, "contexts")
    n = pick(args, "the arXiv trace", 64, 16, 16, 4, scaled, "requests")
    max_new = pick(args, "the trace's outputs", 256, 64, 16, 8, scaled, "output tokens (cap)")
    model, shape = model_of(args, CUDA_ENGINE_MODEL, HOST_ENGINE_MODEL, scaled)
    notes: list[str] = []
    systems = _systems(args, notes)
    rows = []
    for ctx in progress(ctxs, desc="fig8", unit="context"):
        reqs = _trace(args, n, ctx / TRACE_LONGEST_PROMPT, max_new, shape["vocab_size"])
        row: dict[str, Any] = dict(context=ctx, requests=len(reqs), prompt_tokens=sum(len(p) for p, _ in reqs),
                                   output_tokens=sum(o for _, o in reqs))
        slots = 16 if is_cuda(args) else 8
        for s in systems:
            r = _serve(s, model, reqs, args, engine_args(slots, max(2048, ctx)))
            row[f"{s}_makespan_s"] = r["tn"].wall
            row[f"{s}_requests_per_min"] = len(reqs) / r["tn"].wall * 60
        if "hf_cb" in systems:
            row["vattn_over_paged"] = row["vattn_requests_per_min"] / row["hf_cb_requests_per_min"]
        rows.append(row)
    return dict(systems=systems, paged_engine=PAGED_ENGINE, rows=rows, notes=notes,
                prompt_scale="prompt x context / 4096 (the trace's longest prompt is 4054 tokens)",
                headline=", ".join(f"{r['context']}: vattn {r['vattn_requests_per_min']:.1f} req/min"
                                   + (f" ({r['vattn_over_paged']:.2f}x paged)" if "vattn_over_paged" in r else "")
                                   for r in rows))


def online_vattn(model: Any, reqs: list, arrivals: list[float], args: argparse.Namespace, slots: int,
                 ctx: int) -> list[float]:
    """Requests added at their arrival times (seconds from the start) to a stepped `vattn.LLM`;
    each one's latency, arrival to its last token (seconds), in request order."""
    from vattn import LLM, SamplingParams

    llm = LLM(model, device=args.device, dtype=dtype_of(args), max_batch_size=slots,
              max_context_len=max(len(p) + o for p, o in reqs), max_num_batched_tokens=max(2048, ctx))
    try:
        llm.generate([reqs[0][0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        ids: dict[int, int] = {}
        lat = [float("nan")] * len(reqs)
        nxt = 0
        t0 = time.perf_counter()
        while nxt < len(reqs) or llm.has_unfinished():
            now = time.perf_counter() - t0
            while nxt < len(reqs) and arrivals[nxt] <= now:
                p, o = reqs[nxt]
                ids[llm.add_request(p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))] = nxt
                nxt += 1
            if llm.has_unfinished():
                for out in llm.step():
                    if out.finished and out.request_id in ids:
                        i = ids[out.request_id]
                        lat[i] = time.perf_counter() - t0 - arrivals[i]
            elif nxt < len(reqs):
                time.sleep(max(0.0, arrivals[nxt] - now))
        return lat
    finally:
        llm.close()


def online_hf_cb(model: Any, reqs: list, arrivals: list[float], args: argparse.Namespace, slots: int,
                 ctx: int) -> list[float]:
    """The same with transformers' continuous batching manager (its paged cache)."""
    from transformers import GenerationConfig

    from ._models import cb_config

    max_len = max(len(p) + o for p, o in reqs)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(o for _, o in reqs))
    cbc = cb_config(256, num_blocks=slots * -(-max_len // 256) + 4, max_batch_tokens=max(2048, ctx),
                    max_requests_per_batch=slots, use_cuda_graph=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    manager.start()
    try:
        lat = [float("nan")] * len(reqs)
        done = nxt = 0
        t0 = time.perf_counter()
        while done < len(reqs):
            now = time.perf_counter() - t0
            while nxt < len(reqs) and arrivals[nxt] <= now:
                p, o = reqs[nxt]
                manager.add_request(p, request_id=f"q{nxt}", max_new_tokens=o)
                nxt += 1
            r = manager.get_result(timeout=0.005)
            if r is not None and r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"transformers' continuous batching: request {r.request_id}: {r.error}")
                i = int(r.request_id[1:])
                lat[i] = time.perf_counter() - t0 - arrivals[i]
                done += 1
        return lat
    finally:
        manager.stop(block=True, timeout=30)
        if str(getattr(model.config, "_attn_implementation", "")).startswith("paged"):
            model.set_attn_implementation("sdpa")


def fig9(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    """Request latency under Poisson arrivals at two fractions of vattn's offline capacity."""
    from vattn.report import latency_stats

    ctx = pick(args, "the arXiv trace", 16384, 4096, 1024, 512, scaled, "context (prompts scaled to it)")
    n = pick(args, "the arXiv trace", 64, 24, 24, 6, scaled, "requests")
    max_new = pick(args, "the trace's outputs", 128, 32, 16, 6, scaled, "output tokens (cap)")
    model, shape = model_of(args, CUDA_ENGINE_MODEL, HOST_ENGINE_MODEL, scaled)
    notes: list[str] = []
    systems = _systems(args, notes)
    reqs = _trace(args, n, ctx / TRACE_LONGEST_PROMPT, max_new, shape["vocab_size"])
    slots = 16 if is_cuda(args) else 8
    # the request rates: fractions of vattn's offline capacity on the same requests (measured here)
    from . import throughput

    cap = throughput.run_vattn(model, reqs, engine_args(slots, max(2048, ctx)), args.device, dtype_of(args))
    capacity = len(reqs) / cap["tn"].wall
    fractions = [0.5, 0.9]
    scaled["request rates"] = dict(paper="two QPS values", used=f"{fractions} x vattn's offline capacity "
                                   f"({capacity:.2f} req/s here)")
    rows = []
    for frac in progress(fractions, desc="fig9", unit="rate"):
        rate = frac * capacity
        rng = random.Random(args.seed + 1)
        t, arrivals = 0.0, []
        for _ in reqs:
            arrivals.append(t)
            t += rng.expovariate(rate)
        for s in systems:
            fn = online_vattn if s == "vattn" else online_hf_cb
            lat = fn(model, reqs, arrivals, args, slots, ctx)
            st = latency_stats([x for x in lat if x == x])
            rows.append(dict(system=s, rate_req_s=rate, fraction_of_capacity=frac, latencies_s=lat,
                             p50_s=st["p50"], p99_s=st["p99"], mean_s=st["mean"], max_s=st["max"]))
    head = []
    for frac in fractions:
        by = {r["system"]: r for r in rows if r["fraction_of_capacity"] == frac}
        h = f"{frac:g}x capacity: vattn p50 {by['vattn']['p50_s']:.2f} s"
        if "hf_cb" in by:
            h += f" (paged engine {by['hf_cb']['p50_s']:.2f} s)"
        head.append(h)
    return dict(systems=systems, paged_engine=PAGED_ENGINE, rows=rows, notes=notes,
                capacity_req_s=capacity, requests=len(reqs), headline="; ".join(head))
