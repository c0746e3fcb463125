"""`LLM(budget=...)`: two engines (two models) draw their KV pages from one `vattn.Budget`.

Greedy outputs must equal transformers' `generate` for each model, the budget's limit is
never passed, and pages one engine no longer needs are taken by the other when it is
short (the budget asks the first engine's cache to give them back).
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")
import vattn  # noqa: E402
from tests.helpers import PAGE, assert_matches, greedy_params, prompts, reference, tiny_config  # noqa: E402
from vattn.engine import LLM  # noqa: E402

# 4 buffers x 4 KiB = one 16 KiB page group = 32 tokens of a slot; the six requests need
# 12 groups in all, the longest 3: 8 groups make each engine preempt, and leave nothing
# for the second engine while the first holds what it mapped.
GROUP = 4 * PAGE
LIMIT = 8 * GROUP


def engine(family: str, budget: vattn.Budget, **kw) -> LLM:
    return LLM(tiny_config(family), seed=0, max_batch_size=4, page_size=PAGE, budget=budget, **kw)


def created_bytes(llm: LLM) -> int:
    s = llm.memory_stats()
    return s.num_created_pages * s.group_bytes


def test_two_engines_take_turns_on_one_budget():
    budget = vattn.Budget(LIMIT)
    with engine("llama", budget) as a, engine("qwen2", budget) as b:
        assert_matches(a.generate(prompts(), greedy_params()), reference("llama"))
        held = created_bytes(a)
        assert 0 < held <= LIMIT and budget.used == held  # a keeps its free pages for reuse
        assert_matches(b.generate(prompts(), greedy_params()), reference("qwen2"))
        assert created_bytes(a) < held  # b was short and a gave its free pages back
        assert created_bytes(b) > LIMIT - held
        assert budget.used == created_bytes(a) + created_bytes(b) <= LIMIT
        a.cache.allocator.check_invariants()
        b.cache.allocator.check_invariants()
    assert budget.used == 0 and budget.stats().num_participants == 0  # closed engines give everything back


def test_two_engines_serve_at_once_on_one_budget():
    budget = vattn.Budget(LIMIT)
    peak = 0
    with engine("llama", budget) as a, engine("mistral", budget) as b:
        ids = {a: [a.add_request(p, s) for p, s in zip(prompts(), greedy_params())],
               b: [b.add_request(p, s) for p, s in zip(prompts(), greedy_params())]}
        done: dict = {a: {}, b: {}}
        while a.has_unfinished() or b.has_unfinished():
            for llm in (a, b):
                for out in llm.step():
                    if out.finished:
                        done[llm][out.request_id] = out
            peak = max(peak, budget.used)
            assert budget.used <= LIMIT
        assert peak > LIMIT // 2
        assert a.num_preemptions + b.num_preemptions > 0  # the budget was really short
    assert_matches([done[a][i] for i in ids[a]], reference("llama"))
    assert_matches([done[b][i] for i in ids[b]], reference("mistral"))


def test_budget_must_be_a_budget():
    with pytest.raises(vattn.InvalidConfigError, match="budget must be a vattn.Budget"):
        LLM(tiny_config(), seed=0, page_size=PAGE, budget=LIMIT)
