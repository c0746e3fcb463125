"""Decode under CUDA graphs: one captured forward per padded batch size, replayed.

vattn's K/V never move (each slot is a fixed virtual range; pages are mapped under it),
so a captured decode forward stays valid however the cache grows: the graph bakes in
the cache's addresses and reads the batch's slots, positions and context lengths from
static device buffers that each replay refills. A decode iteration of S sequences runs
the graph of the smallest captured size b >= S; the b - S padding rows repeat the last
sequence (same slot, position and token), so they write the same K/V to the same place
and read only mapped pages, and their logits are dropped.

```
static buffers (size max_size), refilled before each replay of graph b:
  input_ids [1, b]  positions [b]  slot_ids [b]       <- rows S..b-1 repeat row S-1
                    (a token still in flight is read on the device from the previous iteration's)
  cu_seqlens_q [b+1] = 0..b (constant)  cu_seqlens_k [b+1]  seqused_k [b]
graph b: model(input_ids, positions) with the varlen kernel's max_seqlen_k = max_context_len
         -> logits [b, V]  (rows 0..S-1 are the batch's)
```

Graphs are captured lazily, at the first decode of each padded size (a capture needs real
mapped pages under the slots it runs: a warm-up forward really executes), after the
attention kernel has checked decodes against SDPA in an eager iteration. Only the
`torch_flash` kernel is captured (its decode reads nothing from the host); prefills,
chunks and mixed iterations run eagerly. A capture that fails (a model whose forward reads a
device value on the host while captured, say) turns graphs off for the engine, with a
warning, and the iteration runs eagerly: graphs never change what is served. (The warm-up
cannot find such reads for the capture: transformers skips its own host checks while a
stream is captured, `transformers.utils.is_tracing`, and makes them in the warm-up.)
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from vattn.attention import AttentionKernel, AttentionMetadata, ForwardContext, forward_context, to_device
from vattn.errors import InvalidConfigError

logger = logging.getLogger(__name__)

GRAPH_KERNELS = ("torch_flash",)  # kernels whose decode can be captured (no host reads per call)


def capture_sizes(max_size: int) -> list[int]:
    """The padded batch sizes captured for `max_size` sequences: 1, 2, 4, then every
    multiple of 8 up to max_size, and max_size itself (vLLM's choice: at most 7 rows of
    padding past 8, few graphs)."""
    if max_size < 1:
        raise InvalidConfigError(f"cuda graph sizes need max_size >= 1, got {max_size}")
    sizes = {s for s in (1, 2, 4) if s <= max_size}
    sizes.update(range(8, max_size + 1, 8))
    sizes.add(max_size)
    return sorted(sizes)


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds n rows, or None when none does."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class GraphTarget:
    """What a captured decode runs (the model runner's, given explicitly): the model's
    logits (compiled or eager), the attention kernel and the per-layer caches it reads, the
    device, and the cache's slot geometry."""

    logits: Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]  # (ids, positions [1, T], keep) -> [S, V]
    kernel: AttentionKernel
    k_caches: list[Any]  # by the model's layer index: [B, T, H_kv, D] each, None for a layer without attention
    v_caches: list[Any]
    device: torch.device
    slot_tokens: int
    max_context_len: int
    synchronize: Callable[[], None]  # waits for the cache's page mapping (none while a graph is captured)

    def context(self, meta: AttentionMetadata) -> ForwardContext:
        return ForwardContext(self.k_caches, self.v_caches, meta, self.kernel)


class DecodeGraphs:
    """The captured decode forwards of one model runner (see the module docstring)."""

    def __init__(self, target: GraphTarget, max_size: int) -> None:
        self.target = target
        self.sizes = capture_sizes(max_size)
        B, dev = self.sizes[-1], target.device
        long, i32 = dict(dtype=torch.long, device=dev), dict(dtype=torch.int32, device=dev)
        self.input_ids = torch.zeros(1, B, **long)  # [1, B]
        self.positions = torch.zeros(B, **long)  # [B]
        self.slot_ids = torch.zeros(B, **long)  # [B]
        self.cu_seqlens_q = torch.arange(B + 1, **i32)  # [B + 1]: one query per row, never changes
        self.cu_seqlens_k = torch.zeros(B + 1, **i32)  # [B + 1]: each row's start in the flat cache
        self.seqused_k = torch.zeros(B, **i32)  # [B]: context lengths
        self.slots = torch.zeros(B, **i32)  # [B]
        self._graphs: dict[int, Any] = {}  # size -> (CUDAGraph, its logits [b, V])
        self._pool: Any = None  # one memory pool for every size (replays never overlap)
        self.disabled_reason: str | None = None
        self.num_replays = 0
        self.capture_s: dict[int, float] = {}  # seconds each size's warm-up + capture took

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def usable(self, num_seqs: int) -> bool:
        """Whether a decode of num_seqs sequences can run as a graph now."""
        kernel = self.target.kernel
        return (self.disabled_reason is None and kernel.name in GRAPH_KERNELS and "decode" in kernel.verified
                and num_seqs <= self.sizes[-1])

    def run(self, slots: list[int], starts: list[int], tokens: list[int],
            placeholders: Sequence[tuple[int, int]] = (), fed: torch.Tensor | None = None) -> torch.Tensor | None:
        """One decode step of S sequences (slot-ascending): each writes its token at
        position starts[i] of slots[i]; the rows of `placeholders` (row, r) read their token on
        the device, `fed[r]` (the previous iteration's sampled tokens `[S']`).
        Returns the logits `[S, V]` (a view of the graph's output: read it before the next
        replay), or None when the capture failed (graphs are off from then on; run the
        iteration eagerly)."""
        S = len(slots)
        b = padded_size(S, self.sizes)
        assert b is not None and slots == sorted(slots), "DecodeGraphs.run: see usable()"
        self._fill(slots, starts, tokens, b, placeholders, fed)
        if b not in self._graphs and not self._capture(b, slots, starts):
            return None
        logits = self._replay(b)
        self.num_replays += 1
        return logits[:S]

    def _replay(self, b: int) -> torch.Tensor:
        """Run graph b on the static buffers; returns its logits `[b, V]`."""
        graph, logits = self._graphs[b]
        graph.replay()
        return logits

    def _fill(self, slots: list[int], starts: list[int], tokens: list[int], b: int,
              placeholders: Sequence[tuple[int, int]] = (), fed: torch.Tensor | None = None) -> None:
        """Write the batch into the static buffers, padded to b rows: one host-to-device
        copy (from pinned memory: it does not wait for the iteration in flight), then device
        copies into the buffers of each dtype; the rows of `placeholders` take their token
        from `fed`, on the device."""
        S, pad = len(slots), b - len(slots)
        slots, starts, tokens = slots + slots[-1:] * pad, starts + starts[-1:] * pad, tokens + tokens[-1:] * pad
        st = self.target.slot_tokens
        ends = [s * st for s in slots] + [slots[-1] * st + starts[-1] + 1]
        table = [tokens + [0], starts + [0], slots + [0], ends, [n + 1 for n in starts] + [0]]
        if placeholders:  # row i reads fed[feed[i]] when feed[i] >= 0
            feed = [-1] * S
            for row, r in placeholders:
                feed[row] = r
            table.append(feed + feed[-1:] * pad + [-1])
        x = to_device(table, self.positions.device)  # [5 or 6, b + 1]
        if placeholders:  # tokens in flight: the previous iteration's, on the device
            src = x[5, :b]
            self.input_ids[0, :b].copy_(torch.where(src >= 0, fed[src.clamp(min=0)], x[0, :b]))
        else:
            self.input_ids[0, :b].copy_(x[0, :b])
        self.positions[:b].copy_(x[1, :b])
        self.slot_ids[:b].copy_(x[2, :b])
        self.slots[:b].copy_(x[2, :b])
        self.cu_seqlens_k[:b + 1].copy_(x[3])  # each row's first key in the flat [B * slot_tokens] view
        self.seqused_k[:b].copy_(x[4, :b])  # context lengths

    def _metadata(self, b: int, slots: list[int], starts: list[int]) -> AttentionMetadata:
        """Metadata whose device tensors are the static buffers (views of b rows). Its host
        lists are the batch being captured (padded); `max_context` = max_context_len makes
        the kernel's launch fit every later replay."""
        pad = b - len(slots)
        meta = AttentionMetadata(slots + slots[-1:] * pad, starts + starts[-1:] * pad, [1] * b, self.slot_ids[:b],
                                 self.positions[:b], self.target.slot_tokens, self.target.device,
                                 max_context=self.target.max_context_len)
        meta._cuda = {"cu_seqlens_q": self.cu_seqlens_q[:b + 1], "cu_seqlens_k": self.cu_seqlens_k[:b + 1],
                      "seqused_k": self.seqused_k[:b], "slots": self.slots[:b]}
        return meta

    def _forward(self, b: int) -> torch.Tensor:
        return self.target.logits(self.input_ids[:, :b], self.positions[None, :b], 0)  # [b, V]; compiled or eager

    def _capture(self, b: int, slots: list[int], starts: list[int]) -> bool:
        """Warm up and capture graph b on the batch now in the static buffers (a warm-up
        forward really runs: it writes the batch's own K/V, which the replay writes again).
        False when it failed (graphs are off from then on)."""
        r = self.target
        t0 = time.perf_counter()
        ctx = r.context(self._metadata(b, slots, starts))
        try:
            r.synchronize()  # no page mapping of the worker while the graph is captured
            with forward_context(ctx):
                side = torch.cuda.Stream(r.device)
                side.wait_stream(torch.cuda.current_stream(r.device))
                with torch.cuda.stream(side):  # warm-up: library handles, workspaces, autotuning
                    for _ in range(2):
                        self._forward(b)
                torch.cuda.current_stream(r.device).wait_stream(side)
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation: run eagerly from now on
            self.disable(f"the warm-up of the decode of {b} sequences failed: {type(e).__name__}: {e}")
            return False
        try:
            with forward_context(ctx):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    logits = self._forward(b)
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation: run eagerly from now on
            _reset_rng_capture_state(r.device)
            self.disable(f"capturing the decode of {b} sequences failed: {type(e).__name__}: {e}")
            return False
        self._pool = graph.pool()
        self._graphs[b] = (graph, logits)
        self.capture_s[b] = time.perf_counter() - t0
        logger.debug("vattn: captured the decode of %d sequences in %.3f s", b, self.capture_s[b])
        return True

    def disable(self, reason: str) -> None:
        """Turn graphs off for good (the iterations run eagerly) and free them."""
        if self.disabled_reason is None:
            logger.warning("vattn: CUDA graphs are off for this engine: %s", reason)
            self.disabled_reason = reason
        self.close()

    def close(self) -> None:
        self._graphs.clear()
        self._pool = None


def _reset_rng_capture_state(device: torch.device) -> None:
    """After a capture the driver invalidated, torch ends it without its epilogue, which
    leaves the device's default generator "capturing": every later random op on the device
    raises ("Offset increment outside graph capture"). Give the generator a fresh state with
    the same seed and offset."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    try:
        gen.graphsafe_set_state(gen.clone_state())
    except Exception:  # noqa: BLE001 - an older torch: nothing more to do
        logger.warning("vattn: could not reset the CUDA generator after a failed capture", exc_info=True)


__all__ = ["DecodeGraphs", "GraphTarget", "capture_sizes", "padded_size", "GRAPH_KERNELS"]
