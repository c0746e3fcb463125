"""Shared pages on contiguous virtual memory: fork with copy-on-write by construction, and
trim. The same physical page is mapped at two virtual addresses (a memfd offset mapped
twice on the host; one handle mapped twice on CUDA)."""
from __future__ import annotations

import math
import os

import pytest
import torch

import vattn
from tests.conftest import check, fill

KB = 1 << 10


def test_fork_shares_whole_pages_and_copies_the_partial_one(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False)  # 32 tokens a page
    a = c.alloc_reqid()
    assert c.step({a: 100})
    fill(c, a, 0, 100, 1)
    mapped = c.backend.num_pages_mapped
    b = c.fork(a, 70)  # pages 0, 1 shared; page 2 (tokens 64..69) copied
    assert b != a
    assert c.backend.num_pages_mapped == mapped + 3
    st = c.stats()
    assert st.num_mapped_pages == 4 + 1  # a's 4 pages + one copy: shared pages count once
    check(c, b, 70, 1)
    # each writes its own continuation
    assert c.step({a: 120, b: 90})
    fill(c, a, 70, 120, 1)  # a's tokens 70.. with a's pattern
    c.k_cache(0)[b, 70:90] = -5.0
    check(c, a, 120, 1)
    assert torch.all(c.k_cache(0)[b, 70:90] == -5.0)
    assert c.k_cache(0)[b, :64].data_ptr() != c.k_cache(0)[a, :64].data_ptr()  # two addresses, one memory
    c.k_cache(1)[b, 64:70] = 9.0  # the copied page is b's own
    check(c, a, 120, 1)
    c.allocator.check_invariants()


def test_fork_with_tokens_that_straddle_pages(make_cache):
    """192 B tokens in 4 KiB pages (token 85 straddles pages 3 and 4): a fork shares the
    pages its tokens fill and copies the page its first own token begins in, which holds
    the straddling token's tail; at a unit boundary (64 tokens: 3 pages) nothing is copied."""
    c = make_cache(page_size=4 * KB, head_dim=24, prefetch=False)
    a = c.alloc_reqid()
    assert c.step({a: 100})
    fill(c, a, 0, 100, 1)
    mapped = c.backend.num_pages_mapped
    b = c.fork(a, 86)  # 16512 bytes: pages 0..3 shared, page 4 (token 85's tail) copied
    assert c.backend.num_pages_mapped == mapped + 5
    d = c.fork(a, 64)  # 12288 bytes: 3 whole pages, no copy
    assert c.backend.num_pages_mapped == mapped + 5 + 3
    check(c, b, 86, 1)
    check(c, d, 64, 1)
    assert c.step({a: 120, b: 110, d: 80})
    fill(c, a, 100, 120, 1)
    fill(c, b, 86, 110, 2)
    fill(c, d, 64, 80, 3)
    check(c, a, 120, 1)
    check(c, b, 86, 1)
    check(c, d, 64, 1)
    c.allocator.check_invariants()


@pytest.mark.parametrize("head_dim, layout, page, unit", [
    (96, "per-layer", 2 << 20, (1024, 3)),  # Phi-3-mini: 6 KiB tokens, 1024 of them in three 2 MiB pages
    (96, "fused", 2 << 20, (32, 3)),  # 32 layers a token: 192 KiB
    (80, "per-layer", 2 << 20, (2048, 5)),  # Phi-2
    (128, "per-layer", 2 << 20, (256, 1)),  # whole tokens: a page is a unit
    (96, "per-layer", 4 * KB, (2, 3)),
    (80, "per-layer", 64 * KB, (64, 5)),
])
def test_the_sharing_unit_is_the_lcm_of_page_and_token(head_dim, layout, page, unit):
    cfg = vattn.CacheConfig(num_layers=32, num_kv_heads=32, head_dim=head_dim, max_batch_size=2,
                            max_context_len=4000, layout=layout)
    g = vattn.config.Geometry(cfg, page)
    assert (g.share_tokens, g.share_pages) == unit
    assert g.share_tokens * g.token_bytes == g.share_pages * page == math.lcm(page, g.token_bytes)
    assert g.slot_tokens % g.share_tokens == 0 and g.slot_tokens >= 4000


def test_shared_page_lives_until_both_let_go(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False, physical_memory=6 * 4 * 4 * KB)  # 6 groups
    a = c.alloc_reqid()
    assert c.step({a: 64})  # two whole pages
    fill(c, a, 0, 64, 1)
    b = c.fork(a, 64)  # nothing to copy: both pages shared
    assert c.stats().num_mapped_pages == 2
    c.free_reqid(a)
    d = c.alloc_reqid()
    assert d == a  # the freed slot with most pages comes back first...
    assert c.step({d: 10, b: 65})  # ...but a new request never writes into pages b shares
    fill(c, d, 0, 10, 3)
    check(c, b, 64, 1)  # b's pages are intact
    fill(c, b, 64, 65, 1)
    c.free_reqid(d)
    # pressure: reclaiming the free slots frees nothing b still maps
    e, f = c.alloc_reqid(), c.alloc_reqid()
    res = c.step({b: 65, e: 64, f: 32})
    assert res
    check(c, b, 65, 1)
    c.allocator.check_invariants()


def test_fork_errors(make_cache):
    c = make_cache(page_size=4 * KB, max_batch_size=2)
    a = c.alloc_reqid()
    assert c.step({a: 40})
    with pytest.raises(vattn.InvalidRequestError, match="num_tokens"):
        c.fork(a, 41)
    with pytest.raises(vattn.InvalidRequestError, match="num_tokens"):
        c.fork(a, 0)
    with pytest.raises(vattn.UnknownReqIdError):
        c.fork(1 - a, 1)
    c.fork(a, 40)
    with pytest.raises(vattn.NoFreeSlotError):
        c.fork(a, 10)
    c.allocator.check_invariants()


def test_close_releases_each_shared_group_once(make_cache):
    c = make_cache(page_size=4 * KB)
    a = c.alloc_reqid()
    assert c.step({a: 200})
    fill(c, a, 0, 200, 1)
    b = c.fork(a, 150)
    d = c.fork(b, 100)
    check(c, d, 100, 1)
    c.allocator.check_invariants()
    c.close()  # a double release would raise (and the fake CUDA driver counts it)


def _memfd_bytes(cache) -> int:
    return os.fstat(cache.backend._fd).st_blocks * 512


def test_trim_gives_memory_back(device):
    if device != "cpu":
        pytest.skip("checks host memory")
    with vattn.KVCache(num_layers=2, num_kv_heads=2, head_dim=16, max_batch_size=4, max_context_len=512,
                       dtype="float32", device="cpu", page_size=4 * KB) as c:
        rs = [c.alloc_reqid() for _ in range(3)]
        assert c.step(dict(zip(rs, [300, 200, 100])))
        fill(c, rs[1], 0, 200, 2)
        c.synchronize()
        for r in (rs[0], rs[2]):
            c.free_reqid(r)
        before, held = c.stats(), _memfd_bytes(c)
        released = c.trim()
        after = c.stats()
        assert released > 0 and after.num_created_pages == before.num_created_pages - released
        assert after.num_mapped_pages == c.geometry.pages_for(200) and after.num_cached_pages == 0
        assert _memfd_bytes(c) <= held - released * c.geometry.group_bytes  # really given back
        check(c, rs[1], 200, 2)
        r = c.alloc_reqid()
        assert c.step({rs[1]: 201, r: 300})  # and memory can be had again
        fill(c, r, 0, 300, 4)
        check(c, r, 300, 4)
        c.allocator.check_invariants()
