"""Sliding-window layers give their pages back (issue 23, part 1).

A layer with a window of W tokens keeps mapped only the pages its queries can still see:
pages wholly behind the window are unmapped as a request grows (the slot's virtual range
stays reserved). On the host an unmapped page faults when read, so every greedy run here
also shows that no kernel path reads behind the window. Interleaved models (Gemma-2,
Gemma-3's 5 local to 1 global, Qwen2 with use_sliding_window, Ministral) get one layer kind
each (full attention, the window) under the cache's coordinator; Mistral (every layer
windowed) one kind, with a window.
"""
from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.helpers import (  # noqa: E402
    MAX_TOKENS,
    PAGE,
    build_model,
    greedy_params,
    hf_greedy,
    prompts,
    run_online,
)

import vattn  # noqa: E402
from vattn.allocator.kinds import SlidingWindow  # noqa: E402
from vattn.engine import LLM, SamplingParams  # noqa: E402
from vattn.errors import InvalidConfigError, InvalidRequestError  # noqa: E402
from vattn.integrations.hf import layer_windows  # noqa: E402

WINDOW = 8  # tokens: shorter than a page (8 tokens of 64-dim heads) times a few
BATCHED = 16  # max_num_batched_tokens: prompts arrive in chunks


def family_config(family: str) -> Any:
    """A tiny seeded config of each sliding-window family (64-dim heads: 8 tokens a page)."""
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.2,
                  sliding_window=WINDOW)
    if family == "mistral":
        return transformers.MistralConfig(num_hidden_layers=2, **common)
    if family == "ministral":
        return transformers.MinistralConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                                            **common)
    if family == "qwen2":
        return transformers.Qwen2Config(num_hidden_layers=2, use_sliding_window=True, max_window_layers=1, **common)
    if family == "gemma2":  # (vattn's attention has no logit softcapping: off here)
        return transformers.Gemma2Config(num_hidden_layers=2, attn_logit_softcapping=None, **common)
    if family == "gemma3":  # 5 local layers to 1 global
        return transformers.Gemma3TextConfig(num_hidden_layers=6, **common)
    raise ValueError(family)


FAMILIES = ["mistral", "ministral", "qwen2", "gemma2", "gemma3"]
_REFS: dict[str, list[list[int]]] = {}


def reference(family: str) -> list[list[int]]:
    if family not in _REFS:
        model = build_model(family_config(family))
        _REFS[family] = [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS)]
    return _REFS[family]


def window_cache(layer_windows: tuple, max_batch_size: int = 2, max_context_len: int = 512, **kw: Any) -> Any:
    """A small host cache (8 tokens a page), mapping only in `step` (no worker, no look-ahead)."""
    return vattn.init(num_layers=len(layer_windows), num_kv_heads=2, head_dim=64, max_batch_size=max_batch_size,
                      max_context_len=max_context_len, dtype="float32", page_size=PAGE, layer_windows=layer_windows,
                      background=False, prefetch=False, **kw)


def window_kinds(cache: Any) -> list[Any]:
    """The managers of the cache's sliding-window layer kinds."""
    return [kind for kind in cache.allocator.kinds if isinstance(kind, SlidingWindow)]


def check_window_bound(cache: Any, batched: int = BATCHED) -> None:
    """Every slot of a window kind maps at most the window, an iteration's new tokens and a
    page (prefetch off): pages wholly behind the window are unmapped."""
    for alloc in window_kinds(cache):
        books, g = alloc.books, alloc.geometry
        tpp = g.share_tokens
        bound = -(-(alloc.window + batched - 1) // tpp) + 1
        for s in range(books.num_slots):
            assert books.num_mapped(s) <= bound, (s, books.slot_pages[s], bound)


def run_checked(llm: LLM, prompt_list: list, params: list) -> list:
    """`run_online`, checking the window bound and the books after every iteration."""
    step = llm.step

    def checked_step() -> Any:
        out = step()
        check_window_bound(llm.cache)
        llm.cache.allocator.check_invariants()
        return out

    llm.step = checked_step
    return run_online(llm, prompt_list, params)


# ------------------------------------------------------------------- the engine ----
def test_layer_windows_of_each_family() -> None:
    assert layer_windows(family_config("mistral")) == (WINDOW, WINDOW)
    assert layer_windows(family_config("qwen2")) == (None, WINDOW)
    assert layer_windows(family_config("gemma2")) == (WINDOW, None)
    assert layer_windows(family_config("gemma3")) == (WINDOW,) * 5 + (None,)
    assert layer_windows(family_config("ministral")) == (WINDOW, None)
    llama = transformers.LlamaConfig(num_hidden_layers=3)
    assert layer_windows(llama) == (None, None, None)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_with_pages_given_back(family: str) -> None:
    """Prompts longer than the window, in chunks: the window kinds hold at most the window
    plus a page per slot, and greedy tokens equal transformers' generate."""
    with LLM(family_config(family), seed=0, max_batch_size=4, page_size=PAGE, max_num_batched_tokens=BATCHED,
             prefetch=False) as llm:
        assert window_kinds(llm.cache), "no sliding-window kind"
        assert (len(llm.cache.allocator.kinds) > 1) == (family != "mistral")
        outs = run_checked(llm, prompts(), greedy_params())
        st = llm.cache.stats()
    assert [o.token_ids for o in outs] == reference(family)
    if family != "mistral":
        assert set(st.kinds) == {"full", f"window={WINDOW}"}
        assert st.mapped_bytes == sum(k.mapped_bytes for k in st.kinds.values())
        assert st.kinds[f"window={WINDOW}"].num_mapped_pages < st.kinds["full"].num_mapped_pages


@pytest.mark.parametrize("family,memory", [("gemma3", 448 << 10), ("qwen2", 200 << 10), ("mistral", 112 << 10)])
def test_prefix_caching_parallel_samples_and_swap(family: str, memory: int) -> None:
    """Shared prompts longer than the window (prefix hits map the pinned pages still in the
    window), n > 1 (forks share only pages within it), and swapping under a small budget:
    every sample's greedy tokens equal transformers' generate."""
    ps = prompts()
    system = ps[4][:40]  # a shared system prompt, 5 pages
    plist = [system + p[:20] for p in ps] + [system + ps[0][:20]]
    max_tokens = [*MAX_TOKENS, 10]
    params = [SamplingParams(temperature=0, max_tokens=m, n=1 + i % 2) for i, m in enumerate(max_tokens)]
    model = build_model(family_config(family))
    ref = [hf_greedy(model, p, m) for p, m in zip(plist, max_tokens)]
    with LLM(family_config(family), seed=0, max_batch_size=6, page_size=PAGE, max_num_batched_tokens=BATCHED,
             prefetch=False, enable_prefix_caching=True, preemption_mode="swap", physical_memory=memory) as llm:
        step = llm.step

        def checked_step() -> Any:
            out = step()
            check_window_bound(llm.cache, 64)  # (a swap-in maps the pages it parked)
            llm.cache.allocator.check_invariants()
            return out

        llm.step = checked_step
        outs = run_online(llm, plist, params, (0, 0, 2, 3, 3, 7, 30))
        assert llm.prefix_cache_stats().num_hit_tokens > 0
        assert llm.scheduler.num_swapped_out > 0
    for out, r, p in zip(outs, ref, params):
        assert len(out.outputs) == p.n
        for o in out.outputs:
            assert o.token_ids == r and o.error is None


def test_swap_parks_only_live_pages() -> None:
    """A swapped-out request of a hybrid cache copies only the pages its window kinds still
    map; swapped in elsewhere, its tokens (full layers) and its window (window layers) are back."""
    with window_cache((WINDOW, None, WINDOW), max_batch_size=3, max_context_len=1024) as cache:
        tpp = cache.geometry.share_tokens
        r = cache.alloc_reqid()
        for n in range(1, 81):
            assert cache.step({r: n})
            for layer in range(3):
                cache.k_cache(layer)[r, n - 1] = n
                cache.v_cache(layer)[r, n - 1] = -n
        firsts = cache.allocator.first_pages(r)
        assert firsts[0] == 0 and firsts[1] == (80 - 1 - WINDOW + 1) // tpp
        handle = cache.swap_out(r, 80)
        full = 80 * 2 * 64 * 4  # bytes of one buffer's 80 tokens
        assert handle.nbytes == 2 * full + 4 * (full - firsts[1] * PAGE)
        other = cache.alloc_reqid()  # takes the parked slot and its pages
        assert other == r and cache.step({other: 80})
        back = cache.swap_in(handle)
        assert back != r and handle.copied_in
        assert cache.allocator.first_pages(back) == firsts
        cache.allocator.check_invariants()
        assert float(cache.k_cache(1)[back, 0, 0, 0]) == 1  # full attention: every token
        for layer in (0, 2):  # the window: the tokens the next query sees
            assert cache.k_cache(layer)[back, 80 - WINDOW:80, 0, 0].tolist() == list(range(81 - WINDOW, 81))
            assert cache.v_cache(layer)[back, 79, 0, 0].item() == -80
        assert cache.step({back: 81})


def test_swap_with_every_layer_windowed() -> None:
    """Mistral's case, one kind with a window: swap parks and copies back only live pages."""
    with window_cache((WINDOW, WINDOW)) as cache:
        r = cache.alloc_reqid()
        for n in range(1, 41):
            assert cache.step({r: n})
            cache.k_cache(1)[r, n - 1] = n
        handle = cache.swap_out(r, 40)
        assert handle.first_pages == (cache.allocator.books.holes(r),) and handle.first_pages[0] > 0
        other = cache.alloc_reqid()
        assert other == r and cache.step({other: 40})
        back = cache.swap_in(handle)
        assert back != r and handle.copied_in
        assert cache.k_cache(1)[back, 40 - WINDOW:40, 0, 0].tolist() == list(range(41 - WINDOW, 41))
        assert cache.step({back: 41})
        cache.allocator.check_invariants()


def test_fork_shares_only_pages_within_the_window_and_pins_compose() -> None:
    with window_cache((WINDOW, None), max_batch_size=4, max_context_len=1024) as cache:
        tpp = cache.geometry.share_tokens
        win = cache.allocator.kinds[1]
        r = cache.alloc_reqid()
        for n in (20, 40, 64):
            assert cache.step({r: n})
        holes = win.books.holes(r)
        assert holes == (40 - WINDOW + 1) // tpp  # the last iteration's queries started at 40
        child = cache.fork(r, 64)
        cache.allocator.check_invariants()
        assert win.books.holes(child) == holes  # the parent's holes: nothing behind the window shared
        assert cache.step({r: 65, child: 65})
        # prefix caching: pin the whole pages; a new request maps them (the window's pages
        # are there), a page given back behind the window stays given back
        handles = cache.pin(r, 64 // tpp)
        cache.free_reqid(r)
        cache.free_reqid(child)
        new = cache.alloc_reqid()
        assert cache.map_pinned(new, handles) == 64
        assert win.books.holes(new) >= 1
        cache.allocator.check_invariants()
        assert cache.step({new: 70})
        # a cached prefix cut where the window's pages were given back maps nothing
        other = cache.alloc_reqid()
        assert cache.map_pinned(other, handles[:holes]) == 0
        cache.allocator.check_invariants()
        assert cache.trim() > 0
        cache.allocator.check_invariants()


def test_pages_behind_the_window_are_unmapped_and_bounded() -> None:
    """The window kind's mapped bytes stay at the window plus an iteration and a page while
    the full kind's grow with the request; free slots keep only their window."""
    with window_cache((64, None), max_context_len=2048) as cache:
        r = cache.alloc_reqid()
        for n in range(1, 1001):
            assert cache.step({r: n})
        st = cache.stats()
        full, win = st.kinds["full"], st.kinds["window=64"]
        tpp = cache.geometry.share_tokens
        assert full.num_mapped_pages == -(-1000 // tpp)
        assert win.num_mapped_pages <= -(-64 // tpp) + 1
        assert win.used_bytes <= (64 + tpp) * win.group_bytes // tpp
        cache.free_reqid(r)
        assert cache.stats().kinds["window=64"].num_mapped_pages == win.num_mapped_pages  # kept, not grown
        r = cache.alloc_reqid()  # the warm slot: its holes are dropped, its window pages reused
        assert cache.step({r: 30})
        cache.allocator.check_invariants()


def test_an_iteration_reading_given_back_pages_is_refused() -> None:
    with window_cache((WINDOW, None)) as cache:
        r = cache.alloc_reqid()
        assert cache.step({r: 40}) and cache.step({r: 41})
        assert cache.step({r: 41})  # the same iteration planned again: its queries still start at 40
        assert cache.allocator.kinds[1].books.holes(r) == (40 - WINDOW + 1) // cache.geometry.share_tokens
        with pytest.raises(InvalidRequestError, match="gave back"):
            cache.step({r: 20})  # back behind the window: those pages are gone
        assert cache.step({r: 60})
        cache.allocator.check_invariants()


def test_fused_layout_keeps_every_page_and_config_errors() -> None:
    with window_cache((WINDOW, None), layout="fused") as cache:
        r = cache.alloc_reqid()
        for n in (100, 200):
            assert cache.step({r: n})
        assert cache.stats().kinds is None
        assert cache.stats().num_mapped_pages == cache.geometry.pages_for(200)
    with pytest.raises(InvalidConfigError, match="one per layer"):
        vattn.init(num_layers=2, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context_len=512,
                   layer_windows=(8,))
    cfg = vattn.CacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context_len=512,
                            layer_windows=(512, None))
    assert cfg.layer_windows is None  # a window as long as the context is full attention


def test_window_validation_errors_say_what_to_do() -> None:
    with window_cache((WINDOW, None)) as cache:
        r = cache.alloc_reqid()
        assert cache.step({r: 64})
        assert cache.step({r: 65})
        pins = cache.pin(r, 8)
        new = cache.alloc_reqid()
        assert cache.map_pinned(new, pins) == 64
        with pytest.raises(InvalidRequestError, match="window"):
            cache.truncate_pinned(new, 8)


def test_window_pages_on_the_fake_cuda_driver(fake_cuda) -> None:
    """The CUDA path's driver calls (cuMemUnmap of pages behind the window, maps after holes,
    fork, swap) obey the strict fake driver's rules, and every mapping goes at close."""
    from tests.conftest import new_cache

    handles, mappings, _ = fake_cuda.live()
    cache = new_cache("fakecuda", page_size=16 << 10, layer_windows=(WINDOW, None), prefetch=False)
    g = cache.geometry
    tpp = g.share_tokens
    r = cache.alloc_reqid()
    for n in range(1, 3 * tpp + 2):
        assert cache.step({r: n})
    win = cache.allocator.kinds[1]
    assert win.books.holes(r) == (3 * tpp - WINDOW + 1) // tpp
    child = cache.fork(r, 3 * tpp + 1)
    handle = cache.swap_out(child, 3 * tpp + 1)
    other = cache.alloc_reqid()
    assert cache.step({other: 2 * tpp})
    back = cache.swap_in(handle)
    assert cache.step({r: 3 * tpp + 2, back: 3 * tpp + 2})
    cache.allocator.check_invariants()
    cache.synchronize()
    booked = sum(a.geometry.num_buffers * sum(grp is not None for pages in a.books.slot_pages for grp in pages)
                 for a in cache.allocator.kinds)
    assert fake_cuda.num_mappings - mappings == booked  # holes are unmapped for the driver too
    assert cache.trim() >= 0
    cache.close()
    assert fake_cuda.live()[:2] == (handles, mappings)


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_windows_with_prefix_caching_at_a_token_that_does_not_divide_the_page(family: str) -> None:
    """48-dim heads: a 384-byte token does not divide the 4 KiB page, so prefixes are shared
    in units of 32 tokens in 3 pages (lcm) while the window layers give back the pages behind
    their 8-token window (the check that a cached prefix still holds its window is in bytes):
    prefix hits happen and every sample's greedy tokens equal transformers' generate."""
    config = family_config(family)
    config.head_dim = 48
    ps = prompts()
    system = (ps[4] + ps[5])[:70]  # two whole units and a part
    plist = [system + p[:12] for p in ps]
    params = [SamplingParams(temperature=0, max_tokens=m, n=1 + i % 2) for i, m in enumerate(MAX_TOKENS)]
    model = build_model(config)
    ref = [hf_greedy(model, p, m) for p, m in zip(plist, MAX_TOKENS)]
    with LLM(config, seed=0, max_batch_size=8, page_size=PAGE, max_num_batched_tokens=BATCHED, prefetch=False,
             enable_prefix_caching=True) as llm:
        g = llm.cache.geometry
        assert (g.share_tokens, g.share_pages) == (32, 3)
        outs = run_online(llm, plist, params, (0, 1, 3, 3, 5, 8))
        assert llm.prefix_cache_stats().num_hit_tokens > 0
        llm.cache.allocator.check_invariants()
    for out, r, p in zip(outs, ref, params):
        assert len(out.outputs) == p.n
        for o in out.outputs:
            assert o.token_ids == r and o.error is None


# ---- found by review: layer kinds and holes meeting prefix chains, failed steps, threads ----
def _kinds_cache(**kw: Any) -> Any:
    """A full and an 8-token window layer kind; 64-dim heads, fp32: 8 tokens a 4 KiB page."""
    args = dict(num_layers=2, num_kv_heads=2, head_dim=64, max_batch_size=2, max_context_len=256, dtype="float32",
                device="cpu", page_size=4096, layer_windows=(None, 8), background=False, prefetch=False)
    return vattn.KVCache(**{**args, **kw})


def test_a_prefix_chain_of_pages_and_holes_maps_its_holes_first() -> None:
    """A chain can join blocks pinned by different requests: [page, page, hole]. The slot's
    holes must lead it (the pages before the last hole are not mapped), else the books count
    no hole and a later step leaves the page its window reads unmapped."""
    from vattn.prefix_cache import PrefixCache

    with _kinds_cache() as cache:
        pc, prompt = PrefixCache(cache), list(range(100, 164))
        y = cache.alloc_reqid()  # 64 tokens in two steps: its window layer gives back pages 0..2
        assert cache.step({y: 32}) and cache.step({y: 64})
        pc.insert(y, prompt)
        cache.free_reqid(y)
        x = cache.alloc_reqid()  # its first 16 tokens in one step: blocks 0 and 1 are now x's pages
        assert cache.step({x: 16})
        pc.insert(x, prompt[:16])
        cache.free_reqid(x)
        z = cache.alloc_reqid()
        n = pc.map_prefix(z, prompt[:25])  # blocks 0, 1 (pages) and 2 (a hole)
        cache.allocator.check_invariants()
        assert n <= 24 and cache.step({z: 25})
        cache.allocator.check_invariants()
        win = cache.allocator.kinds[1].books
        last = win.max_lens[z] - 1
        first = max(0, last - 8 + 1)  # the keys the next query reads
        pages = win.slot_pages[z]
        assert all(pages[p] is not None for p in range(first // 8, last // 8 + 1)), pages


def test_the_prefix_cache_forgets_evicted_blocks_of_layer_kinds() -> None:
    """Past 2 x pins + 1024 entries the prefix cache drops blocks whose pins were evicted: its
    handles carry every kind (and holes), not (group, generation) pairs."""
    from vattn.prefix_cache import PrefixCache

    with _kinds_cache(max_context_len=512, physical_memory=64 * 2 * 4096 * 2) as cache:
        pc = PrefixCache(cache)
        for i in range(400):
            r = cache.alloc_reqid()
            ids = [i * 7 + k for k in range(4 * pc.block_tokens)]
            assert cache.step({r: len(ids)})
            pc.insert(r, ids)
            cache.free_reqid(r)
        assert len(pc.entries) <= 2 * len(cache.allocator.pins) + 1024 + 4


def test_layer_kinds_with_background_premapping_keep_every_token() -> None:
    """The kinds' pre-mapping workers share one backend: with the defaults (background,
    prefetch) every token written stays what was written."""
    import random

    rng = random.Random(0)
    with _kinds_cache(max_batch_size=4, background=True, prefetch=True, layer_windows=(None, 200)) as cache:
        lens: dict[int, int] = {}
        for _ in range(300):
            if len(lens) < 4:
                lens[cache.alloc_reqid()] = 0
            s = rng.choice(list(lens))
            m = lens[s]
            n = min(256, m + rng.randrange(1, 40))
            assert cache.step({s: n})
            for layer in range(2):
                cache.k_cache(layer)[s, m:n] = (torch.arange(m, n, dtype=torch.float32) + 1000 * s)[:, None, None]
            lens[s] = n
            for r, k in lens.items():
                for layer, window in enumerate((None, 200)):
                    lo = 0 if window is None else max(0, k - window + 1)
                    expect = torch.arange(lo, k, dtype=torch.float32) + 1000 * r
                    assert torch.equal(cache.k_cache(layer)[r, lo:k, 0, 0], expect), (r, layer)
            if n == 256:
                cache.free_reqid(s)
                del lens[s]


# ---- issue 30: the engine sizes each step to what memory holds, for every layer kind ----
@pytest.mark.parametrize("family,memory", [("gemma3", 262144), ("mistral", 65536)])
def test_a_tight_memory_prompt_runs_in_shorter_chunks(family: str, memory: int) -> None:
    """The issue's reproducers: a 40-token prompt whose window layers cannot hold it in one
    64-token chunk (a chunk's queries read every key of the chunk) but can in shorter ones:
    the chunk is shortened, not the request refused as "can never fit"; with n=3 every sample
    runs and equals generate's greedy tokens (none is a silent "length" beside an error)."""
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 128, (40,), generator=g).tolist()
    ref = hf_greedy(build_model(family_config(family)), prompt, 13)
    with LLM(family_config(family), seed=0, max_batch_size=4, page_size=PAGE, physical_memory=memory,
             max_num_batched_tokens=64, prefetch=False) as llm:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=13, n=3))[0]
        llm.cache.allocator.check_invariants()
    assert out.finish_reason == "length" and out.error is None
    assert [(o.token_ids, o.finish_reason, o.error) for o in out.outputs] == [(ref, "length", None)] * 3


def test_a_request_that_cannot_run_alone_is_still_refused() -> None:
    """Shorter chunks cannot make a prompt fit whose first token does not: "can never fit"
    (with the sample named), and the engine serves on."""
    with LLM(family_config("gemma3"), seed=0, max_batch_size=2, page_size=PAGE, physical_memory=48 << 10,
             max_num_batched_tokens=64, prefetch=False) as llm:
        big, small = llm.generate([list(range(3, 123)), [5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert big.finish_reason == "error" and "even when it runs alone" in big.error
    assert small.finish_reason == "length" and len(small.token_ids) == 4
