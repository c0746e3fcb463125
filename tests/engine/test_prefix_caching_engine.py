"""Automatic prefix caching in the engine (`LLM(..., enable_prefix_caching=True)`): a new
sequence maps the cached whole pages of its prefix and computes only the rest. Greedy
outputs equal those without prefix caching and transformers' own, whatever the batching:
a long shared system prompt, both layouts, chunked prefill, a budget that forces
preemptions and evictions, parallel samples."""
from __future__ import annotations

import functools
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.helpers import (  # noqa: E402
    PAGE,
    FakeKV,
    build_model,
    fake_advance,
    greedy_params,
    hf_greedy,
    make_seq,
    prompts,
    reference,
    run_online,
    tiny_config,
)

from vattn.engine import LLM, SamplingParams  # noqa: E402
from vattn.engine.loader import prefix_salt  # noqa: E402
from vattn.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from vattn.errors import InvalidConfigError  # noqa: E402

SUFFIX_LENS = (3, 20, 41, 9, 30, 1, 17, 64)
SYSTEM_MAX_TOKENS = (10, 14, 8, 16, 12, 9, 11, 6)
SYSTEM_ARRIVALS = (0, 0, 1, 3, 3, 4, 8, 8)


@functools.lru_cache(maxsize=None)
def system_prompts() -> tuple[tuple[int, ...], ...]:
    """Eight prompts that share a 100-token system prompt (3 whole pages of 32 tokens)."""
    g = torch.Generator().manual_seed(7)
    system = torch.randint(3, 128, (100,), generator=g).tolist()
    return tuple(tuple(system + torch.randint(3, 128, (n,), generator=g).tolist()) for n in SUFFIX_LENS)


@functools.lru_cache(maxsize=None)
def system_reference() -> tuple[tuple[int, ...], ...]:
    model = build_model(tiny_config())
    return tuple(tuple(hf_greedy(model, list(p), m)) for p, m in zip(system_prompts(), SYSTEM_MAX_TOKENS))


def system_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m) for m in SYSTEM_MAX_TOKENS]


def run_system(**kw: Any) -> tuple[list, int, Any]:
    """Serve the system-prompt workload; returns outputs, tokens computed, and the engine's
    prefix stats."""
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4, **kw) as llm:
        computed = [0]
        schedule = llm.scheduler.schedule

        def counting() -> Any:
            out = schedule()
            computed[0] += out.num_batched_tokens
            return out

        llm.scheduler.schedule = counting
        outs = run_online(llm, [list(p) for p in system_prompts()], system_params(), SYSTEM_ARRIVALS)
        llm.cache.allocator.check_invariants()
        return outs, computed[0], llm.prefix_cache_stats(), llm.num_preemptions


def tokens(outs: list) -> list[list[int]]:
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("layout", ["per-layer", "fused"])
def test_shared_system_prompt_is_computed_once(layout: str) -> None:
    plain, plain_computed, none, _ = run_system(layout=layout)
    cached, cached_computed, stats, _ = run_system(layout=layout, enable_prefix_caching=True)
    ref = [list(r) for r in system_reference()]
    assert tokens(plain) == ref and tokens(cached) == ref
    assert none is None
    tpp = stats.block_tokens
    assert tpp == {"per-layer": 32, "fused": 16}[layout]
    # every request after the first two (which arrive together, before anything is cached)
    # maps the system prompt's whole pages
    assert stats.num_hit_tokens >= (len(SUFFIX_LENS) - 2) * (100 // tpp * tpp)
    assert cached_computed == plain_computed - stats.num_hit_tokens
    assert 0 < stats.hit_rate < 1 and stats.num_pinned_pages > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("budget", [None, 16], ids=["whole-prompts", "chunked"])
def test_prefix_caching_under_preemption_and_eviction(budget: int | None, mode: str) -> None:
    """96 KiB of KV (192 tokens): pinned pages are evicted for running requests, requests are
    preempted and recompute (or swap out and back in) with what stayed cached."""
    kw = dict(physical_memory=96 << 10, enable_prefix_caching=True, preemption_mode=mode)
    if budget:
        kw["max_num_batched_tokens"] = budget
    evicted = []

    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4, **kw) as llm:
        alloc = llm.cache.allocator
        real_evict = alloc.books.evict

        def evict(count: int) -> int:
            n = real_evict(count)
            evicted.append(n)
            return n

        alloc.books.evict = evict
        outs = run_online(llm, [list(p) for p in system_prompts()], system_params(), SYSTEM_ARRIVALS)
        again = run_online(llm, prompts(), greedy_params())  # other prompts, same engine
        assert llm.num_preemptions > 0
        stats = llm.prefix_cache_stats()
        alloc.check_invariants()
    assert sum(evicted) > 0 and stats.num_hit_tokens > 0
    assert tokens(outs) == [list(r) for r in system_reference()]
    assert tokens(again) == [list(r) for r in reference()]


def test_prefix_caching_with_parallel_samples() -> None:
    params = [SamplingParams(temperature=0, max_tokens=m, n=1 + i % 3) for i, m in enumerate(SYSTEM_MAX_TOKENS)]
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=5, physical_memory=96 << 10,
             enable_prefix_caching=True) as llm:
        outs = run_online(llm, [list(p) for p in system_prompts()], params, SYSTEM_ARRIVALS)
        assert llm.prefix_cache_stats().num_hit_tokens > 0
        llm.cache.allocator.check_invariants()
    for out, r, sp in zip(outs, system_reference(), params):
        assert [o.token_ids for o in out.outputs] == [list(r)] * sp.n


def test_repeated_prompts_hit_and_seeded_sampling_is_unchanged() -> None:
    ps = prompts()
    sp = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=3, ignore_eos=True)
    with LLM(tiny_config(), seed=0, page_size=PAGE) as llm:
        want = llm.generate(ps, sp)
    with LLM(tiny_config(), seed=0, page_size=PAGE, enable_prefix_caching=True) as llm:
        first = llm.generate(ps, sp)
        hits = llm.prefix_cache_stats().num_hit_tokens
        second = llm.generate(ps, sp)
        # every whole page of each prompt but a last one that holds the prompt's last token
        expected = sum((len(p) - 1) // 32 * 32 for p in ps)
        assert llm.prefix_cache_stats().num_hit_tokens - hits == expected
    assert tokens(first) == tokens(second) == tokens(want)


def test_prefix_salt_is_model_specific() -> None:
    model = build_model(tiny_config())
    other = build_model(tiny_config(kv_heads=4))
    assert prefix_salt(model, torch.float32) == prefix_salt(build_model(tiny_config()), torch.float32)
    assert prefix_salt(model, torch.float32) != prefix_salt(model, torch.float16)
    assert prefix_salt(model, torch.float32) != prefix_salt(other, torch.float32)


def test_prefix_caching_config_errors() -> None:
    with pytest.raises(InvalidConfigError, match="enable_prefix_caching"):
        LLM(tiny_config(), enable_prefix_caching="yes")
    from transformers import LlamaConfig

    # 192-byte tokens in 4 KiB pages share blocks of 64 tokens: none fits a 64-token context
    odd = LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with pytest.raises(InvalidConfigError, match="no prompt could ever share a block; use layout='fused'"):
        LLM(odd, page_size=PAGE, enable_prefix_caching=True)
    with LLM(odd, page_size=PAGE, layout="fused", enable_prefix_caching=True) as llm:
        assert llm.prefix_cache_stats().block_tokens == 32


# ------------------------------------------- a token that does not divide the page ----
def phi3_config() -> Any:
    """A tiny Phi-3-shaped model: head_dim 96 (as Phi-3-mini's), so a token of a per-layer
    buffer (2 KV heads x 96 x fp32 = 768 bytes) does not divide the host's default 64 KiB
    page; blocks of 256 tokens (128 fused) fill 3 pages."""
    from transformers import Phi3Config

    return Phi3Config(vocab_size=128, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)


PHI_SUFFIX_LENS = (5, 40, 1, 23, 70, 12)
PHI_MAX_TOKENS = (8, 6, 10, 5, 7, 9)
PHI_ARRIVALS = (0, 0, 1, 2, 4, 4)


@functools.lru_cache(maxsize=None)
def phi_prompts() -> tuple[tuple[int, ...], ...]:
    """Six prompts sharing a 300-token system prompt (one or two whole blocks)."""
    g = torch.Generator().manual_seed(11)
    system = torch.randint(3, 128, (300,), generator=g).tolist()
    return tuple(tuple(system + torch.randint(3, 128, (n,), generator=g).tolist()) for n in PHI_SUFFIX_LENS)


@pytest.mark.parametrize("layout, block", [("per-layer", 256), ("fused", 128)])
def test_phi3_shaped_model_with_prefix_caching_at_the_default_page_size(layout: str, block: int) -> None:
    """Issue 23: prefix caching refused a page that holds no whole number of tokens, and the
    user had to find a page size that did. Now it shares whole blocks of lcm(page, token)
    bytes at the default page size; greedy outputs equal transformers' own."""
    model = build_model(phi3_config())
    ref = [hf_greedy(model, list(p), m) for p, m in zip(phi_prompts(), PHI_MAX_TOKENS)]
    params = [SamplingParams(temperature=0, max_tokens=m) for m in PHI_MAX_TOKENS]
    with LLM(phi3_config(), seed=0, max_batch_size=4, layout=layout, enable_prefix_caching=True) as llm:
        g = llm.cache.geometry
        assert g.page_size % g.token_bytes  # (a token straddles pages)
        assert (g.share_tokens, g.share_pages) == (block, 3)
        outs = run_online(llm, [list(p) for p in phi_prompts()], params, PHI_ARRIVALS)
        stats = llm.prefix_cache_stats()
        llm.cache.allocator.check_invariants()
    assert tokens(outs) == ref
    assert stats.block_tokens == block
    # every request after the first two (which arrive together) maps the system prompt's blocks
    assert stats.num_hit_tokens >= (len(PHI_SUFFIX_LENS) - 2) * (300 // block * block)


# ------------------------------------------------------------ the scheduler alone ----
class FakePrefix:
    """Records what the scheduler asks; maps `hit` tokens for every lookup."""

    def __init__(self, hit: int) -> None:
        self.hit = hit
        self.lookups: list[tuple[int, list[int]]] = []
        self.inserts: list[tuple[int, list[int]]] = []

    def map_prefix(self, reqid: int, token_ids: list[int]) -> int:
        self.lookups.append((reqid, list(token_ids)))
        return min(self.hit, len(token_ids) - 1)

    def insert(self, reqid: int, token_ids: list[int]) -> None:
        self.inserts.append((reqid, list(token_ids)))


def test_scheduler_maps_prefixes_and_caches_prompts_and_preempted_work() -> None:
    kv, pc = FakeKV(2, capacity=60), FakePrefix(hit=8)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), kv, prefix_cache=pc)
    a, b = make_seq(0, 20, max_tokens=30), make_seq(1, 12, max_tokens=30)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 12), (b, 4)]  # 8 tokens mapped each
    assert [lk[1] for lk in pc.lookups] == [a.token_ids, b.token_ids]
    fake_advance(sched, out)
    assert pc.inserts == [(a.slot, a.prompt_token_ids), (b.slot, b.prompt_token_ids)]
    pc.inserts.clear()
    for _ in range(40):  # a and b decode until 60 tokens no longer hold both: b is preempted
        out = sched.schedule()
        if out.preempted:
            break
        fake_advance(sched, out)
    assert out.preempted == [b] and b.num_preemptions == 1 and b.num_computed_tokens == 0
    assert pc.inserts == [(pc.inserts[0][0], b.token_ids[:-1])]  # everything b had computed
    out = sched.schedule()  # b comes back: looked up again (and preempted again before it ran)
    assert pc.lookups[-1][1] == b.token_ids and out.preempted == [b]
    assert b.num_preemptions == 1 and len(pc.inserts) == 1
