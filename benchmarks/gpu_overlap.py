"""Hidden allocation latency: decode iteration latency with and without background mapping.

A Llama-3-8B-shaped model (hidden 4096, 32 heads, 8 KV heads x 128, intermediate 14336,
`--layers` layers, random bf16 weights made on the GPU) decodes `--batch` requests through
`vattn.LLM` with 2 MiB pages (per-layer layout: 1024 tokens per page), three ways:
- `sync`: `prefetch=False`, every page is mapped inside `step` when a request crosses
  into it (the paper's synchronous baseline: Figure 10's 25 -> 41 ms spikes);
- `background` (the default engine): the next iteration's pages are mapped on a worker
  thread while the current forward runs;
- `premapped`: every page the run will touch is mapped before timing (reserve_physical,
  then step every slot to its final length and free it: deferred reclamation keeps the
  pages), and `prefetch=False`: no mapping at all while timed.
The physical pages exist before timing in all three (`reserve_physical`): creating them is
not what this measures. Prompt lengths are staggered so that each request crosses a page
boundary at a different iteration of the timed window. One forward per `LLM.step`; the
step ends with the sampled tokens on the host, so its wall time is the iteration latency.
Reported: mean / p50 / p99 / max latency of the timed decode iterations, and
background / premapped (target: within 2%).

`--device cpu` runs the same three modes with a tiny model on the host backend.

    python benchmarks/gpu_overlap.py [--quick] [--out DIR] [--device cpu]
"""
from __future__ import annotations

import argparse
import gc
import time
import traceback
from typing import Any

import torch

from _common import environment, latency_stats, print_table, save

MB, GB = 1 << 20, 1 << 30
MODES = ("sync", "background", "premapped")


def model_config(args: argparse.Namespace) -> Any:
    from transformers import LlamaConfig

    common = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if args.device.startswith("cuda"):  # Llama-3-8B layers
        return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                           num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                           max_position_embeddings=8192, **common)
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, **common)


def build_model(config: Any, device: str, dtype: torch.dtype, seed: int = 0) -> Any:
    """Random weights made directly on `device` in `dtype` (no host copy)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def prompt_lens(batch: int, tokens_per_page: int, warmup: int, iters: int) -> list[int]:
    """Request i crosses a page boundary at decode iteration warmup + (i + 0.5) * iters / batch.

    Decode iteration j (0 = the first after the prefill) backs p + j + 1 tokens, which needs
    a new page when p + j + 1 = m * tokens_per_page + 1, i.e. j = m * tokens_per_page - p.
    """
    lens = []
    for i in range(batch):
        j = warmup + int((i + 0.5) * iters / batch)
        m = 1 + i % 4 + j // tokens_per_page
        lens.append(m * tokens_per_page - j)
    return lens


def run_mode(model: Any, mode: str, args: argparse.Namespace, dtype: torch.dtype) -> dict:
    from vattn import LLM, SamplingParams

    kw = {} if mode == "background" else dict(prefetch=False)
    c = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    token_bytes = c.num_key_value_heads * c.head_dim * elem * (c.num_hidden_layers if args.layout == "fused" else 1)
    tpp = args.page_size // token_bytes  # tokens per page in one buffer
    lens = prompt_lens(args.batch, tpp, args.warmup, args.iters)
    max_tokens = args.warmup + args.iters + 2
    final = [p + max_tokens for p in lens]
    llm = LLM(model, device=args.device, dtype=dtype, max_batch_size=args.batch, max_context_len=max(final),
              page_size=args.page_size, layout=args.layout, max_num_batched_tokens=sum(lens) + args.batch, **kw)
    try:
        cache = llm.cache
        g = cache.geometry
        assert cache.page_size // g.token_bytes == tpp, (cache.page_size, g.token_bytes, tpp)
        need = args.batch * g.pages_for(max(final)) * g.group_bytes
        cache.reserve_physical(need)  # the pool exists in every mode
        if mode == "premapped":
            slots = [cache.alloc_reqid() for _ in range(args.batch)]
            assert cache.step({s: max(final) for s in slots}), "could not pre-map"
            for s in slots:
                cache.free_reqid(s)
        gen = torch.Generator().manual_seed(1)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for p in lens:
            llm.add_request(torch.randint(1, model.config.vocab_size, (p,), generator=gen).tolist(), params)
        lat, mapped_delta, decoding = [], [], []
        started: set[int] = set()
        before = cache.stats().num_mapped_pages
        gc.collect()
        gc.disable()
        try:
            while llm.has_unfinished():
                all_decoding = len(started) == args.batch
                t0 = time.perf_counter()
                outs = llm.step()
                dt = time.perf_counter() - t0
                after = cache.stats().num_mapped_pages
                lat.append(dt * 1e3)
                mapped_delta.append(after - before)
                decoding.append(all_decoding)
                before = after
                started |= {o.request_id for o in outs if o.token_ids}
                if any(o.finished for o in outs):
                    break
        finally:
            gc.enable()
        first = decoding.index(True) if True in decoding else len(lat)
        timed = list(range(first + args.warmup, min(len(lat), first + args.warmup + args.iters)))
        stats = latency_stats([lat[i] for i in timed])
        return dict(mode=mode, kernel=llm.runner.kernel.name, page_KiB=cache.page_size // 1024,
                    tokens_per_page=tpp, prompt_lens=lens, group_MiB=g.group_bytes / MB,
                    created_GiB=cache.stats().num_created_pages * g.group_bytes / GB,
                    latency_ms=[lat[i] for i in timed], mapped_groups=[mapped_delta[i] for i in timed],
                    prefill_ms=lat[:first], iterations_with_mapping=sum(mapped_delta[i] > 0 for i in timed),
                    **{f"{k}_ms" if k != "n" else "n": v for k, v in stats.items()})
    finally:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        llm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a tiny run of the same code)")
    ap.add_argument("--quick", action="store_true", help="fewer iterations (the GPU suite)")
    ap.add_argument("--out", default=None, help="folder for the JSON and PNG (default benchmarks/results/)")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the 8B-shaped model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=None, help="timed decode iterations")
    ap.add_argument("--warmup", type=int, default=8, help="decode iterations before timing")
    ap.add_argument("--page-size", type=int, default=None, help="bytes; default 2 MiB (the CUDA granularity)")
    ap.add_argument("--layout", default="per-layer", choices=["per-layer", "fused"])
    ap.add_argument("--repeats", type=int, default=None, help="rounds of the three modes (interleaved)")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("gpu_overlap.py: skipped: no CUDA here (needs a GPU; --device cpu runs a tiny version)")
        return
    if cuda:
        args.iters = args.iters or (200 if args.quick else 600)
        args.repeats = args.repeats or (1 if args.quick else 2)
        args.page_size = args.page_size or (2 << 20)
        dtype = torch.bfloat16
    else:
        args.iters = args.iters or 40
        args.repeats = args.repeats or 1
        args.page_size = args.page_size or (4 << 10)
        args.batch = min(args.batch, 4)
        args.warmup = min(args.warmup, 3)
        dtype = torch.float32
    config = model_config(args)
    t0 = time.perf_counter()
    model = build_model(config, args.device, dtype)
    build_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {config.num_hidden_layers} layers, {n_params / 1e9:.2f} B parameters, {dtype}, built in {build_s:.1f} s")

    runs: list[dict] = []
    errors: list[str] = []
    for rep in range(args.repeats):
        for mode in MODES:
            try:
                r = run_mode(model, mode, args, dtype)
                r["repeat"] = rep
                runs.append(r)
                print(f"  {mode:10s} mean {r['mean_ms']:.3f} ms, p99 {r['p99_ms']:.3f}, max {r['max_ms']:.3f}, "
                      f"{r['iterations_with_mapping']} iterations mapped pages ({r['kernel']})", flush=True)
            except Exception as e:
                traceback.print_exc()
                errors.append(f"{mode} (round {rep}): {type(e).__name__}: {e}")
            if cuda:
                torch.cuda.empty_cache()

    by_mode: dict[str, dict] = {}
    for mode in MODES:
        rs = [r for r in runs if r["mode"] == mode]
        if rs:
            all_lat = [x for r in rs for x in r["latency_ms"]]
            by_mode[mode] = {**{f"{k}_ms" if k != "n" else "n": v for k, v in latency_stats(all_lat).items()},
                             "iterations_with_mapping": sum(r["iterations_with_mapping"] for r in rs)}
    ratios = {}
    if "premapped" in by_mode:
        base = by_mode["premapped"]
        for mode in ("sync", "background"):
            if mode in by_mode:
                for k in ("mean", "p50", "p99", "max"):
                    ratios[f"{mode}/premapped {k}"] = by_mode[mode][f"{k}_ms"] / base[f"{k}_ms"]
    print(f"\ndecode iteration latency (ms): batch {args.batch}, {config.num_hidden_layers} layers, "
          f"{args.layout}, {args.iters} timed iterations x {args.repeats}")
    print_table(["mode", "mean", "p50", "p99", "max", "iterations mapping"],
                [[m, s["mean_ms"], s["p50_ms"], s["p99_ms"], s["max_ms"], s["iterations_with_mapping"]]
                 for m, s in by_mode.items()])
    for k, v in ratios.items():
        print(f"{k}: {v:.4f}")
    if "background/premapped mean" in ratios:
        ok = ratios["background/premapped mean"] <= 1.02
        print(f"background within 2% of premapped (mean): {'yes' if ok else 'NO'}")
    for e in errors:
        print("ERROR", e)

    fig = _plot(runs, args)
    save("gpu_overlap" if cuda else "gpu_overlap_cpu_check",
         {"env": environment(args.device), "args": vars(args), "model": dict(layers=config.num_hidden_layers,
          hidden=config.hidden_size, parameters=n_params, dtype=str(dtype), build_s=build_s),
          "by_mode": by_mode, "ratios": ratios, "runs": runs, "errors": errors}, fig, out=args.out)
    if errors:
        raise SystemExit(1)


def _plot(runs: list[dict], args: argparse.Namespace) -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is missing: no plot")
        return None
    fig, ax = plt.subplots(figsize=(11, 4.2))
    for r in [r for r in runs if r["repeat"] == 0]:
        xs = range(len(r["latency_ms"]))
        ax.plot(xs, r["latency_ms"], lw=0.9, label=f"{r['mode']} (mean {r['mean_ms']:.2f} ms, max {r['max_ms']:.2f})")
        hits = [i for i, m in enumerate(r["mapped_groups"]) if m > 0 and r["mode"] == "sync"]
        if hits:
            ax.plot(hits, [r["latency_ms"][i] for i in hits], "rx", ms=6, label="sync: step mapped pages")
    ax.set(xlabel="decode iteration", ylabel="iteration latency (ms)",
           title=f"decode iterations, batch {args.batch}, {args.layout}, pages mapped on demand vs in the background")
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main()
