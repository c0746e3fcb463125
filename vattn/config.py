"""Configuration of a vattn cache and the geometry derived from it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from vattn import checks
from vattn.checks import MAX_PAGE_SIZE  # noqa: F401 (re-exported: it was defined here)
from vattn.errors import InvalidConfigError

LAYOUTS = ("per-layer", "fused")
CUDA_DRIVERS = ("auto", "cext", "cuda-python")

# torch dtype -> (DLPack type code, bits)
DLPACK_DTYPES: dict[torch.dtype, tuple[int, int]] = {
    torch.float16: (2, 16),
    torch.bfloat16: (4, 16),
    torch.float32: (2, 32),
    torch.float64: (2, 64),
    torch.int8: (0, 8),
    torch.uint8: (1, 8),
}

_DTYPE_NAMES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "uint8": torch.uint8,
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its name ('float16', 'bf16', ...)."""
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.").lower()
        if key not in _DTYPE_NAMES:
            raise InvalidConfigError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)}")
        dtype = _DTYPE_NAMES[key]
    if not isinstance(dtype, torch.dtype) or dtype not in DLPACK_DTYPES:  # (a list is not even hashable)
        raise InvalidConfigError(f"dtype {dtype} is not supported; use one of {list(DLPACK_DTYPES)}")
    return dtype


# Pages up to this size are always allowed, however small the slot (the stock CUDA page);
# larger ones up to MAX_PAGE_SIZE (`vattn.checks`) only where a slot is that large.
SMALL_PAGE_SIZE = 2 << 20
PREFETCH_TOKENS = 16  # pre-mapping's look-ahead (CacheConfig.prefetch_tokens)


@dataclass(frozen=True)
class CacheConfig:
    """What `vattn.init` was asked for. Sizes in bytes; `page_size=None` means the backend's default.

    `physical_memory` caps the bytes of physical pages ever created (None: as many as the
    slots can hold). `background` runs pre-mapping on a worker thread; `prefetch=False`
    turns pre-mapping off (pure on-demand mapping, the paper's synchronous baseline).
    `prefetch_tokens`: how far ahead pre-mapping looks: a request's next page is mapped once
    it is within that many tokens of it, so the worker has that many decode iterations to
    map it before `step` needs it (1: only when its very next token needs it).
    `cuda_driver` picks the CUDA path: "cext" (vattn._C), "cuda-python", or "auto" (cext when
    it loads). `physical_memory=None` means 90% of the GPU memory free at init on CUDA, and
    half of the memory available to the process (MemAvailable, bounded by its cgroup's
    limit) on the host. `zero_reused_pages` clears a page before a request that did not
    write it can read it (pages of a freed slot, reclaimed from another slot, or new from
    the driver, which promises no zeros on CUDA); off by default: the engine always writes
    before it reads, and its kernels mask the rows after a context (the engine turns it on
    for FlashAttention 4, whose tiles read those rows: a NaN there poisons the output).
    `layer_windows`: per layer, its sliding window in tokens (None: full attention), or a
    `vattn.allocator.LayerKind` naming another kind (`Chunk(C)`: Llama 4's chunked local
    attention); with the per-layer layout each window size (each `LayerKind`) is a layer kind
    of its own whose pages wholly behind what its queries read are given back as a request
    grows (see `layer_kinds`). The fused layout keeps every page (a page holds every layer of
    its tokens).
    `state_bytes`: bytes of a slot's recurrent states (Mamba2, gated delta-net layers), one
    more layer kind: a row of whole pages per slot, mapped at its first step, in the same
    budget (`KVCache.state_rows`); `num_snapshots`: rows after the slots' that keep copies of
    states at prefix blocks' ends (`KVCache.snapshots`, the prefix cache).
    `v_head_dim`: V's width where it differs from K's `head_dim`: K and V of a layer then
    share one buffer, a token's row its K then its V, so that every buffer's tokens have one
    size (None: V is as wide as K, in a buffer of its own). A `LayerKind` in `layer_windows`
    that declares its token's widths (`kv_widths`: multi-head latent attention's `Latent`
    keeps one latent "head" as K and the shared RoPE key as V) sets `num_kv_heads`,
    `head_dim` and `v_head_dim` for the cache.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_batch_size: int
    max_context_len: int
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    page_size: int | None = None
    layout: str = "per-layer"
    physical_memory: int | None = None
    background: bool = True
    prefetch: bool = True
    prefetch_tokens: int = PREFETCH_TOKENS
    cuda_driver: str = "auto"
    zero_reused_pages: bool = False
    layer_windows: tuple[Any, ...] | None = None  # per layer: None, an int or a LayerKind
    state_bytes: int = 0
    num_snapshots: int = 0
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_batch_size", "max_context_len"):
            object.__setattr__(self, name, checks.positive(getattr(self, name), name))
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "device", checks.device(self.device))
        object.__setattr__(self, "page_size", checks.page_size(self.page_size))
        checks.one_of(self.layout, "layout", LAYOUTS)
        object.__setattr__(self, "physical_memory", checks.positive(self.physical_memory, "physical_memory",
                                                                    optional=True))
        object.__setattr__(self, "prefetch_tokens", checks.positive(self.prefetch_tokens, "prefetch_tokens"))
        for name in ("background", "prefetch", "zero_reused_pages"):
            checks.flag(getattr(self, name), name)
        checks.one_of(self.cuda_driver, "cuda_driver", CUDA_DRIVERS)
        for name in ("state_bytes", "num_snapshots"):
            object.__setattr__(self, name, checks.as_int(getattr(self, name), name, InvalidConfigError, low=0))
        if self.num_snapshots and not self.state_bytes:
            raise InvalidConfigError(f"num_snapshots={self.num_snapshots} needs recurrent states: give state_bytes")
        if self.layer_windows is not None:
            windows = tuple(self.layer_windows)
            if len(windows) != self.num_layers:
                raise InvalidConfigError(f"layer_windows has {len(windows)} entries; give one per layer "
                                         f"(num_layers={self.num_layers}), None for full attention")
            windows = tuple(_layer_entry(w) for w in windows)
            # a window (or chunk) as long as the context is full attention: nothing is ever behind it
            # (a kind of size 0, such as `Latent`, reads every token: it stays for what else it says)
            windows = tuple(None if w is None or 0 < _tokens(w) >= self.max_context_len else w for w in windows)
            object.__setattr__(self, "layer_windows", windows if any(w is not None for w in windows) else None)
            self._take_kv_widths(windows)
        if self.v_head_dim is not None:
            v = checks.positive(self.v_head_dim, "v_head_dim")
            object.__setattr__(self, "v_head_dim", None if v == self.head_dim else v)

    def _take_kv_widths(self, entries: tuple[Any, ...]) -> None:
        """A `LayerKind` may declare the widths its layers keep a token (`kv_widths`: heads, K
        width, V width; multi-head latent attention's `Latent`): they become `num_kv_heads`,
        `head_dim` and `v_head_dim`, the same for every layer (every buffer's tokens have one size)."""
        widths = {getattr(w, "kv_widths", None) for w in entries}
        if widths == {None}:
            return
        if len(widths) > 1:
            shown = ", ".join("num_kv_heads x head_dim" if w is None else "(heads, K, V) = {}".format(w)
                              for w in sorted(widths, key=str))
            raise InvalidConfigError(
                f"layer_windows names layer kinds whose tokens have different widths ({shown}); a cache keeps "
                "one width for every layer: give every layer a kind of the same widths")
        heads, k, v = widths.pop()
        for name, value in (("num_kv_heads", heads), ("head_dim", k), ("v_head_dim", v)):
            object.__setattr__(self, name, checks.positive(value, name))

    def layer_kinds(self) -> list[tuple[Any, tuple[int, ...]]]:
        """(entry of `layer_windows`, layers) of each layer kind, full attention first, then
        windows from the largest, then the other `LayerKind`s (chunks) from the largest: one
        kind with the fused layout or without windows (every page kept)."""
        windows = self.layer_windows
        if windows is None or self.layout != "per-layer":
            return [(None, tuple(range(self.num_layers)))]
        sizes = sorted(set(windows), key=lambda w: (w is not None, not isinstance(w, int),
                                                    getattr(w, "label", ""), -_tokens(w or 0)))
        return [(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in sizes]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def _layer_entry(w: Any) -> Any:
    """An entry of `layer_windows`, checked: None, a window (an int > 0), or a
    `vattn.allocator.LayerKind` (known by its `size` and `spec`: this module cannot import
    the allocator, whose page layer imports it); a `Window` becomes its int."""
    if w is None:
        return None
    if hasattr(w, "spec") and hasattr(w, "size"):
        return w.entry()
    return checks.positive(w, "a layer window")


def _tokens(entry: Any) -> int:
    """The tokens of a `layer_windows` entry: a window's, or a `LayerKind`'s size."""
    return entry if isinstance(entry, int) else entry.size


@dataclass(frozen=True)
class Geometry:
    """Where every byte goes, for one config and one page size.

    ```
    buffer b (K or V of a layer; of all layers when fused), slot r, page p:
      base_b + r * slot_bytes + p * page_size
      |<------------- slot_bytes (slot_tokens tokens) ------------->|
      [ page 0 ][ page 1 ][ page 2 ] ...                [ page n-1 ]
    ```
    A page group is page p of slot r in all `num_buffers` buffers: the unit the books count.
    `slot_tokens >= max_context_len` so that slots start on page boundaries.
    Derived sizes are computed once (`cached_property`): `pages_for` is on the step's hot path.
    """

    config: CacheConfig
    page_size: int

    @cached_property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.config.dtype).element_size()

    @cached_property
    def buffers_per_layer(self) -> int:
        """2 (K and V each in a buffer), or 1 when V's width differs (`CacheConfig.v_head_dim`,
        or a layer kind's `kv_widths`)."""
        return 1 if self.config.v_head_dim is not None else 2

    @cached_property
    def num_buffers(self) -> int:
        return self.buffers_per_layer * (self.config.num_layers if self.config.layout == "per-layer" else 1)

    @cached_property
    def layers_per_buffer(self) -> int:
        return 1 if self.config.layout == "per-layer" else self.config.num_layers

    @cached_property
    def token_bytes(self) -> int:
        """Bytes one token occupies in one buffer."""
        c = self.config
        return self.layers_per_buffer * c.num_kv_heads * (c.head_dim + (c.v_head_dim or 0)) * self.elem_size

    @cached_property
    def token_bytes_all(self) -> int:
        """Bytes one token occupies in the whole cache (K and V of every layer)."""
        return self.token_bytes * self.num_buffers

    @cached_property
    def share_tokens(self) -> int:
        """Tokens of the sharing unit: lcm(page_size, token_bytes) bytes of a buffer, the
        fewest whole tokens that fill whole pages (`share_pages` of them). Pinned pages map
        into a new request in whole units (`map_pinned`, the prefix cache's blocks), so that
        it never writes a token whose bytes begin in a page it shares (fork copies the page
        its first own token begins in instead). A page that holds whole tokens is its own
        unit; e.g. 6 KiB tokens (Phi-3: 32 KV heads x head_dim 96, fp16) in 2 MiB pages
        share 1024 tokens in three pages."""
        return self.page_size // math.gcd(self.page_size, self.token_bytes)

    @cached_property
    def share_pages(self) -> int:
        """Pages of the sharing unit (`share_tokens`): 1 when a page holds whole tokens."""
        return self.token_bytes // math.gcd(self.page_size, self.token_bytes)

    @cached_property
    def slot_tokens(self) -> int:
        """max_context_len rounded up to whole sharing units (so a slot is a whole number of
        pages, and every slot's units start at the same page of it)."""
        q = self.share_tokens
        return -(-self.config.max_context_len // q) * q

    @cached_property
    def slot_bytes(self) -> int:
        return self.slot_tokens * self.token_bytes

    @cached_property
    def pages_per_slot(self) -> int:
        return self.slot_bytes // self.page_size

    @cached_property
    def buffer_bytes(self) -> int:
        return self.slot_bytes * self.config.max_batch_size

    @cached_property
    def group_bytes(self) -> int:
        """Physical bytes of one page group."""
        return self.page_size * self.num_buffers

    def check_page_size(self) -> None:
        """A page may not be larger than one slot's tokens of one buffer (rounded up to a
        power of two), unless it is at most SMALL_PAGE_SIZE: a bigger page only wastes memory."""
        slot = self.config.max_context_len * self.token_bytes
        if self.page_size > SMALL_PAGE_SIZE and self.page_size > 1 << (slot - 1).bit_length():
            raise InvalidConfigError(
                f"page_size={self.page_size} is larger than a whole slot ({slot} bytes: max_context_len="
                f"{self.config.max_context_len} tokens x {self.token_bytes} bytes per buffer); use a page of "
                f"at most {max(SMALL_PAGE_SIZE, 1 << (slot - 1).bit_length())} bytes")

    def pages_for(self, num_tokens: int) -> int:
        """Page groups a slot needs to hold `num_tokens` tokens."""
        return -(-num_tokens * self.token_bytes // self.page_size)

    def tokens_in(self, num_pages: int) -> int:
        """Whole tokens `num_pages` pages of a slot hold."""
        return num_pages * self.page_size // self.token_bytes

    def held_bytes(self, num_tokens: int) -> int:
        """Bytes `num_tokens` tokens occupy in the whole cache (K and V of every layer)."""
        return num_tokens * self.token_bytes_all

    def shared_pages(self, num_tokens: int) -> int:
        """Whole pages of a slot's first `num_tokens` tokens (what a fork shares)."""
        return num_tokens * self.token_bytes // self.page_size

    first_writable = shared_pages  # the page a slot of that length writes its next token into

    def page_offset(self, slot: int, page: int) -> int:
        """Byte offset of (slot, page) inside every buffer."""
        return slot * self.slot_bytes + page * self.page_size
