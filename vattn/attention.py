"""Which unmodified attention kernel reads the vattn cache, and the metadata it needs.

A request's K/V live contiguously in its slot row of the virtual cache tensors, so a
library kernel reads them as a plain `[B, T, H, D]` tensor. Only the first
`context_len` tokens of a slot are backed by pages: no kernel may touch the rest.

```
packed queries of one iteration (slot-ascending), T tokens in all:
   [ seq a: n_a new tokens ][ seq b: n_b ][ seq c: 1 (decode) ]
   positions start_a .. start_a+n_a-1, ...
k_cache[slot_a, :start_a + n_a]   <- the keys query i of seq a may see: 0 .. start_a + i
```

Kernels, chosen once per engine by `select_kernel`:
- `flash_attn`: `flash_attn_with_kvcache(cache_seqlens, cache_batch_idx)` (CUDA, fp16/bf16,
  the `flash_attn` package installed): decodes in one call, each prefill chunk in one call.
- `flash_attn_4`: FlashAttention 4 (`flash_attn.cute.flash_attn_varlen_func`, the
  `flash-attn-4` package: CuTe-DSL kernels for Hopper and Blackwell, fp16/bf16), asked for by
  name only: the whole batch in one varlen call over the slot rows, as `torch_flash`
  (`cu_seqlens_k` at each slot's row, `seqused_k` the context lengths).
- `torch_flash`: PyTorch's own FlashAttention-2, `aten._flash_attention_forward` varlen with
  `cum_seq_k` pointing at each slot's row of the flat `[B * slot_tokens, H, D]` view and
  `seqused_k` = context lengths (CUDA, fp16/bf16): the whole batch in one call.
- `sdpa`: `torch.nn.functional.scaled_dot_product_attention` on the cache rows (CPU, and
  the fallback everywhere): one call per *group*, sequences in consecutive slots with the
  same start and query length, whose rows are one strided view `k_cache[s:s + c, lo:ctx]`
  (no copy); a decode folds its GQA query heads onto their KV head (K/V read once, not
  once per query head). See `sdpa_attention` for why keys are not gathered into one call.
- `flex` (CPU, asked for by name): `sdpa`'s groups for prompts and chunks, and every decode of
  the iteration in one compiled FlexAttention call per layer over the slot rows
  (`vattn.flex_decode`).
- `sdpa_padded`: every sequence in one call on keys gathered into a padded buffer with a
  mask (measured slower on CPU: see `sdpa_padded_attention`).

The CUDA kernels and `flex` are checked against `sdpa` on their first call and dropped (with a
warning) if they fail or disagree, so a kernel that cannot read this layout never
silently changes the results.
"""
from __future__ import annotations

import contextlib
import importlib.util
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F

from vattn.errors import InvalidConfigError, VattnError
from vattn.flex_decode import FlexDecode

KERNELS = ("flash_attn", "torch_flash", "sdpa", "sdpa_padded", "flash_attn_4", "flex")
# FlashAttention 4's Hopper forward loads K and V in tiles of this many rows with TMA (head_dim
# <= 128; fewer rows for larger heads): a tile whose first row is a slot's last keys is loaded
# whole, so the rows after the context up to the tile's end must be mapped (and finite: a masked
# score times a NaN value is NaN). A slot starts on a page and maps whole pages; so a page must
# hold whole tiles: tokens a page (the smallest CUDA page, 2 MiB) a multiple of this.
FLASH_ATTN_4_TILE_TOKENS = 128
MIN_CUDA_PAGE = 2 << 20


def to_device(data: Sequence[Any], device: torch.device | str, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host ints (a list, or a list of equal lists) as a tensor on `device`, without waiting for
    the device: on CUDA through pinned memory, copied asynchronously (a copy from pageable
    memory first waits for the work queued on the stream, so the host could not prepare the
    next iteration while one runs; the caching host allocator keeps the pinned block until the
    copy is done)."""
    if torch.device(device).type == "cuda":
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, device=device)


@dataclass
class AttentionMetadata:
    """Where the packed tokens of one iteration go in the cache and which keys each sees.

    Sequences are packed in ascending slot order (the varlen kernel wants monotonic
    `cum_seq_k`). Host lists drive the per-request loops; the tensors live on the device.
    """

    slots: list[int]  # per sequence, ascending
    starts: list[int]  # tokens of the sequence already in the cache (num_computed_tokens)
    query_lens: list[int]  # new tokens this iteration
    slot_ids: torch.Tensor  # [T] long: slot of each packed token
    positions: torch.Tensor  # [T] long: absolute position of each packed token
    slot_tokens: int  # slot stride of the cache in tokens (>= max_context_len)
    device: torch.device
    max_context: int | None = None  # the kernel's max_seqlen_k if not max(context_lens) (a CUDA graph's bound)
    _cuda: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _plans: dict[tuple, Any] = field(default_factory=dict, repr=False)  # per-iteration plans, shared by layers

    @classmethod
    def build(cls, slots: Sequence[int], starts: Sequence[int], query_lens: Sequence[int],
              slot_tokens: int, device: torch.device) -> AttentionMetadata:
        slot_ids: list[int] = []
        positions: list[int] = []
        for slot, start, n in zip(slots, starts, query_lens):
            slot_ids += [slot] * n
            positions += range(start, start + n)
        return cls(list(slots), list(starts), list(query_lens), to_device(slot_ids, device),
                   to_device(positions, device), slot_tokens, device)  # (positions: a tensor of its own, compiled)

    @property
    def context_lens(self) -> list[int]:
        return [s + n for s, n in zip(self.starts, self.query_lens)]

    @property
    def max_context_len(self) -> int:
        """The longest context a kernel launch must cover (`max_context` when set)."""
        return self.max_context if self.max_context is not None else max(self.context_lens)

    @property
    def cu_query_lens(self) -> list[int]:
        cu = [0]
        for n in self.query_lens:
            cu.append(cu[-1] + n)
        return cu

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def cuda_tensors(self) -> dict[str, torch.Tensor]:
        """int32 tensors for the CUDA kernels, built once per iteration on first use."""
        if not self._cuda:
            ctx = self.context_lens
            # slot-ascending, so monotonic; the last entry closes the last row at its context
            cu_k = [s * self.slot_tokens for s in self.slots] + [self.slots[-1] * self.slot_tokens + ctx[-1]]
            x = to_device([self.cu_query_lens, cu_k, ctx + [0], self.slots + [0]], self.device, torch.int32)  # one copy
            n = len(self.slots)
            self._cuda = {"cu_seqlens_q": x[0], "cu_seqlens_k": x[1], "seqused_k": x[2, :n], "slots": x[3, :n]}
        return self._cuda

    def sdpa_groups(self, sliding_window: int | None, chunk: int | None = None) -> list[SdpaGroup]:
        """The CPU path's SDPA calls of this iteration (built once, shared by every layer with
        the same window and chunk): runs of sequences in consecutive slots with equal start and
        query length. Their queries are adjacent packed rows (slot-ascending packing) and their
        keys one strided view of the cache."""
        key = (sliding_window,) if chunk is None else (sliding_window, "chunk", chunk)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _plan_groups(self, sliding_window, chunk)
        return plan

    def padded_plan(self, sliding_window: int | None, slot_tokens: int) -> dict[str, Any]:
        """Index tensors and the mask of `sdpa_padded_attention` (built once per iteration)."""
        key = ("padded", sliding_window, slot_tokens)
        plan = self._plans.get(key)
        if plan is None:
            dev = self.device
            n_max, ctx = max(self.query_lens), torch.tensor(self.context_lens, device=dev)  # [S]
            lo = ctx.new_tensor([0 if sliding_window is None else max(0, s - sliding_window + 1)
                                 for s in self.starts])  # [S]: first key any query of the sequence sees
            width = int((ctx - lo).max())
            kpos = lo[:, None] + torch.arange(width, device=dev)  # [S, width]: key positions
            kvalid = kpos < ctx[:, None]
            slots = torch.tensor(self.slots, device=dev)
            kv_index = slots[:, None] * slot_tokens + torch.where(kvalid, kpos, lo[:, None])  # [S, width]
            i = torch.arange(n_max, device=dev)
            qn = torch.tensor(self.query_lens, device=dev)
            qpos = ctx[:, None] - qn[:, None] + i  # [S, n_max]: query positions
            mask = kvalid[:, None, :] & (kpos[:, None, :] <= qpos[:, :, None])  # [S, n_max, width]
            if sliding_window is not None:
                mask &= kpos[:, None, :] > qpos[:, :, None] - sliding_window
            q_index = (torch.arange(len(self.slots), device=dev)[:, None] * n_max + i)[i < qn[:, None]]  # [T]
            plan = self._plans[key] = dict(n_max=n_max, kv_index=kv_index.reshape(-1), q_index=q_index,
                                           mask=mask[:, None])
        return plan


@dataclass(frozen=True)
class SdpaGroup:
    """One `scaled_dot_product_attention` call of the CPU path.

    ```
    slots slot .. slot+count-1 (consecutive), each with n new tokens at start .. ctx-1:
       queries  = packed rows row .. row + count * n           -> [count, H_q, n, D]
       keys     = k_cache[slot:slot + count, lo:ctx]           -> [count, H_kv, ctx - lo, D] (a view)
    ```
    """

    slot: int
    count: int
    row: int  # first packed query row
    n: int  # query length of each sequence
    lo: int  # first key position any query sees (sliding window)
    ctx: int  # context length after this iteration (keys lo .. ctx-1)
    causal: bool  # a whole prompt: SDPA's own causal mask
    mask: torch.Tensor | None  # [n, ctx - lo] bool: a chunk (causal aligned to the end, and the window)


def _plan_groups(meta: AttentionMetadata, sliding_window: int | None, chunk: int | None = None) -> list[SdpaGroup]:
    """`chunk` (Llama 4's chunked local attention): a query at position p sees keys
    floor(p / chunk) * chunk .. p only."""
    groups: list[SdpaGroup] = []
    prev = None
    for slot, start, n, row in zip(meta.slots, meta.starts, meta.query_lens, meta.cu_query_lens):
        if prev is not None and slot == prev.slot + prev.count and start == prev.ctx - prev.n and n == prev.n:
            prev = groups[-1] = SdpaGroup(prev.slot, prev.count + 1, prev.row, n, prev.lo, prev.ctx, prev.causal,
                                          prev.mask)
            continue
        ctx = start + n
        lo = 0 if sliding_window is None else max(0, start - sliding_window + 1)
        if chunk is not None:
            lo = max(lo, start // chunk * chunk)
        mask, causal = None, False
        if n > 1 and lo == 0 and start == 0 and (sliding_window is None or ctx <= sliding_window) and (
                chunk is None or ctx <= chunk):
            causal = True  # a whole prompt: top-left and bottom-right alignment agree
        elif n > 1:  # a chunk: causal aligned to the end, and the window
            q_pos = torch.arange(start, ctx, device=meta.device)[:, None]  # [n, 1]
            k_pos = torch.arange(lo, ctx, device=meta.device)[None, :]  # [1, ctx - lo]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
            if chunk is not None:
                mask &= k_pos // chunk == q_pos // chunk
        prev = SdpaGroup(slot, 1, row, n, lo, ctx, causal, mask)
        groups.append(prev)
    return groups


# ------------------------------------------------------------------ forward context ----
@dataclass
class ForwardContext:
    """Everything the attention function needs during one forward (STYLE #6)."""

    k_caches: list[torch.Tensor]  # per layer, [B, T, H_kv, D] views of the vattn cache
    v_caches: list[torch.Tensor]
    metadata: AttentionMetadata
    kernel: AttentionKernel


_context: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` the current forward context for the duration of the block."""
    global _context
    if _context is not None:
        raise VattnError("a vattn forward is already running; forwards do not nest")
    _context = ctx
    try:
        yield ctx
    finally:
        _context = None


def get_forward_context() -> ForwardContext:
    """The current forward context; raises outside an engine forward."""
    if _context is None:
        raise VattnError(
            "vattn attention was called outside a vattn engine forward; use the model through "
            "vattn.engine.LLM, or switch its attention implementation back (e.g. 'sdpa')")
    return _context


def attend(layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
           sliding_window: int | None = None, sinks: torch.Tensor | None = None,
           chunk: int | None = None) -> torch.Tensor:
    """One attention layer of the current forward: writes its new K/V into the layer's cache and
    runs the context's kernel. query `[T, H_q, D]`, key/value `[T, H_kv, D]`; returns `[T, H_q, D]`.
    `sinks` `[H_q]`: a learned logit per head in every query's softmax denominator (gpt-oss's
    attention sinks; `sdpa_attention` runs them on every device, eagerly). `chunk`: Llama 4's
    chunked local attention, a query at p sees keys from floor(p / chunk) * chunk on (the same path).

    Eagerly this calls the kernel; under `torch.compile` it calls `torch.ops.vattn.attention`, one
    opaque op, so the compiler traces the model around it and never into the per-iteration
    metadata (host lists that change every step)."""
    ctx = get_forward_context()
    k_cache, v_cache = ctx.k_caches[layer], ctx.v_caches[layer]
    if sinks is not None or chunk is not None:  # (the engine refuses compile= and CUDA graphs for them)
        return ctx.kernel.forward(query, key, value, k_cache, v_cache, ctx.metadata, scale, sliding_window, sinks,
                                  chunk)
    if torch.compiler.is_compiling():
        return torch.ops.vattn.attention(query, key, value, k_cache, v_cache, scale, sliding_window)
    return ctx.kernel.forward(query, key, value, k_cache, v_cache, ctx.metadata, scale, sliding_window)


# The op `torch.compile` sees. The cache tensors are arguments, declared mutated (the op writes the
# new K/V into them), so the compiler orders the op honestly and keeps no stale copy of them; they
# are the same tensor objects every step (views over memory reserved once), so dynamo's guards on
# them (dtype, shape, strides: never their data) hold from step to step. The metadata (slots,
# starts, query lengths: host lists, and plans shared by the layers) is read from the forward
# context inside the op, as the eager path reads it: as tensor arguments it would have to become
# host lists again in every layer of every step, and as Python values traced by dynamo each step
# would recompile.
@torch.library.custom_op("vattn::attention", mutates_args=("k_cache", "v_cache"))
def attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
    """query `[T, H_q, D]`, key/value `[T, H_kv, D]`, the layer's `[B, T_max, H_kv, D]` caches;
    returns the attention output `[T, H_q, D]`, contiguous."""
    ctx = get_forward_context()
    out = ctx.kernel.forward(query, key, value, k_cache, v_cache, ctx.metadata, scale, sliding_window)
    return out.contiguous()  # the fake's strides: a kernel may return query's layout


@attention_op.register_fake
def _attention_fake(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
    return torch.empty_like(query, memory_format=torch.contiguous_format)  # [T, H_q, D]


# --------------------------------------------------------------------------- kernels ----
def flash_attn_available() -> bool:
    """flash-attn 2 (`flash_attn_with_kvcache`): a `flash_attn` package of its own. FlashAttention
    4 installs `flash_attn.cute` into a namespace package `flash_attn` without it."""
    spec = importlib.util.find_spec("flash_attn")
    return spec is not None and spec.origin not in (None, "namespace")


def flash_attn_4_available() -> bool:
    """FlashAttention 4 (`flash_attn.cute`, the `flash-attn-4` package) is installed."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:  # no flash_attn at all
        return False


def flash_attn_4_layout_problem(k_cache: torch.Tensor) -> str | None:
    """Why FlashAttention 4 may read unmapped memory on this cache (None when it cannot):
    its K/V tiles of `FLASH_ATTN_4_TILE_TOKENS` rows must not cross into a page after a slot's
    last mapped page, so a page must hold whole tiles."""
    token_bytes = k_cache.stride(1) * k_cache.element_size()  # one token's row in its buffer
    tokens = MIN_CUDA_PAGE // token_bytes
    if MIN_CUDA_PAGE % token_bytes == 0 and tokens % FLASH_ATTN_4_TILE_TOKENS == 0:
        return None
    return (f"a 2 MiB page holds {MIN_CUDA_PAGE / token_bytes:g} tokens of this cache (a token is {token_bytes} "
            f"bytes of a buffer), not a multiple of FlashAttention 4's {FLASH_ATTN_4_TILE_TOKENS}-token K/V tiles: "
            "a tile after a slot's context could read an unmapped page; use layout='per-layer' (the fused "
            "layout puts every layer of a token in one row) or attention='torch_flash'")


def select_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The preferred kernel for a device and dtype (see the module docstring)."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        return "flash_attn" if flash_attn_available() else "torch_flash"
    return "sdpa"


class AttentionKernel:
    """Writes one layer's new K/V into the cache and runs the selected library kernel."""

    def __init__(self, name: str) -> None:
        if name not in KERNELS:
            raise VattnError(f"unknown attention kernel {name!r}; use one of {KERNELS}")
        if name == "flash_attn_4" and not flash_attn_4_available():
            raise InvalidConfigError(
                "attention='flash_attn_4' needs FlashAttention 4 (the flash_attn.cute module), which is not "
                "installed: pip install flash-attn-4 nvidia-cutlass-dsl[cu13] (a Hopper or Blackwell GPU), "
                "or use attention='torch_flash' (PyTorch's own FlashAttention-2)")
        self.name = name
        self._verified: set[str] = set()  # kinds of batch already checked against sdpa
        self.flex = FlexDecode(sdpa_attention) if name == "flex" else None  # its page size: set by the runner

    @property
    def verified(self) -> frozenset[str]:
        """The kinds of batch ('decode', 'prompt', 'chunk') already checked against sdpa."""
        return frozenset(self._verified)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                chunk: int | None = None) -> torch.Tensor:
        """query `[T, H_q, D]`, key/value `[T, H_kv, D]` of the packed new tokens.
        Returns the attention output `[T, H_q, D]`. With `sinks` (`[H_q]`) or a `chunk`,
        `sdpa_attention` runs whatever the kernel: the library kernels here take neither."""
        # Write first: a query sees its own token's key.
        k_cache[meta.slot_ids, meta.positions] = key  # [T, H_kv, D] into [B, T_max, H_kv, D]
        v_cache[meta.slot_ids, meta.positions] = value
        if sinks is not None or chunk is not None:
            return sdpa_attention(query, k_cache, v_cache, meta, scale, sliding_window, sinks, chunk)
        if self.name == "sdpa":
            return sdpa_attention(query, k_cache, v_cache, meta, scale, sliding_window)
        if self.name == "sdpa_padded":
            return sdpa_padded_attention(query, k_cache, v_cache, meta, scale, sliding_window)
        fn = self.flex if self.name == "flex" else _CUDA_KERNELS[self.name]
        if self.name == "flash_attn_4" and (problem := flash_attn_4_layout_problem(k_cache)):
            raise VattnError(f"attention='flash_attn_4' cannot read this cache: {problem}")
        if query.is_cuda and torch.cuda.is_current_stream_capturing():
            # a CUDA graph (vattn.engine.cuda_graphs): checked in an eager iteration before;
            # a failure must abort the capture, not fall back inside it
            return fn(query.contiguous(), k_cache, v_cache, meta, scale, sliding_window)
        try:
            out = fn(query.contiguous(), k_cache, v_cache, meta, scale, sliding_window)
            kinds = _batch_kinds(meta) - self._verified
            if kinds:  # the first batches of each kind: compare with sdpa once
                ref = sdpa_attention(query, k_cache, v_cache, meta, scale, sliding_window)
                tol = 2e-2 if query.dtype == torch.bfloat16 else 5e-3
                if not torch.allclose(out.float(), ref.float(), atol=tol, rtol=tol):
                    raise VattnError(f"{self.name} disagrees with sdpa on the vattn cache layout")
                self._verified |= kinds
            return out
        except Exception as e:  # a kernel that cannot run here: fall back for good
            warnings.warn(f"vattn: attention kernel {self.name!r} failed ({e}); falling back to "
                          "per-request scaled_dot_product_attention", RuntimeWarning, stacklevel=2)
            self.name = "sdpa"
            return sdpa_attention(query, k_cache, v_cache, meta, scale, sliding_window)


def _batch_kinds(meta: AttentionMetadata) -> set[str]:
    """'decode' (1 token), 'prompt' (a whole prompt), 'chunk' (a later part of a prompt)."""
    return {"decode" if n == 1 else "prompt" if s == 0 else "chunk" for s, n in zip(meta.starts, meta.query_lens)}


def sdpa_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, sliding_window: int | None,
                   sinks: torch.Tensor | None = None, chunk: int | None = None, decode: bool = True) -> torch.Tensor:
    """`scaled_dot_product_attention` on the cache rows, one call per `SdpaGroup` (`decode=False`:
    not the decode groups, whose rows are left for the caller to fill).

    Query i of a chunk starting at `start` sits at position start + i and sees keys
    `start + i - window < j <= start + i` (no lower bound without a sliding window).

    A group's keys are a strided view of consecutive slots, so no K/V byte is copied. Keys
    are not gathered across slots into one padded call: on the CPU a decode reads its K/V
    once, memory-bound, and a gather reads and writes them once more before the kernel reads
    the copy (`sdpa_padded_attention`: twice the CPU time of a whole 32-request engine run on a
    2-CPU host, one thread). A decode
    (n = 1) runs with its query heads folded onto their KV head, `[c, H_kv, H_q / H_kv, D]`
    against `[c, H_kv, L, D]`, which reads each KV head once (`enable_gqa` reads it once per
    query head); the result is the same attention, equal to `enable_gqa` within float
    rounding (not bit for bit: the kernel multiplies other shapes). `sinks`: `sink_attention`
    on the same views. `chunk`: keys from the query's chunk only (`_plan_groups`).
    """
    T, Hq, D = query.shape
    Hkv = k_cache.shape[2]
    out = torch.empty_like(query)  # [T, H_q, D]
    for g in meta.sdpa_groups(sliding_window, chunk):
        c, n, a = g.count, g.n, g.row
        if n == 1 and not decode:
            continue
        k = k_cache[g.slot:g.slot + c, g.lo:g.ctx].transpose(1, 2)  # [c, H_kv, ctx - lo, D], a view
        v = v_cache[g.slot:g.slot + c, g.lo:g.ctx].transpose(1, 2)
        if sinks is not None:
            q = query[a:a + c * n].view(c, n, Hq, D).transpose(1, 2)  # [c, H_q, n, D]
            mask = g.mask
            if g.causal:
                mask = torch.ones(n, g.ctx - g.lo, dtype=torch.bool, device=query.device).tril()
            o = sink_attention(q, k, v, mask, scale, sinks)  # [c, H_q, n, D]
            out[a:a + c * n] = o.transpose(1, 2).reshape(c * n, Hq, D)
            continue
        if n == 1:
            q = query[a:a + c].view(c, Hkv, Hq // Hkv, D)  # query head h -> KV head h // (H_q / H_kv)
            out[a:a + c] = F.scaled_dot_product_attention(q, k, v, scale=scale).reshape(c, Hq, D)  # (CUDA's may be strided)
            continue
        q = query[a:a + c * n].view(c, n, Hq, D).transpose(1, 2)  # [c, H_q, n, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, is_causal=g.causal, scale=scale,
                                           enable_gqa=Hq != Hkv)  # [c, H_q, n, D]
        out[a:a + c * n] = o.transpose(1, 2).reshape(c * n, Hq, D)
    return out


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a learned sink logit per head (gpt-oss): the sink joins each query's
    softmax as one more key with no value, so it only takes probability away, as
    transformers' gpt-oss eager attention computes it. q `[c, H_q, n, D]`, k/v `[c, H_kv, L, D]`
    (query head h reads KV head h // (H_q / H_kv)), mask `[n, L]` bool (True: seen) or None,
    sinks `[H_q]`. Returns `[c, H_q, n, D]`."""
    c, Hq, n, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    scores = torch.matmul(q.reshape(c, Hkv, g, n, D), k.unsqueeze(2).transpose(-1, -2)) * scale  # [c, H_kv, g, n, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, Hkv, g, 1, 1).expand(c, Hkv, g, n, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink's share dropped
    return torch.matmul(probs.to(v.dtype), v.unsqueeze(2)).reshape(c, Hq, n, v.shape[-1])


def sdpa_padded_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """Every sequence of the iteration in one `scaled_dot_product_attention` call: keys and
    values gathered from the cache rows into `[S, H_kv, L_max, D]` (positions past a
    sequence's context point at its first key and are masked out), queries padded to
    `[S, H_q, n_max, D]`, one boolean mask `[S, 1, n_max, L_max]` (causal, window, length).

    The gather copies every key and value the kernel reads, which on the CPU costs more than
    the per-call overhead it saves (`vattn bench throughput --attention sdpa_padded` compares);
    `sdpa_attention` is the default. Equal to it within float rounding.
    """
    T, Hq, D = query.shape
    Hkv = k_cache.shape[2]
    S = len(meta.slots)
    p = meta.padded_plan(sliding_window, meta.slot_tokens)  # the cache's slot stride in tokens
    k = _flat_rows(k_cache).index_select(0, p["kv_index"]).view(S, -1, Hkv, D).transpose(1, 2)
    v = _flat_rows(v_cache).index_select(0, p["kv_index"]).view(S, -1, Hkv, D).transpose(1, 2)
    q = query.new_zeros(S * p["n_max"], Hq, D)
    q[p["q_index"]] = query
    q = q.view(S, p["n_max"], Hq, D).transpose(1, 2)  # [S, H_q, n_max, D]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=p["mask"], scale=scale, enable_gqa=Hq != Hkv)
    return o.transpose(1, 2).reshape(S * p["n_max"], Hq, D)[p["q_index"]]  # [T, H_q, D]


def _flat_rows(cache: torch.Tensor) -> torch.Tensor:
    """`[B, T, H, D]` -> `[(B - 1) * slot_tokens + T, H, D]`: slot b's row starts at b * slot_tokens.

    The view never extends past the last slot's T tokens, so it stays inside the tensor's storage.
    """
    B, T, H, D = cache.shape
    slot_tokens = cache.stride(0) // cache.stride(1)
    return cache.as_strided(((B - 1) * slot_tokens + T, H, D), cache.stride()[1:], cache.storage_offset())


def torch_flash_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """PyTorch's FlashAttention-2 varlen over all sequences at once (CUDA only)."""
    t = meta.cuda_tensors()
    window = (sliding_window - 1, 0) if sliding_window is not None else (None, None)
    out = torch.ops.aten._flash_attention_forward(
        query, _flat_rows(k_cache), _flat_rows(v_cache), t["cu_seqlens_q"], t["cu_seqlens_k"],
        max(meta.query_lens), meta.max_context_len, 0.0, True, False, scale=scale,
        window_size_left=window[0], window_size_right=window[1], seqused_k=t["seqused_k"])[0]
    return out  # [T, H_q, D]


def flash_attn_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """flash-attn's `flash_attn_with_kvcache` on the slot rows (CUDA only): decodes in one
    call, each multi-token chunk in its own call (the kernel wants one query length)."""
    from flash_attn import flash_attn_with_kvcache

    t = meta.cuda_tensors()
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
    out = torch.empty_like(query)  # [T, H_q, D]
    cu = meta.cu_query_lens
    decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
    if decodes:
        idx, rows = to_device([decodes, [cu[i] for i in decodes]], query.device)  # [b] each
        o = flash_attn_with_kvcache(query[rows].unsqueeze(1), k_cache, v_cache,
                                    cache_seqlens=t["seqused_k"][idx], cache_batch_idx=t["slots"][idx],
                                    softmax_scale=scale, causal=True, window_size=window)  # [b, 1, H_q, D]
        out[rows] = o[:, 0]
    for i, n in enumerate(meta.query_lens):
        if n == 1:
            continue
        o = flash_attn_with_kvcache(query[cu[i]:cu[i] + n].unsqueeze(0), k_cache, v_cache,
                                    cache_seqlens=t["seqused_k"][i:i + 1], cache_batch_idx=t["slots"][i:i + 1],
                                    softmax_scale=scale, causal=True, window_size=window)  # [1, n, H_q, D]
        out[cu[i]:cu[i] + n] = o[0]
    return out


def flash_attn_4_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, sliding_window: int | None) -> torch.Tensor:
    """FlashAttention 4's varlen kernel over all sequences at once, on the slot rows unmodified
    (CUDA, `flash_attn.cute`): the flat `[rows, H, D]` views of the cache with `cu_seqlens_k`
    at each slot's row and `seqused_k` the context lengths, as `torch_flash_attention`.
    Its first call for a shape JIT-compiles the kernel (seconds)."""
    from flash_attn.cute import flash_attn_varlen_func

    t = meta.cuda_tensors()
    window = (sliding_window - 1, 0) if sliding_window is not None else (None, None)
    out = flash_attn_varlen_func(query, _flat_rows(k_cache), _flat_rows(v_cache), cu_seqlens_q=t["cu_seqlens_q"],
                                 cu_seqlens_k=t["cu_seqlens_k"], max_seqlen_q=max(meta.query_lens),
                                 max_seqlen_k=meta.max_context_len, seqused_k=t["seqused_k"], softmax_scale=scale,
                                 causal=True, window_size=window)
    return out[0] if isinstance(out, tuple) else out  # [T, H_q, D] (and the LSE)


_CUDA_KERNELS = {"flash_attn": flash_attn_attention, "torch_flash": torch_flash_attention,
                 "flash_attn_4": flash_attn_4_attention}


__all__ = [
    "AttentionMetadata", "AttentionKernel", "ForwardContext", "forward_context", "get_forward_context", "attend",
    "attention_op",
    "select_kernel", "sdpa_attention", "sdpa_padded_attention", "sink_attention", "SdpaGroup", "torch_flash_attention",
    "flash_attn_attention", "flash_attn_4_attention", "flash_attn_4_available", "flash_attn_4_layout_problem",
    "KERNELS",
]
