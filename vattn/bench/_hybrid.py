"""`vattn bench fragmentation --hybrid`: memory per request and requests that fit for models
that mix layer kinds (Gemma-2, Gemma-3's 5 local to 1 global, a Mamba hybrid) or keep other
than K and V per head (DeepSeek-V3's latent, Llama 4's chunked local attention, GPT-OSS's
alternating windows with sinks), at their real shapes and long contexts.

Managers (bytes one request holds at each iteration, per GPU, K and V, bf16):
- `uniform-16`: one block size for every layer and no window (vLLM's behaviour before its
  hybrid allocator): every attention layer holds every token, in blocks of 16; a Mamba
  layer holds its state; a latent layer (DeepSeek) its expanded K and V, every head (what a
  cache that knows only K/V per head keeps: transformers' paged cache refuses the latent).
- `pools`: per-kind pools (vLLM's hybrid KV cache manager), blocks of 16 tokens: full layers
  hold every token in blocks; a sliding layer holds the blocks from the one with the first key its next
  query sees (`SlidingWindowManager.remove_skipped_blocks`), a chunked layer those from its
  query's chunk start (`ChunkedLocalAttentionManager`); a latent layer its latent
  (`MLAAttentionSpec`); every kind's page has one byte
  size, so with Mamba layers the attention block grows until a page holds a Mamba layer's
  state (rounded up to 16 tokens) and a state takes one such page.
- `vattn-L-<page>`: vattn per-layer with this change: full layers hold ceil(l x token / page)
  pages (a latent layer: its one buffer of latent rows), a sliding layer the pages from the one
  with its window's first key, a chunked layer those from its query's chunk start (its own
  kind, `vattn.allocator.kinds.ChunkedLocal`); the Mamba
  states of a request are one contiguous row of its slot, mapped in pages (modelled: a fixed
  size per request from the config).
- `vattn-L-<page>-keep`: the same without giving window pages back (vattn before it; what
  the fused layout still does).

A request with prompt p and d output tokens runs its prefill (the window layers hold all p
tokens: the chunk's queries read them) and d - 1 decodes at lengths p + 1 ... p + d - 1,
whose queries start at length - 1. COMPUTED over every (request, iteration) of a workload;
MEASURED: the real allocator (host backend, `vattn.KVCache` with `layer_windows`) serves
requests of the long workload at one shape with the page's tokens kept and a token shrunk
(one layer of each kind, scaled back by the layer counts and token bytes), and its
`stats().kinds` is compared with the closed form on the same steps.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

KB, MB, GB = 1 << 10, 1 << 20, 1 << 30
PAGES = (64 * KB, 256 * KB, 2 * MB)
HOST_PAGE = 4096


@dataclass(frozen=True)
class HybridShape:
    """One model's layer kinds (bf16; tensor parallelism 1)."""

    name: str
    full_layers: int
    window_layers: int
    window: int  # tokens
    kv_heads: int
    head_dim: int
    max_context: int
    mamba_layers: int = 0
    mamba_state: int = 0  # bytes of one Mamba layer's state for one request (conv + SSM)
    elem: int = 2
    chunked: bool = False  # the window layers are chunked local attention (chunks of `window` tokens)
    latent: bool = False  # a layer keeps one latent row a token (kv_heads 1 x head_dim values), not K and V
    expanded: int = 0  # latent: values a token a layer as K and V of every head (what `uniform` keeps)
    sinks: bool = False  # learned sink logits per head (parameters: nothing kept per token)

    def __post_init__(self) -> None:
        if self.latent and (self.window_layers or not self.expanded):
            raise ValueError(f"{self.name}: a latent shape is modelled with full layers only and needs `expanded` "
                             "(the values a token a layer as K and V of every head)")

    @property
    def token_bytes(self) -> int:
        """One token of one attention layer's K (or V); of a latent layer, its latent row."""
        return self.kv_heads * self.head_dim * self.elem

    @property
    def attn_layers(self) -> int:
        return self.full_layers + self.window_layers


def _mamba_state(d_inner: int, d_state: int, d_conv: int, elem: int = 2) -> int:
    return (d_inner * d_state + d_inner * (d_conv - 1)) * elem


# From the models' config.json: layers, layer_types / sliding_window_pattern, sliding_window,
# num_key_value_heads, head_dim, max_position_embeddings (Jamba: attn_layer_period 8,
# offset 4; mamba_expand 2 x hidden 4096, d_state 16, d_conv 4).
HYBRIDS: dict[str, HybridShape] = {s.name: s for s in (
    HybridShape("gemma-2-9b", 21, 21, 4096, 8, 256, 8192),
    HybridShape("gemma-2-27b", 23, 23, 4096, 16, 128, 8192),
    HybridShape("gemma-3-12b", 8, 40, 1024, 8, 256, 131072),
    HybridShape("gemma-3-27b", 10, 52, 1024, 16, 128, 131072),
    HybridShape("jamba-1.5-mini", 4, 0, 0, 8, 128, 262144, mamba_layers=28,
                mamba_state=_mamba_state(8192, 16, 4)),
    # kv_lora_rank 512 + qk_rope_head_dim 64 a token; expanded: 128 heads x (K 128 + 64, V 128)
    HybridShape("deepseek-v3", 61, 0, 0, 1, 576, 163840, latent=True, expanded=128 * (192 + 128)),
    # attention_chunk_size 8192, no_rope_layer_interval 4: every 4th layer a NoPE full one
    HybridShape("llama-4-scout", 12, 36, 8192, 8, 128, 10485760, chunked=True),
    # layer_types alternate sliding_attention (128) and full_attention, from layer 0; sinks
    HybridShape("gpt-oss-120b", 18, 18, 128, 8, 64, 131072, sinks=True),
)}
# the shapes `replay` serves (K and V per head: the replayed cache's two buffers a layer)
REPLAYABLE = [name for name, s in HYBRIDS.items() if not s.latent]


@dataclass(frozen=True)
class Manager:
    name: str
    kind: str  # uniform | pools | vattn
    page: int = 0  # vattn: page bytes
    keep: bool = False  # vattn: window pages kept


MANAGERS = ([Manager("uniform-16", "uniform"), Manager("pools", "pools")]
            + [Manager(f"vattn-L-{p // MB}M" if p >= MB else f"vattn-L-{p // KB}K", "vattn", p) for p in PAGES]
            + [Manager("vattn-L-2M-keep", "vattn", 2 * MB, keep=True)])


def _ceil(a: np.ndarray, b: int) -> np.ndarray:
    return -(-a // b)


def block_tokens(m: Manager, s: HybridShape) -> int:
    """Tokens of an attention block: 16, but per-kind pools share one page size, so with
    Mamba layers a block grows until one layer's page holds a Mamba state (to 16s)."""
    if m.kind == "pools" and s.mamba_layers:
        return max(16, -(-s.mamba_state // (2 * s.token_bytes * 16)) * 16)
    return 16


def held(m: Manager, s: HybridShape, length: np.ndarray, start: np.ndarray) -> dict[str, np.ndarray]:
    """Bytes one request holds per kind at an iteration taking it to `length` tokens whose
    queries start at `start` (arrays of int64)."""
    tb = s.token_bytes
    if not s.window:
        first_key = np.zeros_like(start)
    elif s.chunked:  # the query's chunk start (the pools' ChunkedLocalAttentionManager and vattn's chunked kind)
        first_key = start // s.window * s.window
    else:  # a window's first key
        first_key = np.maximum(0, start - s.window + 1)
    if m.kind in ("uniform", "pools"):
        block = block_tokens(m, s)
        row = (s.expanded * s.elem if m.kind == "uniform" else tb) if s.latent else 2 * tb  # K and V, a token
        full = _ceil(length, block) * block * row
        if m.kind == "uniform" or not s.window:
            win = full
        else:
            win = (_ceil(length, block) - first_key // block) * block * row
        state = s.mamba_state if m.kind == "uniform" else max(s.mamba_state, block * 2 * tb)
    else:
        p = m.page
        full = _ceil(length * tb, p) * p * (1 if s.latent else 2)  # a latent layer: one buffer
        win = full if m.keep or not s.window else (_ceil(length * tb, p) - first_key * tb // p) * p * 2
        state = -(-s.mamba_state * s.mamba_layers // p) * p // max(1, s.mamba_layers) if s.mamba_layers else 0
    return {"full": full * s.full_layers, "window": win * s.window_layers,
            "state": np.full(length.shape, state * s.mamba_layers, dtype=np.int64)}


# ---------------------------------------------------------------------- workloads ----
def long_requests(n: int, context: int, seed: int = 0) -> list[tuple[int, int]]:
    """Long-context requests: prompts log-uniform from context / 32 to 7/8 of the context,
    outputs log-normal (median ~250 tokens), clipped to the context."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = int(math.exp(rng.uniform(math.log(context / 32), math.log(context * 7 / 8))))
        d = min(max(1, int(rng.lognormvariate(5.5, 0.8))), context - p)
        out.append((p, d))
    return out


def iterations(requests: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(length, start, count) of every distinct iteration of the requests: one prefill
    (start 0) and d - 1 decodes each."""
    lengths: dict[tuple[int, int], int] = {}
    for p, _ in requests:
        lengths[(p, 0)] = lengths.get((p, 0), 0) + 1
    top = max(p + d for p, d in requests) + 2
    diff = np.zeros(top, dtype=np.int64)  # decodes at length l (start l - 1), l = p + 1 .. p + d - 1
    for p, d in requests:
        if d > 1:
            diff[p + 1] += 1
            diff[p + d] -= 1
    dec = np.cumsum(diff)
    ls = np.nonzero(dec)[0]
    length = np.concatenate([ls, np.array([k[0] for k, _ in lengths.items()], dtype=np.int64)])
    start = np.concatenate([ls - 1, np.zeros(len(lengths), dtype=np.int64)])
    count = np.concatenate([dec[ls], np.array([c for _, c in lengths.items()], dtype=np.int64)])
    return length.astype(np.int64), start.astype(np.int64), count


def workloads(args: Any) -> dict[str, list[tuple[int, int]]]:
    from vattn.bench._common import TRACE
    from vattn.workload import trace_requests

    out = {"arxiv-4K": [(r.prompt, r.output) for r in trace_requests(str(TRACE), args.requests or 1 << 62, 4096)]}
    for c in args.hybrid_contexts:
        out[f"long-{c // 1024}K"] = long_requests(args.hybrid_requests, c, args.seed)
    return out


def computed_rows(args: Any) -> list[dict[str, Any]]:
    budget = int(args.budget_gib * GB)
    rows = []
    for wname, reqs in workloads(args).items():
        need = max(p + d for p, d in reqs)
        length, start, count = iterations(reqs)
        total = int(count.sum())
        for model in args.hybrid_models:
            s = HYBRIDS[model]
            if need > s.max_context:
                continue
            rs = []
            for m in MANAGERS:
                h = held(m, s, length, start)
                mean = {k: float((v * count).sum()) / total for k, v in h.items()}
                per = sum(mean.values())
                worst = float(sum(h.values()).max())
                rs.append(dict(model=model, workload=wname, manager=m.name, mean_request_MiB=per / MB,
                               full_MiB=mean["full"] / MB, window_MiB=mean["window"] / MB, state_MiB=mean["state"] / MB,
                               worst_request_MiB=worst / MB, fit=budget / per,
                               tokens_per_page=(m.page / s.token_bytes if m.kind == "vattn"
                                                else float(block_tokens(m, s)))))
            base = rs[0]
            for r in rs:
                r["fit_vs_uniform"] = r["fit"] / base["fit"] if base["fit"] else float("inf")
                r["mem_vs_uniform"] = r["mean_request_MiB"] / base["mean_request_MiB"]
            rows += rs
    return rows


# ------------------------------------------------------------------------ replay ----
def replay(args: Any) -> list[dict[str, Any]]:
    """The real allocator on the long workload at `--hybrid-replay-model`'s shape: one full and
    one sliding layer, the page's tokens kept, a token shrunk; figures scaled back."""
    import vattn
    from vattn.allocator import Chunk

    s = HYBRIDS[args.hybrid_replay_model]
    context = max(c for c in args.hybrid_contexts if c <= s.max_context)
    reqs = long_requests(args.hybrid_replay_requests, context, args.seed + 1)
    out = []
    for m in MANAGERS:
        if m.kind != "vattn" or m.keep:
            continue
        tpp = m.page // s.token_bytes  # tokens per page, kept
        head_dim = HOST_PAGE // tpp // 2  # fp16, one KV head: a host page holds tpp tokens
        if head_dim < 1 or HOST_PAGE % tpp:
            continue
        scale = s.token_bytes / (head_dim * 2)  # real bytes per replayed byte
        kinds = (None, Chunk(s.window) if s.chunked else s.window) if s.window else (None,)
        t0 = time.perf_counter()
        measured = {"full": 0.0, "window": 0.0}
        model = {"full": 0.0, "window": 0.0}
        steps = 0
        with vattn.KVCache(num_layers=len(kinds), num_kv_heads=1, head_dim=head_dim, dtype="float16",
                           max_batch_size=len(reqs), max_context_len=context, page_size=HOST_PAGE,
                           layer_windows=kinds, prefetch=False, background=False, device="cpu") as cache:
            # slot -> [queries' start, length of its next step, its last length]
            slots = {cache.alloc_reqid(): [0, p, p + d - 1] for p, d in reqs}
            while slots:
                lens = {sl: r[1] for sl, r in slots.items()}
                assert cache.step(lens)
                st = cache.stats()
                kinds_st = st.kinds or {"full": st}
                measured["full"] += kinds_st["full"].active_bytes
                if s.window:
                    measured["window"] += kinds_st[f"{'chunk' if s.chunked else 'window'}={s.window}"].active_bytes
                length = np.array([r[1] for r in slots.values()], dtype=np.int64)
                start = np.array([r[0] for r in slots.values()], dtype=np.int64)
                one = HybridShape(s.name, 1, 1 if s.window else 0, s.window, 1, head_dim, context, chunked=s.chunked)
                h = held(Manager(m.name, "vattn", HOST_PAGE), one, length, start)
                model["full"] += float(h["full"].sum())
                model["window"] += float(h["window"].sum())
                steps += len(slots)
                for sl, r in list(slots.items()):
                    if r[1] >= r[2]:
                        cache.free_reqid(sl)
                        del slots[sl]
                    else:
                        r[0], r[1] = r[1], r[1] + 1
        real = {k: v * scale / steps * (s.full_layers if k == "full" else s.window_layers) for k, v in measured.items()}
        comp = {k: v * scale / steps * (s.full_layers if k == "full" else s.window_layers) for k, v in model.items()}
        out.append(dict(model=s.name, workload=f"long-{context // 1024}K (replay)", manager=m.name,
                        requests=len(reqs), iterations=steps, measured_full_MiB=real["full"] / MB,
                        measured_window_MiB=real["window"] / MB, model_full_MiB=comp["full"] / MB,
                        model_window_MiB=comp["window"] / MB, seconds=time.perf_counter() - t0))
    return out
