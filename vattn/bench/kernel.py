"""Attention latency on the vattn cache against a paged cache: the paper's FA_vAttention vs FA_Paged.

The same library kernel reads the same K/V values (Llama-3-8B layer: 32 query heads, 8 KV
heads x 128, bf16) from
- `virtual`: layer 0 of a vattn cache (2 MiB pages mapped with the CUDA VMM API), through
  `aten._flash_attention_forward` varlen with `seqused_k` over the flat `[rows, H, D]` view
  of the `[B, T, H, D]` cache, exactly as vattn's `torch_flash` kernel calls it;
  `per-layer` (one buffer per layer) or `fused` (32 layers in one buffer, a layer is a
  strided view);
- `contiguous`: a plain `torch.empty` tensor of the same shape (the target: virtual /
  contiguous <= 1.02), and for `fused` `strided`: plain memory with the fused strides;
- `paged<bs>` (per-layer): blocks of bs = 16, 128, 256 tokens scattered over a block pool
  (a random permutation, as after churn) and a block table `[B, blocks]`, read by the
  first of these that runs and agrees with the contiguous result:
  1. `aten._flash_attention_forward(..., block_table=)` (torch >= 2.13; FlashAttention-2
     wants blocks of a multiple of 256 tokens),
  2. flash-attn's `flash_attn_varlen_func(..., block_table=)` (when installed),
  3. otherwise `gather`: the block table gathered into a contiguous copy, then the same
     kernel: NOT a paged kernel; it bounds what paging costs a kernel that cannot read
     blocks (the GPU image has torch 2.11 and no flash-attn). Each row says which ran
     (`paged<bs>_kernel`); the table, summary and plot call a block size `gather<bs>` when
     the gather ran and `paged<bs>` only when a block-table kernel did.
`--kernel flash_attn_4`: the same three with FlashAttention 4 (`flash_attn.cute`, the
`flash-attn-4` package; vattn's `flash_attn_4` kernel): its varlen call with `seqused_k` on
the vattn cache and on the contiguous tensor, and its own paged mode (`page_table`) on the
block pool, the same data (the paper's comparison with a real paged kernel; written as
`kernel_fa4_<device>`). Its first call of each shape JIT-compiles (seconds, untimed: the
warm-up).
Decode: one query per request. Prefill: `context` causal queries per request. Timing: CUDA-
event-timed replays of a CUDA graph of back-to-back calls (eager if capture fails or with
`--no-graphs`) after a warm-up, the copies interleaved, the median of several repeats.

Memory: a per-layer case holds K and V (kv = 2 x B x T x 8 x 128 x 2 bytes) as the contiguous
copy, the vattn cache and one block pool per block size, and with the gather stand-in each
block size's CUDA graph keeps its gathered copy, plus the eager calls' copies: about
(4 + 2 x blocks) x kv, 10 x 8 GiB = 80 GiB at B=64, T=32768. Cases estimated above
`--max-GiB` (default 85 % of the GPU's memory) are skipped and listed.

Needs a GPU; `--device cpu` runs the same harness with tiny shapes on the host backend and
an SDPA stand-in that reads the flat rows through the same `cu_seqlens_k` / `seqused_k`
(it checks the row and block arithmetic and times nothing useful).

    vattn bench kernel [--quick] [--batches 1 8] [--contexts 1024 8192] [--blocks 16 128 256]
                       [--kernel flash_attn_4]
"""
from __future__ import annotations

import argparse
import statistics
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F

import vattn
from vattn.attention import _flat_rows

from ._common import progress

NAME = "kernel"
HELP = "attention latency: vattn's contiguous cache vs a paged cache with a block table (FA_vAttention vs FA_Paged)"
NEEDS_GPU = True

MB, GB = 1 << 20, 1 << 30
HQ, HKV, D = 32, 8, 128  # Llama-3-8B attention
FUSED_LAYERS = 32


# ----------------------------------------------------------------------- kernels ----
class Batch:
    """Queries and varlen metadata of one decode or prefill batch over a `[B, T, H, D]` cache."""

    def __init__(self, q: torch.Tensor, q_lens: list[int], ctx_lens: list[int], device: torch.device) -> None:
        self.q = q  # [sum(q_lens), HQ, D]
        self.q_lens, self.ctx_lens = q_lens, ctx_lens
        cu_q = [0]
        for n in q_lens:
            cu_q.append(cu_q[-1] + n)
        self.cu_q_list = cu_q
        i32 = dict(dtype=torch.int32, device=device)
        self.cu_q = torch.tensor(cu_q, **i32)
        self.cu_k_dense = torch.tensor([sum(ctx_lens[:i]) for i in range(len(ctx_lens) + 1)], **i32)  # paged kernels
        self.seqused_k = torch.tensor(ctx_lens, **i32)
        self.max_q, self.max_k = max(q_lens), max(ctx_lens)
        self._cu_k: dict[int, torch.Tensor] = {}

    def cu_k(self, slot_tokens: int) -> torch.Tensor:
        """Row of each request's first key in the flat view (slot b = request b), then the end."""
        if slot_tokens not in self._cu_k:
            B = len(self.ctx_lens)
            cu = [b * slot_tokens for b in range(B)] + [(B - 1) * slot_tokens + self.ctx_lens[-1]]
            self._cu_k[slot_tokens] = torch.tensor(cu, dtype=torch.int32, device=self.q.device)
        return self._cu_k[slot_tokens]


def torch_flash(batch: Batch, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """vattn's torch_flash call (no sliding window): `[sum(q_lens), HQ, D]`."""
    slot_tokens = k.stride(0) // k.stride(1)
    return torch.ops.aten._flash_attention_forward(
        batch.q, _flat_rows(k), _flat_rows(v), batch.cu_q, batch.cu_k(slot_tokens), batch.max_q, batch.max_k,
        0.0, True, False, scale=scale, seqused_k=batch.seqused_k)[0]


def fa4_varlen(batch: Batch, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """vattn's flash_attn_4 call (FlashAttention 4's varlen with seqused_k over the flat rows)."""
    from flash_attn.cute import flash_attn_varlen_func

    slot_tokens = k.stride(0) // k.stride(1)
    out = flash_attn_varlen_func(batch.q, _flat_rows(k), _flat_rows(v), cu_seqlens_q=batch.cu_q,
                                 cu_seqlens_k=batch.cu_k(slot_tokens), max_seqlen_q=batch.max_q,
                                 max_seqlen_k=batch.max_k, seqused_k=batch.seqused_k, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


def varlen_emulation(batch: Batch, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The CPU stand-in for `torch_flash`: reads what the flash kernel reads (the flat rows
    from `cu_k` for `seqused_k` tokens) with SDPA, so the row arithmetic is checked."""
    slot_tokens = k.stride(0) // k.stride(1)
    kf, vf = _flat_rows(k), _flat_rows(v)  # [rows, HKV, D]
    cu_k, used = batch.cu_k(slot_tokens).tolist(), batch.seqused_k.tolist()
    out = torch.empty(batch.q.shape, dtype=batch.q.dtype, device=batch.q.device)
    for b, n in enumerate(batch.q_lens):
        a, lo, ctx = batch.cu_q_list[b], cu_k[b], used[b]
        q = batch.q[a:a + n].transpose(0, 1)[None]  # [1, HQ, n, D]
        kk = kf[lo:lo + ctx].transpose(0, 1)[None]  # [1, HKV, ctx, D]
        vv = vf[lo:lo + ctx].transpose(0, 1)[None]
        mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]  # causal, aligned to the end
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
        out[a:a + n] = o[0].transpose(0, 1)
    return out


def reference(batch: Batch, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-request SDPA on `k[b, :ctx]` (causal aligned to the end), in float32."""
    out = torch.empty(batch.q.shape, dtype=torch.float32, device=batch.q.device)
    for b, (n, ctx) in enumerate(zip(batch.q_lens, batch.ctx_lens)):
        a = batch.cu_q_list[b]
        q = batch.q[a:a + n].float().transpose(0, 1)[None]  # [1, HQ, n, D]
        kk = k[b, :ctx].float().transpose(0, 1)[None]  # [1, HKV, ctx, D]
        vv = v[b, :ctx].float().transpose(0, 1)[None]
        mask = None
        if n > 1:
            mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
        out[a:a + n] = o[0].transpose(0, 1)
    return out


# ------------------------------------------------------------------------- paged ----
class Paged:
    """A paged copy of `[B, T, H, D]` K/V: blocks of `bs` tokens at random places in a pool
    `[num_blocks, bs, H, D]`, and the block table `[B, ceil(T / bs)]` (int32) saying where."""

    def __init__(self, kc: torch.Tensor, vc: torch.Tensor, bs: int, seed: int = 0) -> None:
        B, T, H, Dh = kc.shape
        nb = -(-T // bs)
        perm = torch.randperm(B * nb, generator=torch.Generator().manual_seed(seed)).to(kc.device)
        self.bs, self.T = bs, T
        self.table = perm.view(B, nb).to(torch.int32)  # [B, nb]: physical block of (request, logical block)
        self.k = torch.zeros(B * nb, bs, H, Dh, dtype=kc.dtype, device=kc.device)
        self.v = torch.zeros_like(self.k)
        pad = nb * bs - T
        self.k[perm] = F.pad(kc, (0, 0, 0, 0, 0, pad)).reshape(B * nb, bs, H, Dh)
        self.v[perm] = F.pad(vc, (0, 0, 0, 0, 0, pad)).reshape(B * nb, bs, H, Dh)

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, T, H, D]` contiguous copies read through the block table."""
        B, nb = self.table.shape
        idx = self.table.long()
        k = self.k[idx].reshape(B, nb * self.bs, *self.k.shape[2:])[:, :self.T]
        v = self.v[idx].reshape(B, nb * self.bs, *self.v.shape[2:])[:, :self.T]
        return k, v


def paged_torch_flash(batch: Batch, p: Paged, scale: float) -> torch.Tensor:
    """torch's FlashAttention-2 varlen reading the block pool through the block table (torch >= 2.13)."""
    return torch.ops.aten._flash_attention_forward(
        batch.q, p.k, p.v, batch.cu_q, batch.cu_k_dense, batch.max_q, batch.max_k, 0.0, True, False,
        scale=scale, block_table=p.table)[0]


def paged_flash_attn(batch: Batch, p: Paged, scale: float) -> torch.Tensor:
    """flash-attn's varlen kernel reading the block pool through the block table."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(batch.q, p.k, p.v, batch.cu_q, batch.cu_k_dense, batch.max_q, batch.max_k,
                                  softmax_scale=scale, causal=True, block_table=p.table)


def paged_fa4(batch: Batch, p: Paged, scale: float) -> torch.Tensor:
    """FlashAttention 4's own paged mode: the block pool through `page_table` (`seqused_k` the lengths)."""
    from flash_attn.cute import flash_attn_varlen_func

    out = flash_attn_varlen_func(batch.q, p.k, p.v, cu_seqlens_q=batch.cu_q, max_seqlen_q=batch.max_q,
                                 max_seqlen_k=batch.max_k, seqused_k=batch.seqused_k, page_table=p.table,
                                 softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


def paged_kernels(cuda: bool, kernel: str = "torch_flash") -> list[tuple[str, Callable[[Batch, Paged, float], torch.Tensor]]]:
    """The paged kernels to try in order (the first that runs and agrees is used)."""
    out: list[tuple[str, Callable]] = []
    if not cuda:
        return out
    if kernel == "flash_attn_4":  # the same kernel's own paged mode, nothing else
        return [("flash_attn.cute page_table", paged_fa4)]
    schema = str(torch.ops.aten._flash_attention_forward.default._schema)
    if "block_table" in schema:
        out.append(("aten._flash_attention_forward block_table", paged_torch_flash))
    try:
        import flash_attn  # noqa: F401

        out.append(("flash_attn_varlen_func block_table", paged_flash_attn))
    except ImportError:
        pass
    return out


def pick_paged(batch: Batch, p: Paged, scale: float, want: torch.Tensor, kern: Callable, cuda: bool,
               notes: list[str], kernel: str = "torch_flash") -> tuple[str, Callable[[], torch.Tensor]]:
    """The first paged kernel that runs and matches `want`; else gather + the contiguous kernel."""
    for name, fn in paged_kernels(cuda, kernel):
        try:
            out = fn(batch, p, scale)
            if torch.allclose(out.float(), want.float(), atol=2e-2, rtol=0):
                return name, lambda fn=fn: fn(batch, p, scale)
            notes.append(f"{name} (blocks of {p.bs}): differs from the contiguous result")
        except Exception as e:  # e.g. FlashAttention-2 wants blocks of a multiple of 256 tokens
            notes.append(f"{name} (blocks of {p.bs}): {type(e).__name__}: {str(e).splitlines()[0][:160]}")

    def gathered() -> torch.Tensor:
        k, v = p.gather()
        return kern(batch, k, v, scale)

    return "gather + " + (kernel if cuda else "SDPA stand-in"), gathered


# ------------------------------------------------------------------------ timing ----
def time_us(fn: Callable[[], Any], cuda: bool, inner: int) -> float:
    """Mean time of one call over `inner` back-to-back calls (CUDA events on the GPU)."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) * 1e6 / inner


def graph_of(fn: Callable[[], Any], inner: int) -> Any:
    """A CUDA graph of `inner` calls of fn: replays time the kernels without launch overhead."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graph wants
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    return graph


def compare(fns: dict[str, Callable[[], Any]], cuda: bool, warmup: int, repeats: int,
            graphs: bool = True) -> tuple[dict[str, float], str]:
    """Median per-call microseconds of each function, repeats interleaved across them, and
    how they were timed: 'graph' (CUDA graph replays) or 'eager' (CUDA events, or the host
    clock on the CPU)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if cuda:
        torch.cuda.synchronize()
    one = min(time_us(fn, cuda, 1) for fn in fns.values())
    inner = max(1, min(100, int(2000 / max(one, 1.0))))  # >= ~2 ms per timed block
    calls = dict(fns)
    how = "eager"
    if cuda and graphs:
        try:
            replays = {name: graph_of(fn, inner) for name, fn in fns.items()}
            calls = {name: g.replay for name, g in replays.items()}
            how = "graph"
        except Exception as e:  # not capturable here: time eagerly
            print(f"  CUDA graph capture failed ({type(e).__name__}: {e}); timing eagerly")
            torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in calls.items():
            times[name].append(time_us(fn, cuda, 1) / inner if how == "graph" else time_us(fn, cuda, inner))
    return {name: statistics.median(t) for name, t in times.items()}, how


# ---------------------------------------------------------------------- one case ----
def run_case(layout: str, B: int, ctx: int, phases: list[str], args: argparse.Namespace,
             notes: list[str], shape: tuple[int, int, int] | None = None) -> list[dict]:
    """One (layout, batch, context) case, each phase a row; `shape` (query heads, KV heads,
    head dim): default Llama-3-8B's on CUDA, a tiny one on the CPU (`vattn bench paper` sets it)."""
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    hq, hkv, hd = shape or ((HQ, HKV, D) if cuda else (4, 2, 16))
    layers = FUSED_LAYERS if layout == "fused" else 1
    kern = (fa4_varlen if args.kernel == "flash_attn_4" else torch_flash) if cuda else varlen_emulation
    scale = hd ** -0.5
    rows: list[dict] = []
    base = dict(layout=layout, batch=B, context=ctx)
    with vattn.KVCache(num_layers=layers, num_kv_heads=hkv, head_dim=hd, max_batch_size=B, max_context_len=ctx,
                       dtype=dtype, device=args.device, page_size=args.page_size, layout=layout, prefetch=False,
                       cuda_driver=args.cuda_driver) as cache:
        try:
            slots = sorted(cache.alloc_reqid() for _ in range(B))
            assert slots == list(range(B)), slots
            t0 = time.perf_counter()
            assert cache.step({s: ctx for s in slots}), "step failed: not enough physical memory"
            map_s = time.perf_counter() - t0
            kc = torch.randn(B, ctx, hkv, hd, device=dev, dtype=dtype)  # [B, T, H, D]
            vc = torch.randn(B, ctx, hkv, hd, device=dev, dtype=dtype)
            copies = _copies(cache, kc, vc, layout, layers)
            kv = copies["virtual"][0]
            pagers = {bs: Paged(kc, vc, bs) for bs in args.blocks} if layout == "per-layer" else {}
            info = dict(page_KiB=cache.page_size // 1024, slot_tokens=cache.geometry.slot_tokens,
                        tokens_per_page=cache.page_size // cache.geometry.token_bytes,
                        mapped_GiB=cache.stats().mapped_bytes / GB, map_s=map_s,
                        k_stride_tokens=kv.stride(1) // (hkv * hd))
            for phase in phases:
                row = {**base, "phase": phase, **info}
                try:
                    n = 1 if phase == "decode" else ctx
                    q = torch.randn(B * n, hq, hd, device=dev, dtype=dtype)  # [sum(q_lens), HQ, D]
                    batch = Batch(q, [n] * B, [ctx] * B, dev)
                    outs = {name: kern(batch, k, v, scale) for name, (k, v) in copies.items()}
                    _check(row, outs, batch, kc, vc, scale, cuda, B * n <= args.check_tokens)
                    fns = {name: (lambda k=k, v=v: kern(batch, k, v, scale)) for name, (k, v) in copies.items()}
                    for bs, p in pagers.items():
                        row[f"paged{bs}_kernel"], fns[f"paged{bs}"] = pick_paged(batch, p, scale, outs["contiguous"],
                                                                                 kern, cuda, notes, args.kernel)
                        diff = float((fns[f"paged{bs}"]().float() - outs["contiguous"].float()).abs().max())
                        if not diff <= (2e-2 if cuda else 1e-5):
                            row["check_failed"] = f"paged{bs} differs from contiguous by {diff:.3g}"
                    del outs
                    us, row["timing"] = compare(fns, cuda, args.warmup, args.repeats, graphs=not args.no_graphs)
                    _timings(row, us, pagers, kv_bytes=2 * B * ctx * hkv * hd * kc.element_size())
                except Exception as e:  # record and go on with the next case
                    row["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                rows.append(row)
        finally:  # no kernel may still read the pages when the cache unmaps them
            if cuda:
                torch.cuda.synchronize()
    return rows


def _copies(cache: vattn.KVCache, kc: torch.Tensor, vc: torch.Tensor, layout: str,
            layers: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The same K and V ([B, T, H, D]) three ways: the cache's virtual views of layer 0 (written
    here), `kc`/`vc` themselves (contiguous), and for the fused layout plain memory of its strides."""
    B, ctx = kc.shape[:2]
    kv, vv = cache.k_cache(0)[:, :ctx], cache.v_cache(0)[:, :ctx]  # [B, T, H, D] virtual views
    kv.copy_(kc)
    vv.copy_(vc)
    copies = {"virtual": (kv, vv), "contiguous": (kc, vc)}
    if layout == "fused":  # plain memory, the fused layout's strides
        big_k = torch.empty(B, ctx, layers, *kc.shape[2:], device=kc.device, dtype=kc.dtype)
        big_v = torch.empty(B, ctx, layers, *vc.shape[2:], device=vc.device, dtype=vc.dtype)
        big_k[:, :, 0] = kc
        big_v[:, :, 0] = vc
        copies["strided"] = (big_k[:, :, 0], big_v[:, :, 0])
    return copies


def _check(row: dict, outs: dict[str, torch.Tensor], batch: Batch, kc: torch.Tensor, vc: torch.Tensor,
           scale: float, cuda: bool, against_sdpa: bool) -> None:
    """Record in `row` whether every copy's output equals the contiguous one's, and (when
    `against_sdpa`) the virtual one's distance to per-request SDPA in float32."""
    row["equal_to_contiguous"] = all(torch.equal(o, outs["contiguous"]) for o in outs.values())
    row["max_abs_diff_vs_contiguous"] = max(float((o.float() - outs["contiguous"].float()).abs().max())
                                            for o in outs.values())
    if against_sdpa:
        ref = reference(batch, kc, vc, scale)
        diff = float((outs["virtual"].float() - ref).abs().max())
        row["max_abs_diff_vs_sdpa"] = diff
        if not diff <= (3e-2 if cuda else 1e-4):  # bf16 kernel vs float32 SDPA; NaN fails
            row["check_failed"] = f"differs from per-request SDPA by {diff:.3g}"


def _timings(row: dict, us: dict[str, float], pagers: dict, kv_bytes: int) -> None:
    """Record in `row` each kernel's microseconds and the ratios between them."""
    for name, t in us.items():
        row[f"{name}_us"] = t
    row["virtual_vs_contiguous"] = us["virtual"] / us["contiguous"]
    for bs in pagers:
        row[f"paged{bs}_vs_virtual"] = us[f"paged{bs}"] / us["virtual"]
    if "strided" in us:
        row["strided_vs_contiguous"] = us["strided"] / us["contiguous"]
        row["virtual_vs_strided"] = us["virtual"] / us["strided"]
    row["virtual_GBps"] = kv_bytes / (us["virtual"] * 1e-6) / 1e9


# ------------------------------------------------------------------------- bench ----
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a tiny check of the harness)")
    p.add_argument("--quick", action="store_true", help="fewer cases and repeats (the GPU suite)")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--contexts", type=int, nargs="+", default=None)
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 128, 256], help="paged block sizes in tokens")
    p.add_argument("--layouts", nargs="+", default=["per-layer", "fused"], choices=["per-layer", "fused"])
    p.add_argument("--page-size", type=int, default=None, help="bytes; default the backend's (2 MiB on CUDA)")
    p.add_argument("--cuda-driver", default="auto", choices=["auto", "cext", "cuda-python"])
    p.add_argument("--fused-max-GiB", type=float, default=None,
                   help="skip fused cases whose 32-layer cache needs more (default 16 quick, 32 full)")
    p.add_argument("--max-GiB", type=float, default=None,
                   help="skip per-layer cases estimated to need more GPU memory (default: 85 %% of the GPU's)")
    p.add_argument("--prefill-max-tokens", type=int, default=65536, help="prefill only where batch x context <= this")
    p.add_argument("--check-tokens", type=int, default=4096, help="compare with SDPA where batch x queries <= this")
    p.add_argument("--budget-s", type=float, default=None, help="start no new case after this many seconds")
    p.add_argument("--no-graphs", action="store_true", help="time eager calls (CUDA events) instead of graph replays")
    p.add_argument("--kernel", default="torch_flash", choices=["torch_flash", "flash_attn_4"],
                   help="the library kernel of every variant (flash_attn_4: FlashAttention 4, its page_table "
                        "for the blocks; writes kernel_fa4_<device>)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        raise vattn.InvalidConfigError("vattn bench kernel needs a CUDA GPU; --device cpu checks the harness only")
    if args.kernel == "flash_attn_4" and cuda:
        from vattn.attention import flash_attn_4_available

        if not flash_attn_4_available():
            raise vattn.InvalidConfigError("--kernel flash_attn_4 needs FlashAttention 4 (pip install flash-attn-4; "
                                           "the GPU run carries it: benchmarks/gpu_wheels.sh --fa4)")
    if cuda:
        args.batches = args.batches or ([1, 8, 64] if args.quick else [1, 4, 16, 64])
        args.contexts = args.contexts or ([1024, 8192, 32768] if args.quick else [1024, 4096, 16384, 32768])
        args.warmup, args.repeats = (3, 5) if args.quick else (5, 11)
    else:  # host backend, tiny shapes: checks the row and block arithmetic, times nothing useful
        args.batches = args.batches or [1, 3]
        args.contexts = args.contexts or [64, 200]
        args.page_size = args.page_size or (16 << 10)
        args.warmup, args.repeats = 1, 2
    fused_max = (args.fused_max_GiB if args.fused_max_GiB is not None else (16 if args.quick else 32)) * GB
    tok_bytes_fused = 2 * FUSED_LAYERS * HKV * D * 2 if cuda else 2 * FUSED_LAYERS * 2 * 16 * 4
    max_bytes = (args.max_GiB * GB if args.max_GiB is not None
                 else 0.85 * torch.cuda.get_device_properties(torch.device(args.device)).total_memory if cuda
                 else float("inf"))
    start = time.perf_counter()
    rows: list[dict] = []
    skipped: list[str] = []
    notes: list[str] = []
    cases = [(layout, B, ctx) for layout in args.layouts for B in args.batches for ctx in args.contexts]
    for layout, B, ctx in progress(cases, desc="kernel", unit="case"):
        name = f"{layout} B={B} T={ctx}"
        if layout == "fused" and B * ctx * tok_bytes_fused > fused_max:
            skipped.append(f"{name}: the 32-layer fused cache needs {B * ctx * tok_bytes_fused / GB:.0f} GiB")
            continue
        if layout == "per-layer" and (need := per_layer_bytes(B, ctx, len(args.blocks), cuda)) > max_bytes:
            skipped.append(f"{name}: needs about {need / GB:.0f} GiB of GPU memory, over --max-GiB "
                           f"{max_bytes / GB:.0f}")
            continue
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            skipped.append(f"{name}: time budget of {args.budget_s:.0f} s spent")
            continue
        phases = ["decode"] + (["prefill"] if B * ctx <= args.prefill_max_tokens else [])
        try:
            rows += run_case(layout, B, ctx, phases, args, notes)
        except Exception as e:
            traceback.print_exc()
            rows.append(dict(layout=layout, batch=B, context=ctx, phase="setup", error=f"{type(e).__name__}: {e}"))
        if cuda:
            torch.cuda.empty_cache()
    ok = [r for r in rows if "error" not in r]
    kernel = ({"torch_flash": "aten._flash_attention_forward varlen + seqused_k",
               "flash_attn_4": "flash_attn.cute.flash_attn_varlen_func + seqused_k (FlashAttention 4)"}[args.kernel]
              if cuda else "SDPA over the flat rows (CPU check of the varlen metadata)")
    extra = {"file_name": "kernel_fa4"} if args.kernel == "flash_attn_4" else {}
    return dict(**extra, kernel=kernel, rows=rows, skipped=skipped, notes=sorted(set(notes)), summary=_summary(ok, args.blocks),
                failures=[f"{r['layout']} {r['phase']} B={r['batch']} T={r['context']}: {r.get('error') or r['check_failed']}"
                        for r in rows if "error" in r or "check_failed" in r])


def per_layer_bytes(B: int, ctx: int, num_blocks: int, cuda: bool) -> int:
    """Peak device memory of a per-layer case, about: K + V as the contiguous copy, the vattn
    cache and one block pool per block size; each block size's graph keeps a gathered copy
    (the gather stand-in), and the eager warm-up calls leave two more in the allocator."""
    kv = 2 * B * ctx * (HKV * D * 2 if cuda else 2 * 16 * 4)
    return kv * (4 + 2 * num_blocks)


def _blocks(rows: list[dict]) -> list[int]:
    return sorted({int(k[5:-3]) for r in rows for k in r if k.startswith("paged") and k.endswith("_us")})


def block_label(rows: list[dict], bs: int) -> str:
    """What the block-size-`bs` figures measured: `paged<bs>` when a block-table kernel ran,
    `gather<bs>` when the block table was gathered into a contiguous copy for the contiguous
    kernel (no paged kernel here), `paged|gather<bs>` when cases differ."""
    kernels = {r[f"paged{bs}_kernel"] for r in rows if r.get(f"paged{bs}_kernel")}
    gathered = {k for k in kernels if k.startswith("gather")}
    if kernels and gathered == kernels:
        return f"gather{bs}"
    return f"paged{bs}" if not gathered else f"paged|gather{bs}"


def table(result: dict[str, Any]) -> tuple[list[str], list[list]]:
    """One row per (layout, phase, batch, context): microseconds and ratios."""
    ok = [r for r in result["rows"] if "error" not in r]
    blocks = _blocks(ok)
    label = {bs: block_label(ok, bs) for bs in blocks}
    print(f"\nkernel: {result['kernel']}")
    for bs in blocks:
        print(f"{label[bs]}: " + ", ".join(sorted({r[f'paged{bs}_kernel'] for r in ok if f'paged{bs}_kernel' in r})))
    for n in result["notes"]:
        print(f"note: {n}")
    for k, v in result["summary"].items():
        print(f"{k}: {v}")
    for f in result["failures"]:
        print(f"FAILED {f}")
    for s in result["skipped"]:
        print(f"skipped {s}")
    headers = ["layout", "phase", "B", "T", "virtual us", "contiguous us", "virt/contig"] + \
        [f"{label[bs]} us" for bs in blocks] + [f"{label[bs]}/virt" for bs in blocks] + ["strided/contig", "equal"]
    rows = [[r["layout"], r["phase"], r["batch"], r["context"], r["virtual_us"], r["contiguous_us"],
             r["virtual_vs_contiguous"]] + [r.get(f"paged{bs}_us", "-") for bs in blocks]
            + [r.get(f"paged{bs}_vs_virtual", "-") for bs in blocks]
            + [r.get("strided_vs_contiguous", "-"), r["equal_to_contiguous"]] for r in ok]
    return headers, rows


def _summary(rows: list[dict], blocks: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in ("per-layer", "fused"):
        for phase in ("decode", "prefill"):
            rs = [r for r in rows if r["layout"] == layout and r["phase"] == phase]
            if rs:
                ratios = [r["virtual_vs_contiguous"] for r in rs]
                out[f"{layout} {phase} virtual/contiguous"] = dict(
                    max=max(ratios), median=statistics.median(ratios), within_2pct=sum(x <= 1.02 for x in ratios),
                    cases=len(ratios))
    for bs in blocks:
        for phase in ("decode", "prefill"):
            ratios = [r[f"paged{bs}_vs_virtual"] for r in rows if r["phase"] == phase and f"paged{bs}_vs_virtual" in r]
            if ratios:
                out[f"{phase} {block_label(rows, bs)}/virtual"] = dict(median=statistics.median(ratios), min=min(ratios),
                                                          max=max(ratios), cases=len(ratios))
    fused = [r for r in rows if r["layout"] == "fused" and r["phase"] == "decode"]
    if fused:
        worst = max(fused, key=lambda r: r["virtual_vs_contiguous"])
        out["fused decode worst case"] = (
            f"B={worst['batch']} T={worst['context']}: virtual/contiguous {worst['virtual_vs_contiguous']:.3f}, "
            f"strided/contiguous {worst.get('strided_vs_contiguous', float('nan')):.3f}, virtual/strided "
            f"{worst.get('virtual_vs_strided', float('nan')):.3f} (strided/contiguous > 1: the layout itself, "
            "e.g. TLB reach with 32 tokens of a layer per 2 MiB page; virtual/strided > 1: the VMM mapping)")
    out["all outputs equal to contiguous"] = all(r["equal_to_contiguous"] for r in rows) if rows else None
    return out


def plot(result: dict[str, Any]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "error" not in r]
    blocks = _blocks(rows)
    label = {bs: block_label(rows, bs) for bs in blocks}
    gather = any(lab.startswith("gather") for lab in label.values())
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, phase in zip(axes, ("decode", "prefill")):
        for B in sorted({r["batch"] for r in rows}):
            rs = sorted((r for r in rows if r["layout"] == "per-layer" and r["phase"] == phase and r["batch"] == B),
                        key=lambda r: r["context"])
            if not rs:
                continue
            line = ax.plot([r["context"] for r in rs], [r["virtual_vs_contiguous"] for r in rs], "o-",
                           label=f"vattn B={B}")
            for bs, ls in zip(blocks, ("--", ":", "-.")):
                ax.plot([r["context"] for r in rs], [r[f"paged{bs}_vs_virtual"] for r in rs], ls, marker="s",
                        color=line[0].get_color(), alpha=0.7, label=f"{label[bs]} B={B}")
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set(xscale="log", xlabel="context (tokens)",
               ylabel="latency / vattn (blocks) or / contiguous (vattn)",
               title=f"{phase}: " + ("blocks gathered, then the contiguous kernel (no paged kernel here)"
                                     if gather else "paged kernel") + " vs vattn")
        ax.legend(fontsize=6, ncol=2)
    return fig
