"""Shared pages in the engine: what prefix caching, parallel sampling and swapping save.

Three workloads on a small Llama-style model (4 layers, 4 KV heads x 32, random weights,
float32 on the CPU), each served twice or more by `vattn.LLM`, and compared on physical
KV memory (peak page groups mapped, peak bytes), tokens the model computed, wall time and
greedy (or seeded) outputs, which must be identical token for token:

(a) prefix caching: requests that share a 1000-token system prompt (plus a short question
    each), without and with `enable_prefix_caching`, for several page sizes (a page is
    the sharing granularity: per-layer 4, 16, 64 KiB = 8, 32, 128 tokens; fused 64 KiB =
    32 tokens). Reports the hit rate (prompt tokens mapped instead of computed).
(b) parallel sampling: prompts with `SamplingParams(n=4)` against 4 independent requests
    per prompt (seeds seed + i: the same tokens by construction), and against those 4
    requests with prefix caching.
(c) preemption: a budget that holds a few requests at a time, `preemption_mode`
    "recompute" against "swap" (and recompute with prefix caching, which keeps what a
    preempted request computed in pinned pages): output tokens/s, preemptions, tokens
    computed.

Each case runs `--repeats` times on a fresh engine; the fastest run is reported (the
tokens must be the same every time).

`--shape phi3` runs (a) only, on a Phi-3-shaped model (head_dim 96 as Phi-3-mini's, 4
layers, 4 KV heads: a 1536-byte per-layer token does not divide a page) at the default
page size, per-layer and fused: prefix caching shares blocks of whole tokens in whole
pages (`Geometry.share_tokens`, issue 23); writes sharing_phi3_<device>.*.

    OMP_NUM_THREADS=1 python benchmarks/sharing.py [--quick] [--shape phi3]

torch runs on one thread (OMP_NUM_THREADS=1 unless set). Peak figures are sampled after
every engine step; "mapped" includes pages kept for later (free slots, pre-mapped tails,
pinned prefix pages), i.e. the physical memory the cache holds. Writes
benchmarks/results/sharing_<device>.json and .png.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from _common import environment, print_table, save  # noqa: E402

from vattn.engine import LLM, SamplingParams  # noqa: E402

KB, MB = 1 << 10, 1 << 20


def model_config(shape: str = "llama") -> Any:
    if shape == "phi3":
        from transformers import Phi3Config

        return Phi3Config(vocab_size=2048, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                          initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                       initializer_range=0.2)


def serve(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    """Add every request, step until all finish; peak memory after each step."""
    peak_pages = peak_bytes = 0
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    done: dict[int, Any] = {}
    start = time.perf_counter()
    while llm.has_unfinished():
        for out in llm.step():
            if out.finished:
                done[out.request_id] = out
        st = llm.memory_stats()
        peak_pages, peak_bytes = max(peak_pages, st.num_mapped_pages), max(peak_bytes, st.mapped_bytes)
    seconds = time.perf_counter() - start
    outs = [done[i] for i in ids]
    tokens = [[o.token_ids for o in out.outputs] for out in outs]
    errors = sum(o.finish_reason == "error" for out in outs for o in out.outputs)
    n_out = sum(len(t) for ts in tokens for t in ts)
    pc, g = llm.prefix_cache_stats(), llm.cache.geometry
    return dict(page_size=g.page_size, block_tokens=g.share_tokens, block_pages=g.share_pages, seconds=seconds, peak_mapped_pages=peak_pages, peak_mapped_MiB=peak_bytes / MB,
                group_KiB=llm.memory_stats().group_bytes / KB, computed_tokens=llm.scheduler.num_computed_tokens,
                output_tokens=n_out, output_tok_s=n_out / seconds, preemptions=llm.num_preemptions,
                swapped_out=llm.scheduler.num_swapped_out, swapped_in=llm.scheduler.num_swapped_in,
                hit_rate=pc.hit_rate if pc else None, hit_tokens=pc.num_hit_tokens if pc else 0,
                errors=errors, tokens=tokens)


def engine(layout: str = "per-layer", page_size: int | None = 16 * KB, shape: str = "llama", **kw: Any) -> LLM:
    return LLM(model_config(shape), seed=0, dtype="float32", device="cpu", max_context_len=2048, layout=layout,
               page_size=page_size, **kw)


def measure(repeats: int, prompts: list[list[int]], params: list[SamplingParams], **kw: Any) -> dict[str, Any]:
    """`serve` on a fresh engine `repeats` times: the fastest run (the work is the same each
    time: the tokens must be too)."""
    runs = []
    for _ in range(repeats):
        with engine(**kw) as llm:
            runs.append(serve(llm, prompts, params))
    assert all(r["tokens"] == runs[0]["tokens"] for r in runs), "a repeat gave other tokens"
    best = min(runs, key=lambda r: r["seconds"])
    best["seconds_all"] = [r["seconds"] for r in runs]
    return best


def rand_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 2048) for _ in range(n)]


# ------------------------------------------------------------------ (a) prefix cache ----
def prefix_workload(num_requests: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    system = rand_tokens(rng, 1000)
    prompts = [system + rand_tokens(rng, rng.randint(16, 96)) for _ in range(num_requests)]
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True) for _ in prompts]
    return prompts, params


def run_prefix(args: argparse.Namespace) -> list[dict[str, Any]]:
    prompts, params = prefix_workload(args.prefix_requests)
    configs: list[tuple[str, int | None]] = [("per-layer", 4 * KB), ("per-layer", 16 * KB), ("per-layer", 64 * KB),
                                             ("per-layer", 256 * KB), ("fused", 64 * KB)]
    if args.shape == "phi3":
        configs = [("per-layer", None), ("fused", None)]  # the default page size
    rows = []
    for layout, page in configs:
        runs = {cached: measure(args.repeats, prompts, params, layout=layout, page_size=page, shape=args.shape,
                                max_batch_size=args.prefix_requests, max_num_batched_tokens=2048,
                                enable_prefix_caching=cached) for cached in (False, True)}
        off, on = runs[False], runs[True]
        page = on["page_size"]
        cfg = model_config(args.shape)
        token_bytes = 4 * cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads  # float32
        tpp = page // (token_bytes * (cfg.num_hidden_layers if layout == "fused" else 1))  # (rounded down)
        rows.append(dict(layout=layout, page_KiB=page // KB, tokens_per_page=tpp, block_tokens=on["block_tokens"],
                         block_pages=on["block_pages"], hit_rate=on["hit_rate"],
                         peak_mapped_MiB_off=off["peak_mapped_MiB"], peak_mapped_MiB_on=on["peak_mapped_MiB"],
                         peak_pages_off=off["peak_mapped_pages"], peak_pages_on=on["peak_mapped_pages"],
                         computed_off=off["computed_tokens"], computed_on=on["computed_tokens"],
                         seconds_off=off["seconds"], seconds_on=on["seconds"],
                         same_tokens=off["tokens"] == on["tokens"], errors=off["errors"] + on["errors"]))
        print(f"  (a) {layout} {page // KB} KiB: hit rate {on['hit_rate']:.1%}, "
              f"{off['seconds']:.1f} s -> {on['seconds']:.1f} s", flush=True)
    return rows


# ----------------------------------------------------------- (b) parallel sampling ----
def run_parallel(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(1)
    prompts = [rand_tokens(rng, rng.randint(256, 512)) for _ in range(args.parallel_prompts)]
    n = 4

    def sp(seed: int, samples: int) -> SamplingParams:
        return SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, ignore_eos=True, seed=seed, n=samples)

    cases = {
        "n=4": (prompts, [sp(100 * i, n) for i in range(len(prompts))], {}),
        "4 requests": ([p for p in prompts for _ in range(n)],
                       [sp(100 * i + k, 1) for i in range(len(prompts)) for k in range(n)], {}),
        "4 requests + prefix cache": ([p for p in prompts for _ in range(n)],
                                      [sp(100 * i + k, 1) for i in range(len(prompts)) for k in range(n)],
                                      {"enable_prefix_caching": True}),
    }
    rows, tokens = [], {}
    for name, (ps, params, kw) in cases.items():
        r = measure(args.repeats, ps, params, max_batch_size=n * len(prompts), max_num_batched_tokens=2048, **kw)
        if name == "n=4":
            tokens[name] = [t for ts in r["tokens"] for t in ts]
        else:
            tokens[name] = [ts[0] for ts in r["tokens"]]
        rows.append(dict(case=name, **{k: v for k, v in r.items() if k != "tokens"}))
        print(f"  (b) {name}: {r['seconds']:.1f} s, peak {r['peak_mapped_MiB']:.1f} MiB", flush=True)
    same = tokens["n=4"] == tokens["4 requests"] == tokens["4 requests + prefix cache"]
    for row in rows:
        row["same_tokens"] = same
    return rows


# -------------------------------------------------------------- (c) swap/recompute ----
def run_preemption(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(2)
    prompts = [rand_tokens(rng, rng.randint(200, 600)) for _ in range(args.preempt_requests)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(64, 256), ignore_eos=True) for _ in prompts]
    rows, tokens = [], []
    for mode, cached in (("recompute", False), ("swap", False), ("recompute", True)):
        r = measure(args.repeats, prompts, params, max_batch_size=16, max_num_batched_tokens=1024,
                    physical_memory=args.preempt_budget_mib * MB, preemption_mode=mode, enable_prefix_caching=cached)
        tokens.append(r["tokens"])
        name = mode + (" + prefix cache" if cached else "")
        rows.append(dict(mode=name, **{k: v for k, v in r.items() if k != "tokens"}))
        print(f"  (c) {name}: {r['output_tok_s']:.0f} tok/s, {r['preemptions']} preemptions", flush=True)
    for row in rows:
        row["same_tokens"] = all(t == tokens[0] for t in tokens)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    ap.add_argument("--prefix-requests", type=int, default=16)
    ap.add_argument("--parallel-prompts", type=int, default=6)
    ap.add_argument("--preempt-requests", type=int, default=24)
    ap.add_argument("--preempt-budget-mib", type=int, default=12, help="KV budget of (c)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each case; the fastest is reported")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    ap.add_argument("--shape", choices=("llama", "phi3"), default="llama",
                    help="phi3: (a) only, on a Phi-3-shaped model (tokens that do not divide the page)")
    args = ap.parse_args()
    if args.quick:
        args.prefix_requests, args.parallel_prompts, args.preempt_requests, args.repeats = 4, 2, 6, 1
        args.preempt_budget_mib = 6
    torch.manual_seed(0)
    t0 = time.perf_counter()
    prefix = run_prefix(args)
    print(f"\n(a) {args.prefix_requests} requests sharing a 1000-token system prompt, 32 tokens each")
    print_table(["layout", "page KiB", "tok/page", "tok/block", "pages/block", "hit rate", "peak MiB off",
                 "peak MiB on", "computed off", "computed on", "s off", "s on", "same tokens"],
                [[r["layout"], r["page_KiB"], r["tokens_per_page"], r["block_tokens"], r["block_pages"], r["hit_rate"],
                  r["peak_mapped_MiB_off"], r["peak_mapped_MiB_on"], r["computed_off"], r["computed_on"],
                  r["seconds_off"], r["seconds_on"], r["same_tokens"]] for r in prefix])
    cfg = model_config(args.shape)
    model = dict(shape=args.shape, layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                 head_dim=cfg.hidden_size // cfg.num_attention_heads, dtype="float32")
    if args.shape == "phi3":
        total = time.perf_counter() - t0
        save("sharing_phi3_host", {"env": environment("cpu"), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                                   "torch_threads": torch.get_num_threads(), "seconds": total, "model": model,
                                   "config": vars(args), "prefix_caching": prefix}, out=args.out)
        return
    parallel, preemption = run_parallel(args), run_preemption(args)
    print(f"\n(b) {args.parallel_prompts} prompts of 256-512 tokens, 4 samples of 64 tokens each")
    print_table(["case", "peak MiB", "peak pages", "computed", "s", "out tok/s", "same tokens"],
                [[r["case"], r["peak_mapped_MiB"], r["peak_mapped_pages"], r["computed_tokens"], r["seconds"],
                  r["output_tok_s"], r["same_tokens"]] for r in parallel])
    print(f"\n(c) {args.preempt_requests} requests, {args.preempt_budget_mib} MiB of KV: preemption modes")
    print_table(["mode", "out tok/s", "s", "preemptions", "swapped out", "swapped in", "computed", "peak MiB",
                 "same tokens"],
                [[r["mode"], r["output_tok_s"], r["seconds"], r["preemptions"], r["swapped_out"], r["swapped_in"],
                  r["computed_tokens"], r["peak_mapped_MiB"], r["same_tokens"]] for r in preemption])
    total = time.perf_counter() - t0
    print(f"\ntotal {total:.0f} s")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    labels = [f"{r['layout']}\n{r['page_KiB']} KiB\n{r['block_tokens']} tok/block" for r in prefix]
    x = range(len(prefix))
    ax1.bar([i - 0.2 for i in x], [r["peak_mapped_MiB_off"] for r in prefix], 0.4, label="no prefix cache")
    ax1.bar([i + 0.2 for i in x], [r["peak_mapped_MiB_on"] for r in prefix], 0.4, label="prefix cache")
    ax1.set_xticks(list(x), labels, fontsize=8)
    ax1.set(ylabel="peak mapped KV (MiB)", title="(a) shared 1000-token system prompt")
    twin = ax1.twinx()
    twin.plot(list(x), [100 * r["hit_rate"] for r in prefix], "k.-", label="hit rate")
    twin.set(ylabel="hit rate (%)", ylim=(0, 100))
    ax1.legend(loc="upper left", fontsize=8)
    ax2.bar([r["case"].replace(" + ", "\n+ ") for r in parallel], [r["peak_mapped_MiB"] for r in parallel])
    ax2.set(ylabel="peak mapped KV (MiB)", title="(b) 4 samples per prompt")
    for i, r in enumerate(parallel):
        ax2.annotate(f"{r['seconds']:.1f} s", (i, r["peak_mapped_MiB"]), ha="center", va="bottom", fontsize=8)
    ax3.bar([r["mode"].replace(" + ", "\n+ ") for r in preemption], [r["output_tok_s"] for r in preemption])
    ax3.set(ylabel="output tokens/s", title=f"(c) preemption under {args.preempt_budget_mib} MiB")
    for i, r in enumerate(preemption):
        ax3.annotate(f"{r['preemptions']} preemptions", (i, r["output_tok_s"]), ha="center", va="bottom", fontsize=8)

    payload = {"env": environment("cpu"), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               "torch_threads": torch.get_num_threads(), "seconds": total, "model": model, "config": vars(args), "prefix_caching": prefix, "parallel_sampling": parallel, "preemption": preemption}
    save("sharing_host", payload, fig, out=args.out)


if __name__ == "__main__":
    main()
