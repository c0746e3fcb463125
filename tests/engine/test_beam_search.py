"""`LLM.beam_search`: the sequences and scores of transformers' `generate(num_beams=W,
do_sample=False)` (widths 1, 4, 16; length penalties, early stopping, EOS tokens), beams as
forks that share their parent's whole pages, pruned beams freed, and the refusals."""
from __future__ import annotations

import functools
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.helpers import PAGE, build_model, tiny_config  # noqa: E402

from vattn.engine import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from vattn.errors import InvalidConfigError, InvalidRequestError, OutOfPhysicalMemoryError  # noqa: E402

PROMPT_LENS = (20, 45)
TOL = 1e-4


def beam_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]


@functools.lru_cache(maxsize=None)
def hf_model() -> Any:
    return build_model(tiny_config())


def hf_beams(prompt: list[int], width: int, max_tokens: int, eos: tuple[int, ...] = (),
             **kw: Any) -> list[tuple[list[int], float]]:
    """transformers' W best (generated tokens, score), best first (width 1: its greedy search,
    scored as beam search scores it)."""
    ids = torch.tensor([prompt])
    out = hf_model().generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                              max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0,
                              eos_token_id=list(eos) if eos else None, **kw)
    rows = [r[len(prompt):] for r in out.sequences.tolist()]
    if width == 1:
        gen = rows[0]
        if eos and any(t in eos for t in gen):
            gen = gen[:next(i for i, t in enumerate(gen) if t in eos) + 1]
        lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, gen)]
        return [(gen, sum(lps) / len(lps) ** kw.get("length_penalty", 1.0))]
    return list(zip(rows, out.sequences_scores.tolist()))


def assert_same(ours: list, ref: list, eos: tuple[int, ...] = ()) -> None:
    assert len(ours) == len(ref)
    for seq, (row, score) in zip(ours, ref):
        gen = seq.output_token_ids
        assert row[:len(gen)] == gen, (gen, row)
        fill = eos[0] if eos else 0  # transformers pads with `pad_token_id or eos_token_id[0]` (pad: 0)
        assert all(t == fill for t in row[len(gen):]), "transformers' hypothesis is longer"
        assert seq.score == pytest.approx(score, abs=TOL)
        assert seq.finish_reason == ("stop" if gen[-1] in eos else "length")
        assert seq.cum_logprob <= 0


def engine(**kw: Any) -> LLM:
    kw.setdefault("max_batch_size", 16)
    return LLM(tiny_config(), seed=0, page_size=PAGE, **kw)


@pytest.mark.parametrize("width", [1, 4, 16])
def test_equals_transformers(width: int) -> None:
    prompts = beam_prompts()
    with engine() as llm:
        llm.eos_token_ids = ()  # the tiny model has no real EOS: see test_eos for one
        outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=10))
        assert llm.cache.stats().num_active == 0  # every beam's slot is free again
    for prompt, out in zip(prompts, outs):
        assert_same(out.sequences, hf_beams(prompt, width, 10))
        assert out.sequences[0].tokens[:len(prompt)] == prompt


@pytest.mark.parametrize("length_penalty,early_stopping", [(0.0, False), (2.0, "never"), (-1.0, True),
                                                          (1.0, True)])
def test_length_penalty_and_early_stopping(length_penalty: float, early_stopping: Any) -> None:
    prompt = beam_prompts()[0]
    with engine() as llm:
        llm.eos_token_ids = ()
        out = llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=length_penalty,
                                                       early_stopping=early_stopping))[0]
    assert_same(out.sequences, hf_beams(prompt, 4, 8, length_penalty=length_penalty,
                                        early_stopping=early_stopping))


def frequent_tokens(prompt: list[int], n: int) -> tuple[int, ...]:
    """Tokens the model's beams generate early: as EOS tokens, hypotheses finish at once."""
    seen: dict[int, int] = {}
    for row, _ in hf_beams(prompt, 8, 6):
        for t in row[1:4]:
            seen[t] = seen.get(t, 0) + 1
    return tuple(sorted(seen, key=lambda t: -seen[t])[:n])


@pytest.mark.parametrize("num_eos,width,early_stopping", [(1, 4, False), (2, 4, True), (1, 16, False),
                                                          (1, 4, "never")])
def test_eos(num_eos: int, width: int, early_stopping: Any) -> None:
    """Hypotheses that end with an EOS finish (scored by their generated length, the EOS
    included) while the others run on, as in transformers; ignore_eos runs through them."""
    prompt = beam_prompts()[1]
    eos = frequent_tokens(prompt, num_eos)
    with engine() as llm:
        llm.eos_token_ids = eos
        out = llm.beam_search(prompt, BeamSearchParams(beam_width=width, max_tokens=10,
                                                       early_stopping=early_stopping))[0]
        ignored = llm.beam_search(prompt, BeamSearchParams(beam_width=width, max_tokens=10, ignore_eos=True))[0]
    assert any(s.finish_reason == "stop" for s in out.sequences)
    assert_same(out.sequences, hf_beams(prompt, width, 10, eos=eos, early_stopping=early_stopping), eos)
    assert all(len(s.output_token_ids) == 10 for s in ignored.sequences)
    assert_same(ignored.sequences, hf_beams(prompt, width, 10))


def test_forks_share_whole_pages() -> None:
    """Every fork maps its parent's whole pages (no copy) and copies only the partly filled last
    one: counted at the cache, and against what copying whole beams would cost."""
    prompt = beam_prompts()[1] * 2  # 90 tokens: 2 whole pages of 32 tokens, then a partial one
    with engine() as llm:
        llm.eos_token_ids = ()
        tpp = llm.cache.geometry.tokens_in(1)
        forks: list[int] = []
        fork = llm.cache.fork

        def counting_fork(reqid: int, num_tokens: int) -> int:
            forks.append(num_tokens)
            return fork(reqid, num_tokens)

        llm.cache.fork = counting_fork
        out = llm.beam_search(prompt, BeamSearchParams(beam_width=8, max_tokens=12))[0]
        stats = out.stats
        assert stats.num_forks == len(forks) >= 7  # the first step forks the prompt 7 times
        assert stats.pages_shared == sum(n // tpp for n in forks)
        assert stats.pages_copied == sum(1 for n in forks if n % tpp)
        assert stats.pages_shared >= 2 * stats.pages_copied
        assert stats.pages_if_copied == stats.pages_shared + stats.pages_copied
        # memory: 8 beams of 102 tokens hold the prompt's 2 whole pages once, and 2 pages each of
        # their own (from token 64 on), against 8 x 4 pages unshared
        group = llm.cache.stats().group_bytes
        whole = 8 * -(-(len(prompt) + 12) // tpp) * group
        assert 0 < stats.peak_kv_bytes <= (2 + 2 * 8) * group < whole
        assert llm.beam_search_stats().num_forks == stats.num_forks
        assert llm.cache.stats().num_active == 0
    assert_same(out.sequences, hf_beams(prompt, 8, 12))


def test_several_prompts_in_turns() -> None:
    """More beams than slots: the prompts are searched a batch at a time, same results."""
    prompts = beam_prompts()
    with engine(max_batch_size=4) as llm:
        llm.eos_token_ids = ()
        outs = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=6))
    for prompt, out in zip(prompts, outs):
        assert_same(out.sequences, hf_beams(prompt, 4, 6))


def test_refusals() -> None:
    with engine(max_batch_size=4) as llm:
        with pytest.raises(InvalidConfigError, match="beam_width=5"):
            llm.beam_search([1, 2, 3], BeamSearchParams(beam_width=5, max_tokens=4))
        with pytest.raises(InvalidRequestError, match="BeamSearchParams"):
            llm.beam_search([1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(InvalidRequestError):
            BeamSearchParams(beam_width=0, max_tokens=4)
        with pytest.raises(InvalidRequestError):
            BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")
        rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(InvalidRequestError, match="runs alone"):
            llm.beam_search([1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=4))
        llm.abort_request(rid)
        llm.step()
        assert llm.beam_search([1, 2, 3], BeamSearchParams(beam_width=2, max_tokens=4))[0].sequences
        # the engine still serves requests after a search
        assert len(llm.generate([4, 5, 6], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids) == 3


def test_out_of_memory_frees_every_slot() -> None:
    with engine(physical_memory=64 << 10) as llm:
        llm.eos_token_ids = ()
        with pytest.raises(OutOfPhysicalMemoryError):
            llm.beam_search(list(range(3, 120)) * 3, BeamSearchParams(beam_width=16, max_tokens=40))
        assert llm.cache.stats().num_active == 0
        assert llm.generate([4, 5, 6], SamplingParams(temperature=0, max_tokens=3))[0].finished


def test_bench_beam_small() -> None:
    """`vattn bench beam` end to end on a small shape: equal best sequences, less KV than transformers."""
    import argparse

    from vattn.bench import beam

    p = argparse.ArgumentParser()
    beam.add_arguments(p)
    args = p.parse_args(["--prompt-tokens", "40", "--max-tokens", "4", "--hidden", "64", "--layers", "1",
                         "--repeats", "1", "--widths", "4", "16", "--page-size", "4096"])
    result = beam.run(args)
    assert not result["failures"], result["failures"]
    assert result["ratios"]["vattn_w16_kv_bytes_vs_hf_w16"] < 1
    headers, rows = beam.table(result)
    assert len(rows[0]) == len(headers)
