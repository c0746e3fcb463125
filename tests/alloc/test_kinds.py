"""One coordinator over every layer kind (full attention, sliding window, recurrent state):
a step is planned for every kind before any maps, a slot is stepped in every kind or in
none, and the kinds share one page layer and one budget (issue 30)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import vattn
from vattn.allocator import Chunk
from vattn.allocator.kinds import ChunkedLocal

PAGE = 4096  # 2 KV heads x 64 dims x fp32: 512 B a token, 8 tokens a page


def kinds_cache(layer_windows: tuple = (8, None), **kw) -> vattn.KVCache:
    args = dict(num_layers=len(layer_windows), num_kv_heads=2, head_dim=64, max_batch_size=3, max_context_len=1024,
                dtype="float32", page_size=PAGE, layer_windows=layer_windows, background=False, prefetch=False)
    return vattn.KVCache(**{**args, **kw})


def books_of(cache: vattn.KVCache) -> list:
    """Per kind: every slot's pages and holes (what a failed step must leave as it was)."""
    return [([list(p) for p in k.books.slot_pages], list(k.books.lead)) for k in cache.allocator.kinds]


def test_a_failed_step_leaves_what_the_window_reads_mapped() -> None:
    """The issue's reproducer: a step that the full kind cannot back must not give back the
    window kind's pages (it used to, and reading them was a SIGSEGV). In a child process, so
    that the crash (with the fix reverted) fails this test and nothing else."""
    code = textwrap.dedent("""
        import vattn
        c = vattn.init(num_layers=2, num_kv_heads=2, head_dim=64, max_batch_size=3, max_context_len=1024,
                       dtype="float32", page_size=4096, layer_windows=(8, None), background=False, prefetch=False,
                       physical_memory=52 * 4096)
        r = c.alloc_reqid(); assert c.step({r: 64}); c.k_cache(0)[r, :64] = 1.0
        assert r in c.step({r: 200}).failed; assert r in c.step({r: 300}).failed
        print(float(c.k_cache(0)[r, 57:64].sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) == 7 * 2 * 64  # the window's keys are there, as written


def test_a_chunked_kind_gives_back_whole_chunks_exactly_at_chunk_boundaries() -> None:
    """Llama 4's chunked local attention: a query at q reads its own chunk only (keys from
    q // 16 * 16 on). The pages of the chunks behind go back when the first query of a new
    chunk is planned, not a token earlier nor later (a window of the chunk's size would give
    back one page at 32, none at 17); the full kind keeps every page, the current chunk's
    keys stay, and a fork or a swap-out behind the current chunk is refused."""
    with kinds_cache((Chunk(16), None)) as cache:  # 8 tokens a page: a chunk is 2 pages
        chunk, full = cache.allocator.kinds[1], cache.allocator.kinds[0]
        assert cache.kind_names == ["full", "chunk=16"] and isinstance(chunk, ChunkedLocal)
        r = cache.alloc_reqid()
        seen = []
        for n in (16, 17, 24, 32, 33, 48, 49, 64, 65):  # queries from the previous length on
            assert cache.step({r: n})
            cache.k_cache(0)[r, n - 1] = float(n)
            seen.append((n, chunk.books.holes(r), chunk.books.num_mapped(r), full.books.num_mapped(r)))
            cache.allocator.check_invariants()
        assert seen == [(16, 0, 2, 2), (17, 2, 1, 3), (24, 2, 1, 3), (32, 2, 2, 4), (33, 4, 1, 5),
                        (48, 4, 2, 6), (49, 6, 1, 7), (64, 6, 2, 8), (65, 8, 1, 9)]
        assert float(cache.k_cache(0)[r, 64, 0, 0]) == 65.0  # the current chunk's keys, as written
        st = cache.stats().kinds
        assert st["chunk=16"].num_mapped_pages == 1 and st["full"].num_mapped_pages == 9
        assert cache.can_fork(r, 65) and not cache.can_fork(r, 60)  # 60 reads from 48: given back
        with pytest.raises(vattn.InvalidRequestError, match="chunked-attention layers gave back"):
            cache.swap_out(r, 60)


def test_every_kind_is_run_by_the_manager_its_spec_type_names() -> None:
    """One {spec type: manager} table (`registry.MANAGERS`) builds every kind; a spec no
    manager runs is refused, naming the table."""
    from dataclasses import dataclass

    from vattn.allocator.kinds import KindSpec
    from vattn.allocator.registry import MANAGERS, manager_for

    with kinds_cache((8, Chunk(16), None), state_bytes=3000, num_snapshots=2) as cache:
        kinds = cache.allocator.kinds
        assert [k.name for k in kinds] == ["full", "window=8", "chunk=16", "state"] == cache.kind_names
        assert [type(k).__name__ for k in kinds] == ["FullAttention", "SlidingWindow", "ChunkedLocal", "RecurrentState"]
        assert all(type(k) is MANAGERS[type(k.spec)] for k in kinds)
        assert cache.snapshots is kinds[3].snapshots and all(k.snapshots is None for k in kinds[:3])

    @dataclass(frozen=True)
    class Unknown(KindSpec):
        pass

    with pytest.raises(ValueError, match="registry.MANAGERS"):
        manager_for(Unknown("x", None, []))
    with kinds_cache() as cache, pytest.raises(vattn.InvalidRequestError, match="no recurrent states"):
        cache.snapshots.want(0, [8])


def test_a_latent_kind_is_full_attention_with_the_widths_its_spec_declares() -> None:
    """`Latent` (multi-head latent attention, vLLM's `MLAAttentionSpec`): its spec type is run by
    the full-attention manager and its widths are the cache's (one latent head of K, a V of
    another width, in one buffer a layer); layers of other widths beside it are refused. Its
    model mapping is the module its spec names."""
    from vattn.allocator.latent import Latent, LatentSpec
    from vattn.allocator.registry import mapping_modules

    with kinds_cache((Latent(k_width=24, v_width=8),) * 3) as cache:
        (kind,) = cache.allocator.kinds
        assert type(kind).__name__ == "FullAttention" and isinstance(kind.spec, LatentSpec)
        assert (kind.spec.heads, kind.spec.k_width, kind.spec.v_width) == (1, 24, 8) and cache.kind_names == ["latent"]
        c, g = cache.config, cache.geometry
        assert (c.num_kv_heads, c.head_dim, c.v_head_dim) == (1, 24, 8) and g.num_buffers == 3
        assert cache.k_cache(2).shape == (3, 1024, 1, 24) and cache.v_cache(2).shape == (3, 1024, 1, 8)
        r = cache.alloc_reqid()
        assert cache.step({r: 40}) and len(kind.books.slot_pages[r]) == g.pages_for(40) == 2  # 128 B a token: 32 a page
        cache.k_cache(0)[r, :40], cache.v_cache(0)[r, :40] = 1.0, 2.0
        assert (cache.k_cache(0)[r, :40] == 1).all() and (cache.v_cache(0)[r, :40] == 2).all()
    with pytest.raises(vattn.InvalidConfigError, match="different widths"):
        kinds_cache((Latent(k_width=24, v_width=8), None))
    assert LatentSpec.mapping in mapping_modules()


def test_a_failed_slot_keeps_its_lengths_and_pages_in_every_kind() -> None:
    with kinds_cache(physical_memory=52 * PAGE) as cache:
        r = cache.alloc_reqid()
        assert cache.step({r: 64})
        cache.k_cache(0)[r, :64] = 1.0
        cache.k_cache(1)[r, :64] = 2.0
        before = books_of(cache)
        for n in (200, 300):
            res = cache.step({r: n})
            assert res.failed == (r,) and res.num_mapped == 0
            assert books_of(cache) == before and cache.allocator.num_tokens(r) == 64
            cache.allocator.check_invariants()
        assert float(cache.k_cache(0)[r, 57:64].sum()) == 7 * 2 * 64
        assert cache.step({r: 65})  # the next iteration, from 64 on, as if nothing had happened
        assert float(cache.k_cache(0)[r, 57:64].sum()) == 7 * 2 * 64
        assert float(cache.k_cache(1)[r, :64].sum()) == 2 * 64 * 2 * 64


def test_a_kind_short_of_pages_takes_room_from_another_kinds_spare_pages() -> None:
    """The window kind's pages given back are spare groups of its own size; when the budget
    is full, the full kind's next pages are made by releasing them (one budget, planned in
    bytes), and a step never holds more than the budget."""
    with kinds_cache(physical_memory=24 * 2 * PAGE, max_batch_size=1) as cache:
        r = cache.alloc_reqid()
        n = 0
        while True:
            res = cache.step({r: n + 8})
            if not res:
                break
            n += 8
            cache.allocator.check_invariants()
        st = cache.stats()
        full, win = st.kinds["full"], st.kinds["window=8"]
        assert full.num_mapped_pages == n // 8  # every page the budget holds went to the full kind
        assert win.num_mapped_pages <= 2 and win.num_free_pages == 0
        assert cache.allocator.layer.created_bytes <= cache.allocator.max_bytes == 24 * 2 * PAGE
        assert n // 8 >= 24 - 3


def test_one_worker_premaps_every_kind() -> None:
    """Background pre-mapping maps ahead in every kind from one worker; a kind's pages and
    lengths stay in step with the others'."""
    with kinds_cache(layer_windows=(8, None, 32), background=True, prefetch=True, prefetch_tokens=8) as cache:
        r = cache.alloc_reqid()
        for n in range(1, 200):
            assert cache.step({r: n})
            for layer in range(3):
                cache.k_cache(layer)[r, n - 1] = n
            cache.synchronize()
            cache.allocator.check_invariants()
        threads = [t for t in __import__("threading").enumerate() if t.name == "vattn-premap"]
        assert len(threads) >= 1 and cache.allocator.premapper.thread in threads
        for layer, window in enumerate((8, None, 32)):
            lo = 0 if window is None else 199 - window
            assert cache.k_cache(layer)[r, lo:199, 0, 0].tolist() == list(range(lo + 1, 200))


# ------------------------------------------------------------------ recurrent states ----
def state_cache(**kw) -> vattn.KVCache:
    """One full K/V layer and 3000 bytes of states a slot (a row of one 4 KiB page)."""
    args = dict(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=3, max_context_len=256, dtype="float32",
                page_size=PAGE, background=False, prefetch=False, state_bytes=3000, num_snapshots=2)
    return vattn.KVCache(**{**args, **kw})


def test_states_are_a_layer_kind_mapped_at_the_first_step() -> None:
    with state_cache() as cache:
        rows = cache.state_rows()
        assert rows.shape == (3 + 2, PAGE) and rows.dtype == torch.uint8
        r = cache.alloc_reqid()
        assert cache.stats().kinds["state"].num_mapped_pages == 0
        assert cache.step({r: 10})
        st = cache.stats()
        assert st.kinds["state"].num_mapped_pages == 1 and st.kinds["state"].used_bytes == 3000
        rows[r, :3000] = 7
        assert cache.step({r: 40}) and int(rows[r, :3000].sum()) == 7 * 3000  # a step keeps the row
        cache.allocator.check_invariants()


def test_states_fork_as_a_copy_and_swap_with_the_slot() -> None:
    with state_cache() as cache:
        rows = cache.state_rows()
        r = cache.alloc_reqid()
        assert cache.step({r: 20})
        rows[r] = 3
        assert not cache.can_fork(r, 10)  # a state is right at its slot's length only
        with pytest.raises(vattn.InvalidRequestError, match="recurrent states"):
            cache.fork(r, 10)
        child = cache.fork(r, 20)
        assert int(rows[child].sum()) == 3 * PAGE
        rows[child] = 5  # written in place: the parent's row is its own
        assert int(rows[r].sum()) == 3 * PAGE
        with pytest.raises(vattn.InvalidRequestError, match="recurrent states"):
            cache.swap_out(child, 10)
        handle = cache.swap_out(child, 20)
        other = cache.alloc_reqid()
        assert cache.step({other: 30})  # takes the parked slot, its pages and its state row
        rows[other] = 9
        back = cache.swap_in(handle)
        assert handle.copied_in and int(rows[back].sum()) == 5 * PAGE
        cache.allocator.check_invariants()


def test_snapshots_are_pages_of_the_budget_kept_least_recently_used() -> None:
    """A wanted boundary gets a snapshot row when the step that passes it is planned; rows
    count against physical_memory, and cached ones are evicted first when memory is short."""
    unit = 2 * PAGE + PAGE  # one page of every buffer: K, V, states
    with state_cache(physical_memory=7 * unit) as cache:
        rows = cache.state_rows()
        r = cache.alloc_reqid()
        cache.snapshots.want(r, [8, 16])
        assert cache.step({r: 12})
        planned = cache.snapshots.planned()
        assert list(planned) == [r] and list(planned[r]) == [8]
        row = planned[r][8]
        assert row >= 3  # a snapshot row, after the slots'
        rows[row] = 1  # what the state layers write at token 8
        assert cache.step({r: 20}) and list(cache.snapshots.planned()[r]) == [16]
        taken = cache.snapshots.take(r, 16)
        assert sorted(taken) == [8, 16]
        h8 = cache.snapshots.pin(taken[8])
        cache.snapshots.free(taken[16])
        assert cache.snapshots.is_pinned(h8)
        assert cache.stats().kinds["state"].num_mapped_pages == 3  # r's row, the kept one, the free one (cached)
        new = cache.alloc_reqid()
        assert cache.snapshots.restore(new, h8)  # copied at its first step, when its row is mapped
        assert cache.step({new: 9}) and int(rows[new].sum()) == PAGE
        cache.free_reqid(new)
        cache.free_reqid(r)
        hog = cache.alloc_reqid()
        state = next(k for k in cache.allocator.kinds if k.name == "state").books
        free_row = taken[16]
        for n in range(8, 257, 8):  # the hog's pages come from the free snapshot row, then the kept one
            assert cache.step({hog: n})
            if not cache.snapshots.is_pinned(h8):
                break
        assert not cache.snapshots.is_pinned(h8) and not state.slot_pages[free_row]
        cache.allocator.check_invariants()
        assert cache.allocator.layer.created_bytes <= 7 * unit


def run_child(code: str) -> str:
    """Run `code` in a child process (a SIGSEGV there fails one test only); its stdout."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"rc {out.returncode}: {out.stderr[-2000:]}"
    return out.stdout


def test_a_slots_own_state_row_is_never_kept_as_a_snapshot() -> None:
    """snapshots.pin of a live slot's row used to keep it as a snapshot: trim() evicted it,
    unmapping the slot's states, and reading them was a SIGSEGV."""
    out = run_child("""
        import vattn
        c = vattn.KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=3, max_context_len=256,
                          dtype="float32", page_size=4096, state_bytes=3000, num_snapshots=2, background=False,
                          prefetch=False)
        r = c.alloc_reqid(); assert c.step({r: 5}); c.state_rows()[r].fill_(7)
        try:
            c.snapshots.pin(r)
        except vattn.InvalidRequestError as e:
            print("refused:", e)
        c.trim()
        print(int(c.state_rows()[r].sum()))  # (a SIGSEGV when trim() unmapped the slot's row)
        c.allocator.check_invariants()
    """)
    assert "refused: snapshots.pin(0): row 0 is slot 0's own state row" in out
    assert int(out.split()[-1]) == 7 * PAGE


def test_snapshot_rows_are_handed_out_once_and_bad_handles_are_refused() -> None:
    with state_cache(num_snapshots=3) as cache:
        r = cache.alloc_reqid()
        assert cache.step({r: 5})
        row = cache.snapshots.capture(r)
        assert row is not None
        cache.allocator.check_invariants()  # a row the caller holds is accounted for
        cache.snapshots.free(row)
        for bad, what in ((row, "is free"), (r, "own state row"), (99, "not a row of this cache"),
                          ("x", "an int"), (1.0, "an int")):
            with pytest.raises(vattn.InvalidRequestError, match=what):
                cache.snapshots.free(bad)
            with pytest.raises(vattn.InvalidRequestError, match=what):
                cache.snapshots.pin(bad)
        handle = cache.snapshots.pin(cache.snapshots.new_row())
        with pytest.raises(vattn.InvalidRequestError, match="kept already"):
            cache.snapshots.pin(handle[0])
        for bad in ((1, 2, 3), ("a", 1), 5):
            if bad != 5:  # (an int is a row for snapshots.free)
                with pytest.raises(vattn.InvalidRequestError, match="handle pin returned"):
                    cache.snapshots.free(bad)
            with pytest.raises(vattn.InvalidRequestError, match="handle pin returned"):
                cache.snapshots.restore(r, bad)
        cache.snapshots.free(handle)
        cache.snapshots.free(handle)  # freed (or evicted) already: nothing
        rows = [cache.snapshots.new_row() for _ in range(3)]
        assert sorted(rows) == [3, 4, 5]  # every snapshot row once, no slot's
        cache.allocator.check_invariants()
        for x in rows:
            cache.snapshots.free(x)
        with pytest.raises(vattn.InvalidRequestError, match="boundary"):
            cache.snapshots.want(r, [-5])
        with pytest.raises(vattn.InvalidRequestError, match="upto"):
            cache.snapshots.take(r, "x")
        cache.allocator.check_invariants()


def test_a_request_without_states_of_its_own_is_not_snapshotted() -> None:
    """Before its first step a slot's state row is unmapped (snapshot() read it: SIGSEGV),
    holds an earlier request's states (a reused slot), or is about to get a kept snapshot's
    (a pending restore): snapshot() refuses all three."""
    out = run_child("""
        import vattn
        c = vattn.KVCache(num_layers=1, num_kv_heads=2, head_dim=64, max_batch_size=3, max_context_len=256,
                          dtype="float32", page_size=4096, state_bytes=3000, num_snapshots=2, background=False,
                          prefetch=False)
        r = c.alloc_reqid()
        try:
            c.snapshots.capture(r)
        except vattn.InvalidRequestError as e:
            print("refused:", e)
    """)
    assert "refused: reqid 0 has no recurrent states of its own yet" in out
    with state_cache() as cache:
        rows = cache.state_rows()
        r = cache.alloc_reqid()
        assert cache.step({r: 5})
        rows[r] = 7
        kept = cache.snapshots.pin(cache.snapshots.capture(r))
        cache.free_reqid(r)
        again = cache.alloc_reqid()
        assert again == r and int(rows[again].sum()) == 7 * PAGE  # the earlier request's states
        with pytest.raises(vattn.InvalidRequestError, match="step it first"):
            cache.snapshots.capture(again)
        assert cache.snapshots.restore(again, kept)
        with pytest.raises(vattn.InvalidRequestError, match="with the snapshot it restores"):
            cache.snapshots.capture(again)
        assert cache.step({again: 6})
        row = cache.snapshots.capture(again)
        assert row is not None and int(rows[row].sum()) == 7 * PAGE
        cache.snapshots.free(row)
        cache.allocator.check_invariants()


def test_a_window_kind_refuses_a_swap_out_count_behind_its_window() -> None:
    """swap_out at a count whose keys the window gave back used to book negative bytes in
    the host store and make a handle that failed at the step after swap_in."""
    with kinds_cache(layer_windows=(None, 8)) as cache:
        r = cache.alloc_reqid()
        assert cache.step({r: 300})
        for n in (301, 302):
            assert cache.step({r: n})
        for layer in range(2):
            cache.k_cache(layer)[r, 290:302] = 3.0
        with pytest.raises(vattn.InvalidRequestError, match="gave back the pages before token 288"):
            cache.swap_out(r, 10)
        assert cache.host.leased == 0 and cache.allocator.num_tokens(r) == 302  # nothing changed
        handle = cache.swap_out(r, 302)
        assert cache.host.leased > 0
        other = cache.alloc_reqid()
        assert cache.step({other: 400})  # takes the parked slot's pages: the swap-in copies
        back = cache.swap_in(handle)
        assert handle.copied_in and cache.step({back: 303})
        for layer in range(2):
            assert float(cache.k_cache(layer)[back, 295:302].sum()) == 3.0 * 7 * 2 * 64
        cache.allocator.check_invariants()


def test_reserve_physical_counts_the_groups_a_kind_holds_already() -> None:
    """A full kind with many groups beside a window kind with few: reserving n groups of
    every kind must not take the window kind to n when the total would pass the budget."""
    with kinds_cache(layer_windows=(None, 8), max_batch_size=2, physical_memory=20 * 4 * PAGE) as cache:
        alloc = cache.allocator  # 20 units of 4 pages (K and V of each kind): 40 groups of 2 pages
        r = cache.alloc_reqid()
        for n in range(8, 225, 8):
            assert cache.step({r: n})
        created = [k.books.physical.num_created for k in alloc.kinds]
        cache.trim()  # the window kind's groups behind the window go
        created = [k.books.physical.num_created for k in alloc.kinds]
        assert created[0] == 28 and created[1] < 12
        with pytest.raises(vattn.OutOfPhysicalMemoryError, match="over the budget"):
            alloc.reserve_physical(15 * alloc.unit_bytes)  # 28 + 15 groups > 40
        assert [k.books.physical.num_created for k in alloc.kinds] == created
        alloc.check_invariants()
        assert alloc.reserve_physical(12 * alloc.unit_bytes) == 12 - created[1]  # 28 + 12: the whole budget
        assert [k.books.physical.num_created for k in alloc.kinds] == [28, 12]
        assert alloc.layer.created_bytes == alloc.max_bytes
        alloc.check_invariants()


def test_revert_step_takes_the_last_step_back() -> None:
    """What a tensor-parallel rank does with a slot another rank could not back: its length
    goes back to before the step (as if the step had failed it here too), so that the next
    step from the same start, a shorter one, reads what is there; a slot the last step did
    not move is left alone."""
    with kinds_cache() as cache:
        r, other = cache.alloc_reqid(), cache.alloc_reqid()
        assert cache.step({r: 64, other: 8})
        cache.k_cache(0)[r, :64] = 1.0
        assert cache.step({r: 100, other: 8})  # r moves, other does not
        cache.revert_step([r, other])
        assert (cache.allocator.num_tokens(r), cache.allocator.num_tokens(other)) == (64, 8)
        assert cache.step({r: 80, other: 9})  # the iteration from 64 again, shorter: its window is there
        assert float(cache.k_cache(0)[r, 57:64].sum()) == 7 * 2 * 64
        cache.revert_step([r])  # (taken back twice: the second step's own)
        assert cache.allocator.num_tokens(r) == 64
        cache.revert_step([r])  # nothing more to take back
        assert cache.allocator.num_tokens(r) == 64
        cache.allocator.check_invariants()
