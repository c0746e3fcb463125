"""Speculative decoding by n-gram prompt lookup (`speculative_config`): greedy tokens equal to
decoding without it and to transformers' generate; the rejection sampler's output distribution is
the target's; a rejection maps, unmaps and copies nothing; nothing rejected is cached; stop
conditions inside an accepted run cut exactly; the refusals."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from tests.helpers import build_model, hf_greedy, prompts, run_online, tiny_config
from vattn.engine import LLM, SamplingParams
from vattn.engine.rejection import accept_point_mass
from vattn.engine.spec_decode import NgramProposer, SpecConfig, ngram_lookup, parse_speculative_config
from vattn.errors import InvalidConfigError

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_TOKENS = (24, 40, 16, 33, 28, 40)
PAGE = 4096


def rep_prompts() -> list[list[int]]:
    """tests.helpers' prompts, each repeating a piece of itself: n-grams to look up from the start."""
    return [p + p[:max(3, len(p) // 2)] + p[:5] for p in prompts()]


def greedy(max_tokens=MAX_TOKENS, **kw) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, **kw) for m in max_tokens]


@functools.lru_cache(maxsize=None)
def hf_reference(family: str = "llama") -> tuple:
    model = build_model(tiny_config(family))
    return tuple(tuple(hf_greedy(model, p, m)) for p, m in zip(rep_prompts(), MAX_TOKENS))


class OracleProposer:
    """Drafts from transformers' greedy output, every third one (by a hash of where it is) wrong:
    runs of accepted drafts of every length, and rejections at every position. The engine's
    machinery (verification, the length moving back, stops inside a run) does not depend on
    where drafts come from; the n-gram lookup is tested on its own."""

    def __init__(self, family: str = "llama") -> None:
        self.ref = {tuple(p): list(r) for p, r in zip(rep_prompts(), hf_reference(family))}

    def propose(self, seq, limit):
        truth = self.ref[tuple(seq.prompt_token_ids)]
        pos = seq.num_output_tokens
        n = 1 + (seq.request_id * 7 + pos) % 5
        drafts = truth[pos:pos + min(n, limit)]
        return [(t + 1) % 128 if (seq.request_id + pos + i) % 3 == 2 else t for i, t in enumerate(drafts)]

    def observe(self, seq, proposed, accepted):
        pass


def engine(family: str = "llama", spec=SPEC, oracle: bool = False, **kw) -> LLM:
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("page_size", PAGE)
    llm = LLM(tiny_config(family), seed=0, speculative_config=spec, **kw)
    if oracle:
        llm.scheduler.proposer = OracleProposer(family)
    return llm


def run(llm: LLM, params=None, online: bool = True):
    params = params or greedy()
    return run_online(llm, rep_prompts(), params) if online else llm.generate(rep_prompts(), params)


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


# ---------------------------------------------------------------------- greedy ----
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_equals_transformers_and_no_speculation(family):
    with engine(family, spec=None) as plain:
        want = tokens(run(plain))
    with engine(family) as llm:
        got = tokens(run(llm))
        stats = llm.spec_decode_stats()
    assert got == want == [list(r) for r in hf_reference(family)]
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    assert sum(r.num_draft_tokens for r in stats.requests.values()) == stats.num_draft_tokens
    assert sum(r.num_accepted_tokens for r in stats.requests.values()) == stats.num_accepted_tokens
    assert stats.acceptance_rate == stats.num_accepted_tokens / stats.num_draft_tokens


@pytest.mark.parametrize("kw", [
    dict(max_num_batched_tokens=16),  # chunked prefill beside decodes with drafts
    dict(layout="fused"),
    dict(spec={**SPEC, "adaptive": False, "num_speculative_tokens": 7}),
    dict(spec={**SPEC, "prompt_lookup_min": 2, "prompt_lookup_max": 2, "num_speculative_tokens": 1}),
], ids=["chunked", "fused", "k7-not-adaptive", "k1-bigram"])
def test_greedy_equal_under_other_settings(kw):
    with engine(**kw) as llm:
        outs = run(llm)
        stats = llm.spec_decode_stats()
    assert tokens(outs) == [list(r) for r in hf_reference()]
    assert stats.num_draft_tokens > 0
    assert outs[1].metrics.num_draft_tokens >= outs[1].metrics.num_accepted_draft_tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equal_with_preemption_and_prefix_caching(mode):
    """Too little memory for the batch: requests are preempted (their computed blocks pinned)
    and come back through the prefix cache (or swap in), with drafts all along."""
    kw = dict(physical_memory=12 * PAGE * 2 * 2, enable_prefix_caching=True, preemption_mode=mode,
              max_batch_size=6)
    with engine(oracle=True, **kw) as llm:
        inserted: list[list[int]] = []
        pc = llm.prefix_cache
        real_insert = pc.insert
        pc.insert = lambda reqid, ids: (inserted.append(list(ids)), real_insert(reqid, ids))[1]
        outs = run(llm)
        assert llm.num_preemptions > 0
        assert llm.spec_decode_stats().num_accepted_tokens > 0
    assert tokens(outs) == [list(r) for r in hf_reference()]
    # every token list pinned (hashed into the cache, written through to an offload tier) is a
    # prefix of a request's real tokens: no rejected draft ever reaches the cache
    finals = [o.prompt_token_ids + o.token_ids for o in outs]
    assert inserted and all(any(f[:len(ids)] == ids for f in finals) for ids in inserted)


def test_offload_tier_gets_only_accepted_tokens():
    """With a host tier, blocks are written through as they are pinned: a second engine-less
    check that every block the tier holds hashes tokens some request really had."""
    kw = dict(physical_memory=12 * PAGE * 2 * 2, enable_prefix_caching=True, offload_bytes=64 << 20,
              max_batch_size=6)
    with engine(oracle=True, **kw) as llm:
        pc = llm.prefix_cache
        hashed: list[list[int]] = []
        real = pc.block_hashes
        pc.block_hashes = lambda ids: (hashed.append(list(ids)), real(ids))[1]
        outs = run(llm)
        assert llm.num_preemptions > 0 and llm.prefix_cache_stats().host_bytes > 0
    assert tokens(outs) == [list(r) for r in hf_reference()]
    finals = [o.prompt_token_ids + o.token_ids for o in outs]
    assert all(any(f[:len(ids)] == ids for f in finals) for ids in hashed)


def test_parallel_samples_greedy():
    with engine(oracle=True) as llm:
        outs = llm.generate(rep_prompts()[:3], [SamplingParams(temperature=0, max_tokens=m, n=3)
                                                 for m in MAX_TOKENS[:3]])
    for out, ref in zip(outs, hf_reference()):
        assert [o.token_ids for o in out.outputs] == [list(ref)] * 3


# ----------------------------------------------------------- pages on rejection ----
def test_a_rejection_maps_unmaps_and_copies_nothing():
    """One request, nothing mapped ahead: a step that follows a rejection (the length moved back
    over the rejected drafts, whose rows it writes again) and reaches no page past the longest
    length so far makes no call to the backend at all; nothing is unmapped, forked, swapped or
    reverted over the whole run."""
    with engine(background=False, prefetch=False, max_batch_size=1, oracle=True) as llm:
        cache = llm.runner.cache
        be, g = cache.backend, cache.geometry
        page_tokens = g.page_size // g.token_bytes
        record = []
        longest = {}
        rejected = [False]
        real_step, real_note = cache.step, llm.scheduler._note_drafts

        def note(seq, proposed, accepted):
            rejected[0] = accepted < proposed
            real_note(seq, proposed, accepted)

        def step(lens):
            before = (be.num_map_calls, be.num_unmap_calls, be.num_pages_mapped, be.num_pages_unmapped)
            result = real_step(lens)
            after = (be.num_map_calls, be.num_unmap_calls, be.num_pages_mapped, be.num_pages_unmapped)
            for slot, n in lens.items():
                old = longest.get(slot, 0)
                within = -(-n // page_tokens) <= -(-old // page_tokens)
                record.append((within and rejected[0], before, after))
                longest[slot] = max(old, n)
            rejected[0] = False
            return result

        cache.step, llm.scheduler._note_drafts = step, note
        for name in ("fork", "swap_out", "swap_in", "revert_step", "trim"):
            setattr(cache, name, lambda *a, _n=name: pytest.fail(f"cache.{_n} called"))
        i = max(range(6), key=lambda i: len(hf_reference()[i]))
        prompt = rep_prompts()[i]
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i]))
        stats = llm.spec_decode_stats()
        unmapped = be.num_unmap_calls
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # some drafts were rejected, some not
    after_rejection = [(b, a) for went_back, b, a in record if went_back]
    assert len(after_rejection) >= 3
    assert all(b == a for b, a in after_rejection)  # not one call to the backend
    assert unmapped == 0
    assert out[0].token_ids == list(hf_reference()[i])


# ---------------------------------------------------------------- stop conditions ----
def test_stops_inside_an_accepted_run_cut_exactly():
    """EOS, stop_token_ids and max_tokens landing inside a run of accepted drafts end the output
    exactly where one token a step ends it."""
    ref = [list(r) for r in hf_reference()]
    # a token from the middle of each greedy output, after a few tokens (so drafts run before it)
    stops = [r[len(r) // 2] for r in ref]
    for eos in (False, True):
        cases = []
        for i, (r, t) in enumerate(zip(ref, stops)):
            p = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], **({} if eos else {"stop_token_ids": [t]}))
            cases.append(p)
        results = []
        for spec in (None, SPEC):
            with engine(spec=spec, oracle=spec is not None) as llm:
                if eos:
                    llm.eos_token_ids = set(stops)
                results.append(run(llm, cases))
        plain, spec_outs = results
        assert tokens(plain) == tokens(spec_outs)
        assert [o.finish_reason for o in plain] == [o.finish_reason for o in spec_outs]
        assert any(o.finish_reason == "stop" and len(o.token_ids) < m for o, m in zip(plain, MAX_TOKENS))
    for m in (1, 2, 3, 5, 9):
        with engine(oracle=True) as llm:
            outs = run(llm, greedy([m] * 6))
        with engine(spec=None) as llm:
            plain = run(llm, greedy([m] * 6))
        assert tokens(outs) == tokens(plain) == [r[:m] for r in ref]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in plain]


# ------------------------------------------------------------------------ sampling ----
def _chi2_ok(counts: list[int], probs: list[float]) -> bool:
    """Pearson's chi-square of `counts` against `probs`, below the 1 - 1e-4 quantile
    (Wilson-Hilferty; cells with probability 0 must be empty)."""
    n = sum(counts)
    stat, df = 0.0, -1
    for c, p in zip(counts, probs):
        if p <= 0:
            if c:
                return False
            continue
        stat += (c - n * p) ** 2 / (n * p)
        df += 1
    z = 3.719
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < crit


@pytest.mark.parametrize("draft_mass", [0.0, 0.05, 0.4, 0.9])
def test_rejection_sampler_output_is_the_targets_distribution(draft_mass):
    """A point-mass draft (n-gram) accepted with p(d), else a draw from p without d: the first
    token is distributed as p0; given the first draft was accepted, the next as p1."""
    torch.manual_seed(0)
    vocab, draws = 6, 20000
    p0 = torch.rand(vocab)
    p0[1] = p0[2] = 0
    p0 = p0 / p0.sum() * (1 - draft_mass)
    p0[1] = draft_mass
    p1 = torch.softmax(torch.randn(vocab), -1)
    probs = torch.stack([p0, p1, torch.full((vocab,), 1 / vocab)])
    drafts = torch.tensor([1, 4])
    g = torch.Generator().manual_seed(1)
    first, second = [0] * vocab, [0] * vocab
    for _ in range(draws):
        j, token = accept_point_mass(probs, drafts, g)
        out = drafts[:j].tolist() + [token]
        first[out[0]] += 1
        if out[0] == 1 and len(out) > 1:
            second[out[1]] += 1
    assert _chi2_ok(first, p0.tolist())
    if draft_mass >= 0.4:
        assert sum(second) > 1000 and _chi2_ok(second, p1.tolist())


def test_engine_samples_follow_the_model():
    """Temperature 1 through the engine on a 12-token vocabulary: the first three tokens'
    marginals over 1500 samples (drafts proposed from the prompt) match transformers' exact
    probabilities; and speculation did propose and reject drafts on the way."""
    config = tiny_config(eos_token_id=None, bos_token_id=None, pad_token_id=0)
    config.vocab_size = 12
    prompt = [3, 4, 5, 6, 3, 4, 5, 6, 3, 4, 5]
    n = 1500
    with LLM(config, seed=0, max_batch_size=64, page_size=PAGE, speculative_config=SPEC) as llm:
        outs = llm.generate([prompt] * 2, [SamplingParams(temperature=1.0, max_tokens=4, n=n // 2, seed=seed)
                                           for seed in (7, 10_007)])  # (samples seeded seed + i: all distinct)
        stats = llm.spec_decode_stats()
    samples = [o.token_ids for out in outs for o in out.outputs]
    assert stats.num_draft_tokens > 100 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    model = build_model(config)
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)  # [V]
        ctx = torch.tensor([prompt + [t] for t in range(12)])
        p2_given = model(ctx).logits[:, -1].softmax(-1)  # [V, V]
        p2 = p1 @ p2_given
        ctx3 = torch.tensor([prompt + [a, b] for a in range(12) for b in range(12)])
        p3_given = model(ctx3).logits[:, -1].softmax(-1).reshape(12, 12, 12)
        p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    for pos, p in ((0, p1), (1, p2), (2, p3)):
        counts = [0] * 12
        for s in samples:
            counts[s[pos]] += 1
        assert _chi2_ok(counts, p.tolist()), (pos, counts, (p * n).tolist())


def test_seeded_sampling_is_reproducible():
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=m, seed=3 + i) for i, m in enumerate(MAX_TOKENS)]
    runs = []
    for online in (True, False):
        with engine() as llm:
            runs.append(tokens(run(llm, params, online=online)))
            assert llm.spec_decode_stats().num_draft_tokens > 0
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------- proposer ----
def test_ngram_lookup_takes_the_longest_then_earliest_match():
    assert ngram_lookup([1, 2, 3, 9, 2, 3, 7, 2, 3], 1, 3, 2) == [9, 2]
    assert ngram_lookup([5, 1, 2, 3, 4, 1, 2, 8, 9, 1, 2], 1, 3, 3) == [3, 4, 1]
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 2) == []
    assert ngram_lookup([1, 2, 3, 1], 2, 3, 2) == []
    assert ngram_lookup([1, 2, 1], 1, 1, 5) == [2, 1]


def test_adaptive_proposals_back_off_where_nothing_is_accepted():
    from vattn.engine.sequence import Sequence

    seq = Sequence(0, [1, 2, 3, 4, 5, 6, 1, 2], SamplingParams(temperature=0, max_tokens=50), 0.0)
    prop = NgramProposer(SpecConfig("ngram", 4, 3, 1))
    assert len(prop.propose(seq, 10)) == 4
    prop.observe(seq, 4, 0)
    assert len(prop.propose(seq, 10)) == 2  # nothing accepted: half as many
    prop.observe(seq, 2, 0)
    assert len(prop.propose(seq, 10)) == 1
    prop.observe(seq, 1, 0)  # at one draft token and still nothing: a pause
    skipped = 0
    while not prop.propose(seq, 10):
        skipped += 1
    assert skipped >= 1
    prop.observe(seq, 1, 1)
    assert len(prop.propose(seq, 10)) == 3  # all accepted: 2 more


def test_requests_with_penalties_or_logprobs_decode_without_drafts():
    with engine() as llm:
        outs = run(llm, [SamplingParams(temperature=0, max_tokens=m, logprobs=1 if i % 2 else None,
                                        repetition_penalty=1.0 if i % 2 else 1.2) for i, m in enumerate(MAX_TOKENS)])
        assert llm.spec_decode_stats().num_draft_tokens == 0
    with engine(spec=None) as plain:
        ref = run(plain, [SamplingParams(temperature=0, max_tokens=m, logprobs=1 if i % 2 else None,
                                         repetition_penalty=1.0 if i % 2 else 1.2) for i, m in enumerate(MAX_TOKENS)])
    assert tokens(outs) == tokens(ref)


# ---------------------------------------------------------------------- refusals ----
@pytest.mark.parametrize("value,match", [
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 3}, "not supported yet"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "not supported yet"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, ">="),
    ({"method": "ngram", "num_speculative_tokens": 2, "bogus": 1}, "unknown"),
    ({"method": "nope", "num_speculative_tokens": 2}, "method"),
    ("ngram", "dict"),
])
def test_bad_speculative_configs_are_refused(value, match):
    with pytest.raises(InvalidConfigError, match=match):
        parse_speculative_config(value)


def test_vllm_defaults():
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3}) == SpecConfig("ngram", 3, 5, 5)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 4}) == SpecConfig("ngram", 3, 4, 4)


@pytest.mark.parametrize("kw,match", [
    (dict(async_scheduling=True), "async_scheduling"),
    (dict(cuda_graphs=True), "cuda_graphs"),
    (dict(tensor_parallel_size=2), "tensor_parallel_size"),
])
def test_engine_settings_it_cannot_run_with_are_refused(kw, match):
    with pytest.raises(InvalidConfigError, match=match):
        engine(**kw)


def test_defaults_turn_async_scheduling_off():
    from vattn.engine.config import EngineConfig

    assert not EngineConfig(speculative_config=SPEC, device="cpu").uses_async_scheduling()


def test_recurrent_state_models_are_refused():
    from tests.engine.test_model_support import hybrid_config

    with pytest.raises(InvalidConfigError, match="recurrent-state"):
        LLM(hybrid_config("bamba"), seed=0, max_batch_size=2, speculative_config=SPEC)


def test_sliding_window_layers_step_back_over_rejected_drafts():
    """Mistral with a 16-token window (per-layer: pages behind the window are given back): the
    length moving back over rejected drafts never reads a page given back; tokens equal
    transformers'."""
    config = tiny_config("mistral", sliding_window=16)
    model = build_model(config)
    ref = [hf_greedy(model, p, m) for p, m in zip(rep_prompts(), MAX_TOKENS)]
    with LLM(config, seed=0, max_batch_size=8, page_size=PAGE, speculative_config=SPEC) as llm:
        oracle = OracleProposer()
        oracle.ref = {tuple(p): r for p, r in zip(rep_prompts(), ref)}
        llm.scheduler.proposer = oracle
        outs = run(llm)
        assert llm.spec_decode_stats().num_draft_tokens > llm.spec_decode_stats().num_accepted_tokens > 0
    assert tokens(outs) == ref
