"""Prefix caching on vattn pages: pinned pages outlive their request, map into a new
request's slot without a copy, and are evicted least recently used first under pressure."""
from __future__ import annotations

import pytest

import vattn
from tests.conftest import check, fill
from vattn.prefix_cache import PrefixCache

KB = 1 << 10
TPP = 32  # SMALL geometry: 128 B a token, 4 KiB pages


def test_a_second_request_maps_the_cached_prefix(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c, salt="model-a")
    prompt = list(range(100))  # 3 whole pages + 4 tokens
    a = c.alloc_reqid()
    assert pc.map_prefix(a, prompt) == 0  # a miss
    assert c.step({a: 100})
    fill(c, a, 0, 100, 1)
    pc.insert(a, prompt)
    c.free_reqid(a)
    b = c.alloc_reqid()
    d = c.alloc_reqid()  # another slot than a's
    assert d != a
    mapped = c.backend.num_pages_mapped
    assert pc.map_prefix(d, prompt + [7, 8]) == 3 * TPP
    assert c.backend.num_pages_mapped == mapped + 3  # mapped, not copied
    check(c, d, 3 * TPP, 1)  # a's K/V, read through d's own contiguous row
    assert c.step({d: 110})
    fill(c, d, 96, 110, 2)  # d computes only the rest
    check(c, d, 96, 1)
    assert pc.hit_rate == pytest.approx(96 / (100 + 102))
    c.free_reqid(b)
    c.allocator.check_invariants()


def test_prefix_of_a_running_request_is_shared_and_never_written(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c)
    prompt = list(range(64))
    a = c.alloc_reqid()
    assert c.step({a: 64})
    fill(c, a, 0, 64, 1)
    pc.insert(a, prompt)
    b = c.alloc_reqid()
    assert pc.map_prefix(b, prompt) == 32  # one token is left to compute: one page of two
    assert pc.map_prefix(c.alloc_reqid(), prompt + [1]) == 64
    assert c.step({a: 80, b: 40})
    fill(c, a, 64, 80, 1)
    fill(c, b, 32, 40, 2)  # b's second page is its own
    check(c, a, 80, 1)
    c.allocator.check_invariants()
    assert c.stats().num_pinned_pages == 2


def test_pinned_pages_are_evicted_lru_under_pressure_and_by_trim(make_cache):
    group = 2 * 2 * 4 * KB
    c = make_cache(page_size=4 * KB, prefetch=False, physical_memory=4 * group)  # 4 groups
    pc = PrefixCache(c)
    p1, p2 = list(range(32)), list(range(1000, 1032))
    for prompt, tag in ((p1, 1), (p2, 2)):
        r = c.alloc_reqid()
        assert c.step({r: 32})
        fill(c, r, 0, 32, tag)
        pc.insert(r, prompt)
        c.free_reqid(r)
    st = c.stats()
    assert st.num_pinned_pages == 2
    x = c.alloc_reqid()
    assert c.step({x: 96})  # three groups: free slots' pages, then the oldest pin
    c.allocator.check_invariants()
    assert c.stats().num_pinned_pages <= 1
    y = c.alloc_reqid()
    hit = pc.map_prefix(y, p2 + [5])
    if hit:  # p2 was the most recently used: it survived, with its data
        check(c, y, 32, 2)
    c.free_reqid(y)
    c.free_reqid(x)
    assert c.trim() > 0
    assert c.stats().num_pinned_pages == 0
    z = c.alloc_reqid()
    assert pc.map_prefix(z, p2 + [5]) == 0  # evicted entries are misses, never stale data
    c.allocator.check_invariants()


def test_pin_and_map_errors(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False)
    a = c.alloc_reqid()
    assert c.step({a: 40})
    with pytest.raises(vattn.InvalidRequestError, match="whole pages"):
        c.pin(a, 2)
    h = c.pin(a, 1)
    with pytest.raises(vattn.InvalidRequestError, match="has run"):
        c.map_pinned(a, h)
    PrefixCache(make_cache(page_size=4 * KB, head_dim=24))  # 192 B tokens: blocks of 3 pages (issue 23)


def test_truncate_pinned_keeps_the_agreed_prefix(make_cache):
    """What a tensor-parallel rank does when another rank mapped fewer cached pages: it unmaps
    the pages past the agreed tokens from the new slot; they stay pinned, and the slot then
    computes its own pages from there."""
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c)
    prompt = list(range(100))
    a = c.alloc_reqid()
    assert c.step({a: 100})
    fill(c, a, 0, 100, 1)
    pc.insert(a, prompt)  # 3 whole pages pinned
    c.free_reqid(a)
    b = c.alloc_reqid()
    assert pc.map_prefix(b, prompt + [1]) == 3 * TPP
    with pytest.raises(vattn.InvalidRequestError, match="whole number of sharing units"):
        c.truncate_pinned(b, TPP + 1)
    with pytest.raises(vattn.InvalidRequestError, match="whole number of sharing units"):
        c.truncate_pinned(b, 4 * TPP)
    assert c.truncate_pinned(b, TPP) == 2
    assert c.stats().num_pinned_pages == 3
    check(c, b, TPP, 1)
    assert c.step({b: 80})
    fill(c, b, TPP, 80, 2)  # its own pages: the pinned ones keep a's tokens
    with pytest.raises(vattn.InvalidRequestError, match="before its first step"):
        c.truncate_pinned(b, TPP)  # it ran: its own tokens would be unmapped
    check(c, b, TPP, 1)
    d = c.alloc_reqid()
    assert pc.map_prefix(d, prompt + [1]) == 3 * TPP
    check(c, d, 3 * TPP, 1)
    e = c.alloc_reqid()
    assert pc.map_prefix(e, prompt) == 3 * TPP
    assert c.truncate_pinned(e, 0) == 3  # a miss after all
    with pytest.raises(vattn.InvalidRequestError, match="nothing was mapped"):
        c.truncate_pinned(e, 0)
    assert c.step({e: 10})
    c.allocator.check_invariants()


@pytest.mark.parametrize("bad", [None, "abc", 5, [1.5] * 40, [float("nan")] * 40, [-1] * 40, [2**64] * 40, [1.5],
                                 [-1]], ids=repr)
def test_token_ids_that_are_not_token_ids_are_refused(make_cache, bad):
    """None raised TypeError; 'abc', floats, NaN and -1 were taken (a short list is never
    hashed, so it passed unseen)."""
    c = make_cache(page_size=4 * KB, prefetch=False)
    pc = PrefixCache(c)
    a = c.alloc_reqid()
    assert c.step({a: 40})
    for call in (pc.map_prefix, pc.insert, lambda _r, ids: pc.block_hashes(ids)):
        with pytest.raises(vattn.InvalidRequestError, match="token_ids must be"):
            call(a, bad)
    assert not pc.entries and pc.num_query_tokens == 0
    pc.insert(a, list(range(40)))  # still works
    assert len(pc.entries) == 1


# ------------------------------------------- tokens that do not divide the page (issue 23) ----
ODD = dict(page_size=4 * KB, head_dim=24, prefetch=False)  # 192 B tokens: 64 tokens in 3 pages share
UNIT = 64


def test_a_token_that_does_not_divide_the_page_shares_whole_units(make_cache):
    """A page of 4 KiB holds 21 1/3 tokens of 192 bytes: prefix caching keys blocks of 64
    tokens (lcm(4096, 192) bytes = 3 pages) and maps them whole, so the new request's own
    tokens start on a page boundary and it never writes into a page it shares."""
    c = make_cache(**ODD)
    g = c.geometry
    assert (g.share_tokens, g.share_pages) == (UNIT, 3) and g.slot_tokens % UNIT == 0
    pc = PrefixCache(c, salt="phi")
    assert (pc.block_tokens, pc.block_pages) == (UNIT, 3)
    prompt = list(range(150))  # 2 whole blocks + 22 tokens
    a = c.alloc_reqid()
    assert c.step({a: 150})
    fill(c, a, 0, 150, 1)
    pc.insert(a, prompt)
    assert c.stats().num_pinned_pages == 6
    c.free_reqid(a)
    b = c.alloc_reqid()
    mapped = c.backend.num_pages_mapped
    assert pc.map_prefix(b, prompt + [7]) == 2 * UNIT
    assert c.backend.num_pages_mapped == mapped + 6  # mapped, not copied
    check(c, b, 2 * UNIT, 1)
    assert c.step({b: 170})  # its own pages from page 6 (token 128, byte 24576) on
    fill(c, b, 2 * UNIT, 170, 2)
    d = c.alloc_reqid()
    assert pc.map_prefix(d, prompt[:100] + [5, 6]) == UNIT  # one block in common
    check(c, d, UNIT, 1)
    e = c.alloc_reqid()
    assert pc.map_prefix(e, prompt + [9]) == 2 * UNIT  # b's own tokens changed nothing pinned
    check(c, e, 2 * UNIT, 1)
    assert pc.hit_rate == pytest.approx(5 * UNIT / (151 + 102 + 151))
    c.allocator.check_invariants()


def test_map_pinned_maps_whole_units_and_truncates_in_units(make_cache):
    c = make_cache(**ODD)
    a = c.alloc_reqid()
    assert c.step({a: 200})
    fill(c, a, 0, 200, 1)
    with pytest.raises(vattn.InvalidRequestError, match="whole pages"):
        c.pin(a, 10)  # 200 tokens fill 9 pages and a third (37 1/2 KiB)
    handles = c.pin(a, 9)
    c.free_reqid(a)
    b = c.alloc_reqid()
    assert c.map_pinned(b, handles[:5]) == UNIT  # a unit and 2 pages of the next: one unit
    assert len(c.allocator.books.slot_pages[b]) == 3
    check(c, b, UNIT, 1)
    d = c.alloc_reqid()
    assert c.map_pinned(d, handles) == 3 * UNIT
    for bad in (2 * UNIT - 1, -UNIT):
        with pytest.raises(vattn.InvalidRequestError, match="whole number of sharing units"):
            c.truncate_pinned(d, bad)
    assert c.truncate_pinned(d, UNIT) == 6
    check(c, d, UNIT, 1)
    assert c.step({d: 100})
    fill(c, d, UNIT, 100, 2)
    check(c, b, UNIT, 1)
    assert c.map_pinned(c.alloc_reqid(), handles[:2]) == 0  # less than a unit
    c.allocator.check_invariants()


def test_a_unit_no_prompt_could_share_is_refused_with_what_fits(make_cache):
    with pytest.raises(vattn.InvalidConfigError, match="no prompt could ever share.*layout='fused'"):
        PrefixCache(make_cache(**ODD, max_context_len=UNIT))  # fused: 384 B tokens, 32 a block
    with pytest.raises(vattn.InvalidConfigError, match="no layout or page size"):  # 56 B tokens: 512 a block
        PrefixCache(make_cache(page_size=4 * KB, head_dim=7, num_layers=1, max_context_len=512))
    PrefixCache(make_cache(**ODD, max_context_len=UNIT + 1))


def test_a_salt_that_is_not_str_or_bytes_is_refused(make_cache):
    """salt=5 used to become 5 zero bytes (bytes(5)), naming no model; salt=None a raw TypeError."""
    c = make_cache(page_size=4 * KB, prefetch=False)
    for bad in (None, 5):
        with pytest.raises(vattn.InvalidConfigError, match="salt must be str or bytes"):
            PrefixCache(c, salt=bad)
    assert PrefixCache(c, salt=bytearray(b"m")).salt == PrefixCache(c, salt="m").salt == b"m"
