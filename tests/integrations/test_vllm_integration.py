"""vattn.integrations.vllm without vLLM and without a GPU: the host backend behind a
stand-in of vLLM's `BlockPool` that carries the patch's hunks (the same lines as
patches/vllm-*.patch), driven by the block-allocation call sequence of a server.

`tests/integrations/test_vllm_patch.py` (slow) runs the real, patched vLLM block pool."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from tests.conftest import FakeClock
from vattn.integrations import vllm as vv

PAGE = 64 << 10


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("VATTN_VLLM_PAGE_SIZE", str(PAGE))
    for name in ("VATTN_VLLM", "VATTN_VLLM_LIMIT", "VATTN_VLLM_IDLE_TRIM_S"):
        monkeypatch.delenv(name, raising=False)
    yield
    vv.reset_worker()


# ------------------------------------------------- a stand-in of vLLM's block pool ----
class Block:
    """vLLM's KVCacheBlock: the fields the block pool uses."""

    def __init__(self, i: int) -> None:
        self.block_id, self.ref_cnt, self.block_hash = i, 0, None
        self.prev_free_block = self.next_free_block = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeQueue:
    """vLLM's FreeKVCacheBlockQueue (a doubly linked list with fake head and tail)."""

    def __init__(self, blocks):
        self.fake_free_list_head, self.fake_free_list_tail = Block(-1), Block(-1)
        self.fake_free_list_head.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = self.fake_free_list_head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft_n(self, n):
        out = []
        for _ in range(n):
            b = self.fake_free_list_head.next_free_block
            assert b is not self.fake_free_list_tail
            self.remove(b)
            out.append(b)
        return out

    def remove(self, b):
        if b.prev_free_block is None or b.next_free_block is None:
            raise RuntimeError(f"remove() called on an invalid block: {b}")
        b.prev_free_block.next_free_block = b.next_free_block
        b.next_free_block.prev_free_block = b.prev_free_block
        b.prev_free_block = b.next_free_block = None
        self.num_free_blocks -= 1

    def _insert_after(self, prev, b):
        b.prev_free_block, b.next_free_block = prev, prev.next_free_block
        prev.next_free_block.prev_free_block = b
        prev.next_free_block = b
        self.num_free_blocks += 1

    def prepend_n(self, blocks):
        prev = self.fake_free_list_head
        for b in blocks:
            self._insert_after(prev, b)
            prev = b

    def append_n(self, blocks):
        for b in blocks:
            self._insert_after(self.fake_free_list_tail.prev_free_block, b)


class BlockPool:
    """vLLM 0.33's BlockPool, cut to what allocation touches, with the patch's hunks."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeQueue(self.blocks)
        self.cached = {}  # hash -> block
        self._reuse_watchers = {}
        self.null_block = self.free_block_queue.popleft_n(1)[0]
        self.vattn = None  # hunk: set by vattn.integrations.vllm.attach

    def get_num_free_blocks(self):
        return self.vattn.num_free_blocks() if self.vattn else self.free_block_queue.num_free_blocks  # hunk

    def get_new_blocks(self, n):
        if n > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        ret = self.vattn.take(n) if self.vattn else self.free_block_queue.popleft_n(n)  # hunk
        for b in ret:
            self._reuse_watchers.pop(b.block_id, None)
            self._maybe_evict_cached_block(b)
            assert b.ref_cnt == 0
            b.ref_cnt += 1
        return ret

    def _maybe_evict_cached_block(self, b):
        if b.block_hash is None:
            return False
        del self.cached[b.block_hash]
        b.block_hash = None
        return True

    def cache_full_block(self, b, h):
        if h not in self.cached:
            b.block_hash = h
            self.cached[h] = b

    def touch(self, blocks):
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered):
        first, last = [], []
        for b in ordered:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (first if b.block_hash is None or not self.enable_caching else last).append(b)
        if self.vattn:  # hunk
            self.vattn.release(first)
        else:
            self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)

    def unpin_blocks(self, blocks, on_reuse):
        released = []
        for b in blocks:
            b.ref_cnt -= 1
            self._reuse_watchers[b.block_id] = on_reuse
            if b.ref_cnt == 0:
                released.append(b)
        self.free_block_queue.append_n(released)

    def reset_prefix_cache(self):
        free = self.vattn.num_unused_blocks() if self.vattn else self.get_num_free_blocks()  # hunk
        if self.num_gpu_blocks - free != 1:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        if self.vattn:
            self.vattn.reclaim()  # hunk
        return True


# ------------------------------------------------------------- configurations ----
def kv_config(num_blocks=64, layers=2, block_tokens=16, heads=2, head_dim=64, dtype_bytes=2,
              layout="layer-outer"):
    """A vLLM KVCacheConfig (the fields vattn reads) of one attention group."""
    page = 2 * block_tokens * heads * head_dim * dtype_bytes  # K and V of one block, one layer
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    if layout == "layer-outer":
        ls, bs = num_blocks * page, page
    else:  # block-outer
        ls, bs = page, layers * page
    tensor = SimpleNamespace(size=num_blocks * layers * page, layers=names, layer_stride=ls, block_stride=bs, offset=0)
    group = SimpleNamespace(layer_names=names, kv_cache_spec=SimpleNamespace(page_size_bytes=page, block_size=block_tokens))
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[group])


def engine(cfg=None, limit=None):
    """The scheduler's block pool and one worker's KV cache, both on vattn."""
    cfg = cfg or kv_config()
    if limit is not None:
        import os
        os.environ["VATTN_VLLM_LIMIT"] = str(limit)
    bp = BlockPool(cfg.num_blocks)
    skv = vv.attach(bp, cfg)
    assert skv is not None and bp.vattn is skv
    buf = vv.kv_cache_buffer(cfg, cfg.kv_cache_tensors[0].size, "cpu")
    return bp, skv, vv.worker_kv("cpu"), buf


def step(skv):
    """One scheduler step: the output carries the ops, the worker applies them."""
    out = SimpleNamespace(vattn_ops=vv.take_ops(SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=skv.block_pool))))
    vv.apply(out)
    return out.vattn_ops


def held(bp):
    return [b for b in bp.blocks if b.block_id == 0 or b.ref_cnt > 0 or b.block_hash is not None]


def write(w, b):
    g = w.layout
    for r in g.regions:
        w.tensor[r + b * g.block_bytes:r + (b + 1) * g.block_bytes] = b % 120 + 1


def check(w, b):
    g = w.layout
    for r in g.regions:
        assert w.is_mapped(b), b
        assert int(w.tensor[r + b * g.block_bytes]) == b % 120 + 1, f"block {b} lost its data"
        assert int(w.tensor[r + (b + 1) * g.block_bytes - 1]) == b % 120 + 1, f"block {b} lost its data"


# ------------------------------------------------------------------- geometry ----
def test_block_layout_layer_outer_and_block_outer():
    cfg = kv_config(num_blocks=64, layers=3)
    g = vv.block_layout(cfg)
    page = 2 * 16 * 2 * 64 * 2
    assert (g.num_blocks, g.block_bytes, g.page_size) == (64, page, PAGE)
    assert g.regions == (0, 64 * page, 128 * page)  # one region per layer
    g2 = vv.block_layout(kv_config(num_blocks=64, layers=3, layout="block-outer"))
    assert g2.regions == (0,) and g2.block_bytes == 3 * page  # one block = every layer's page
    assert g2.reserved_bytes % PAGE == 0 and g2.reserved_bytes >= g2.size


def test_block_layout_refuses_what_it_cannot_back():
    cfg = kv_config(num_blocks=63)  # 63 blocks x 8 KiB: layer 1 starts in the middle of a 64 KiB page
    with pytest.raises(vv.UnsupportedLayoutError, match="multiple of the page size"):
        vv.block_layout(cfg)
    cfg = kv_config()
    cfg.kv_cache_tensors[0].block_stride //= 4  # heads outside blocks (LHBNC): a block is not one run
    with pytest.raises(vv.UnsupportedLayoutError, match="block-compact"):
        vv.block_layout(cfg)
    cfg = kv_config()
    cfg.kv_cache_groups[0].kv_cache_spec.has_layer_views = False  # Mamba's raw state
    with pytest.raises(vv.UnsupportedLayoutError):
        vv.block_layout(cfg)
    bp = BlockPool(cfg.num_blocks)
    assert vv.attach(bp, cfg) is None and bp.vattn is None  # vLLM keeps its own memory
    assert vv.kv_cache_buffer(cfg, cfg.kv_cache_tensors[0].size, "cpu") is None


def test_align_num_blocks_makes_layers_start_on_pages():
    groups = kv_config().kv_cache_groups  # 8 KiB a block and layer: 8 blocks a 64 KiB page
    assert vv.align_num_blocks(1000, groups, block_outermost=False) == 1000
    assert vv.align_num_blocks(1003, groups, block_outermost=False) == 1000
    assert vv.align_num_blocks(1003, groups, block_outermost=True) == 1003
    assert vv.align_num_blocks(1003, groups, False, block_stride=lambda s: 12 << 10) == 992  # 64 KiB / gcd(64 KiB, 12 KiB) = 16
    vv.block_layout(kv_config(num_blocks=vv.align_num_blocks(1003, groups, False)))
    # an MLA block (73,728 bytes) on 64 KiB pages: a multiple of 8 blocks; 7 lost, 7.9 pages a layer
    assert vv.align_num_blocks(1007, groups, False, block_stride=lambda s: 73728) == 1000


def strided_config(num_blocks: int, stride: int, layers: int = 2):
    """A layer-outer KVCacheConfig of `layers` layers of `stride` bytes a block, as vLLM plans it."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    tensor = SimpleNamespace(size=num_blocks * layers * stride, layers=names, layer_stride=num_blocks * stride,
                             block_stride=stride, offset=0)
    group = SimpleNamespace(layer_names=names, kv_cache_spec=SimpleNamespace(page_size_bytes=stride, block_size=16))
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[group])


# (what vLLM measured, the bytes of a block in every layer, the page): each was rounded *up* before
@pytest.mark.parametrize("measured, layers, stride, page, backed", [
    (8 << 20, 11, 4096, 2 << 20, None),  # vLLM's test_layer_outer_pads_only_unaligned_pages: 186 blocks (512 before)
    (8 << 20, 11, 4096, 64 << 10, 176),  # the same at 64 KiB pages: rounded down, 10 blocks lost
    (10 * 2 * (16 << 10), 2, 16 << 10, 2 << 20, None),  # test_get_kv_cache_configs_multiple_workers: 10 (128 before)
    (100 * 61 * 41984, 61, 656 * 64, 2 << 20, None),  # fp8 latent attention, 100 blocks (2048 before: +4.7 GiB)
    (3000 * 61 * 41984, 61, 656 * 64, 2 << 20, 2048),  # 3000 blocks: a multiple of 2048 (952 lost, by design)
    (100 * 61 * 73728, 61, 576 * 2 * 64, 2 << 20, None),  # bf16 latent: m = 128
    (300 * 61 * 73728, 61, 576 * 2 * 64, 2 << 20, 256),
])
def test_aligned_blocks_never_exceed_what_vllm_measured(monkeypatch, measured, layers, stride, page, backed):
    """The overcommit of issue 38: `align_num_blocks` rounded up to one whole-page run when
    vLLM measured fewer blocks (186 -> 512, a 22 MiB KV tensor against 8 MiB). Now the count
    never grows; a cache with no whole-page run keeps vLLM's count and is not backed by vattn
    (`TooFewBlocksError`, which EngineCore's `start` turns into a refusal naming what works)."""
    monkeypatch.setenv("VATTN_VLLM_PAGE_SIZE", str(page))
    cfg = strided_config(1, stride, layers)
    n = measured // (layers * stride)  # vLLM: available memory // bytes per block
    got = vv.align_num_blocks(n, cfg.kv_cache_groups, False)
    assert got * layers * stride <= measured
    if backed is None:
        assert got == n
        with pytest.raises(vv.TooFewBlocksError, match=f"VATTN_VLLM_PAGE_SIZE={page}.*multiple of "
                                                         f"{vv.page_run_blocks(stride, page)} blocks"):
            vv.block_layout(strided_config(got, stride, layers))
    else:
        assert got == backed
        g = vv.block_layout(strided_config(got, stride, layers))
        assert g.num_pages * page * len(g.regions) == got * layers * stride  # every page it can map was measured


def test_too_few_blocks_names_the_page_size_that_works(monkeypatch):
    monkeypatch.setenv("VATTN_VLLM_PAGE_SIZE", str(2 << 20))
    with pytest.raises(vv.TooFewBlocksError) as e:
        vv.block_layout(strided_config(100, 656 * 64, 61))
    msg = str(e.value)
    assert "room for 100 KV blocks of 41984 bytes" in msg and "multiple of 2048" in msg
    assert "VATTN_VLLM_PAGE_SIZE=65536" in msg  # 64 KiB / gcd(64 KiB, 41,984) = 64 blocks <= 100
    assert "VATTN_VLLM=0" in msg and "--gpu-memory-utilization" in msg
    bp = BlockPool(100)
    assert vv.attach(bp, strided_config(100, 656 * 64, 61)) is None  # in-process without start: vLLM's memory


# strides of real models: latent attention (fp8: 656 B a token, bf16: 576 x 2 B) at 16 and 64
# tokens a block, ordinary K+V blocks, odd multiples of 16 bytes
STRIDES = st.one_of(st.sampled_from([656 * 16, 656 * 64, 576 * 2 * 16, 576 * 2 * 64, 4096 * 11, 8 << 10, 16 << 10,
                                     32 << 10, 12 << 10, 73728, 2 << 20, 3 << 20]),
                    st.integers(1, 1 << 14).map(lambda x: 16 * x))
PAGES = st.sampled_from([64 << 10, 1 << 20, 2 << 20, 4 << 20])


@given(strides=st.lists(STRIDES, min_size=1, max_size=3), layers=st.integers(1, 4), page=PAGES,
       measured=st.integers(0, 64 << 30))
@settings(max_examples=400, deadline=None)
def test_align_num_blocks_never_exceeds_the_measured_bytes(strides, layers, page, measured):
    """For any strides, page size and measured memory: `num_blocks * bytes per block` never
    exceeds what vLLM measured, and blocks are lost only as the design says: fewer than one
    whole-page run `m` (the count kept is the largest multiple of `m`), or none at all when
    vLLM measured fewer than `m` (that cache is then not backed by vattn)."""
    import os
    os.environ["VATTN_VLLM_PAGE_SIZE"] = str(page)  # (monkeypatch is function-scoped: hypothesis reuses it)
    names = [f"l{i}" for i in range(layers * len(strides))]
    spec_of = {n: strides[i % len(strides)] for i, n in enumerate(names)}
    groups = [SimpleNamespace(layer_names=names, kv_cache_spec=SimpleNamespace(
        kv_cache_specs={n: SimpleNamespace(page_size_bytes=s) for n, s in spec_of.items()}))]
    per_block = sum(spec_of.values())  # vLLM's bytes_per_block, layer-outer
    n = measured // per_block
    got = vv.align_num_blocks(n, groups, False)
    m = math.lcm(*(page // math.gcd(page, s) for s in strides))  # one whole-page run for every layer
    assert got <= n and got * per_block <= measured
    if n <= 1 or n < m:
        assert got == n  # nothing rounded: not backed by vattn (start refuses) unless already aligned
    else:
        assert got % m == 0 and n - got < m
        assert all(got * s % page == 0 for s in strides)  # every layer starts on a page
    if len(strides) == 1 and n >= 1:
        cfg = strided_config(got, strides[0], layers)
        if layers > 1 and got < m:
            with pytest.raises(vv.TooFewBlocksError):
                vv.block_layout(cfg)
        elif got >= 1:
            g = vv.block_layout(cfg)
            if layers > 1:  # the pages it can map: exactly the measured blocks' bytes
                assert g.num_pages * page * len(g.regions) == got * per_block <= measured


def test_off_means_stock_vllm(monkeypatch):
    monkeypatch.setenv("VATTN_VLLM", "0")
    cfg = kv_config()
    bp = BlockPool(cfg.num_blocks)
    assert vv.attach(bp, cfg) is None
    assert vv.kv_cache_buffer(cfg, 100, "cpu") is None
    assert vv.align_num_blocks(1003, cfg.kv_cache_groups, False) == 1003
    assert bp.get_num_free_blocks() == cfg.num_blocks - 1
    assert [b.block_id for b in bp.get_new_blocks(3)] == [1, 2, 3]


# ------------------------------------------------------------ the server trace ----
@pytest.mark.parametrize("limit_groups", [None, 6])
def test_server_trace_memory_grows_with_load_and_falls_after_free_and_trim(limit_groups):
    bp, skv, w, buf = engine(kv_config(num_blocks=256, layers=2),
                             limit=None if limit_groups is None else limit_groups * 2 * PAGE)
    g = w.layout
    idle = w.mapped_bytes
    assert idle == len(g.regions) * PAGE and w.is_mapped(0)  # the null block's page only
    assert buf.data_ptr() == w.tensor.data_ptr() and buf.numel() == g.size
    rng = random.Random(0)
    reqs: dict[int, list] = {}
    peak, trace = idle, []
    for t in range(300):  # arrivals, decode growth, finishes: vLLM's allocate_slots / free calls
        if rng.random() < 0.3 and len(reqs) < 12:
            n = rng.randint(1, 8)
            if n <= bp.get_num_free_blocks():
                reqs[t] = bp.get_new_blocks(n)
                trace.append(("alloc", n))
        for rid in list(reqs):
            r = rng.random()
            if r < 0.15:
                bp.free_blocks(reversed(reqs.pop(rid)))  # vLLM frees the tail first
                trace.append(("free", rid))
            elif r < 0.5 and bp.get_num_free_blocks() >= 1:
                reqs[rid] += bp.get_new_blocks(1)
        ops = step(skv)
        for blocks in reqs.values():
            for b in blocks:
                if int(w.tensor[g.regions[0] + b.block_id * g.block_bytes]) != b.block_id % 120 + 1:
                    write(w, b.block_id)
        for blocks in reqs.values():
            for b in blocks:
                check(w, b.block_id)  # nothing in use was unmapped; its data survived every step
        skv.check_invariants()
        peak = max(peak, w.mapped_bytes)
        assert w.mapped_bytes == skv.stats().mapped_bytes  # the worker holds exactly the books
        if ops is not None:
            assert ops.seq == w.seq
    assert peak > 4 * idle  # memory grew with load
    if limit_groups is not None:
        assert peak == limit_groups * 2 * PAGE  # never over the limit: free blocks in mapped pages went first
    used_pages = skv.stats().num_mapped_pages
    for rid in list(reqs):
        bp.free_blocks(reversed(reqs.pop(rid)))
    step(skv)
    assert skv.stats().num_mapped_pages == used_pages  # freeing keeps pages (deferred reclamation)
    assert skv.trim() > 0
    step(skv)
    assert w.mapped_bytes == idle and w.is_mapped(0)  # back to the null block's page
    skv.check_invariants()
    assert bp.get_num_free_blocks() == (255 if limit_groups is None else limit_groups * 8 - 1)  # what the limit holds
    assert bp.reset_prefix_cache()


def test_page_aware_allocation_packs_blocks_into_mapped_pages():
    bp, skv, w, _ = engine(kv_config(num_blocks=256))  # 8 blocks a page
    a = bp.get_new_blocks(7)  # page 0 holds the null block and these 7
    step(skv)
    assert w.mapped_bytes == 2 * PAGE
    b = bp.get_new_blocks(8)
    step(skv)
    assert w.mapped_bytes == 2 * 2 * PAGE
    bp.free_blocks(reversed(a))
    c = bp.get_new_blocks(3)  # back into page 0, next to the null block, no new page
    assert {x.block_id for x in c} <= {x.block_id for x in a}
    assert step(skv) is None
    bp.free_blocks(b + c)


def test_exhausted_pool_is_a_scheduling_miss():
    page_group = 2 * PAGE  # two regions
    bp, skv, w, _ = engine(kv_config(num_blocks=256), limit=3 * page_group)  # 24 blocks, one is null
    assert bp.get_num_free_blocks() == 23

    def allocate_slots(n):  # vLLM's KVCacheManager.allocate_slots: a miss is None, nothing changes
        return None if n > bp.get_num_free_blocks() else bp.get_new_blocks(n)

    a = allocate_slots(20)
    assert a is not None
    step(skv)
    before = (bp.get_num_free_blocks(), w.mapped_bytes)
    assert allocate_slots(4) is None  # scheduling miss: vLLM preempts or waits
    assert (bp.get_num_free_blocks(), w.mapped_bytes) == before
    with pytest.raises(ValueError, match="Cannot get 4 free blocks"):  # vLLM's own check, no vattn crash
        bp.get_new_blocks(4)
    assert allocate_slots(3) is not None
    assert step(skv) is None and w.mapped_bytes == 3 * page_group  # the limit held
    bp.free_blocks(a[:10])  # a preempted request's blocks
    assert allocate_slots(4) is not None
    skv.check_invariants()


def test_prefix_cached_blocks_keep_their_pages_until_evicted():
    bp, skv, w, _ = engine(kv_config(num_blocks=256))
    blocks = bp.get_new_blocks(16)
    step(skv)
    for i, b in enumerate(blocks[:12]):  # 12 full blocks get a prefix hash, 4 stay partial
        bp.cache_full_block(b, ("prompt", i))
        write(w, b.block_id)
    bp.free_blocks(reversed(blocks))
    assert bp.free_block_queue.num_free_blocks == 12  # cached: vLLM's queue, mapped
    skv.trim(evict_prefix_cache=False)
    step(skv)
    for b in blocks[:12]:
        check(w, b.block_id)  # a later request may hit them: still mapped, data intact
    hit = [bp.cached[("prompt", i)] for i in range(4)]
    bp.touch(hit)  # a prefix hit takes them back
    assert skv.trim() > 0  # the idle trim evicts the other cached blocks
    step(skv)
    for b in hit:
        check(w, b.block_id)
    assert len(bp.cached) == 4 and bp.free_block_queue.num_free_blocks == 0
    skv.check_invariants()
    bp.free_blocks(hit)


def test_cached_blocks_are_handed_out_only_when_memory_is_short():
    bp, skv, w, _ = engine(kv_config(num_blocks=256), limit=2 * 2 * PAGE)  # 16 blocks
    a = bp.get_new_blocks(8)
    for i, b in enumerate(a):
        bp.cache_full_block(b, i)
    bp.free_blocks(a)
    assert bp.get_num_free_blocks() == 15  # 7 in the pool + 8 cached
    b = bp.get_new_blocks(7)
    assert len(bp.cached) == 8  # memory under the limit first: the cache survives
    c = bp.get_new_blocks(2)  # then the LRU cached blocks, as stock vLLM evicts
    assert len(bp.cached) == 6 and {x.block_id for x in c} <= {x.block_id for x in a}
    step(skv)
    skv.check_invariants()
    bp.free_blocks(b + c)


def test_watched_blocks_stay_mapped_until_reused():
    bp, skv, w, _ = engine(kv_config(num_blocks=64))
    a = bp.get_new_blocks(4)
    step(skv)
    for b in a:
        write(w, b.block_id)
    bp.unpin_blocks(a, on_reuse=lambda b: None)  # readable until reused
    skv.trim()
    step(skv)
    for b in a:
        check(w, b.block_id)
    skv.check_invariants()


def test_reset_prefix_cache_gives_blocks_back_to_the_pool():
    bp, skv, w, _ = engine(kv_config(num_blocks=64), limit=2 * 2 * PAGE)
    a = bp.get_new_blocks(15)
    for i, b in enumerate(a):
        bp.cache_full_block(b, i)
    bp.free_blocks(a)
    assert bp.reset_prefix_cache()  # "nothing in use" counts free blocks whatever the memory
    assert bp.free_block_queue.num_free_blocks == 0 and skv.pool.num_free_blocks == 63
    skv.check_invariants()


def test_set_limit_gives_cached_pages_back():
    bp, skv, w, _ = engine(kv_config(num_blocks=256))
    a = bp.get_new_blocks(40)
    step(skv)
    bp.free_blocks(a[20:])
    skv.set_limit(4 * 2 * PAGE)
    ops = step(skv)
    assert ops.counts().get("unmap", 0) > 0
    assert w.mapped_bytes <= 4 * 2 * PAGE
    for b in a[:20]:
        check_mapped = w.is_mapped(b.block_id)
        assert check_mapped
    assert bp.get_num_free_blocks() == 32 - 21
    skv.check_invariants()


# ----------------------------------------------------------- fence and order ----
def test_maps_and_unmaps_wait_for_the_device_once_per_batch(monkeypatch):
    # an unmap: kernels enqueued before may read the page; a map: it replaces the scratch
    # page there, which kernels may read too (vLLM may touch any block)
    bp, skv, w, _ = engine(kv_config(num_blocks=256))
    events = []
    monkeypatch.setattr(w, "synchronize", lambda: events.append("sync"))
    real_unmap, real_map = w.backend.unmap, w.backend.map
    monkeypatch.setattr(w.backend, "unmap", lambda *a: (events.append("unmap"), real_unmap(*a))[1])
    monkeypatch.setattr(w.backend, "map", lambda *a: (events.append("map"), real_map(*a))[1])
    a = bp.get_new_blocks(30)
    step(skv)
    assert events[0] == "sync" and "map" in events and events.count("sync") == 1
    events.clear()
    bp.free_blocks(a[:10])
    bp.get_new_blocks(5)  # reuses mapped pages: nothing to map, nothing to wait for
    step(skv)
    assert events == []
    bp.free_blocks(a[10:])
    bp.free_blocks(a)
    skv.trim()
    step(skv)
    assert events[0] == "sync" and "unmap" in events and events.count("sync") == 1


def test_batches_out_of_order_are_refused():
    bp, skv, w, _ = engine()
    bp.get_new_blocks(10)
    first = skv.drain()
    bp.get_new_blocks(10)
    second = skv.drain()
    with pytest.raises(vv.OpsOutOfOrderError, match="batch 2 after batch 0"):
        w.apply(second)
    w.apply(first)
    with pytest.raises(vv.OpsOutOfOrderError):
        w.apply(first)
    w.apply(second)
    bad = vv.PageOps(3, (1, 2, 3), [])
    with pytest.raises(vv.OpsOutOfOrderError, match="geometry"):
        w.apply(bad)


def test_the_layout_key_is_the_block_to_page_map_not_the_regions():
    """A pipeline stage with another layer count (other regions) applies the same batches;
    another block size or page is another map of blocks to pages, and refused."""
    one = vv.block_layout(kv_config(num_blocks=64, layers=1))
    two = vv.block_layout(kv_config(num_blocks=64, layers=2))
    other = vv.block_layout(kv_config(num_blocks=64, layers=2, heads=4))
    assert one.key == two.key and one.regions != two.regions and other.key != two.key
    bp, skv, w, _ = engine(kv_config(num_blocks=64, layers=2))
    bp.get_new_blocks(10)
    ops = skv.drain()
    with pytest.raises(vv.OpsOutOfOrderError, match="geometry"):
        w.apply(vv.PageOps(ops.seq, other.key, ops.ops))
    w.apply(ops)


def test_ops_without_a_vattn_worker_are_an_error():
    bp, skv, w, _ = engine()
    bp.get_new_blocks(10)
    ops = skv.drain()
    vv.reset_worker()
    with pytest.raises(vv.OpsOutOfOrderError, match="VATTN_VLLM"):
        vv.apply(SimpleNamespace(vattn_ops=ops))
    with pytest.raises(vv.OpsOutOfOrderError, match="VATTN_VLLM"):  # the idle path alike
        vv.apply_rpc(SimpleNamespace(), ops)
    vv.apply(SimpleNamespace(vattn_ops=None))  # nothing to do


def test_a_new_allocation_replaces_the_profiling_one():
    cfg = kv_config(num_blocks=64)
    first = vv.kv_cache_buffer(cfg, cfg.kv_cache_tensors[0].size, "cpu")
    w1 = vv.worker_kv("cpu")
    del first
    vv.kv_cache_buffer(cfg, cfg.kv_cache_tensors[0].size, "cpu")
    assert vv.worker_kv("cpu") is not w1 and w1.closed and not w1.mapped


# ---------------------------------------------------------------------- idle ----
def engine_core(bp, sent: list) -> SimpleNamespace:
    """A stand-in EngineCore whose executor applies each collective_rpc on one worker and
    records the batch it sent in `sent`."""

    class Executor:
        def collective_rpc(self, method, args=()):
            sent.append(args[0])
            return [method(SimpleNamespace(), *args)]

    return SimpleNamespace(scheduler=SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=bp)),
                           model_executor=Executor())


def test_idle_trim_after_the_delay_reaches_the_workers(monkeypatch):
    monkeypatch.setenv("VATTN_VLLM_IDLE_TRIM_S", "0.05")
    bp, skv, w, _ = engine(kv_config(num_blocks=256))
    sent: list = []
    core = engine_core(bp, sent)
    clock = skv.idle.clock = FakeClock()
    a = bp.get_new_blocks(40)
    step(skv)
    bp.free_blocks(a)
    vv.on_idle(core)  # the engine just went idle: the clock starts
    assert not sent and vv.idle_wakeup(core) == pytest.approx(0.06)  # the delay, and 10 ms to be past it
    clock.advance(0.04)
    vv.on_idle(core)
    assert not sent and vv.idle_wakeup(core) == pytest.approx(0.02)  # not idle long enough
    clock.advance(0.01)
    vv.on_idle(core)
    assert len(sent) == 1 and w.mapped_bytes == 2 * PAGE and w.seq == sent[0].seq
    assert vv.idle_wakeup(core) is None  # trimmed: block as vLLM does
    clock.advance(100)
    vv.on_idle(core)
    assert len(sent) == 1
    bp.get_new_blocks(3)
    step(skv)  # work again: the idle clock restarts
    assert skv.idle.idle_since is None and not skv.idle.trimmed


def test_idle_trim_off(monkeypatch):
    monkeypatch.setenv("VATTN_VLLM_IDLE_TRIM_S", "-1")
    bp, skv, w, _ = engine()
    core = SimpleNamespace(scheduler=SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=bp)))
    vv.on_idle(core)
    assert vv.idle_wakeup(core) is None
    monkeypatch.setenv("VATTN_VLLM_IDLE_TRIM_S", "soon")
    with pytest.raises(vv.InvalidConfigError, match="seconds"):
        vv.on_idle(core)
    monkeypatch.setenv("VATTN_VLLM_IDLE_TRIM_S", "nan")
    with pytest.raises(vv.InvalidConfigError, match="seconds"):
        vv.on_idle(core)


@pytest.mark.parametrize("raw, delay", [("30", 30.0), ("0", 0.0), ("0.25", 0.25), ("-1", None), ("-0.5", None),
                                        ("inf", None), ("1e300", None), ("", "default")])
def test_one_idle_trim_rule_for_the_three_integrations(monkeypatch, raw, delay):
    """vattn.integrations._env (vattn.idle's rule): seconds >= 0; None, a negative number,
    infinity or more than a timer can wait (10**300 as an int raised OverflowError): never;
    the same for the environment variables and the Python settings."""
    from vattn.integrations import _env, hf_cb
    from vattn.integrations import sglang as vs

    monkeypatch.setenv("VATTN_VLLM_IDLE_TRIM_S", raw)
    monkeypatch.setenv("VATTN_SGLANG_IDLE_TRIM_S", raw)
    assert vv.idle_trim_s() == (vv.DEFAULT_IDLE_TRIM_S if delay == "default" else delay)
    assert vs.KVSettings.from_env().idle_trim_s == (vs.KVSettings().idle_trim_s if delay == "default" else delay)
    if delay != "default":
        value = float(raw)
        assert vs.KVSettings(idle_trim_s=value).idle_trim_s == delay
        assert hf_cb._check_settings(None, None, value) == delay
        assert _env.idle_delay(int(value) if value.is_integer() else value) == delay
    assert _env.idle_delay(None) is None and vs.KVSettings(idle_trim_s=None).idle_trim_s is None
    for bad in (float("nan"), "2", True):
        with pytest.raises(vv.InvalidConfigError, match="idle_trim_s must be a number of seconds"):
            _env.idle_delay(bad)
        with pytest.raises(vv.InvalidConfigError, match="idle_trim_s"):
            vs.KVSettings(idle_trim_s=bad)


def test_an_idle_trim_past_what_a_timer_can_wait_blocks_as_vllm_does(monkeypatch):
    """idle_wakeup is the timeout of vLLM's input queue: 1e300 s made `queue.get` raise
    OverflowError in EngineCore's loop; past what a timer can wait is never (None: block)."""
    monkeypatch.setenv("VATTN_VLLM_IDLE_TRIM_S", "1e300")
    bp, skv, w, _ = engine()
    core = engine_core(bp, [])
    vv.on_idle(core)
    assert vv.idle_wakeup(core) is None


@pytest.mark.parametrize("trim_s", ["30", "-1"])
def test_set_limit_on_an_idle_engine_reaches_the_workers(monkeypatch, trim_s):
    """While idle (idle trim off, or not due yet) no step follows: the limit's unmaps must
    reach the workers now, not with the next request."""
    monkeypatch.setenv("VATTN_VLLM_IDLE_TRIM_S", trim_s)
    bp, skv, w, _ = engine(kv_config(num_blocks=256))
    sent: list = []
    core = engine_core(bp, sent)
    a = bp.get_new_blocks(40)
    step(skv)
    bp.free_blocks(a[20:])
    vv.on_idle(core)
    assert not sent and (vv.idle_wakeup(core) is None) == (trim_s == "-1")  # block, or wait ~30 s
    skv.set_limit(4 * 2 * PAGE)  # in the EngineCore process, e.g. from a utility call
    assert vv.idle_wakeup(core) == 0.0  # the idle loop comes back at once
    vv.on_idle(core)
    assert sent and w.mapped_bytes <= 4 * 2 * PAGE and w.seq == skv.seq
    assert vv.idle_wakeup(core) != 0.0
    for b in a[:20]:
        assert w.is_mapped(b.block_id)
    n = len(sent)
    vv.set_limit(core, 3 * 2 * PAGE)  # the in-process API sends at once
    assert len(sent) == n + 1 and w.mapped_bytes <= 3 * 2 * PAGE and w.seq == skv.seq
    skv.check_invariants()


def test_block_outer_layout_blocks_span_pages():
    cfg = kv_config(num_blocks=40, layers=12, layout="block-outer")  # 96 KiB a block: 1.5 pages
    bp, skv, w, _ = engine(cfg)
    a = bp.get_new_blocks(9)
    step(skv)
    for b in a:
        write(w, b.block_id)
    bp.free_blocks(a[::2])
    skv.trim()
    step(skv)
    for b in a[1::2]:
        check(w, b.block_id)
    skv.check_invariants()


def test_limit_too_small_for_the_null_block(monkeypatch):
    monkeypatch.setenv("VATTN_VLLM_LIMIT", "100")
    cfg = kv_config()
    with pytest.raises(vv.InvalidConfigError, match="null block"):
        vv.attach(BlockPool(cfg.num_blocks), cfg)
    monkeypatch.setenv("VATTN_VLLM_LIMIT", "lots")
    with pytest.raises(vv.InvalidConfigError, match="VATTN_VLLM_LIMIT"):
        vv.memory_limit()


def test_workers_clear_pages_mapped_with_new_memory(monkeypatch):
    """The scheduler's pool (zero_new) sends a "zero" for each page mapped with new memory;
    a worker whose new memory may hold old data (a GPU: here the host backend made to
    behave so) clears them, a worker on the host (new memory reads zeros) skips it."""
    from tests.alloc.test_pool import DirtyHost
    from vattn.vmem.host import HostBackend

    cfg = kv_config(num_blocks=64)  # 8 blocks a page
    bp = BlockPool(cfg.num_blocks)
    skv = vv.attach(bp, cfg)
    dirty = vv.WorkerKV(cfg, cfg.kv_cache_tensors[0].size, "cpu", backend=DirtyHost())
    host = HostBackend()
    cleared = []
    real = host.zero
    monkeypatch.setattr(host, "zero", lambda *a: (cleared.append(a[1]), real(*a)))
    plain = vv.WorkerKV(cfg, cfg.kv_cache_tensors[0].size, "cpu", backend=host)
    page = lambda w, p: [w.whole[r + p * PAGE:r + (p + 1) * PAGE] for r in w.layout.regions]  # noqa: E731
    assert all(bool((x == 0).all()) for x in page(dirty, 0))  # the null block's page
    a = bp.get_new_blocks(10)  # the rest of page 0 and page 1 (new memory)
    ops = skv.drain()
    assert ("zero", [1]) in ops.ops
    for w in (dirty, plain):
        w.apply(ops)
        for b in a:
            write(w, b.block_id)
    bp.free_blocks(a)
    skv.trim()  # page 1 goes back
    bp.get_new_blocks(10)  # page 1 again: new memory
    ops = skv.drain()
    for w in (dirty, plain):
        w.apply(ops)
        assert all(bool((x == 0).all()) for x in page(w, 1))
    assert not cleared
    for w in (dirty, plain):
        w.close()
        w.backend.close()
    skv.pool.close()


def test_worker_on_the_cuda_backend_with_the_strict_fake_driver(fake_cuda, monkeypatch):
    """The worker's replay on vattn's CUDA backend (the C path), under tests/fake_cuda's
    driver rules: granularity-aligned maps in a live reservation, whole-mapping unmaps,
    no release of a mapped handle; nothing left live afterwards."""
    import gc

    backend = fake_cuda.backend()
    P = backend.granularity
    monkeypatch.setenv("VATTN_VLLM_PAGE_SIZE", str(P))
    cfg = kv_config(num_blocks=4 * P // 8192, layers=3)  # 8 KiB blocks: 4 pages a layer
    bp = BlockPool(cfg.num_blocks)
    skv = vv.attach(bp, cfg)
    w = vv.WorkerKV(cfg, cfg.kv_cache_tensors[0].size, "cpu", backend=backend)
    per_page = P // 8192
    a = bp.get_new_blocks(2 * per_page - 1)  # pages 0 (with the null block) and 1
    b = bp.get_new_blocks(per_page)  # page 2
    w.apply(skv.drain())
    for x in a + b:
        write(w, x.block_id)
    bp.free_blocks(a)
    assert skv.trim() == 3 * P  # page 1; page 0 keeps the null block
    w.apply(skv.drain())
    for x in b:
        check(w, x.block_id)
    c = bp.get_new_blocks(2 * per_page)
    w.apply(skv.drain())
    for x in b:
        check(w, x.block_id)
    assert fake_cuda.num_violations == 0, fake_cuda.violations()
    bp.free_blocks(b + c)
    skv.trim()
    w.apply(skv.drain())
    assert w.mapped_bytes == 3 * P
    w.close()
    backend.close()
    del w
    gc.collect()
    assert fake_cuda.num_violations == 0, fake_cuda.violations()


@pytest.mark.parametrize("device", ["host", "fakecuda"])
def test_every_byte_of_the_kv_tensor_reads_and_writes_whatever_the_scheduler_handed_out(device, request,
                                                                                        monkeypatch):
    """vLLM owns the tensor and may touch any byte of it (blocks never handed out, padding
    rows, its own tests): on vattn memory that never faults (it segfaulted, and on a GPU it
    is an illegal address), and the blocks in use keep their data whatever is written
    elsewhere. The whole reservation, the tail past vLLM's size included."""
    import gc

    backend = None if device == "host" else request.getfixturevalue("fake_cuda").backend()
    P = PAGE if backend is None else backend.granularity
    monkeypatch.setenv("VATTN_VLLM_PAGE_SIZE", str(P))
    cfg = kv_config(num_blocks=4 * P // 8192 + 3, layers=2, layout="block-outer")  # 16 KiB blocks over pages
    bp = BlockPool(cfg.num_blocks)
    skv = vv.attach(bp, cfg)
    w = vv.WorkerKV(cfg, cfg.kv_cache_tensors[0].size, "cpu", backend=backend)
    assert w.whole.numel() > w.tensor.numel()  # a tail past the size vLLM asked for
    w.whole.fill_(1)  # only the null block's page is real
    a = bp.get_new_blocks(5)
    w.apply(skv.drain())
    for x in a:
        write(w, x.block_id)
    used = {0, *(x.block_id for x in a)}
    g = w.layout
    for b in set(range(cfg.num_blocks)) - used:  # every other block: junk
        w.tensor[b * g.block_bytes:(b + 1) * g.block_bytes] = 99
    w.whole[cfg.num_blocks * g.block_bytes:] = 98
    for x in a:
        check(w, x.block_id)
    bp.free_blocks(a)
    skv.trim()
    w.apply(skv.drain())  # their pages give way to the scratch again
    assert w.mapped_bytes == w.layout.page_size
    w.whole.fill_(2)
    assert int(w.whole[-1]) == 2
    w.close()
    if backend is not None:
        backend.close()
        del w
        gc.collect()
        fake = request.getfixturevalue("fake_cuda")
        assert fake.num_violations == 0, fake.violations()


# ------------------------------------------------------------- shared budget ----
def test_a_budget_shared_with_another_process(monkeypatch, tmp_path):
    """VATTN_BUDGET=NAME: the scheduler's books join a budget another process (a vattn
    cache here) draws from. The scheduler counts and gets the other's cached pages; asked
    by the other while idle, its responder gives back pages no block holds and the idle
    loop sends the unmaps to the worker; a member limit set from another process (with
    multiprocessing on, the scheduler is not in the caller's process) holds."""
    import os
    import subprocess
    import sys

    from tests.budget.test_budget_shared import REPO, Member, memfd_bytes, row, wait_for
    from vattn.budget import shared as budget_shared

    group = 2 * PAGE  # the scheduler's page group: one page in each of the 2 layers' regions
    monkeypatch.setenv(budget_shared.DIR_ENV, str(tmp_path))
    monkeypatch.setenv("VATTN_BUDGET", "vl")
    monkeypatch.setenv("VATTN_BUDGET_LIMIT", str(8 * group))
    monkeypatch.setenv("VATTN_VLLM_IDLE_TRIM_S", "-1")
    other = Member("vl")
    try:
        r1, r2 = other.call("alloc")["out"], other.call("alloc")["out"]
        assert other.call("step", lens={r1: 1024, r2: 1024})["out"]["ok"]  # 1 MiB: the whole budget
        other.call("free", r=r1)
        other.call("free", r=r2)  # cached
        bp, skv, w, _ = engine(kv_config(num_blocks=256))  # the null block's page: asked of the other
        assert isinstance(skv.budget, budget_shared.SharedBudget) and w.mapped_bytes == group
        sent: list = []
        core = engine_core(bp, sent)
        wait_for(lambda: row("vl", other.pid)["cached"] == 7 * group, 1)
        assert bp.get_num_free_blocks() >= 40  # the other's cached pages count
        a = bp.get_new_blocks(40)  # 5 more pages: the other gives them back
        step(skv)
        for b in a:
            write(w, b.block_id)
        for b in a:
            check(w, b.block_id)
        assert memfd_bytes(other.pid) <= 2 * group and skv.budget.used <= 8 * group
        bp.free_blocks(a)  # cached in the scheduler's books, mapped in the worker
        assert 0 < vv.idle_wakeup(core) <= budget_shared.POLL_S  # idle, but polling for give-backs
        r3 = other.call("alloc")["out"]
        assert not other.call("step", lens={r3: 1024})["out"]["ok"]  # its own 2 cached groups are not enough
        assert other.call("step", lens={r3: 1024})["out"]["ok"]  # the scheduler's responder gave back
        assert vv.idle_wakeup(core) == 0.0 and w.mapped_bytes == 6 * group  # unmaps to send
        vv.on_idle(core)
        assert sent and w.mapped_bytes <= 4 * group and w.seq == skv.seq
        # this engine's own limit, from another process: its responder gives back what is over
        out = subprocess.run([sys.executable, "-m", "vattn", "budget", "set-limit", "vl", str(group), "--pid",
                              str(os.getpid())], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert out.returncode == 0, out.stderr
        wait_for(lambda: vv.idle_wakeup(core) == 0.0, 2)
        vv.on_idle(core)
        assert w.mapped_bytes == group  # the null block's page alone
        assert bp.get_num_free_blocks() == 7  # the null block's page; no page more under its limit
        with pytest.raises(ValueError, match="Cannot get 8 free blocks"):  # vLLM would not even ask
            bp.get_new_blocks(8)
        skv.check_invariants()
        skv.pool.close()
        skv.budget.close()
    finally:
        other.stop()


def test_on_a_shared_budget_the_workers_keep_no_reserve(monkeypatch, tmp_path):
    """Under EngineCore the workers keep a reserve of created pages against other processes;
    on a shared budget the budget keeps them off instead (no reserve, no top-ups)."""
    from vattn.budget import shared as budget_shared

    monkeypatch.setenv(budget_shared.DIR_ENV, str(tmp_path))
    cfg = kv_config()
    vv._started = vv.Workers(vv.block_layout(cfg).key, (len(vv.block_layout(cfg).regions),))
    try:
        alone = vv.attach(BlockPool(cfg.num_blocks), cfg)
        assert alone.reserve == 0 and alone.budget is None
        monkeypatch.setenv("VATTN_BUDGET", "nores")
        shared = vv.attach(BlockPool(cfg.num_blocks), cfg)
        assert shared.reserve is None and isinstance(shared.budget, budget_shared.SharedBudget)
        assert shared.budget.used == shared.stats().mapped_bytes > 0  # the null block's page, taken
        core = SimpleNamespace(scheduler=SimpleNamespace(kv_cache_manager=SimpleNamespace(block_pool=shared.block_pool)))
        vv.before_schedule(core)  # no reserve to top up: nothing is sent (no executor to send it with)
        alone.pool.close()
        shared.pool.close()
        shared.budget.close()
    finally:
        vv._started = None
