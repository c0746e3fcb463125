"""Decode iteration latency with synchronous page mapping and with background pre-mapping
(the vAttention paper's Figure 10).

`vattn.LLM` decodes `--batch` requests with a real model forward per iteration, in each mode:
- `sync`: `prefetch=False`: a request that crosses into a new page gets it inside `step`,
  on the critical path (on the host: the memfd grown by `posix_fallocate` when the pool is
  empty, then one `mmap` per buffer; on CUDA `cuMemCreate` + `cuMemMap`);
- `background` (the engine's default): after each `step` a worker thread creates and maps
  the next page of every request within `prefetch_tokens` (16) of it while the forwards run;
- `background-next` (optional): the same with `prefetch_tokens=1`, only what the very next
  iteration needs (one forward's time to map it);
- `premapped` (optional, `--modes`): every page the run touches is mapped before timing: the
  floor, no allocation at all while timed.
Every request of the batch crosses into a new page at the same iterations, as in the paper's
figure (`--stagger`: each at its own); every mode sees the same requests, so the boundary
iterations are the same. Reported per mode: mean / p50 / p99 / max latency of the timed
decode iterations, the mean at boundary iterations (where `sync` maps pages) over the median
of the others (`spike`), the time inside the cache's `step` (the critical path's share of
allocation), and how many iterations mapped pages inside `step`.

On the host the model is small and deep (many buffers per page group, little compute) so
that allocation is visible against the forward; `--reserve` creates the physical pages
before timing (then only mapping is measured).
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch

from vattn.bench._common import latency_stats, progress
from vattn.bench._models import build_model, llama_config

NAME = "overlap"
HELP = "decode iteration latency: pages mapped in step vs by the background worker (paper Fig. 10)"
NEEDS_GPU = False

MODES = ("sync", "background", "background-next", "premapped")
MODE_ARGS = {"sync": dict(prefetch=False), "background": {}, "background-next": dict(prefetch_tokens=1),
             "premapped": dict(prefetch=False)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--modes", nargs="+", default=["sync", "background"], choices=MODES)
    p.add_argument("--batch", type=int, default=None, help="requests decoding together (default: 16 host, 8 CUDA)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed decode iterations (default: 3 pages' worth; 1 page's with --quick)")
    p.add_argument("--quick", action="store_true", help="one page's worth of iterations per mode (the GPU suite)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no new mode or repeat after this many seconds (default: no limit)")
    p.add_argument("--warmup", type=int, default=4, help="decode iterations before timing")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: 16 host, 8 CUDA)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default: 64 host, 4096 CUDA)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: 8 host, 32 CUDA)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: 8 host and CUDA)")
    p.add_argument("--head-dim", type=int, default=None, help="(default: 64 host, 128 CUDA)")
    p.add_argument("--page-size", type=int, default=None, help="bytes (default: 128 KiB host, 2 MiB CUDA)")
    p.add_argument("--layout", default="per-layer", choices=["per-layer", "fused"])
    p.add_argument("--stagger", action="store_true",
                   help="requests cross page boundaries at different iterations (default: all at once)")
    p.add_argument("--reserve", action="store_true", help="create the physical pages before timing (map only)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of the modes (interleaved)")
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (cuda_graphs=False): the eager forward")
    p.add_argument("--seed", type=int, default=0)


def _defaults(args: argparse.Namespace) -> None:
    cuda = args.device.startswith("cuda")
    shape = dict(layers=(8, 16), hidden=(4096, 64), heads=(32, 8), kv_heads=(8, 8), head_dim=(128, 64),
                 page_size=(2 << 20, 128 << 10), batch=(8, 16))
    for name, (gpu, host) in shape.items():
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else host)


def model_config(args: argparse.Namespace) -> Any:
    return llama_config(vocab_size=256 if not args.device.startswith("cuda") else 32000, hidden_size=args.hidden,
                        intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                        max_position_embeddings=1 << 16)


def prompt_lens(batch: int, tokens_per_page: int, warmup: int, stagger: bool) -> list[int]:
    """Prompt lengths such that request i crosses into a new page at decode iterations
    warmup + o_i + k * tokens_per_page: o_i = tpp / 2 for all (the paper's figure: every
    request of the batch crosses at once), or (i + 0.5) * tpp / batch with `stagger`.

    Decode iteration j (0 = the first after the prefill) backs p + j + 1 tokens, which needs
    a new page when p + j + 1 = m * tokens_per_page + 1, i.e. j = m * tokens_per_page - p.
    """
    def offset(i: int) -> int:
        return int((i + 0.5) * tokens_per_page / batch) if stagger else tokens_per_page // 2

    return [(2 + i % 3) * tokens_per_page - (warmup + offset(i)) for i in range(batch)]


def run_mode(model: Any, mode: str, args: argparse.Namespace, dtype: torch.dtype, lens: list[int],
             max_tokens: int) -> dict:
    """One decode run; latency of every iteration after the prefill."""
    from vattn import LLM, SamplingParams

    final = max(lens) + max_tokens
    llm = LLM(model, device=args.device, dtype=dtype, max_batch_size=args.batch, max_context_len=final,
              page_size=args.page_size, layout=args.layout, max_num_batched_tokens=sum(lens) + args.batch,
              **MODE_ARGS[mode], **(dict(cuda_graphs=False) if args.eager else {}))
    try:
        cache = llm.cache
        g = cache.geometry
        if args.reserve or mode == "premapped":
            cache.reserve_physical(args.batch * g.pages_for(final) * g.group_bytes)
        if mode == "premapped":  # every page of the run mapped now; deferred reclamation keeps them
            slots = [cache.alloc_reqid() for _ in range(args.batch)]
            assert cache.step({s: final for s in slots}), "could not pre-map the run"
            for s in slots:
                cache.free_reqid(s)
        gen = torch.Generator().manual_seed(args.seed)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for p in lens:
            llm.add_request(torch.randint(1, model.config.vocab_size, (p,), generator=gen).tolist(), params)
        lat, step_ms, mapped, created = [], [], [], []
        inner = cache.step
        in_step = [0.0, 0]  # this iteration: seconds in cache.step, groups it mapped itself

        def timed_step(seq_lens: Any) -> Any:  # the scheduler's call: what is on the critical path
            t = time.perf_counter()
            res = inner(seq_lens)
            in_step[0] += time.perf_counter() - t
            in_step[1] += res.num_mapped
            return res

        cache.step = timed_step  # type: ignore[method-assign]
        gc.collect()
        gc.disable()
        try:
            llm.step()  # the prefill (one iteration: max_num_batched_tokens holds every prompt)
            while llm.has_unfinished():
                created0 = cache.stats().num_created_pages
                in_step[:] = [0.0, 0]
                t0 = time.perf_counter()
                outs = llm.step()
                lat.append((time.perf_counter() - t0) * 1e3)
                step_ms.append(in_step[0] * 1e3)
                mapped.append(in_step[1])
                created.append(cache.stats().num_created_pages - created0)
                if any(o.finished for o in outs):
                    break
        finally:
            gc.enable()
            del cache.step
        graphs = llm.runner.graphs
        return dict(mode=mode, latency_ms=lat, step_ms=step_ms, mapped_groups=mapped, created_groups=created,
                    cuda_graphs=None if graphs is None else dict(replays=graphs.num_replays, off=graphs.disabled_reason),
                    tokens_per_page=cache.page_size // g.token_bytes, group_KiB=g.group_bytes / 1024,
                    kernel=llm.runner.kernel.name)
    finally:
        llm.close()


def run(args: argparse.Namespace) -> dict:
    """Every mode on the same requests; latency series and spike statistics."""
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    _defaults(args)
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(model_config(args), args.device, dtype, args.seed)
    elem = torch.empty((), dtype=dtype).element_size()
    token_bytes = args.kv_heads * args.head_dim * elem * (args.layers if args.layout == "fused" else 1)
    tpp = args.page_size // token_bytes  # tokens per page of one buffer
    iters = args.iters or (tpp if args.quick else 3 * tpp)
    lens = prompt_lens(args.batch, tpp, args.warmup, args.stagger)
    max_tokens = args.warmup + iters + 1
    runs: list[dict] = []
    skipped: list[str] = []
    start = time.perf_counter()
    bar = progress(total=args.repeats * len(args.modes), desc="overlap", unit="run")
    for rep in range(args.repeats):
        for mode in args.modes:
            if runs and args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                skipped.append(f"{mode} repeat {rep}: time budget spent")
                continue
            bar.set_postfix_str(mode)
            r = run_mode(model, mode, args, dtype, lens, max_tokens)
            window = slice(args.warmup, args.warmup + iters)
            r.update({k: r[k][window] for k in ("latency_ms", "step_ms", "mapped_groups", "created_groups")},
                     repeat=rep)
            runs.append(r)
            bar.update(1)
    bar.close()
    # Boundary iterations: where a request needs a new page (sync maps it in step there).
    boundary = sorted({j - args.warmup for p in lens for j in range(iters + args.warmup)
                       if (p + j) % tpp == 0 and args.warmup <= j})
    modes = {}
    others = set(range(iters)) - set(boundary)
    for mode in args.modes:
        rs = [r for r in runs if r["mode"] == mode]
        if not rs:  # the budget was spent before it ran
            continue

        def at(key: str, idx: Any) -> list[float]:
            return [r[key][i] for r in rs for i in sorted(idx) if i < len(r[key])]

        stats = latency_stats([x for r in rs for x in r["latency_ms"]])
        m = modes[mode] = {f"{k}_ms" if k != "n" else "n": v for k, v in stats.items()}
        for key, name in (("latency_ms", ""), ("step_ms", "step_")):
            m[f"{name}boundary_mean_ms"] = statistics.fmean(at(key, boundary)) if boundary else float("nan")
            m[f"{name}other_median_ms"] = statistics.median(at(key, others)) if others else float("nan")
        m.update(spike=m["boundary_mean_ms"] / m["other_median_ms"],
                 step_mean_ms=statistics.fmean(x for r in rs for x in r["step_ms"]),
                 step_max_ms=max(x for r in rs for x in r["step_ms"]),
                 iterations_mapping=sum(g > 0 for r in rs for g in r["mapped_groups"]),
                 iterations_creating=sum(c > 0 for r in rs for c in r["created_groups"]))
    # on CUDA the engine's kernel is torch_flash (or flash_attn); "sdpa" there means it fell back
    failures = [f"{r['mode']}: the attention kernel fell back to {r['kernel']!r}" for r in runs
                if cuda and r["kernel"] not in ("flash_attn", "torch_flash")]
    return dict(device=args.device, dtype=str(dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                cuda_graphs=[r.get("cuda_graphs") for r in runs],
                tokens_per_page=tpp, prompt_lens=lens, timed_iterations=iters, boundary_iterations=boundary,
                group_KiB=runs[0]["group_KiB"], modes=modes, runs=runs, skipped=skipped, failures=failures)


def table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["mode", "mean ms", "p50 ms", "p99 ms", "max ms", "at boundaries ms", "others (median) ms",
               "cache.step at boundaries ms", "cache.step others ms", "cache.step max ms", "iterations mapping in step"]
    rows = [[m, s["mean_ms"], s["p50_ms"], s["p99_ms"], s["max_ms"], s["boundary_mean_ms"], s["other_median_ms"],
             s["step_boundary_mean_ms"], s["step_other_median_ms"], s["step_max_ms"], s["iterations_mapping"]]
            for m, s in result["modes"].items()]
    return headers, rows


def plot(result: dict) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=(3, 2))
    colors = {"sync": "tab:red", "background": "tab:blue", "background-next": "tab:green", "premapped": "tab:gray"}
    for b in result["boundary_iterations"]:
        for ax in (top, bottom):
            ax.axvline(b, color="0.85", lw=3, zorder=0)
    for r in [r for r in result["runs"] if r["repeat"] == 0]:
        s, c = result["modes"][r["mode"]], colors.get(r["mode"])
        top.plot(r["latency_ms"], lw=0.9, color=c,
                 label=f"{r['mode']}: mean {s['mean_ms']:.1f} ms, at page boundaries {s['boundary_mean_ms']:.1f}, "
                       f"max {s['max_ms']:.1f}")
        bottom.plot(r["step_ms"], lw=0.9, color=c, label=f"{r['mode']}: cache.step at boundaries "
                    f"{s['step_boundary_mean_ms']:.2f} ms, elsewhere {s['step_other_median_ms']:.3f} ms (median)")
    top.set(ylabel="iteration latency (ms)",
            title=f"{result['device']}: {len(result['prompt_lens'])} requests decoding, {result['tokens_per_page']} "
                  "tokens/page (grey: page boundaries); pages allocated in step (sync) or by the worker")
    bottom.set(xlabel="decode iteration", ylabel="in cache.step (ms)")
    top.legend(fontsize=8)
    bottom.legend(fontsize=8)
    return fig
