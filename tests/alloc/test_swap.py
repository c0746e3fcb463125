"""Swapping a request out to host memory and back: with no copy while its slot is untouched,
by copying otherwise; the data is the same either way."""
from __future__ import annotations

import pytest

import vattn
from tests.conftest import check, fill

KB = 1 << 10


def test_swap_in_of_an_untouched_slot_copies_nothing(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False)
    a = c.alloc_reqid()
    assert c.step({a: 100})
    fill(c, a, 0, 100, 1)
    h = c.swap_out(a, 100)
    assert h.nbytes == 100 * c.geometry.token_bytes_all
    mapped = c.backend.num_pages_mapped
    r = c.swap_in(h)
    assert r == a and h.copied_in is False and c.backend.num_pages_mapped == mapped
    check(c, r, 100, 1)
    assert c.step({r: 101})
    c.allocator.check_invariants()


def test_swap_in_after_the_slot_was_reused_copies_the_data_back(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False, physical_memory=12 * 2 * 2 * 4 * KB)  # 12 groups
    a = c.alloc_reqid()
    assert c.step({a: 100})  # 4 groups
    fill(c, a, 0, 100, 1)
    h = c.swap_out(a, 90)
    b = c.alloc_reqid()
    assert b == a  # the freed slot with most pages: a new request takes it
    assert c.step({b: 200})  # and overwrites it
    fill(c, b, 0, 200, 2)
    r = c.swap_in(h)
    assert r != a and h.copied_in is True
    check(c, r, 90, 1)
    check(c, b, 200, 2)
    c.allocator.check_invariants()


def test_swap_in_without_memory_changes_nothing(make_cache):
    c = make_cache(page_size=4 * KB, prefetch=False, physical_memory=4 * 2 * 2 * 4 * KB)
    a = c.alloc_reqid()
    assert c.step({a: 128})
    fill(c, a, 0, 128, 1)
    h = c.swap_out(a, 128)
    b = c.alloc_reqid()
    assert c.step({b: 128})  # takes every page
    free = c.num_free_reqids
    with pytest.raises(vattn.OutOfPhysicalMemoryError, match="swapped-out"):
        c.swap_in(h)
    assert c.num_free_reqids == free
    c.allocator.check_invariants()
    c.free_reqid(b)
    r = c.swap_in(h)
    check(c, r, 128, 1)


def test_swap_out_errors(make_cache):
    c = make_cache(page_size=4 * KB)
    a = c.alloc_reqid()
    assert c.step({a: 10})
    with pytest.raises(vattn.InvalidRequestError, match="num_tokens"):
        c.swap_out(a, 11)
    with pytest.raises(vattn.UnknownReqIdError):
        c.swap_out(3 - a if a < 3 else 0, 1)


def test_swap_in_takes_a_handle_and_brings_its_request_back_once(make_cache):
    """A second swap_in of one handle made two live requests of it; a non-handle raised
    AttributeError. Once the request it brought back is freed, the handle may come back
    again (the scheduler does so for a request preempted before it ran)."""
    c = make_cache(page_size=4 * KB, prefetch=False)
    a = c.alloc_reqid()
    assert c.step({a: 100})
    fill(c, a, 0, 100, 1)
    h = c.swap_out(a, 100)
    for bad in (None, "handle", (h.slot, h.epoch)):
        with pytest.raises(vattn.InvalidRequestError, match="takes the SwapHandle swap_out returned"):
            c.swap_in(bad)
    r = c.swap_in(h)
    free = c.num_free_reqids
    with pytest.raises(vattn.InvalidRequestError, match=f"swapped in already .* live as reqid {r}"):
        c.swap_in(h)
    assert c.num_free_reqids == free  # no second copy of the request
    c.allocator.check_invariants()
    c.free_reqid(r)
    again = c.swap_in(h)
    check(c, again, 100, 1)
    c.allocator.check_invariants()
