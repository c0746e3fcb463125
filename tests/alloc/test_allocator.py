"""The allocator on real virtual memory (host backend; CUDA cases run with a GPU)."""
from __future__ import annotations

import random
import threading

import pytest
import torch

import vattn
from tests.conftest import check, fill

KB = 1 << 10


@pytest.mark.parametrize("layout", ["per-layer", "fused"])
@pytest.mark.parametrize("page_size", [4 * KB, 64 * KB, 128 * KB, 256 * KB, 2048 * KB])
def test_data_survives_steps_frees_and_reuse(make_cache, layout, page_size):
    cache = make_cache(layout=layout, page_size=page_size, max_context_len=3000)
    g = cache.geometry
    assert g.slot_bytes % page_size == 0 and g.slot_tokens >= 3000
    k = cache.k_cache(1)
    assert k.shape == (4, 3000, cache.config.num_kv_heads, 16) and k.dtype == torch.float32
    assert k.data_ptr() == cache.k_cache(1)[0].data_ptr()  # no copies: views of one reservation

    a, b = cache.alloc_reqid(), cache.alloc_reqid()
    lens = {a: 0, b: 0}
    for new in ([700, 5], [1, 1], [1, 1], [900, 1], [1, 1]):
        old = dict(lens)
        lens = {a: lens[a] + new[0], b: lens[b] + new[1]}
        assert cache.step(lens)
        for s, tag in ((a, 1), (b, 2)):
            fill(cache, s, old[s], lens[s], tag)
        check(cache, a, lens[a], 1)
        check(cache, b, lens[b], 2)
    cache.free_reqid(a)
    c = cache.alloc_reqid()
    assert cache.step({b: lens[b] + 1, c: 2000})
    fill(cache, c, 0, 2000, 3)
    check(cache, b, lens[b], 2)  # b never moved
    check(cache, c, 2000, 3)
    cache.allocator.check_invariants()


def test_views_are_strided_slices_of_one_slot(make_cache, device):
    if device != "cpu":
        pytest.skip("checks host-sized strides")
    cache = make_cache(layout="fused", page_size=4 * KB, max_context_len=100)
    g = cache.geometry
    k0, k1 = cache.k_cache(0), cache.k_cache(1)
    assert k0.stride() == (g.slot_tokens * 2 * 32, 2 * 32, 16, 1)  # [B, L, (layers), H, D]
    assert k1.data_ptr() - k0.data_ptr() == 32 * 4  # next layer, same token
    r = cache.alloc_reqid()
    assert cache.step({r: 100})
    k1[r, 10] = 7.0
    assert k0[r, 10].abs().sum() == 0 or not torch.equal(k0[r, 10], k1[r, 10])
    assert torch.equal(k1[r, 10], torch.full((2, 16), 7.0, device=k1.device))


def test_reused_slot_is_not_remapped(make_cache):
    cache = make_cache(page_size=4 * KB, prefetch=False)
    be = cache.backend
    r = cache.alloc_reqid()
    assert cache.step({r: 300})
    fill(cache, r, 0, 300, 1)
    mapped, unmapped = be.num_pages_mapped, be.num_pages_unmapped
    assert mapped == cache.geometry.pages_for(300)
    cache.free_reqid(r)
    r2 = cache.alloc_reqid()
    assert r2 == r  # the freed slot with most pages comes back first
    res = cache.step({r2: 300})
    assert res and res.num_mapped == 0
    assert (be.num_pages_mapped, be.num_pages_unmapped) == (mapped, unmapped)
    check(cache, r2, 300, 1)  # the same physical pages: the old bytes are still there


def test_alloc_prefers_freed_slot_with_most_pages(make_cache):
    cache = make_cache(page_size=4 * KB, prefetch=False)
    slots = [cache.alloc_reqid() for _ in range(3)]
    assert cache.step(dict(zip(slots, [10, 400, 200])))
    for s in slots:
        cache.free_reqid(s)
    assert cache.alloc_reqid() == slots[1]
    assert cache.alloc_reqid() == slots[2]


def test_out_of_pages_fails_then_succeeds_after_free(make_cache):
    # token_bytes = 2 heads * 16 dims * 4 B = 128 B: a 4 KiB page holds 32 tokens; budget: 4 groups.
    cache = make_cache(page_size=4 * KB, physical_memory=4 * 4 * KB * 4, prefetch=False)
    g = cache.geometry
    assert cache.allocator.max_pages == 4 and g.pages_for(64) == 2
    a, b, c = cache.alloc_reqid(), cache.alloc_reqid(), cache.alloc_reqid()
    assert cache.step({a: 64, b: 64})
    fill(cache, a, 0, 64, 1)
    fill(cache, b, 0, 64, 2)
    res = cache.step({a: 64, b: 64, c: 10})
    assert not res and res.failed == (c,)  # the newest is refused
    cache.allocator.check_invariants()
    check(cache, a, 64, 1)
    check(cache, b, 64, 2)
    res = cache.step({a: 65, b: 64, c: 10})  # a would need a third page: nothing left for anyone
    assert res.failed == (a, c)
    check(cache, a, 64, 1)
    cache.free_reqid(b)  # the caller preempts
    res = cache.step({a: 65, c: 10})
    assert res and res.num_unmapped >= 1  # pages moved from b's slot to c's
    fill(cache, c, 0, 10, 3)
    check(cache, a, 64, 1)
    check(cache, c, 10, 3)
    cache.allocator.check_invariants()


def test_failed_step_keeps_everything_mapped(make_cache):
    cache = make_cache(page_size=4 * KB, physical_memory=6 * 4 * KB * 4)
    a, b = cache.alloc_reqid(), cache.alloc_reqid()
    assert cache.step({a: 100, b: 50})
    fill(cache, a, 0, 100, 1)
    fill(cache, b, 0, 50, 2)
    before = cache.stats()
    res = cache.step({a: 100, b: 400})
    assert res.failed == (b,)
    after = cache.stats()
    assert before.num_mapped_pages == after.num_mapped_pages == 6
    assert after.num_created_pages == 6
    check(cache, a, 100, 1)
    check(cache, b, 50, 2)
    cache.allocator.check_invariants()


def _run_trace(cache, seed: int, steps: int, sync_each: bool, max_prompt: int = 300):
    """A random alloc/step/free trace; returns the books after each step."""
    rng = random.Random(seed)
    lens: dict[int, int] = {}
    tags: dict[int, int] = {}
    books, results = [], []
    for i in range(steps):
        if lens and rng.random() < 0.15:
            s = rng.choice(sorted(lens))
            check(cache, s, lens.pop(s), tags.pop(s))
            cache.free_reqid(s)
        if cache.num_free_reqids and rng.random() < 0.4:
            s = cache.alloc_reqid()
            lens[s], tags[s] = 0, i + 1
        new = {s: min(n + (rng.randint(1, max_prompt) if n == 0 else 1), cache.config.max_context_len) for s, n in lens.items()}
        res = cache.step(new)
        results.append(res)
        for s in res.failed:  # preempt: the caller frees the refused requests
            check(cache, s, lens.pop(s), tags.pop(s))
            cache.free_reqid(s)
            new.pop(s)
        for s, n in new.items():
            fill(cache, s, lens[s], n, tags[s])
            lens[s] = n
        if sync_each:
            cache.synchronize()
            a = cache.allocator
            b = a.books
            books.append(([len(p) for p in b.slot_pages], len(b.physical.spare), b.physical.num_created, sorted(b.free_slots)))
        cache.allocator.check_invariants()
    for s, n in lens.items():
        check(cache, s, n, tags[s])
    return books, results


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_background_and_sync_modes_leave_identical_books(make_cache, seed):
    kw = dict(page_size=4 * KB, physical_memory=20 * 4 * KB * 4)
    bg = make_cache(background=True, **kw)
    sync = make_cache(background=False, **kw)
    books_bg, res_bg = _run_trace(bg, seed, 120, sync_each=True)
    books_sync, res_sync = _run_trace(sync, seed, 120, sync_each=True)
    assert res_bg == res_sync
    assert books_bg == books_sync
    assert any(not r for r in res_bg), "the trace should run out of pages at least once"


def test_stress_worker_busy_no_race(make_cache):
    # Big eager pre-mapping keeps the worker busy while the caller steps, allocs and frees.
    cache = make_cache(page_size=4 * KB, max_batch_size=8, max_context_len=2048, physical_memory=300 * 4 * KB * 4)
    errors = []

    def reader():  # a second thread reading figures while the books change
        try:
            for _ in range(300):
                cache.stats()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    _run_trace(cache, seed=7, steps=400, sync_each=False, max_prompt=2000)
    t.join()
    assert not errors
    assert cache.allocator.worker_error is None
    assert cache.backend.num_pages_mapped > 0


def test_background_premaps_next_decode_page(make_cache):
    cache = make_cache(page_size=4 * KB)  # 32 tokens per page
    r = cache.alloc_reqid()
    assert cache.step({r: 32})  # exactly one page; the next token needs a second one
    cache.synchronize()
    assert len(cache.allocator.books.slot_pages[r]) == 2
    res = cache.step({r: 33})
    assert res and res.num_mapped == 0  # the worker mapped it already


@pytest.mark.parametrize("background", [False, True])
def test_prefetch_tokens_is_the_look_ahead(make_cache, background):
    cache = make_cache(page_size=4 * KB, prefetch_tokens=8, background=background)  # 32 tokens per page
    r = cache.alloc_reqid()
    assert cache.step({r: 24})  # 8 tokens from the page's end: not yet
    cache.synchronize()
    assert len(cache.allocator.books.slot_pages[r]) == 1
    assert cache.step({r: 25})  # 7 from it: the next page is mapped ahead
    cache.synchronize()
    assert len(cache.allocator.books.slot_pages[r]) == 2
    for n in range(26, 34):  # the decodes up to and past the boundary map nothing in step
        assert cache.step({r: n}).num_mapped == 0
    fill(cache, r, 0, 33, 2)
    check(cache, r, 33, 2)
    with pytest.raises(vattn.InvalidConfigError, match="prefetch_tokens"):
        make_cache(prefetch_tokens=0)


def test_a_step_that_needs_nothing_runs_beside_the_worker(make_cache):
    cache = make_cache(page_size=4 * KB, prefetch_tokens=4)  # 32 tokens per page, background mapping
    a, b = cache.alloc_reqid(), cache.alloc_reqid()
    assert cache.step({a: 10, b: 10})
    cache.synchronize()
    gate, entered = threading.Event(), threading.Event()
    backend = cache.allocator.backend
    real_map = backend.map

    def held_map(*args, **kw):  # the worker's driver call waits for the gate
        if threading.current_thread().name == "vattn-premap":
            entered.set()
            gate.wait(30)
        return real_map(*args, **kw)

    backend.map = held_map
    try:
        assert cache.step({a: 29, b: 11})  # a is 3 tokens from its page's end: the worker maps its next
        assert entered.wait(10), "the worker did not start"
        done: list = []
        t = threading.Thread(target=lambda: done.append(cache.step({a: 30, b: 12})))
        t.start()
        t.join(10)
        assert done and done[0] and done[0].num_mapped == 0, "a step that needs no page waited for the worker"
        assert cache.allocator.premapper.busy  # still in its driver call
    finally:
        gate.set()
        del backend.map
    cache.synchronize()
    assert len(cache.allocator.books.slot_pages[a]) == 2
    assert cache.step({a: 33, b: 13}).num_mapped == 0  # the worker's page serves the boundary
    fill(cache, a, 0, 33, 3)
    check(cache, a, 33, 3)
    cache.allocator.check_invariants()


def test_no_prefetch_maps_only_on_demand(make_cache):
    cache = make_cache(page_size=4 * KB, prefetch=False)
    r = cache.alloc_reqid()
    assert cache.step({r: 32}).num_mapped == 1
    assert cache.step({r: 33}).num_mapped == 1


def test_list_seq_lens_like_the_paper(make_cache):
    cache = make_cache(page_size=4 * KB)
    r = cache.alloc_reqid()
    lens = [0] * 4
    lens[r] = 50
    assert cache.step(lens)
    fill(cache, r, 0, 50, 1)
    check(cache, r, 50, 1)


def test_reserve_physical_and_stats(make_cache):
    cache = make_cache(page_size=4 * KB, physical_memory=10 * 4 * KB * 4, prefetch=False)
    g = cache.geometry
    assert cache.reserve_physical(5 * g.group_bytes) == 5
    assert cache.reserve_physical(3 * g.group_bytes) == 0
    st = cache.stats()
    assert (st.num_created_pages, st.num_free_pages, st.num_mapped_pages) == (5, 5, 0)
    r = cache.alloc_reqid()
    assert cache.step({r: 40})  # 40 tokens -> 2 pages of 32 tokens
    st = cache.stats()
    assert st.mapped_bytes == 2 * g.group_bytes
    assert st.used_bytes == 40 * g.token_bytes_all
    assert st.fragmentation_bytes == 2 * g.group_bytes - 40 * g.token_bytes_all
    assert st.free_tokens == 8 * 32
    with pytest.raises(vattn.OutOfPhysicalMemoryError, match="budget"):
        cache.reserve_physical(11 * g.group_bytes)


def test_set_max_pages(make_cache):
    """The public way to change the budget (tensor parallelism agrees on the ranks' minimum):
    checked, and what step and stats see."""
    cache = make_cache(page_size=4 * KB, physical_memory=10 * 4 * KB * 4, prefetch=False)
    alloc, g = cache.allocator, cache.geometry
    assert cache.reserve_physical(3 * g.group_bytes) == 3
    alloc.set_max_pages(4)
    assert cache.stats().max_pages == 4
    r = cache.alloc_reqid()
    assert cache.step({r: 4 * 32})  # 4 pages: the whole budget
    assert not cache.step({r: 5 * 32})  # over the budget
    for bad in (2, 0, -1):
        with pytest.raises(vattn.InvalidRequestError, match="max_pages must be >= 1 and >= the 4 page groups"):
            alloc.set_max_pages(bad)
    with pytest.raises(vattn.InvalidRequestError):
        alloc.set_max_pages(4.5)
    alloc.set_max_pages(6)
    assert cache.step({r: 5 * 32}) and alloc.max_pages == 6


def test_several_instances_in_one_process(make_cache):
    a, b = make_cache(page_size=4 * KB), make_cache(page_size=8 * KB, layout="fused")
    ra, rb = a.alloc_reqid(), b.alloc_reqid()
    assert a.step({ra: 100}) and b.step({rb: 100})
    fill(a, ra, 0, 100, 1)
    fill(b, rb, 0, 100, 2)
    check(a, ra, 100, 1)
    check(b, rb, 100, 2)


def test_module_level_api(device):
    if device != "cpu":
        pytest.skip("covered by KVCache tests")
    vattn.close()
    with pytest.raises(vattn.NotInitializedError):
        vattn.alloc_reqid()
    cache = vattn.init(num_layers=1, num_kv_heads=1, head_dim=8, max_batch_size=2, max_context_len=64,
                       dtype="float32", device="cpu", page_size=4096)
    try:
        r = vattn.alloc_reqid()
        assert vattn.step([20, 0] if r == 0 else [0, 20])
        vattn.k_cache(0)[r, :20] = 3.0
        assert vattn.v_cache(0).shape == (2, 64, 1, 8)
        assert float(cache.k_cache(0)[r, :20].sum()) == 3.0 * 20 * 8
        vattn.free_reqid(r)
    finally:
        vattn.close()
    with pytest.raises(vattn.NotInitializedError):
        vattn.step([0, 0])
