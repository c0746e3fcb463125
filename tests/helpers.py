"""Shared by the engine tests: tiny seeded models, transformers' greedy reference, an
online driver, and a fake cache for the scheduler alone."""
from __future__ import annotations

import copy
import functools
import types
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from vattn.engine import LLM, RequestOutput, SamplingParams
from vattn.engine.sequence import Sequence

FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
PROMPT_LENS = (5, 17, 33, 48, 70, 3)
MAX_TOKENS = (12, 20, 8, 24, 16, 22)
ARRIVALS = (0, 0, 2, 3, 3, 7)  # the iteration at which each prompt is added
PAGE = 4096  # 32 tokens per page for the per-layer layout of the tiny models, 16 fused


def tiny_config(family: str = "llama", kv_heads: int = 2, **kw: Any) -> Any:
    return FAMILIES[family](vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                            initializer_range=0.2, **kw)


def build_model(config: Any, seed: int = 0) -> Any:
    """The weights `LLM(config, seed=seed)` builds."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]


def greedy_params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS]


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=None)
def reference(family: str = "llama", kv_heads: int = 2, sliding_window: int | None = None) -> tuple:
    """transformers' greedy outputs for `prompts()` (cached per model)."""
    kw = {} if sliding_window is None else {"sliding_window": sliding_window}
    model = build_model(tiny_config(family, kv_heads, **kw))
    return tuple(tuple(hf_greedy(model, p, m)) for p, m in zip(prompts(), MAX_TOKENS))


def run_online(llm: LLM, prompt_list: list, params: list[SamplingParams],
               arrivals: tuple[int, ...] = ARRIVALS) -> list[RequestOutput]:
    """Add each prompt at its arrival iteration, step until all finish; outputs in prompt order."""
    index: dict[int, int] = {}
    done: dict[int, RequestOutput] = {}
    it = 0
    while len(done) < len(prompt_list):
        for i, a in enumerate(arrivals):
            if a == it:
                index[llm.add_request(prompt_list[i], params[i])] = i
        for out in llm.step():
            assert out.request_id in index
            if out.finished:
                done[index[out.request_id]] = out
        it += 1
        assert it < 5000, "the engine does not make progress"
    assert not llm.has_unfinished()
    return [done[i] for i in range(len(prompt_list))]


def assert_matches(outs: list[RequestOutput], ref: tuple) -> None:
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert out.token_ids == list(r), f"prompt {i}: {out.token_ids} != {list(r)}"
        assert out.finish_reason in ("stop", "length")
        assert out.finished and out.error is None



# ----------------------------------------------------------------- scheduler, alone ----
class FakeResult:
    def __init__(self, failed: tuple[int, ...]) -> None:
        self.failed = failed

    def __bool__(self) -> bool:
        return not self.failed


class FakeKV:
    """Slots and a token capacity; fails the newest slots that do not fit, like KVCache.
    `fork` and `swap_in` take a slot, `swap_out` frees one; the tokens count as there."""

    def __init__(self, num_slots: int, capacity: int | None = None) -> None:
        self.free = list(range(num_slots))
        self.capacity = capacity
        self.steps: list[dict[int, int]] = []
        self.forks: list[tuple[int, int, int]] = []  # (source slot, tokens, new slot)
        self.swaps: list[tuple[str, int, int]] = []  # ("out" | "in", slot, tokens)
        self.swap_in_error: Exception | None = None

    @property
    def num_free_reqids(self) -> int:
        return len(self.free)

    def alloc_reqid(self) -> int:
        return self.free.pop(0)

    def free_reqid(self, reqid: int) -> None:
        assert reqid not in self.free
        self.free.append(reqid)

    def can_fork(self, reqid: int, num_tokens: int) -> bool:
        return reqid not in self.free

    def fork(self, reqid: int, num_tokens: int) -> int:
        assert reqid not in self.free
        slot = self.alloc_reqid()
        self.forks.append((reqid, num_tokens, slot))
        return slot

    def swap_out(self, reqid: int, num_tokens: int) -> Any:
        self.free_reqid(reqid)
        self.swaps.append(("out", reqid, num_tokens))
        return types.SimpleNamespace(slot=reqid, num_tokens=num_tokens)

    def swap_in(self, handle: Any) -> int:
        if self.swap_in_error is not None:
            raise self.swap_in_error
        slot = self.alloc_reqid()
        self.swaps.append(("in", slot, handle.num_tokens))
        return slot

    def step(self, seq_lens: dict[int, int]) -> FakeResult:
        self.steps.append(dict(seq_lens))
        if self.capacity is None or sum(seq_lens.values()) <= self.capacity:
            return FakeResult(())
        return FakeResult((max(seq_lens),))


def fake_advance(sched: Any, out: Any, token: int = 7) -> list[Any]:
    """Run `out` with a fake model: every sequence that samples gets `token`."""
    tokens = {}
    for s in out.scheduled:
        if s.seq.num_computed_tokens + s.num_new_tokens == s.seq.num_tokens:
            tokens.update(dict.fromkeys([x.seq_id for x in (s.seq, *s.fan_out)], token))
    sched.commit(out.scheduled)
    return sched.postprocess(out.scheduled, tokens, {}, 0.0)


def make_seq(i: int, length: int, max_tokens: int = 8, **params: Any) -> Sequence:
    """Request `i`: a prompt of `length` tokens, greedy (SamplingParams `params`)."""
    return Sequence(i, list(range(1, length + 1)), SamplingParams(temperature=0, max_tokens=max_tokens, **params), 0.0)


NOBODY = 65534  # the second local user of the shared-host tests ("nobody")


def as_nobody(script: str) -> None:
    """Run the shell `script` as uid/gid 65534 with no other group."""
    import subprocess

    subprocess.run(["sh", "-c", script], user=NOBODY, group=NOBODY, extra_groups=[], check=True, timeout=60,
                   capture_output=True)
