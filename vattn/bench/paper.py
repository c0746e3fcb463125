"""The vAttention paper's (ASPLOS'25) eight experiments, one command each, with the paper's axes.

    vattn bench paper [--figure 2 3 4 6 7 8 9 11] [--device cpu|cuda] [--quick]

Each figure reuses the measurement of an existing benchmark and writes its own JSON
(environment: device, versions, commit, date) and PNG, `paper_fig<N>_<host|cuda>`, to
benchmarks/results/ (or `--out`); `paper_<host|cuda>.json` indexes them (`--one-png`: the
figures' results in that one JSON and every plot in one PNG, for the GPU suite's few files).

| fig | what | measured with |
|---|---|---|
| 2 | prefill attention latency, paged vs non-paged, Llama-3-8B heads, 1K-32K tokens | `kernel.run_case` |
| 3 | a paged decode kernel at blocks of 16/32/64/128 tokens, batch 1-16 x 16K | `kernel.run_case` |
| 4 | decode tokens/s and the allocation bandwidth it needs, batch 1-300, 900-token requests; the bandwidth vattn's `step` provides per page size (64 KiB-2 MiB) | `throughput.run_vattn`, `alloc.bench_new_pages` |
| 6 | single-request prefill throughput (one layer's attention), 2K-192K tokens, paged vs vAttention | `kernel.run_case` |
| 7 | decode tokens/s against batch 1-32 at 16K context: vattn.LLM vs a paged engine | `throughput.run_vattn`, `run_hf_cb` |
| 8 | offline arXiv trace at 64K-192K context: requests per minute | `throughput.run_vattn`, `run_hf_cb` |
| 9 | online arXiv trace at two request rates: latency CDF | the engines stepped under Poisson arrivals |
| 11 | decode iteration latency, synchronous vs overlapped allocation, per page size | `overlap.run` |

On the host (no GPU) every figure runs, scaled down where the paper's sizes cannot run on a
few CPUs: each result's `scaled` says the paper's value and the one used. Kernel figures on the
host: PyTorch SDPA on the contiguous / virtual cache; the "paged" baseline there is the block
table gathered into a contiguous copy, then SDPA: NOT a paged kernel ("gather+SDPA (no paged
kernel on the host)"). On CUDA they use the paged kernel `vattn bench kernel` uses
(FlashAttention 4's `page_table` mode when installed, else torch's or flash-attn's block-table
FlashAttention, else the gather, labelled so). The paged engine of figures 7-9 is transformers'
continuous batching (its paged cache, `generate_batch`'s manager), not vLLM. Page sizes under
2 MiB need the host backend or, on the stock CUDA driver, fused page groups (a 2 MiB page holding
every layer's tokens: as many tokens as a 2 MiB / layers per-layer page).
"""
from __future__ import annotations

import argparse
import io
import random
import statistics
import time
from typing import Any, Callable

import torch

import vattn

from . import _common
from ._common import progress

NAME = "paper"
HELP = "the vAttention paper's eight experiments (Figs. 2, 3, 4, 6, 7, 8, 9, 11), one JSON + PNG each"
NEEDS_GPU = False

KB, MB = 1 << 10, 1 << 20
FIGURES = (2, 3, 4, 6, 7, 8, 9, 11)
HOST_PAGED = "gather+SDPA (no paged kernel on the host)"
PAPER = {  # the paper's experiment and its headline (../shared/PAPER_NOTES.md, the issue)
    2: ("prefill kernel latency, paged vs non-paged, Llama-3-8B, 1K-32K tokens",
        "paged prefill kernels slower than non-paged: vAttention 1.60-3.92x over FA_Paged, 1.03-1.45x over FI_Paged"),
    3: ("a paged decode kernel at block sizes 16/32/64/128, batch 1-16 x 16K",
        "the paged kernel's latency depends on the block size; FlashAttention's decode kernel 2.85x faster than "
        "vLLM's paged one (Yi-6B, 16 x 16K)"),
    4: ("decode tokens/s and the allocation bandwidth it needs (MB/s), batch 1-300, 900-token requests",
        "peak need 600 MB/s; the driver gives up to 7.6 GB/s per GPU even at 64 KB pages"),
    6: ("single-request prefill throughput, 2K-192K tokens, paged vs vAttention",
        "prefill 1.60-3.92x over FA_Paged, 1.03-1.45x over FI_Paged"),
    7: ("decode tokens/s vs batch 1-32 at 16K context",
        "decode up to 1.97x vLLM (Yi-6B), 1.3x (Llama-3-8B), 1.6x (Yi-34B); about FA_Paged with blocks of 128"),
    8: ("offline arXiv trace, 64K-192K tokens: requests per minute",
        "end to end 1.22x / 1.29x vs paged FlashAttention / FlashInfer"),
    9: ("online trace: latency CDF at two request rates", "lower latency than the paged systems at both rates"),
    11: ("decode iteration latency with and without overlapped allocation",
         "synchronous mapping spikes 25 -> 41 ms (Llama-3-8B, batch 4, 2 MB pages); overlap removes them"),
}


# ------------------------------------------------------------------------ helpers ----
def _cuda(args: argparse.Namespace) -> bool:
    return str(args.device).startswith("cuda")


def _pick(args: argparse.Namespace, paper: Any, cuda_full: Any, cuda_quick: Any, host_full: Any,
          host_quick: Any, scaled: dict, name: str) -> Any:
    """The value of one axis here; recorded in `scaled` when it differs from the paper's."""
    used = (cuda_quick if args.quick else cuda_full) if _cuda(args) else (host_quick if args.quick else host_full)
    if used != paper:
        scaled[name] = dict(paper=paper, used=used)
    return used


def _seed_tokens(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if _cuda(args) else torch.float32


def _model(args: argparse.Namespace, cuda_shape: dict, host_shape: dict, scaled: dict) -> tuple[Any, dict]:
    """A Llama-shaped model with random seeded weights (`_models.build_model`)."""
    from ._models import build_model, llama_config

    shape = cuda_shape if _cuda(args) else host_shape
    if not _cuda(args):
        scaled["model"] = dict(paper="Yi-6B / Llama-3-8B / Yi-34B", used=f"random Llama, {shape}")
    cfg = llama_config(max_position_embeddings=1 << 18, tie_word_embeddings=False, **shape)
    return build_model(cfg, args.device, _dtype(args), args.seed, attn_implementation="sdpa"), shape


def _token_bytes(shape: dict, dtype: torch.dtype) -> int:
    """K and V of one token, every layer."""
    head_dim = shape.get("head_dim", shape["hidden_size"] // shape["num_attention_heads"])
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * \
        torch.empty((), dtype=dtype).element_size()


def _engine_args(args: argparse.Namespace, batch: int, tokens: int, page_size: int | None = None) -> argparse.Namespace:
    """What `throughput.run_vattn` / `run_hf_cb` read."""
    return argparse.Namespace(max_batch_size=batch, max_num_batched_tokens=tokens, page_size=page_size,
                              attention=None)


def _hf_cb_problem() -> str | None:
    from vattn.integrations.hf_cb import memory_problem

    return memory_problem()


def decode_run(model: Any, reqs: list, args: argparse.Namespace, tok_bytes: int) -> dict[str, Any]:
    """`vattn.LLM` on `reqs` (all admitted at once): the prefill steps, then the decode steps
    timed; decode tokens/s, the bytes the cache mapped while decoding and the need per iteration."""
    from vattn import LLM, SamplingParams

    B = len(reqs)
    prompt, new = len(reqs[0][0]), reqs[0][1]
    llm = LLM(model, device=args.device, dtype=_dtype(args), max_batch_size=B, max_context_len=prompt + new,
              max_num_batched_tokens=min(B * prompt + B, 32768))
    try:
        llm.generate([reqs[0][0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        for p, n in reqs:
            llm.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        started: set[int] = set()
        while len(started) < B:  # the prefill: every request has its first token
            started |= {o.request_id for o in llm.step() if o.token_ids}
        _common.sync(args.device)
        mapped0 = llm.cache.stats().mapped_bytes
        t0 = time.perf_counter()
        steps = 0
        while llm.has_unfinished():
            llm.step()
            steps += 1
        _common.sync(args.device)
        decode_s = time.perf_counter() - t0
        mapped = llm.cache.stats().mapped_bytes - mapped0
    finally:
        llm.close()
    tok_s = B * (new - 1) / decode_s
    return dict(decode_tok_s=tok_s, decode_steps=steps, iteration_ms=1e3 * decode_s / max(steps, 1),
                bytes_per_iteration=B * tok_bytes,  # K/V of the batch's new tokens, every layer
                needed_MBps=tok_s * tok_bytes / 1e6, mapped_while_decoding_MB=mapped / 1e6,
                mapped_MBps=mapped / decode_s / 1e6)


# ------------------------------------------------------------- kernel figures ----
def _kernel_args(args: argparse.Namespace, blocks: list[int]) -> tuple[argparse.Namespace, str]:
    """`kernel.run_case`'s arguments; the library kernel (FlashAttention 4 when installed on CUDA)."""
    kernel = "torch_flash"
    if _cuda(args):
        from vattn.attention import flash_attn_4_available

        kernel = "flash_attn_4" if flash_attn_4_available() else "torch_flash"
    return argparse.Namespace(device=args.device, page_size=None if _cuda(args) else 64 * KB, cuda_driver="auto",
                              kernel=kernel, warmup=2 if _cuda(args) else 1, repeats=(5 if args.quick else 9)
                              if _cuda(args) else (2 if args.quick else 3), check_tokens=0, no_graphs=False,
                              blocks=blocks), kernel


def _kernel_rows(args: argparse.Namespace, cases: list[tuple[int, int]], phase: str, blocks: list[int],
                 scaled: dict, desc: str) -> dict[str, Any]:
    """`kernel.run_case` per (batch, context), one layer (per-layer layout); rows with labels."""
    from . import kernel

    kargs, kern = _kernel_args(args, blocks)
    shape = None if _cuda(args) else (8, 2, 64)  # query heads, KV heads, head dim
    if shape:
        scaled["heads"] = dict(paper="Llama-3-8B: 32 query, 8 KV heads x 128, bf16", used="8 query, 2 KV heads x 64, fp32")
    notes: list[str] = []
    rows = []
    for B, ctx in progress(cases, desc=desc, unit="case"):
        rows += kernel.run_case("per-layer", B, ctx, [phase], kargs, notes, shape=shape)
        if _cuda(args):
            torch.cuda.empty_cache()
    ok = [r for r in rows if "error" not in r]
    labels = {}
    for bs in blocks:
        lab = kernel.block_label(ok, bs)
        labels[bs] = f"{HOST_PAGED}, blocks of {bs}" if not _cuda(args) else (
            f"{lab} ({', '.join(sorted({r[f'paged{bs}_kernel'] for r in ok if f'paged{bs}_kernel' in r}))})")
    return dict(kernel=kern if _cuda(args) else "SDPA (varlen rows) on the host", rows=rows, paged_labels=labels,
                notes=sorted(set(notes)), failures=[f"B={r['batch']} T={r['context']}: {r.get('error') or r['check_failed']}"
                                                    for r in rows if "error" in r or "check_failed" in r])


def fig2(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    paper = [1024, 2048, 4096, 8192, 16384, 32768]
    ctxs = _pick(args, paper, paper, [1024, 4096, 16384], [1024, 2048, 4096], [256, 512, 1024], scaled, "contexts")
    out = _kernel_rows(args, [(1, c) for c in ctxs], "prefill", [16], scaled, "fig2")
    for r in out["rows"]:
        if "error" not in r:
            r["paged_over_virtual"] = r["paged16_vs_virtual"]
    ok = [r for r in out["rows"] if "error" not in r]
    out["headline"] = (f"prefill, paged (16) / vattn: {min(r['paged_over_virtual'] for r in ok):.2f}-"
                       f"{max(r['paged_over_virtual'] for r in ok):.2f}x; vattn / contiguous "
                       f"{max(r['virtual_vs_contiguous'] for r in ok):.2f}x at most") if ok else "no case ran"
    return out


def fig3(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    batches = _pick(args, [1, 2, 4, 8, 16], [1, 2, 4, 8, 16], [1, 4, 16], [1, 2, 4, 8, 16], [1, 4], scaled, "batches")
    ctx = _pick(args, 16384, 16384, 16384, 4096, 1024, scaled, "context")
    blocks = [16, 32, 64, 128]
    out = _kernel_rows(args, [(b, ctx) for b in batches], "decode", blocks, scaled, "fig3")
    ok = [r for r in out["rows"] if "error" not in r]
    out["blocks"] = blocks
    if ok:
        big = max(ok, key=lambda r: r["batch"])
        out["headline"] = (f"decode B={big['batch']} x {ctx}: paged / vattn " + ", ".join(
            f"{bs}: {big[f'paged{bs}_vs_virtual']:.2f}x" for bs in blocks))
    else:
        out["headline"] = "no case ran"
    return out


def fig6(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    paper = [2048, 4096, 8192, 16384, 32768, 65536, 131072, 196608]
    ctxs = _pick(args, paper, paper, [2048, 16384, 65536], [1024, 2048, 4096], [512, 1024], scaled, "contexts")
    out = _kernel_rows(args, [(1, c) for c in ctxs], "prefill", [16], scaled, "fig6")
    scaled["what"] = dict(paper="the whole model's prefill tokens/s", used="one layer's prefill attention tokens/s")
    for r in out["rows"]:
        if "error" not in r:
            r["virtual_tok_s"] = r["context"] / (r["virtual_us"] * 1e-6)
            r["paged_tok_s"] = r["context"] / (r["paged16_us"] * 1e-6)
            r["vattn_over_paged"] = r["virtual_tok_s"] / r["paged_tok_s"]
    ok = [r for r in out["rows"] if "error" not in r]
    out["headline"] = (f"prefill attention tokens/s, vattn / paged (16): {min(r['vattn_over_paged'] for r in ok):.2f}-"
                       f"{max(r['vattn_over_paged'] for r in ok):.2f}x") if ok else "no case ran"
    return out


# ---------------------------------------------------------- allocation: fig 4 ----
def fig4(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    from . import alloc

    batches = _pick(args, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300], [1, 8, 32, 64, 128, 256, 300], [1, 32, 128],
                    [1, 4, 16, 64, 128], [1, 4, 16], scaled, "batches")
    new = _pick(args, "900-token requests", 64, 16, 16, 8, scaled, "decode tokens per request")
    prompt = 900 - new
    model, shape = _model(args, dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=64),
                          dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16), scaled)
    tok_bytes = _token_bytes(shape, _dtype(args))
    rng = random.Random(args.seed)
    rows = []
    for B in progress(batches, desc="fig4", unit="batch"):
        reqs = [(_seed_tokens(prompt, shape["vocab_size"], rng), new) for _ in range(B)]
        rows.append(dict(batch=B, prompt=prompt, new_tokens=new, **decode_run(model, reqs, args, tok_bytes)))
    # the bandwidth vattn's synchronous step gives a new request, per page size (alloc.bench_new_pages)
    pages = _pick(args, "2 MiB (stock driver); 64/128/256 KiB with the authors' driver",
                  [2 * MB], [2 * MB], [64 * KB, 128 * KB, 256 * KB, 512 * KB, MB, 2 * MB], [64 * KB, 256 * KB, 2 * MB],
                  scaled, "page sizes")
    aargs = argparse.Namespace(device=args.device, layers=32, reps=3 if args.quick else 5,
                               max_mib=(2048 if _cuda(args) else 768) if args.quick else (8192 if _cuda(args) else 768))
    avail = []
    with progress(total=2 * 3 * len(pages), desc="fig4 alloc", unit="case") as bar:
        for page in pages:
            counts = [n for n in (1, 4, 16, 64) if alloc._reps(aargs, n * 2 * aargs.layers * page) >= 2]
            rs = [x for x in alloc.bench_new_pages(aargs, page, counts, bar) if x["mode"] == "sync"]
            if rs:
                best = max(rs, key=lambda x: x["GBps"])
                avail.append(dict(page_KiB=page // KB, GBps=best["GBps"], at_MiB=best["new_groups"] * best["group_MiB"],
                                  rows=rs))
    peak = max((r["needed_MBps"] for r in rows), default=float("nan"))
    for a in avail:
        a["headroom_over_peak_need"] = a["GBps"] * 1e3 / peak if peak > 0 else float("nan")
    return dict(rows=rows, token_bytes=tok_bytes, available=avail, peak_needed_MBps=peak,
                headline=f"peak need {peak:.1f} MB/s at batch {max(batches)}; step gives " + ", ".join(
                    f"{a['GBps']:.1f} GB/s at {a['page_KiB']} KiB" for a in avail))


# ------------------------------------------------------- engines: figs 7, 8, 9 ----
HOST_ENGINE_MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)
CUDA_ENGINE_MODEL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64)


def _systems(args: argparse.Namespace, notes: list[str]) -> list[str]:
    problem = _hf_cb_problem() if not args.no_paged_engine else "--no-paged-engine"
    if problem:
        notes.append(f"the paged engine (transformers' continuous batching) left out: {problem}")
        return ["vattn"]
    return ["vattn", "hf_cb"]


def _serve(system: str, model: Any, reqs: list, args: argparse.Namespace, eargs: argparse.Namespace) -> dict:
    from . import throughput

    if system == "vattn":
        return throughput.run_vattn(model, reqs, eargs, args.device, _dtype(args))
    return throughput.run_hf_cb(model, reqs, eargs, args.device)


def fig7(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    batches = _pick(args, [1, 2, 4, 8, 16, 32], [1, 2, 4, 8, 16, 32], [1, 8, 32], [1, 2, 4, 8, 16], [1, 4],
                    scaled, "batches")
    ctx = _pick(args, 16384, 16384, 4096, 1024, 256, scaled, "context")
    new = 32 if _cuda(args) else (32 if not args.quick else 16)  # decode = (t_N - t_1) / (N - 1): not too few
    model, shape = _model(args, CUDA_ENGINE_MODEL, HOST_ENGINE_MODEL, scaled)
    notes: list[str] = []
    systems = _systems(args, notes)
    rng = random.Random(args.seed)
    rows = []
    for B in progress(batches, desc="fig7", unit="batch"):
        reqs = [(_seed_tokens(ctx - new, shape["vocab_size"], rng), new) for _ in range(B)]
        row: dict[str, Any] = dict(batch=B, context=ctx, new_tokens=new)
        for s in systems:
            r = _serve(s, model, reqs, args, _engine_args(args, B, min(B * ctx, 8192)))
            decode_s = r["tn"].wall - r["t1"].wall
            row[f"{s}_decode_tok_s"] = B * (new - 1) / decode_s if decode_s > 0 else float("nan")
        if "hf_cb" in systems:
            row["vattn_over_paged"] = row["vattn_decode_tok_s"] / row["hf_cb_decode_tok_s"]
        rows.append(row)  # nan where t_N <= t_1 (the decode within the noise of a shared machine)
    best = max((x for r in rows if (x := r.get("vattn_over_paged", float("nan"))) == x), default=float("nan"))
    return dict(systems=systems, paged_engine="transformers continuous batching (paged cache)", rows=rows, notes=notes,
                headline=(f"decode tok/s vattn / paged engine: up to {best:.2f}x" if "hf_cb" in systems else
                          f"vattn decode tok/s {rows[-1]['vattn_decode_tok_s']:.0f} at batch {rows[-1]['batch']}"))


def _trace(args: argparse.Namespace, n: int, scale: float, max_new: int, vocab: int) -> list[tuple[list[int], int]]:
    """The first `n` arXiv requests, prompts scaled by `scale` (the paper's long contexts from the
    trace's shape), outputs capped at `max_new`; random token ids (seeded)."""
    from vattn.workload import trace_requests

    rng = random.Random(args.seed)
    reqs = trace_requests(str(_common.TRACE), n, 1 << 30)
    return [(_seed_tokens(max(1, round(r.prompt * scale)), vocab, rng), max(2, min(max_new, r.output))) for r in reqs]


TRACE_LONGEST_PROMPT = 4096  # the arXiv trace's prompts are at most 4054 tokens: scaled to the context


def fig8(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    paper = [65536, 131072, 196608]
    ctxs = _pick(args, paper, paper, [65536], [1024, 2048, 3072], [512, 1024], scaled, "contexts")
    n = _pick(args, "the arXiv trace", 64, 16, 16, 4, scaled, "requests")
    max_new = _pick(args, "the trace's outputs", 256, 64, 16, 8, scaled, "output tokens (cap)")
    model, shape = _model(args, CUDA_ENGINE_MODEL, HOST_ENGINE_MODEL, scaled)
    notes: list[str] = []
    systems = _systems(args, notes)
    rows = []
    for ctx in progress(ctxs, desc="fig8", unit="context"):
        reqs = _trace(args, n, ctx / TRACE_LONGEST_PROMPT, max_new, shape["vocab_size"])
        row: dict[str, Any] = dict(context=ctx, requests=len(reqs), prompt_tokens=sum(len(p) for p, _ in reqs),
                                   output_tokens=sum(o for _, o in reqs))
        slots = 16 if _cuda(args) else 8
        for s in systems:
            r = _serve(s, model, reqs, args, _engine_args(args, slots, max(2048, ctx)))
            row[f"{s}_makespan_s"] = r["tn"].wall
            row[f"{s}_requests_per_min"] = len(reqs) / r["tn"].wall * 60
        if "hf_cb" in systems:
            row["vattn_over_paged"] = row["vattn_requests_per_min"] / row["hf_cb_requests_per_min"]
        rows.append(row)
    return dict(systems=systems, paged_engine="transformers continuous batching (paged cache)", rows=rows, notes=notes,
                prompt_scale="prompt x context / 4096 (the trace's longest prompt is 4054 tokens)",
                headline=", ".join(f"{r['context']}: vattn {r['vattn_requests_per_min']:.1f} req/min"
                                   + (f" ({r['vattn_over_paged']:.2f}x paged)" if "vattn_over_paged" in r else "")
                                   for r in rows))


def online_vattn(model: Any, reqs: list, arrivals: list[float], args: argparse.Namespace, slots: int,
                 ctx: int) -> list[float]:
    """Requests added at their arrival times (seconds from the start) to a stepped `vattn.LLM`;
    each one's latency, arrival to its last token (seconds), in request order."""
    from vattn import LLM, SamplingParams

    llm = LLM(model, device=args.device, dtype=_dtype(args), max_batch_size=slots,
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
    from vattn.report import latency_stats

    ctx = _pick(args, "the arXiv trace", 16384, 4096, 1024, 512, scaled, "context (prompts scaled to it)")
    n = _pick(args, "the arXiv trace", 64, 24, 24, 6, scaled, "requests")
    max_new = _pick(args, "the trace's outputs", 128, 32, 16, 6, scaled, "output tokens (cap)")
    model, shape = _model(args, CUDA_ENGINE_MODEL, HOST_ENGINE_MODEL, scaled)
    notes: list[str] = []
    systems = _systems(args, notes)
    reqs = _trace(args, n, ctx / TRACE_LONGEST_PROMPT, max_new, shape["vocab_size"])
    slots = 16 if _cuda(args) else 8
    # the request rates: fractions of vattn's offline capacity on the same requests (measured here)
    from . import throughput

    cap = throughput.run_vattn(model, reqs, _engine_args(args, slots, max(2048, ctx)), args.device, _dtype(args))
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
    return dict(systems=systems, paged_engine="transformers continuous batching (paged cache)", rows=rows, notes=notes,
                capacity_req_s=capacity, requests=len(reqs), headline="; ".join(head))


# --------------------------------------------------------------- fig 11 overlap ----
def fig11(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    from . import overlap

    cuda = _cuda(args)
    # (layout, page bytes): the host sweeps real page sizes; on CUDA 2 MiB per-layer, and fused page groups
    # (a 2 MiB page of every layer: 2 MiB / layers of one layer's tokens)
    configs = _pick(args, [("per-layer", 2 * MB)], [("per-layer", 2 * MB), ("fused", 2 * MB)],
                    [("per-layer", 2 * MB), ("fused", 2 * MB)],
                    [("per-layer", 64 * KB), ("per-layer", 256 * KB), ("per-layer", 2 * MB)],
                    [("per-layer", 64 * KB), ("per-layer", 256 * KB)], scaled, "pages")
    batch = _pick(args, 4, 4, 4, 16, 8, scaled, "batch")
    layers = None if cuda else 16
    if not cuda:
        scaled["model"] = dict(paper="Llama-3-8B", used="random Llama: 16 layers, hidden 64, 16 KV heads x 128 (8 KiB "
                               "a token a layer, so pages hold few tokens), fp32")
    rows = []
    for layout, page in progress(configs, desc="fig11", unit="page"):
        oargs = argparse.Namespace(device=args.device, modes=["sync", "background"], batch=batch, iters=None,
                                   quick=True, budget_s=None, warmup=4, layers=layers, hidden=None if cuda else 64,
                                   heads=None if cuda else 16, kv_heads=None if cuda else 16,
                                   head_dim=None if cuda else 128, page_size=page, layout=layout, stagger=False,
                                   reserve=False, repeats=1, eager=False, seed=args.seed)
        overlap._defaults(oargs)
        elem = torch.empty((), dtype=_dtype(args)).element_size()
        tpp = page // (oargs.kv_heads * oargs.head_dim * elem * (oargs.layers if layout == "fused" else 1))
        oargs.iters = max(tpp, 16) if args.quick else max(2 * tpp, 32)
        r = overlap.run(oargs)
        eff = page // oargs.layers if layout == "fused" else page
        for mode, m in r["modes"].items():
            rows.append(dict(layout=layout, page_KiB=page // KB, effective_page_KiB=eff // KB, tokens_per_page=tpp,
                             batch=batch, mode=mode, iterations=r["timed_iterations"],
                             boundary_iterations=r["boundary_iterations"], mean_ms=m["mean_ms"], p50_ms=m["p50_ms"],
                             p99_ms=m["p99_ms"], max_ms=m["max_ms"], boundary_mean_ms=m["boundary_mean_ms"],
                             other_median_ms=m["other_median_ms"], spike=m["spike"],
                             step_boundary_mean_ms=m["step_boundary_mean_ms"],
                             iterations_mapping_in_step=m["iterations_mapping"],
                             series_ms=next(x["latency_ms"] for x in r["runs"] if x["mode"] == mode)))
    head = []
    for layout, page in configs:
        by = {x["mode"]: x for x in rows if x["layout"] == layout and x["page_KiB"] == page // KB}
        if "sync" in by and "background" in by:
            head.append(f"{by['sync']['effective_page_KiB']} KiB: page-boundary iterations sync "
                        f"{by['sync']['boundary_mean_ms']:.1f} ms vs overlapped {by['background']['boundary_mean_ms']:.1f} "
                        f"ms (others {by['sync']['other_median_ms']:.1f})")
    return dict(rows=rows, headline="; ".join(head))


RUNNERS: dict[int, Callable[[argparse.Namespace, dict], dict]] = {2: fig2, 3: fig3, 4: fig4, 6: fig6, 7: fig7,
                                                                   8: fig8, 9: fig9, 11: fig11}


# ------------------------------------------------------------------------ plots ----
def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_figure(n: int, res: dict[str, Any], device: str) -> Any:
    """The paper's figure `n` from its result."""
    plt = _plt()
    title = f"Fig. {n} ({device}): {PAPER[n][0]}"
    if n in (2, 6):
        rows = [r for r in res["rows"] if "error" not in r]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [r["context"] for r in rows]
        if n == 2:
            ax.plot(xs, [r["virtual_us"] / 1e3 for r in rows], "o-", label="vattn (virtual cache)")
            ax.plot(xs, [r["contiguous_us"] / 1e3 for r in rows], "^:", label="contiguous tensor")
            ax.plot(xs, [r["paged16_us"] / 1e3 for r in rows], "s--", label=res["paged_labels"][16])
            ax.set(ylabel="prefill attention latency, one layer (ms)")
        else:
            ax.plot(xs, [r["virtual_tok_s"] for r in rows], "o-", label="vattn (virtual cache)")
            ax.plot(xs, [r["paged_tok_s"] for r in rows], "s--", label=res["paged_labels"][16])
            ax.set(ylabel="prefill tokens/s (one layer's attention)")
        ax.set(xscale="log", xlabel="context (tokens)")
    elif n == 3:
        rows = [r for r in res["rows"] if "error" not in r]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [r["batch"] for r in rows]
        ax.plot(xs, [r["virtual_us"] for r in rows], "o-", color="k", label="vattn (virtual cache)")
        for bs in res["blocks"]:
            ax.plot(xs, [r[f"paged{bs}_us"] for r in rows], "s--", label=res["paged_labels"][bs])
        ax.set(xscale="log", yscale="log", xlabel=f"batch (x {rows[0]['context'] if rows else '?'} tokens)",
               ylabel="decode attention latency, one layer (us)")
    elif n == 4:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        rows = res["rows"]
        xs = [r["batch"] for r in rows]
        a1.plot(xs, [r["decode_tok_s"] for r in rows], "o-", label="decode tokens/s")
        a1b = a1.twinx()
        a1b.plot(xs, [r["needed_MBps"] for r in rows], "s--", color="tab:red", label="allocation needed (MB/s)")
        a1.set(xscale="log", xlabel="batch (900-token requests)", ylabel="decode tokens/s")
        a1b.set(ylabel="allocation bandwidth needed (MB/s)")
        a1.legend(loc="upper left", fontsize=7)
        a1b.legend(loc="lower right", fontsize=7)
        av = res["available"]
        a2.bar([f"{a['page_KiB']} KiB" for a in av], [a["GBps"] * 1e3 for a in av], label="vattn step (sync) MB/s")
        a2.axhline(res["peak_needed_MBps"], color="tab:red", ls="--", label="peak need (left)")
        a2.set(yscale="log", xlabel="page size", ylabel="MB/s", title="allocation bandwidth available vs needed")
        a2.legend(fontsize=7)
        fig.suptitle(title, fontsize=9)
        return fig
    elif n == 7:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        xs = [r["batch"] for r in res["rows"]]
        for s in res["systems"]:
            ax.plot(xs, [r[f"{s}_decode_tok_s"] for r in res["rows"]], "o-",
                    label="vattn.LLM" if s == "vattn" else res["paged_engine"])
        ax.set(xscale="log", xlabel=f"batch (context {res['rows'][0]['context']})", ylabel="decode tokens/s")
    elif n == 8:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        rows = res["rows"]
        w = 0.8 / len(res["systems"])
        for i, s in enumerate(res["systems"]):
            ax.bar([j + (i - (len(res["systems"]) - 1) / 2) * w for j in range(len(rows))],
                   [r[f"{s}_requests_per_min"] for r in rows], w,
                   label="vattn.LLM" if s == "vattn" else res["paged_engine"])
        ax.set_xticks(range(len(rows)), [f"{r['context'] // 1024}K" for r in rows])
        ax.set(xlabel="context (arXiv prompts scaled to it)", ylabel="requests per minute")
    elif n == 9:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in res["rows"]:
            lat = sorted(x for x in r["latencies_s"] if x == x)
            ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], "-" if r["system"] == "vattn" else "--",
                    label=f"{'vattn.LLM' if r['system'] == 'vattn' else 'paged engine'} at {r['rate_req_s']:.2f} req/s")
        ax.set(xlabel="request latency (s)", ylabel="CDF")
    elif n == 11:
        configs = list(dict.fromkeys((r["layout"], r["page_KiB"]) for r in res["rows"]))
        fig, axes = plt.subplots(len(configs), 1, figsize=(10, 2.6 * len(configs)), squeeze=False)
        for ax, (layout, page) in zip(axes[:, 0], configs):
            rs = [r for r in res["rows"] if r["layout"] == layout and r["page_KiB"] == page]
            for b in rs[0]["boundary_iterations"]:
                ax.axvline(b, color="0.85", lw=3, zorder=0)
            for r in rs:
                ax.plot(r["series_ms"], lw=0.9, color="tab:red" if r["mode"] == "sync" else "tab:blue",
                        label=f"{'synchronous' if r['mode'] == 'sync' else 'overlapped'}: at boundaries "
                              f"{r['boundary_mean_ms']:.1f} ms, p99 {r['p99_ms']:.1f}")
            ax.set(ylabel="iteration (ms)", title=f"{layout} {page} KiB pages (effective {rs[0]['effective_page_KiB']} "
                   f"KiB, {rs[0]['tokens_per_page']} tokens/page), batch {rs[0]['batch']}")
            ax.legend(fontsize=7)
        axes[-1, 0].set(xlabel="decode iteration (grey: page boundaries)")
        fig.suptitle(title, fontsize=9)
        return fig
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    return fig


def _as_image(fig: Any) -> Any:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=80)
    _plt().close(fig)
    buf.seek(0)
    return _plt().imread(buf)


# ------------------------------------------------------------------------ bench ----
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--figure", type=int, nargs="+", default=list(FIGURES), choices=FIGURES,
                   help="the paper's figures to run (default: all eight)")
    p.add_argument("--device", default="cpu", help="cpu (host backend, default) or cuda")
    p.add_argument("--quick", action="store_true", help="CI-size runs (the GPU suite)")
    p.add_argument("--no-paged-engine", action="store_true",
                   help="figures 7-9: vattn.LLM only (leave out transformers' continuous batching)")
    p.add_argument("--one-png", action="store_true",
                   help="write the figures' results into paper_<device>.json and every plot into one PNG "
                   "(the GPU suite's few files) instead of a JSON + PNG per figure")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if _cuda(args) and not torch.cuda.is_available():
        raise vattn.InvalidConfigError("vattn bench paper --device cuda needs a CUDA GPU and none is available "
                                       "here; run it on the host with --device cpu")
    from . import device_tag

    tag = device_tag(args.device)
    figures: dict[str, Any] = {}
    failures: list[str] = []
    for n in sorted(set(args.figure)):
        scaled: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            res = RUNNERS[n](args, scaled)
        except vattn.InvalidConfigError:
            raise
        except Exception as e:  # record it, go on with the next figure
            import traceback

            traceback.print_exc()
            failures.append(f"fig {n}: {type(e).__name__}: {e}")
            continue
        res.update(figure=n, paper_experiment=PAPER[n][0], paper_headline=PAPER[n][1], scaled=scaled,
                   device=args.device, seconds=time.perf_counter() - t0)
        failures += [f"fig {n}: {f}" for f in res.get("failures", [])]
        print(f"\nFig. {n}: {res['headline']}" + (f"  [scaled: {', '.join(scaled)}]" if scaled else ""), flush=True)
        fig = None if args.no_plot else plot_figure(n, res, args.device)
        entry = dict(headline=res["headline"], paper_headline=PAPER[n][1], scaled=scaled, seconds=res["seconds"])
        if args.one_png:
            entry["result"] = res
            entry["image"] = None if fig is None else _as_image(fig)
        else:
            payload = {"benchmark": f"paper_fig{n}", "environment": _common.environment(args.device),
                       "config": {k: v for k, v in vars(args).items() if k not in ("bench", "out", "no_plot")},
                       "result": res}
            entry["path"] = str(_common.save(f"paper_fig{n}_{tag}", payload, fig, out=args.out))
            if fig is not None:
                _plt().close(fig)
        figures[str(n)] = entry
    return dict(file_name="paper", device=args.device, figures=figures, failures=failures)


def table(result: dict[str, Any]) -> tuple[list[str], list[list]]:
    rows = []
    for n, e in result["figures"].items():
        sc = "; ".join(f"{k}: {v['paper']} -> {v['used']}" for k, v in e["scaled"].items())
        rows.append([f"Fig. {n}", e["headline"], sc or "-"])
    for f in result["failures"]:
        print(f"FAILED {f}")
    return ["figure", "measured", "scaled (paper -> here)"], rows


def plot(result: dict[str, Any]) -> Any:
    """With --one-png: every figure's plot in one grid (else the figures wrote their own PNGs)."""
    images = [(n, e.pop("image")) for n, e in result["figures"].items() if e.get("image") is not None]
    for e in result["figures"].values():
        e.pop("image", None)
    if not images:
        return None
    plt = _plt()
    cols = min(2, len(images))
    rows = -(-len(images) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 5 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (n, img) in zip(axes.flat, images):
        ax.imshow(img)
    return fig
