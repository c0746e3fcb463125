"""The sampling fields of issue 36 through the real engine on the tiny seeded model: penalties,
min_tokens, min_p / top-k / top-p, logprobs and stop strings, each against transformers where it
has the same processor, or against a reference formula; and their checks."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tests.engine.test_engine import word_tokenizer  # noqa: E402
from tests.helpers import MAX_TOKENS, PAGE, build_model, prompts, reference, run_online, tiny_config  # noqa: E402

from vattn.engine import LLM, SamplingParams  # noqa: E402
from vattn.engine.detokenizer import OffsetDetokenizer, StreamDetokenizer, make_detokenizer  # noqa: E402
from vattn.engine.sampler import apply_min_p, apply_penalties, apply_top_k_top_p  # noqa: E402
from vattn.errors import InvalidRequestError  # noqa: E402

EOS = 2  # LlamaConfig's eos_token_id: the tiny model's end-of-sequence token


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(tiny_config())


def engine(**kw: Any) -> LLM:
    return LLM(tiny_config(), **{"seed": 0, "page_size": PAGE, "max_batch_size": 8, **kw})


def penalized_greedy(model: Any, prompt: list[int], max_tokens: int, rep: float = 1.0, freq: float = 0.0,
                     pres: float = 0.0) -> list[int]:
    """Greedy decoding with the penalties written out per token (the reference formula)."""
    out: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].clone()  # [V]
        for t in set(prompt) | set(out):  # repetition: prompt and generated tokens
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t, c in Counter(out).items():  # frequency and presence: generated tokens only
            logits[t] -= freq * c + pres
        out.append(int(logits.argmax()))
        if out[-1] == EOS:
            break
    return out


# ------------------------------------------------------------------------- penalties ----
def test_repetition_penalty_equals_transformers_generate(model: Any) -> None:
    ps = prompts()[:4]
    with engine() as llm:
        outs = llm.generate(ps, SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=16))
    for p, out in zip(ps, outs):
        ids = torch.tensor([p])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             repetition_penalty=1.5, pad_token_id=0)[0, len(p):].tolist()
        assert out.token_ids == ref
    assert any(out.token_ids != list(r[:16]) for out, r in zip(outs, reference()))  # the penalty changed something


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_follow_the_reference_formula_in_a_preempting_batch(model: Any, async_scheduling: bool) -> None:
    """Presence, frequency and repetition penalties, different per request, next to requests
    without them, with preemptions (the counts survive a recomputation) and with the sampled
    token in flight (asynchronous scheduling: counted on the device)."""
    settings_ = [dict(pres=1.5), dict(freq=1.0), dict(rep=0.7, freq=-0.5), dict(), dict(pres=-1.0, rep=2.0),
                 dict(freq=2.0, pres=0.5)]
    params = [SamplingParams(temperature=0, max_tokens=m, presence_penalty=s.get("pres", 0.0),
                             frequency_penalty=s.get("freq", 0.0), repetition_penalty=s.get("rep", 1.0))
              for m, s in zip(MAX_TOKENS, settings_)]
    with engine(max_batch_size=4, physical_memory=80 << 10, async_scheduling=async_scheduling) as llm:
        outs = run_online(llm, prompts(), params)
        assert llm.num_preemptions > 0
        assert llm.runner.sampler.token_counts.rows == {}, "a sequence's token counts leaked"
    for p, m, s, out in zip(prompts(), MAX_TOKENS, settings_, outs):
        assert out.token_ids == penalized_greedy(model, p, m, **s)


def test_penalties_on_random_logits() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, generator=g) * 4
    prompt = [[1, 5, 5], [], [7]]
    generated = [[5, 9, 9, 9], [3], []]
    in_prompt = torch.zeros(3, 50, dtype=torch.bool)
    counts = torch.zeros(3, 50)
    for r in range(3):
        in_prompt[r, prompt[r]] = True
        for t in generated[r]:
            counts[r, t] += 1
    rep, freq, pres = torch.tensor([[1.3], [0.5], [1.0]]), torch.tensor([[0.4], [-1.0], [2.0]]), \
        torch.tensor([[0.0], [1.5], [-0.5]])
    got = apply_penalties(x, in_prompt, counts, rep, freq, pres)
    want = x.clone()
    for r in range(3):
        for t in set(prompt[r]) | set(generated[r]):
            want[r, t] = want[r, t] / rep[r, 0] if want[r, t] > 0 else want[r, t] * rep[r, 0]
        for t, c in Counter(generated[r]).items():
            want[r, t] -= freq[r, 0] * c + pres[r, 0]
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------ min_tokens ----
def test_min_tokens_equals_transformers_min_new_tokens(model: Any) -> None:
    """With an end-of-sequence token that greedy decoding produces early, min_tokens holds it
    off as transformers' min_new_tokens does; a stop token id too."""
    p = prompts()[1]
    ref = list(reference()[1])
    eos = ref[2]  # greedy would stop at its third token
    ids = torch.tensor([p])
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                          min_new_tokens=8, eos_token_id=eos, pad_token_id=0)[0, len(p):].tolist()
    with engine() as llm:
        llm.eos_token_ids = {eos}
        plain = llm.generate(p, SamplingParams(temperature=0, max_tokens=20))[0]
        held = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, min_tokens=8))[0]
        llm.eos_token_ids = {EOS}
        stop_id = llm.generate(p, SamplingParams(temperature=0, max_tokens=20, min_tokens=8, stop_token_ids=[eos]))[0]
        sampled = llm.generate(p, SamplingParams(temperature=1.0, max_tokens=20, min_tokens=8,
                                                 stop_token_ids=[eos], seed=3))[0]
    assert plain.token_ids == ref[:3] and plain.finish_reason == "stop"
    assert held.token_ids == want and len(want) > 8 and eos not in want[:8]
    assert stop_id.token_ids == want and stop_id.outputs[0].stop_reason == eos
    assert eos not in sampled.token_ids[:8]


# ------------------------------------------------------------------ top-k, top-p, min-p ----
def test_masks_equal_transformers_warpers() -> None:
    """Per-row top-k, top-p and min-p in one batch: the masks of transformers' warpers applied
    to each row alone."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=g) * 3
    x[0, :10] = x[0, 0]  # ties
    ks, ps, mins = [1, 5, 300, 50, 299, 10], [0.9, 1.0, 0.3, 0.99, 0.5, 0.01], [0.0, 0.1, 0.5, 0.9, 1.0, 0.05]
    inf = float("-inf")
    top_k = apply_top_k_top_p(x, ks, None)
    top_p = apply_top_k_top_p(x, None, torch.tensor(ps)[:, None])
    min_p = apply_min_p(x, torch.tensor(mins)[:, None])
    for r in range(6):
        row = x[r:r + 1]
        assert torch.equal(top_k[r] == inf, TopKLogitsWarper(ks[r])(None, row.clone())[0] == inf)
        if ps[r] < 1:
            assert torch.equal(top_p[r] == inf, TopPLogitsWarper(ps[r])(None, row.clone())[0] == inf)
        if mins[r] > 0:
            assert torch.equal(min_p[r] == inf, MinPLogitsWarper(mins[r])(None, row.clone())[0] == inf)
        kept = top_k[r] != inf
        assert torch.equal(top_k[r][kept], x[r][kept])  # kept logits are untouched
    # both: top-k then top-p, with a row without top-k (one sort) and with top-k in every row
    # (no ties: which of tokens tied at the nucleus' edge goes is the sort's choice)
    y = torch.randn(6, 300, generator=g) * 3
    for k_rows in (ks, [1, 5, 40, 50, 299, 10]):
        both = apply_top_k_top_p(y, k_rows, torch.tensor(ps)[:, None])
        for r in range(6):
            want = TopKLogitsWarper(k_rows[r])(None, y[r:r + 1].clone())
            if ps[r] < 1:
                want = TopPLogitsWarper(ps[r])(None, want)
            assert torch.equal(both[r] == inf, want[0] == inf), (k_rows, r)
            assert torch.equal(both[r][both[r] != inf], y[r][both[r] != inf])


def test_min_p_one_is_greedy() -> None:
    with engine() as llm:
        outs = llm.generate(prompts()[:3], [SamplingParams(temperature=1.5, min_p=1.0, max_tokens=m, seed=1)
                                            for m in MAX_TOKENS[:3]])
    assert [o.token_ids for o in outs] == [list(r) for r in reference()[:3]]


def test_seeded_requests_with_every_field_are_batch_independent() -> None:
    """A seeded request draws the same tokens alone and in a crowded, preempting batch of
    requests with other fields (greedy, penalties, min-p, unseeded)."""
    sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, presence_penalty=0.5,
                        frequency_penalty=0.3, repetition_penalty=1.1, min_tokens=4, max_tokens=16, seed=77, n=2)
    p = prompts()[2]
    with engine() as llm:
        alone = [o.token_ids for o in llm.generate(p, sp)[0].outputs]
        again = [o.token_ids for o in llm.generate(p, sp)[0].outputs]
    others = [SamplingParams(temperature=0, max_tokens=12, presence_penalty=1.0),
              SamplingParams(temperature=1.0, max_tokens=20, min_p=0.1),
              sp,
              SamplingParams(temperature=0.7, max_tokens=24, frequency_penalty=-1.0, seed=5),
              SamplingParams(temperature=1.2, max_tokens=16, top_k=3, logprobs=2),
              SamplingParams(temperature=0, max_tokens=22)]
    with engine(max_batch_size=4, physical_memory=80 << 10, async_scheduling=True) as llm:
        outs = run_online(llm, prompts(), others)
        assert llm.num_preemptions > 0
    assert alone == again and alone[0] != alone[1]
    assert [o.token_ids for o in outs[2].outputs] == alone
    assert outs[5].token_ids == list(reference()[5])


# --------------------------------------------------------------------------- logprobs ----
def test_logprobs_are_the_models_raw_log_softmax(model: Any) -> None:
    ps = prompts()[:3]
    asks = [SamplingParams(temperature=0, max_tokens=8, logprobs=3),
            SamplingParams(temperature=0, max_tokens=8, logprobs=0, repetition_penalty=1.5),
            SamplingParams(temperature=0, max_tokens=8)]
    with engine() as llm:
        outs = llm.generate(ps, asks)
    for p, sp, out in zip(ps, asks, outs):
        o = out.outputs[0]
        if sp.logprobs is None:
            assert o.logprobs is None and o.cumulative_logprob is None
            continue
        with torch.no_grad():
            logits = model(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1]  # [N, V]
        raw = logits.log_softmax(-1)
        assert len(o.logprobs) == len(o.token_ids)
        for step, (tok, entry) in enumerate(zip(o.token_ids, o.logprobs)):
            assert next(iter(entry)) == tok  # the sampled token first
            assert entry[tok].logprob == pytest.approx(float(raw[step, tok]), abs=1e-4)
            assert entry[tok].rank == int((raw[step] > raw[step, tok]).sum()) + 1
            top = raw[step].topk(sp.logprobs).indices.tolist()
            assert set(entry) == {tok, *top}
            assert [entry[t].rank for t in top] == list(range(1, sp.logprobs + 1))
        assert o.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)))
    assert all(e[t].rank == 1 for t, e in zip(outs[0].token_ids, outs[0].outputs[0].logprobs))  # greedy


# ----------------------------------------------------------------------- stop strings ----
def words(ids: list[int]) -> str:
    """What the word tokenizer decodes `ids` to (special tokens skipped)."""
    return " ".join(f"w{t}" for t in ids if t >= 3)


def test_stop_strings_cut_the_text_across_token_boundaries() -> None:
    ref = list(reference()[1])
    assert all(t >= 3 for t in ref[3:5])
    stop = f"{str(ref[3])[-1]} w{str(ref[4])[0]}"  # from inside token 3 to inside token 4
    first = next(k for k in range(1, len(ref) + 1) if stop in words(ref[:k]))
    assert not any(stop in f"w{t}" for t in ref), "the stop string must span two tokens"
    text = words(ref[:first])
    with engine(tokenizer=word_tokenizer()) as llm:
        prompt = words(prompts()[1])
        cut, kept, never = llm.generate([prompt] * 3, [
            SamplingParams(temperature=0, max_tokens=20, stop=["zzz", stop]),
            SamplingParams(temperature=0, max_tokens=20, stop=stop, include_stop_str_in_output=True),
            SamplingParams(temperature=0, max_tokens=20, stop="w999")])
    assert cut.token_ids == ref[:first] and cut.finish_reason == "stop" and cut.outputs[0].stop_reason == stop
    assert cut.text == text[:text.index(stop)]
    assert kept.token_ids == ref[:first] and kept.text == text[:text.index(stop) + len(stop)]
    assert never.token_ids == ref and never.text == words(ref) and never.outputs[0].stop_reason is None


def test_streamed_text_never_shows_part_of_a_stop_string() -> None:
    """Online, each step's text is a prefix of the final one: the characters that may start a
    stop string are held back until they are known not to (vLLM's rule)."""
    ref = list(reference()[1])
    stop = f"{str(ref[3])[-1]} w{str(ref[4])[0]}"
    with engine(tokenizer=word_tokenizer()) as llm:
        rid = llm.add_request(words(prompts()[1]), SamplingParams(temperature=0, max_tokens=20, stop=[stop, "w1234"]))
        texts = []
        while llm.has_unfinished():
            texts += [o.text for o in llm.step() if o.request_id == rid]
    assert texts[-1] == words(ref)[:words(ref).index(stop)]
    assert all(texts[-1].startswith(t) for t in texts) and len(set(texts)) > 2


def test_stop_strings_need_a_tokenizer() -> None:
    with engine() as llm:
        with pytest.raises(InvalidRequestError, match="tokenizer"):
            llm.add_request([5, 6, 7], SamplingParams(stop="w5"))
        assert not llm.has_unfinished()


def test_incremental_detokenizers_equal_decode_on_split_characters() -> None:
    """A byte-level BPE splits multi-byte characters across tokens: both detokenizers hold the
    incomplete character back and end with what decoding the whole text gives."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = "héllo wörld, 日本語のテキスト! ok 🙂🙂 done"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world ok done"], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = fast.encode(text)
    assert len(ids) > len(text) // 2
    for detok in (make_detokenizer(fast), OffsetDetokenizer(fast, True)):
        pieces = [detok.add(t) for t in ids]
        assert detok.text == fast.decode(ids) == text
        assert all("\ufffd" not in piece for piece in pieces)
    assert isinstance(make_detokenizer(fast), StreamDetokenizer)


# ------------------------------------------------------------------------- the checks ----
FIELDS = {
    "min_p": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1),
    "presence_penalty": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and -2 <= v <= 2),
    "frequency_penalty": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and -2 <= v <= 2),
    "repetition_penalty": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf),
    "min_tokens": (lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 16),
    "logprobs": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= 20)),
    "stop": (lambda v: v is None or (isinstance(v, str) and v != "")
             or (isinstance(v, list) and all(isinstance(s, str) and s for s in v))),
    "include_stop_str_in_output": (lambda v: isinstance(v, bool)),
    "skip_special_tokens": (lambda v: isinstance(v, bool)),
}
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-30, 30), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), st.just(b"x"))


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(FIELDS)), VALUES)
def test_sampling_params_accept_exactly_the_documented_values(name: str, value: Any) -> None:
    """Each new field (max_tokens 16) is accepted where its docstring says and refused with an
    InvalidRequestError naming it elsewhere: never another exception, never a silent default."""
    valid = FIELDS[name](value) and not (isinstance(value, float) and math.isnan(value))
    if valid:
        sp = SamplingParams(**{name: value})
        if name == "stop":
            assert sp.stop == (() if value is None else (value,) if isinstance(value, str) else tuple(value))
        else:
            assert getattr(sp, name) == value
    else:
        with pytest.raises(InvalidRequestError, match=name):
            SamplingParams(**{name: value})


def test_min_tokens_is_bounded_by_max_tokens() -> None:
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3
    with pytest.raises(InvalidRequestError, match="min_tokens.*max_tokens=3"):
        SamplingParams(max_tokens=3, min_tokens=4)


# ------------------------------------------------------------------------------- CUDA ----
@pytest.mark.gpu
def test_the_sampler_on_cuda_matches_the_host() -> None:
    """The masks and penalties on the device equal the host's; a seeded row draws the same
    token alone and in a batch; logprobs come back as on the host."""
    from vattn.engine.sampler import Sampler
    from vattn.engine.sequence import Sequence

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 300, generator=g) * 3
    cuda = torch.device("cuda")
    ks, ps = [1, 5, 300, 50], torch.tensor([[0.9], [1.0], [0.3], [0.5]])
    mins = torch.tensor([[0.0], [0.1], [0.5], [0.9]])
    inf = float("-inf")
    assert torch.equal(apply_top_k_top_p(x.to(cuda), ks, ps.to(cuda)).cpu() == inf, apply_top_k_top_p(x, ks, ps) == inf)
    assert torch.equal(apply_min_p(x.to(cuda), mins.to(cuda)).cpu() == inf, apply_min_p(x, mins) == inf)
    seeded = SamplingParams(temperature=0.9, top_k=30, presence_penalty=0.5, seed=3, logprobs=2)
    rows = [seeded, SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.8),
            SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=2)]
    seqs = [Sequence(i, [5, 6, 7], p, 0.0) for i, p in enumerate(rows)]
    ids = [s.seq_id for s in seqs]
    alone = Sampler(cuda, 0).sample(x[:1].to(cuda), ids[:1], rows[:1], seqs=seqs[:1], eos_token_ids={2})
    batch = Sampler(cuda, 0).sample(x.to(cuda), ids, rows, seqs=seqs, eos_token_ids={2})
    assert batch.tokens.device.type == "cuda" and not batch.errors
    assert int(alone.tokens[0]) == int(batch.tokens[0])
    assert int(batch.tokens[1]) == int(x[1].argmax())
    entry = batch.logprobs[0].to_host()[ids[0]]
    raw = x[0].log_softmax(-1)
    assert entry[int(batch.tokens[0])].logprob == pytest.approx(float(raw[int(batch.tokens[0])]), abs=1e-4)
