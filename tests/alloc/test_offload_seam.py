"""The allocator's seam for the offload tiers (`KVCache.extend_prefix`, `drop_prefix`,
`page_views`, `Coordinator.first_reads`): pages backed after a mapped prefix for data a
lower tier copies in, in every K/V kind, a sliding window's only where its next query reads."""
from __future__ import annotations

import pytest

import vattn
from tests.alloc.test_offload import cached
from tests.conftest import check
from vattn.errors import InvalidRequestError
from vattn.prefix_cache import PrefixCache

KB = 1 << 10
TPP = 32  # SMALL at 4 KiB pages: 128-byte tokens, 32 a page
BLOCK = 4 * 4 * KB  # a page group (one page of each of 4 buffers) on the host
PROMPT = list(range(100))


def test_extend_prefix_backs_fresh_pages_after_the_pinned_ones(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c)
    cached(c, pc, PROMPT[:64], 1)
    r = c.alloc_reqid()
    assert pc.map_prefix(r, PROMPT[:65]) == 64  # two pinned pages
    held, fresh = c.extend_prefix(r, 128)
    assert held == 128 and fresh == [(2, 2)]
    for view in c.page_views(0, r, 2, 2):  # fill the fresh pages as a restore would
        view.fill_(7)
    c.allocator.check_invariants()
    assert c.step({r: 130})  # its own tokens from 128 on
    check(c, r, 64, 1)
    assert all(bool((v == 7).all()) for v in c.page_views(0, r, 2, 2))  # not cleared by the step
    with pytest.raises(InvalidRequestError, match="before its first step"):
        c.extend_prefix(r, 160)  # it ran
    s = c.alloc_reqid()
    with pytest.raises(InvalidRequestError, match="whole number of sharing units"):
        c.extend_prefix(s, 40)
    c.free_reqid(r)
    c.free_reqid(s)
    c.allocator.check_invariants()


def test_extend_prefix_short_of_memory_maps_nothing_and_drop_prefix_empties(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False, physical_memory=3 * BLOCK)  # (scaled on fake CUDA)
    pc = PrefixCache(c)
    cached(c, pc, PROMPT[:64], 1)
    r = c.alloc_reqid()
    assert pc.map_prefix(r, PROMPT[:65]) == 64
    assert c.extend_prefix(r, 4 * TPP) == (64, [(0, 0)])  # one group left of the budget: nothing mapped
    check(c, r, 64, 1)
    c.drop_prefix(r)
    assert c.allocator.num_tokens(r) == 0 and c.allocator.books.slot_pages[r] == []
    c.allocator.check_invariants()
    assert c.step({r: 10})
    c.free_reqid(r)


def test_extend_prefix_in_a_window_kind_maps_only_what_the_next_query_reads():
    # 64-dim heads, fp32: 256-byte tokens, 16 a 4 KiB page; a full and a 16-token window kind
    with vattn.KVCache(num_layers=2, num_kv_heads=1, head_dim=64, max_batch_size=2, max_context_len=256,
                       dtype="float32", device="cpu", page_size=4 * KB, layer_windows=(None, 16), prefetch=False,
                       background=False) as c:
        r = c.alloc_reqid()
        assert c.allocator.first_reads(64) == [0, (64 - 16 + 1) // 16]
        held, fresh = c.extend_prefix(r, 64)
        assert held == 64 and fresh == [(0, 4), (3, 1)]  # the query at 64 reads keys 49.. (page 3)
        assert c.allocator.kinds[1].books.slot_pages[r][:3] == [None] * 3  # holes, leading
        c.allocator.check_invariants()
        assert c.step({r: 70})
        c.free_reqid(r)
