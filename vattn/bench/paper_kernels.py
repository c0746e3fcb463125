"""The paper's kernel figures (2, 3, 6) for `vattn bench paper`: attention latency on the vattn
cache against a paged cache, through `vattn bench kernel`'s `run_case`, one layer.

On the host the kernel is PyTorch SDPA and the "paged" line is the block table gathered into
a contiguous copy, then SDPA (`HOST_PAGED`: not a paged kernel). On CUDA: FlashAttention 4
(its `page_table` mode for the paged line) when installed, else torch's FlashAttention."""
from __future__ import annotations

import argparse
from typing import Any

import torch

from ._common import progress
from .paper_common import HOST_PAGED, KB, is_cuda, pick


# ------------------------------------------------------------- kernel figures ----
def _kernel_args(args: argparse.Namespace, blocks: list[int]) -> tuple[argparse.Namespace, str]:
    """`kernel.run_case`'s arguments; the library kernel (FlashAttention 4 when installed on CUDA)."""
    kernel = "torch_flash"
    if is_cuda(args):
        from vattn.attention import flash_attn_4_available

        kernel = "flash_attn_4" if flash_attn_4_available() else "torch_flash"
    return argparse.Namespace(device=args.device, page_size=None if is_cuda(args) else 64 * KB, cuda_driver="auto",
                              kernel=kernel, warmup=2 if is_cuda(args) else 1, repeats=(5 if args.quick else 9)
                              if is_cuda(args) else (2 if args.quick else 3), check_tokens=0, no_graphs=False,
                              blocks=blocks), kernel


def _kernel_rows(args: argparse.Namespace, cases: list[tuple[int, int]], phase: str, blocks: list[int],
                 scaled: dict, desc: str) -> dict[str, Any]:
    """`kernel.run_case` per (batch, context), one layer (per-layer layout); rows with labels."""
    from . import kernel

    kargs, kern = _kernel_args(args, blocks)
    shape = None if is_cuda(args) else (8, 2, 64)  # query heads, KV heads, head dim
    if shape:
        scaled["heads"] = dict(paper="Llama-3-8B: 32 query, 8 KV heads x 128, bf16", used="8 query, 2 KV heads x 64, fp32")
    notes: list[str] = []
    rows = []
    for B, ctx in progress(cases, desc=desc, unit="case"):
        rows += kernel.run_case("per-layer", B, ctx, [phase], kargs, notes, shape=shape)
        if is_cuda(args):
            torch.cuda.empty_cache()
    ok = [r for r in rows if "error" not in r]
    labels = {}
    for bs in blocks:
        lab = kernel.block_label(ok, bs)
        labels[bs] = f"{HOST_PAGED}, blocks of {bs}" if not is_cuda(args) else (
            f"{lab} ({', '.join(sorted({r[f'paged{bs}_kernel'] for r in ok if f'paged{bs}_kernel' in r}))})")
    return dict(kernel=kern if is_cuda(args) else "SDPA (varlen rows) on the host", rows=rows, paged_labels=labels,
                notes=sorted(set(notes)), failures=[f"B={r['batch']} T={r['context']}: {r.get('error') or r['check_failed']}"
                                                    for r in rows if "error" in r or "check_failed" in r])


def fig2(args: argparse.Namespace, scaled: dict) -> dict[str, Any]:
    """Prefill attention latency, paged (blocks of 16) against the vattn cache and a contiguous tensor."""
    paper = [1024, 2048, 4096, 8192, 16384, 32768]
    ctxs = pick(args, paper, paper, [1024, 4096, 16384], [1024, 2048, 4096], [256, 512, 1024], scaled, "contexts")
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
    """Decode attention latency against the batch, paged at blocks of 16-128 against the vattn cache."""
    batches = pick(args, [1, 2, 4, 8, 16], [1, 2, 4, 8, 16], [1, 4, 16], [1, 2, 4, 8, 16], [1, 4], scaled, "batches")
    ctx = pick(args, 16384, 16384, 16384, 4096, 1024, scaled, "context")
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
    """One request's prefill attention tokens/s against the context, paged (16) against the vattn cache."""
    paper = [2048, 4096, 8192, 16384, 32768, 65536, 131072, 196608]
    ctxs = pick(args, paper, paper, [2048, 16384, 65536], [1024, 2048, 4096], [512, 1024], scaled, "contexts")
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
