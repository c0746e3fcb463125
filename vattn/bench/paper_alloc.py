"""The paper's allocation figures (4, 11) for `vattn bench paper`: the allocation bandwidth a
decode needs against what vattn's `step` gives per page size (`alloc.bench_new_pages`), and
decode iteration latency with pages mapped inside `step` or by the background worker
(`overlap.run`). Both map real pages on the host too (memfd pages mapped with `mmap`), so the
page-size sweep the paper's stock driver could not run (64 KiB-2 MiB) runs there."""
from __future__ import annotations

import argparse
import random
from typing import Any

import torch

from ._common import progress
from .paper_common import KB, MB, dtype_of, is_cuda, pick, seed_tokens, token_bytes
from .paper_common import model as model_of
from .paper_engines import decode_vattn


def _decode(model: Any, reqs: list, args: argparse.Namespace, tok_bytes: int) -> dict[str, Any]:
    """`decode_vattn` on one batch, and the allocation bandwidth its decode needs: the K/V of
    the batch's new tokens, every layer, at its decode tokens/s."""
    B = len(reqs)
    d = decode_vattn(model, reqs, args, min(B * len(reqs[0][0]) + B, 32768))
    return dict(d, bytes_per_iteration=B * tok_bytes, needed_MBps=d["decode_tok_s"] * tok_bytes / 1e6)


# ---------------------------------------------------------- allocation: fig 4 ----
def fig4(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    """Decode tokens/s against the batch (900-token requests) and the allocation bandwidth it
    needs, against what a synchronous `step` maps per page size."""
    from . import alloc

    batches = pick(args, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300], [1, 8, 32, 64, 128, 256, 300], [1, 32, 128],
                    [1, 4, 16, 64, 128], [1, 4, 16], scaled, "batches")
    new = pick(args, "900-token requests", 64, 16, 16, 8, scaled, "decode tokens per request")
    prompt = 900 - new
    model, shape = model_of(args, dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=64),
                          dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16), scaled)
    tok_bytes = token_bytes(shape, dtype_of(args))
    rng = random.Random(args.seed)
    rows = []
    for B in progress(batches, desc="fig4", unit="batch"):
        reqs = [(seed_tokens(prompt, shape["vocab_size"], rng), new) for _ in range(B)]
        rows.append(dict(batch=B, prompt=prompt, new_tokens=new, **_decode(model, reqs, args, tok_bytes)))
    # the bandwidth vattn's synchronous step gives a new request, per page size (alloc.bench_new_pages)
    pages = pick(args, "2 MiB (stock driver); 64/128/256 KiB with the authors' driver",
                  [2 * MB], [2 * MB], [64 * KB, 128 * KB, 256 * KB, 512 * KB, MB, 2 * MB], [64 * KB, 256 * KB, 2 * MB],
                  scaled, "page sizes")
    aargs = argparse.Namespace(device=args.device, layers=32, reps=3 if args.quick else 5,
                               max_mib=(2048 if is_cuda(args) else 768) if args.quick else (8192 if is_cuda(args) else 768))
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


# --------------------------------------------------------------- fig 11 overlap ----
def fig11(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    """Decode iteration latency with pages mapped inside `step` (sync) or by the background worker,
    per page size."""
    from . import overlap

    cuda = is_cuda(args)
    # (layout, page bytes): the host sweeps real page sizes; on CUDA 2 MiB per-layer, and fused page groups
    # (a 2 MiB page of every layer: 2 MiB / layers of one layer's tokens)
    configs = pick(args, [("per-layer", 2 * MB)], [("per-layer", 2 * MB), ("fused", 2 * MB)],
                    [("per-layer", 2 * MB), ("fused", 2 * MB)],
                    [("per-layer", 64 * KB), ("per-layer", 256 * KB), ("per-layer", 2 * MB)],
                    [("per-layer", 64 * KB), ("per-layer", 256 * KB)], scaled, "pages")
    batch = 4  # the paper's, on the host too (batch 16 made a 2 MiB page's run take many minutes there)
    layers = None if cuda else 16
    if not cuda:
        scaled["model"] = dict(paper="Llama-3-8B", used="random Llama: 16 layers, hidden 64, 16 KV heads x 128 (8 KiB "
                               "a token a layer, so pages hold few tokens), fp32")
    rows = []
    for layout, page in progress(configs, desc="fig11", unit="page"):
        oargs = argparse.Namespace(device=args.device, modes=["sync", "background"], batch=batch, iters=None,
                                   quick=args.quick, budget_s=None, warmup=4, layers=layers,
                                   hidden=None if cuda else 64,
                                   heads=None if cuda else 16, kv_heads=None if cuda else 16,
                                   head_dim=None if cuda else 128, page_size=page, layout=layout, stagger=False,
                                   reserve=False, repeats=1, eager=False, seed=args.seed)
        overlap._defaults(oargs)
        elem = torch.empty((), dtype=dtype_of(args)).element_size()
        tpp = page // (oargs.kv_heads * oargs.head_dim * elem * (oargs.layers if layout == "fused" else 1))
        # timed iterations: two pages' worth (two boundaries); one where a page holds hundreds of
        # tokens (2 MiB on the host: 256), whose iterations read hundreds of MiB each on a few CPUs
        oargs.iters = max(tpp, 16) if args.quick else (max(2 * tpp, 32) if tpp <= 64 else tpp)
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
