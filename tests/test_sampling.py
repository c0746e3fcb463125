"""Sampling: seeded reproducibility, the engine's generator, top-k/top-p, and SamplingParams checks."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import MAX_TOKENS, PAGE, prompts, reference, run_online, tiny_config  # noqa: E402

from vattn.engine import LLM, SamplingParams  # noqa: E402
from vattn.errors import InvalidRequestError  # noqa: E402


def test_seeded_sampling_is_reproducible() -> None:
    sp = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=20, seed=1234)
    p = prompts()[2]
    with LLM(tiny_config(), seed=0, page_size=PAGE) as llm:
        alone = llm.generate(p, sp)[0].token_ids
        again = llm.generate(p, sp)[0].token_ids
        other_seed = llm.generate(p, SamplingParams(temperature=0.9, top_k=20, top_p=0.9, max_tokens=20,
                                                    seed=99))[0].token_ids
    assert alone == again and len(alone) == 20
    assert alone != other_seed
    # In a crowded, preempting batch next to unseeded and greedy requests: the same tokens.
    others = [SamplingParams(temperature=1.0, max_tokens=m) for m in MAX_TOKENS]
    others[2] = sp
    others[0] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[0])
    with LLM(tiny_config(), seed=0, page_size=PAGE, max_batch_size=4, physical_memory=80 << 10) as llm:
        outs = run_online(llm, prompts(), others)
        assert llm.num_preemptions > 0
    assert outs[2].token_ids == alone
    assert outs[0].token_ids == list(reference()[0])


def test_unseeded_sampling_follows_engine_seed() -> None:
    sp = SamplingParams(temperature=1.0, top_p=0.8, max_tokens=16)
    runs = []
    for seed in (3, 3, 4):
        with LLM(tiny_config(), seed=0, page_size=PAGE) as llm:
            llm.runner.sampler.default_generator.manual_seed(seed)
            runs.append([o.token_ids for o in llm.generate(prompts()[:3], sp)])
    assert runs[0] == runs[1] != runs[2]


def test_top_k_one_is_greedy() -> None:
    with LLM(tiny_config(), seed=0, page_size=PAGE) as llm:
        out = llm.generate(prompts()[1], SamplingParams(temperature=0.7, top_k=1, max_tokens=MAX_TOKENS[1]))
    assert out[0].token_ids == list(reference()[1])


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_k": -2}, {"top_k": 2.5}, {"max_tokens": 0}, {"max_tokens": -3}, {"max_tokens": 2.0},
    {"stop_token_ids": [-1]}, {"stop_token_ids": 5}, {"seed": "x"}, {"ignore_eos": "yes"},
])
def test_bad_sampling_params(kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)

