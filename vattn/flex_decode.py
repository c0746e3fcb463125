"""Decode attention on the host with PyTorch's FlexAttention: every decoding sequence of an
iteration in one compiled call per layer, reading the slots' rows of the vattn cache in place.

`attention="flex"` (CPU). Prompts and chunks run `sdpa_attention`'s groups as with "sdpa"; the
decode rows (one new token each) run `torch.nn.attention.flex_attention.flex_attention`, compiled
by inductor into a C++ kernel for this CPU, over the whole cache of the layer:

```
queries  [S, H_kv, G, D]   a row per slot (zero where the slot does not decode), G = H_q / H_kv
keys     k_cache.transpose(1, 2)  [S, H_kv, T_max, D]   the cache itself: a view, no copy
blocks   slot s reads KV blocks 0 .. ceil(ctx_s / block) - 1 only: the full ones unmasked, the
         last one masked at ctx_s (`kv_idx < lens[s]`); a slot that does not decode reads none
```

Why: PyTorch's CPU flash attention, called once per sequence and layer, multiplies a 2-row
query block by each K/V block with MKL's sgemm, which streams K/V at a third of what the host's
memory gives one core. `benchmarks/cpu_decode_attention.py` (this repo's AMD EPYC host, one
thread, a decode step of 8 layers, 8 heads / 4 KV heads of 64, caches cold): 8 x 1K-token
contexts 17.7 ms with SDPA, 11.9 with flex, 4.5 to merely read the K/V; 16 x 300 12.1 / 9.0 /
3.6; 8 of 16 slots at 100-520 6.0 / 5.9 / 1.8 (short contexts: little to gain). vLLM's CPU
build runs a paged decode kernel of its own for this.

Memory safety: a block is read whole, so the cache must map whole blocks: a slot starts on a
page and maps whole pages, so a block of `block_tokens(...)` tokens (a divisor of a page's
tokens) after a slot's context is mapped whenever its first token is. Blocks past a slot's last
one are never read. The values of the last block's rows past the context are zeroed before the
call (a masked key's value is multiplied by 0, and a stale NaN would survive that).

Compiling: one static graph per cache shape (`torch.compile(..., dynamic=False)`: inductor's CPU
template for dynamic shapes failed to build here), 2-4 s the first time on this host (inductor
caches its C++ on disk). Past dynamo's recompile limit, or if anything fails, the kernel falls
back to "sdpa" with a warning (`AttentionKernel`), as the CUDA kernels do.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from vattn.compiling import raise_past_recompile_limit
from vattn.errors import VattnError

MAX_BLOCK = 64  # KV tokens a block at most (flex's CPU kernel; a page of the throughput model holds 64)
MIN_BLOCK = 16


def block_tokens(k_cache: torch.Tensor, page_bytes: int) -> int | None:
    """KV tokens a flex block may hold on this cache (None: no size keeps a block's reads on
    mapped pages): the largest power of two <= MAX_BLOCK dividing a page's tokens, where a
    slot's row starts on a page (its stride a whole number of pages)."""
    token_bytes = k_cache.stride(1) * k_cache.element_size()  # a token's row in its buffer
    if page_bytes % token_bytes or (k_cache.stride(0) * k_cache.element_size()) % page_bytes:
        return None
    page_tokens, block = page_bytes // token_bytes, MAX_BLOCK
    while block >= MIN_BLOCK and page_tokens % block:
        block //= 2
    return block if block >= MIN_BLOCK else None


class FlexDecode:
    """The flex decode path of one engine: the compiled `flex_attention` and the buffer of
    context lengths its mask reads (one tensor for the engine's life, written in place each
    iteration, so the compiled graph is reused)."""

    def __init__(self, sdpa: Callable[..., torch.Tensor]) -> None:
        self.sdpa = sdpa  # `vattn.attention.sdpa_attention`: the prompts, and what flex does not cover
        self.page_bytes: int | None = None  # the cache's page (set by the runner once the cache exists)
        self._lens: torch.Tensor | None = None  # [S] int32: context length of each slot this iteration
        self._fn: Any = None

    def _mask(self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx < self._lens[b]

    def _plan(self, meta: Any, k_cache: torch.Tensor, block: int) -> dict[str, Any]:
        """The iteration's decode rows and block mask (built once, shared by every layer)."""
        S, T = k_cache.shape[0], k_cache.shape[1]
        key = ("flex", S, T, block)
        plan = meta._plans.get(key)
        if plan is not None:
            return plan
        rows = [r for r, n in zip(meta.cu_query_lens, meta.query_lens) if n == 1]
        slots = [s for s, n in zip(meta.slots, meta.query_lens) if n == 1]
        ctx = [c for c, n in zip(meta.context_lens, meta.query_lens) if n == 1]
        if self._lens is None or self._lens.shape[0] != S:
            self._lens = torch.zeros(S, dtype=torch.int32)
        lens = torch.zeros(S, dtype=torch.int32)
        lens[slots] = torch.tensor(ctx, dtype=torch.int32)
        self._lens.copy_(lens)  # in place: the compiled mask reads this tensor
        nb = -(-T // block)  # (T, max_context_len, need not be whole blocks: flex stops at T)
        whole = lens // block  # [S]: blocks every key of which is seen; the partial one's index
        full = whole.view(S, 1, 1)
        partial = (lens % block != 0).to(torch.int32).view(S, 1, 1)  # the last, masked at the length
        partial_idx = torch.zeros(S, 1, 1, nb, dtype=torch.int32)
        partial_idx[:, 0, 0, 0] = whole
        full_idx = torch.arange(nb, dtype=torch.int32).expand(S, 1, 1, nb).contiguous()
        # the rows after each context up to its block's end: read (masked) by the kernel; zeroed below
        tail = [(s, p) for s, c in zip(slots, ctx) for p in range(c, min(T, -(-c // block) * block))]
        plan = meta._plans[key] = {  # masks: by the folded query heads G (the query block)
            "rows": torch.tensor(rows), "slots": torch.tensor(slots), "parts": (partial, partial_idx, full, full_idx),
            "masks": {}, "tail": tuple(torch.tensor(x, dtype=torch.long) for x in zip(*tail)) if tail else None}
        return plan

    def __call__(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: Any, scale: float,
                 sliding_window: int | None) -> torch.Tensor:
        """query `[T, H_q, D]` (the cache written already); returns `[T, H_q, D]`."""
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        if query.device.type != "cpu":
            raise VattnError("attention='flex' runs on the host only; on CUDA use 'torch_flash' or 'flash_attn'")
        if self.page_bytes is None:
            raise VattnError("attention='flex' needs the cache's page size (FlexDecode.page_bytes)")
        block = block_tokens(k_cache, self.page_bytes)
        if block is None:
            raise VattnError(f"attention='flex': no KV block of {MIN_BLOCK}-{MAX_BLOCK} tokens tiles this cache's "
                             f"{self.page_bytes}-byte pages (a token's row is {k_cache.stride(1) * k_cache.element_size()}"
                             " bytes); use attention='sdpa'")
        if sliding_window is not None or 1 not in meta.query_lens:
            return self.sdpa(query, k_cache, v_cache, meta, scale, sliding_window)
        out = self.sdpa(query, k_cache, v_cache, meta, scale, None, decode=False)  # prompts and chunks
        plan = self._plan(meta, k_cache, block)
        S, T, Hkv, D = k_cache.shape
        Hq = query.shape[1]
        G = Hq // Hkv
        mask = plan["masks"].get(G)
        if mask is None:
            mask = plan["masks"][G] = BlockMask.from_kv_blocks(
                *plan["parts"], BLOCK_SIZE=(G, block), mask_mod=self._mask, seq_lengths=(G, T), compute_q_blocks=False)
        if self._fn is None:
            self._fn = torch.compile(flex_attention, dynamic=False)
        if plan["tail"] is not None:
            # A masked key still multiplies its value by a probability of 0, and 0 x NaN is NaN: rows
            # past a context hold whatever the page held (another request's values, a rejected draft's),
            # so their values are zeroed first. They are this slot's own rows (its page takes its next
            # token), written again before a query sees them.
            v_cache[plan["tail"]] = 0
        rows, slots = plan["rows"], plan["slots"]
        q = query.new_zeros(S, Hkv, G, D)
        q[slots] = query[rows].view(-1, Hkv, G, D)  # query head h reads KV head h // G
        with raise_past_recompile_limit():  # never an uncompiled flex (it would materialise every score)
            o = self._fn(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), block_mask=mask, scale=scale)
        out[rows] = o[slots].reshape(-1, Hq, D)  # [S, H_kv, G, D] -> the decode rows
        return out


__all__ = ["FlexDecode", "block_tokens", "MAX_BLOCK"]
