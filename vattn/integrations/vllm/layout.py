"""What vLLM's scheduler and every worker must agree on: the `VATTN_VLLM*` settings and the
KV cache's block layout (`BlockLayout`: where each block's bytes lie in the backing allocation)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from vattn.errors import TooFewBlocksError, UnsupportedLayoutError
from vattn.integrations import _env

DEFAULT_PAGE_SIZE = 2 << 20  # the CUDA granularity on stock drivers
DEFAULT_IDLE_TRIM_S = 30.0
DEFAULT_RESERVE = 4  # page groups each worker creates ahead of the scheduler (see "Refused pages")


# ------------------------------------------------------------------ configuration ----
def enabled() -> bool:
    """False when `VATTN_VLLM=0` (stock vLLM memory)."""
    return _env.flag("VATTN_VLLM")


def page_size() -> int:
    """Bytes of one page (per region); `VATTN_VLLM_PAGE_SIZE`, default 2 MiB."""
    return _env.number("VATTN_VLLM_PAGE_SIZE", int, DEFAULT_PAGE_SIZE, low=1, what="an integer number of bytes")


def memory_limit() -> int | None:
    """`VATTN_VLLM_LIMIT`: bytes of KV pages each worker may hold (None: the whole cache)."""
    return _env.number("VATTN_VLLM_LIMIT", int, None, low=0, what="an integer number of bytes")


def idle_trim_s() -> float | None:
    """Seconds of idleness before memory goes back; None: never."""
    return _env.idle_trim_s("VATTN_VLLM_IDLE_TRIM_S", DEFAULT_IDLE_TRIM_S)


def reserve_groups() -> int:
    """`VATTN_VLLM_RESERVE`: page groups each worker keeps created ahead (default 4; the
    scheduler doubles what it asks for while requests wait on memory)."""
    return _env.number("VATTN_VLLM_RESERVE", int, DEFAULT_RESERVE, low=1, what="an integer number of page groups")


def settings() -> dict[str, Any]:
    """The settings the scheduler and every worker must agree on (`start` compares them)."""
    return {"VATTN_VLLM": enabled(), "VATTN_VLLM_PAGE_SIZE": page_size(), "VATTN_VLLM_LIMIT": memory_limit(),
            "VATTN_VLLM_RESERVE": reserve_groups()}


# ------------------------------------------------------------------- block layout ----
@dataclass(frozen=True)
class BlockLayout:
    """Where each block's bytes are in the KV cache's backing allocation.

    Block `b` occupies `[region + b * block_bytes, region + (b + 1) * block_bytes)` in every
    region (a layer's K/V pages with a layer-outer layout, the whole cache with a
    block-outer one). Page `p` of every region is mapped and unmapped together (one page
    group of the elastic pool). Regions start on page boundaries and do not overlap.
    """

    num_blocks: int
    block_bytes: int
    page_size: int
    regions: tuple[int, ...]  # byte offsets into the backing allocation
    size: int  # bytes of the backing allocation vLLM asked for

    @property
    def num_pages(self) -> int:
        return -(-self.num_blocks * self.block_bytes // self.page_size)

    @property
    def reserved_bytes(self) -> int:
        """Address space to reserve: the allocation, and every region's last page whole."""
        end = max(self.size, max(self.regions) + self.num_pages * self.page_size)
        return -(-end // self.page_size) * self.page_size

    @property
    def key(self) -> tuple:
        """What the scheduler's page operations mean: which blocks lie on page `p` (the
        blocks, their bytes, the page). The regions are each worker's own: pipeline stages
        with other layer counts map page `p` in each of their own regions."""
        return (self.num_blocks, self.block_bytes, self.page_size)


def _layer_spec(kv_cache_config: Any, layer: str) -> Any:
    for group in kv_cache_config.kv_cache_groups:
        if layer in group.layer_names:
            spec = group.kv_cache_spec
            specs = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
            return specs[layer] if isinstance(specs, dict) else spec
    raise UnsupportedLayoutError(f"layer {layer!r} is in no KV cache group")


def block_layout(kv_cache_config: Any, page: int | None = None) -> BlockLayout:
    """The `BlockLayout` of a vLLM `KVCacheConfig` (read by duck typing: `num_blocks`,
    `kv_cache_tensors` with `size, layers, layer_stride, block_stride, offset`, and
    `kv_cache_groups` with `layer_names, kv_cache_spec.page_size_bytes`).

    Raises `UnsupportedLayoutError` when the blocks are not contiguous runs laid out
    regularly (then vLLM keeps its own memory)."""
    P = page_size() if page is None else page
    tensors = list(kv_cache_config.kv_cache_tensors)
    N = int(kv_cache_config.num_blocks)
    if not tensors:
        raise UnsupportedLayoutError("the model has no KV cache tensors")
    if len({t.size for t in tensors}) != 1:
        raise UnsupportedLayoutError("KV cache tensors of different sizes (more than one backing allocation)")
    size = tensors[0].size
    strides, regions = set(), set()
    for t in tensors:
        if getattr(t, "host_resident", False):
            raise UnsupportedLayoutError("host-resident KV cache tensors (HiSparse)")
        specs = [_layer_spec(kv_cache_config, name) for name in t.layers]
        if not all(getattr(s, "has_layer_views", True) for s in specs):
            raise UnsupportedLayoutError("layers without per-layer views (e.g. Mamba state) lay out their own bytes")
        pages = [s.page_size_bytes for s in specs]
        L, ls, bs, off = len(t.layers), t.layer_stride, t.block_stride, getattr(t, "offset", 0)
        pg = max(pages)
        if off + (L - 1) * ls + pg <= bs:  # block-outer: block b is [b * bs, (b + 1) * bs) of the whole allocation
            strides.add(bs)
            regions.add(0)
        elif pg <= bs and (L == 1 or ls >= N * bs):  # layer-outer, block-compact: a region per layer
            strides.add(bs)
            regions.update(off + i * ls for i in range(L))
        else:
            raise UnsupportedLayoutError(
                f"layout with layer_stride={ls}, block_stride={bs}, page={pg} is not block-compact; "
                "use VLLM_KV_CACHE_LAYOUT=NHD (LBNHC) or HND (LBHNC)")
    if len(strides) != 1:
        raise UnsupportedLayoutError(f"block strides differ between KV cache tensors: {sorted(strides)}")
    B = strides.pop()
    g = BlockLayout(N, B, P, tuple(sorted(regions)), size)
    span = g.num_pages * P
    for a, b in zip(g.regions, g.regions[1:]):
        if a % P or b - a < span:
            if N < page_run_blocks(B, P):
                raise TooFewBlocksError(too_few_blocks_message(N, B, P))
            raise UnsupportedLayoutError(
                f"regions at {a} and {b} share a page of {P} bytes: the number of blocks ({N}) times the block "
                f"stride ({B}) must be a multiple of the page size (the patch aligns num_blocks for this)")
    if g.regions[-1] % P:
        raise UnsupportedLayoutError(f"a region at {g.regions[-1]} does not start on a page of {P} bytes")
    return g


def page_run_blocks(stride: int, page: int) -> int:
    """The fewest blocks of `stride` bytes that end on a page boundary: `page / gcd(page,
    stride)` (a layer-outer layout needs a multiple of it for every layer to start on a page)."""
    return page // math.gcd(page, stride)


def largest_page_for(num_blocks: int, stride: int, page: int) -> int | None:
    """The largest power-of-two page size below `page` whose whole-page run of `stride`-byte
    blocks fits in `num_blocks` (None: not even one of 4 KiB)."""
    p = page >> 1
    while p >= 4096:
        if page_run_blocks(stride, p) <= num_blocks:
            return p
        p >>= 1
    return None


def too_few_blocks_message(num_blocks: int, stride: int, page: int) -> str:
    """What `TooFewBlocksError` says: what vLLM measured, what one page run needs, what works."""
    m = page_run_blocks(stride, page)
    smaller = largest_page_for(num_blocks, stride, page)
    alt = (f"VATTN_VLLM_PAGE_SIZE={smaller} (where the device maps pages that small: the host backend; CUDA's "
           f"granularity is 2 MiB), " if smaller else "")
    return (f"vLLM measured room for {num_blocks} KV blocks of {stride} bytes a layer, and with "
            f"VATTN_VLLM_PAGE_SIZE={page} every layer's blocks must start on a page: that needs a multiple of {m} "
            f"blocks ({m * stride} bytes a layer), and rounding {num_blocks} down to one leaves none. Give the KV "
            f"cache room for at least {m} blocks (--gpu-memory-utilization, --num-gpu-blocks-override), or set "
            f"{alt}or VATTN_VLLM=0 (stock memory)")


def align_num_blocks(num_blocks: int, kv_cache_groups: Sequence[Any], block_outermost: bool,
                     block_stride: Any = None) -> int:
    """vLLM's planning hook: with a layer-outer layout, layer `l`'s blocks start at
    `l * num_blocks * stride`; round `num_blocks` *down* so that this is a whole number of
    pages for every layer: to a multiple of `m = lcm over layers of P / gcd(P, stride)`
    (`page_run_blocks`), the largest such count. Never up: the result is at most what vLLM
    measured room for, so vattn never promises blocks the device may not have.

    Fewer than `m` blocks are lost: with one stride, less than `lcm(P, stride)` bytes a
    layer, which is one page when the stride divides the page or the page the stride, and
    up to `stride / gcd(P, stride)` pages otherwise (an MLA block of 73,728 bytes on 64 KiB
    pages: m = 8, up to 7 blocks, 7.9 pages a layer; an fp8 latent block of 656 x 64 =
    41,984 bytes on 2 MiB pages: m = 2048, up to 2047 blocks). When `num_blocks < m`
    rounding would leave none: vLLM's count is returned unchanged, a worker keeps vLLM's
    own memory for that cache (a profiling cache of a few blocks), and EngineCore's `start`
    refuses the engine's real cache with the page size that works (`TooFewBlocksError`).
    `block_stride(spec)`: vLLM's padded per-layer block stride (default: the page size)."""
    if not enabled() or block_outermost or num_blocks <= 1:
        return num_blocks
    P = page_size()
    m = 1
    for group in kv_cache_groups:
        for name in group.layer_names:
            spec = group.kv_cache_spec
            specs = getattr(spec, "kv_cache_specs", None)
            spec = specs[name] if isinstance(specs, dict) else spec
            s = block_stride(spec) if block_stride is not None else spec.page_size_bytes
            m = math.lcm(m, page_run_blocks(s, P))
    if num_blocks < m:
        return num_blocks  # no whole-page run: vattn does not back it (start refuses the engine's cache)
    return num_blocks - num_blocks % m
