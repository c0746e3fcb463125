"""Sampling: seeded reproducibility, the engine's generator, top-k/top-p, and SamplingParams checks."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.helpers import MAX_TOKENS, PAGE, prompts, reference, run_online, tiny_config  # noqa: E402

from vattn.engine import LLM, SamplingParams  # noqa: E402
from vattn.errors import InvalidConfigError, InvalidRequestError  # noqa: E402


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
    {"seed": 2**64}, {"seed": 2**70}, {"seed": -2**63 - 1}, {"seed": 1.0}, {"seed": True},
    {"temperature": float("inf")}, {"temperature": "1"}, {"top_p": float("nan")}, {"top_k": True},
    {"max_tokens": np.int64(0)}, {"max_tokens": torch.tensor([3])}, {"max_tokens": torch.tensor(3.0)},
    {"stop_token_ids": "12"}, {"stop_token_ids": [1.0]}, {"stop_token_ids": torch.tensor(3)},
], ids=repr)
def test_bad_sampling_params(kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError, match=list(kwargs)[0]):
        SamplingParams(**kwargs)


def test_sampling_params_take_what_torch_takes_as_plain_numbers() -> None:
    """Seeds at both ends of torch.Generator's range; numpy and 0-d tensor numbers become
    Python ints and floats."""
    for seed in (-2**63, 2**64 - 1, 0):
        assert SamplingParams(seed=seed).seed == seed
        torch.Generator().manual_seed(seed)  # what the sampler does with it
    sp = SamplingParams(temperature=np.float32(0.5), top_p=torch.tensor(0.9), top_k=np.int8(5),
                        max_tokens=torch.tensor(7), stop_token_ids=np.array([3, 4]), seed=np.uint64(2**64 - 1))
    assert sp == SamplingParams(temperature=0.5, top_p=float(torch.tensor(0.9)), top_k=5, max_tokens=7,
                                stop_token_ids=(3, 4), seed=2**64 - 1)
    for name in ("top_k", "max_tokens", "seed"):
        assert type(getattr(sp, name)) is int
    assert all(type(t) is int for t in sp.stop_token_ids) and type(sp.temperature) is float


def test_extreme_seeds_and_tiny_temperature_run() -> None:
    """The ends of the seed range sample; a temperature too small to divide by is greedy."""
    p = prompts()[1]
    with LLM(tiny_config(), seed=0, page_size=PAGE) as llm:
        outs = llm.generate([p, p, p], [SamplingParams(temperature=0.8, max_tokens=6, seed=2**64 - 1),
                                        SamplingParams(temperature=0.8, max_tokens=6, seed=-2**63),
                                        SamplingParams(temperature=1e-30, max_tokens=MAX_TOKENS[1])])
    assert [len(o.token_ids) for o in outs[:2]] == [6, 6]
    assert outs[2].token_ids == list(reference()[1])
    for seed in (2**64 - 1, -2**63):  # the engine's own seed (weights, unseeded sampling)
        with LLM(tiny_config(), seed=seed, page_size=PAGE) as llm:
            assert llm.generate(p, SamplingParams(max_tokens=4))[0].finish_reason == "length"
    with pytest.raises(InvalidConfigError, match="seed"):
        LLM(tiny_config(), seed=2**64)



def test_greedy_argmax_follows_torch_argmax() -> None:
    """The sampler's row-wise argmax (numpy's on the CPU): torch.argmax's result, ties to the
    first maximum, a NaN counts as the maximum; inference tensors and strided rows too."""
    from vattn.engine.sampler import argmax_tokens

    def argmax_rows(t: torch.Tensor) -> list[int]:
        out = argmax_tokens(t)  # [S] int64 on the logits' device
        assert out.dtype == torch.int64 and out.shape == t.shape[:1]
        return out.tolist()

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3000, generator=g)
    x[1, 10] = x[1, 2000] = x[1].max() + 1  # a tie: the first one
    x[2, 5], x[2, 9] = float("nan"), float("inf")  # NaN wins
    x[3, :] = float("-inf")
    with torch.inference_mode():
        y = x * 1.0
    for t in (x, y, x[::2], x.t().contiguous().t()):
        assert argmax_rows(t) == t.argmax(-1).tolist()
    assert argmax_rows(x)[1:4] == [10, 5, 0]
    assert argmax_rows(x.double()) == x.argmax(-1).tolist()  # other dtypes: torch's own
