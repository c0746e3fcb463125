"""attention='flex' (`vattn.flex_decode`): the host's decodes in one compiled FlexAttention call
per layer over the slot rows, against one SDPA call per request; on a cache that is NaN past
every context (a read that leaks past a context shows), and in the engine against transformers."""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.nn.attention.flex_attention")

from tests.engine.test_attention_batched import BATCH, make, per_request  # noqa: E402
from vattn.attention import sdpa_attention  # noqa: E402
from vattn.flex_decode import FlexDecode, block_tokens  # noqa: E402

PAGE_TOKENS = 32  # the tests' page: 32 tokens of a [.., H_kv, 16] float32 row, as tests.helpers.PAGE


def flex(hkv: int, d: int = 16) -> FlexDecode:
    f = FlexDecode(sdpa_attention)
    f.page_bytes = PAGE_TOKENS * hkv * d * 4
    return f


@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2)])
def test_flex_equals_one_call_per_request_and_zeroes_only_its_blocks_tails(hq: int, hkv: int) -> None:
    q, k_cache, v_cache, meta = make(hq, hkv)
    ref = per_request(q, k_cache, v_cache, meta, 0.25, None)
    out = flex(hkv)(q, k_cache, v_cache, meta, 0.25, None)
    assert not out.isnan().any()  # a stale NaN past a context, multiplied by a probability of 0, would show
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for slot, (start, n) in BATCH.items():
        ctx = start + n
        end = -(-ctx // PAGE_TOKENS) * PAGE_TOKENS if n == 1 else ctx  # decodes: the rest of their last block
        assert (v_cache[slot, ctx:end] == 0).all() and v_cache[slot, end:].isnan().all()
        assert k_cache[slot, ctx:].isnan().all()  # keys past a context are masked, never written


def test_a_sliding_window_or_no_decode_runs_sdpa() -> None:
    q, k_cache, v_cache, meta = make(8, 2, seed=3)
    out = flex(2)(q, k_cache, v_cache, meta, 0.25, 4)
    torch.testing.assert_close(out, per_request(q, k_cache, v_cache, meta, 0.25, 4), rtol=1e-5, atol=1e-6)
    assert v_cache[0, 41:].isnan().all()  # nothing zeroed: flex did not run


@pytest.mark.parametrize("hkv, d, slot_tokens, page, want", [
    (2, 16, 128, 4096, 32),  # 32 tokens a page
    (4, 64, 2048, 2 << 20, 64),  # 2,048 tokens a page: blocks of 64 at most
    (4, 64, 128, 2 << 20, None),  # a slot's row does not start on a page
    (3, 16, 128, 4096, None),  # a 192-byte row does not divide the page: a block could cross it
    (4, 64, 128, 8192, None),  # 8 tokens a page: below the smallest block
])
def test_block_tokens_keep_reads_on_mapped_pages(hkv: int, d: int, slot_tokens: int, page: int,
                                                 want: int | None) -> None:
    assert block_tokens(torch.empty(2, slot_tokens, hkv, d), page) == want


def test_a_context_limit_between_blocks_reads_the_slots_own_rows() -> None:
    """The engine's cache views stop at max_context_len (here 48 of a 64-token slot stride)."""
    q, k_cache, v_cache, meta = make(8, 2, seed=4)
    ref = per_request(q, k_cache, v_cache, meta, 0.25, None)
    out = flex(2)(q, k_cache[:, :48], v_cache[:, :48], meta, 0.25, None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_a_page_no_block_tiles_is_an_error() -> None:
    from vattn.errors import VattnError

    q, k_cache, v_cache, meta = make(8, 2)
    f = FlexDecode(sdpa_attention)
    f.page_bytes = 8 * 2 * 16 * 4  # 8 tokens a page
    with pytest.raises(VattnError, match="no KV block"):
        f(q, k_cache, v_cache, meta, 0.25, None)


def test_flex_in_the_engine_matches_transformers() -> None:
    from tests.helpers import assert_matches, greedy_params, prompts, reference, run_online, tiny_config

    from vattn.engine import LLM

    with LLM(tiny_config(), seed=0, max_batch_size=4, page_size=4096, max_num_batched_tokens=64,
             attention="flex") as llm:
        assert_matches(run_online(llm, prompts(), greedy_params()), reference())
        assert llm.runner.kernel.name == "flex" and "decode" in llm.runner.kernel.verified  # never fell back


def test_flex_on_cuda_is_refused_before_anything_loads() -> None:
    from vattn.engine.config import EngineConfig
    from vattn.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match="runs on the host"):
        EngineConfig(attention="flex", device="cuda")
    assert EngineConfig(attention="flex", device="cpu").attention == "flex"


@pytest.fixture
def fresh_dynamo():
    """Each engine shape compiles flex once; dynamo keeps at most 8 graphs of one function."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("case", ["prefix-caching,swap", "n>1,forks", "fused,chunked"])
def test_flex_equals_sdpa_across_the_engines_features(case: str, fresh_dynamo: None) -> None:
    """Shared pages (prefix caching, forks whose partial page is copied), swaps and the fused
    layout: flex's zeroed tails never reach another sequence's keys, and every token equals SDPA's."""
    from tests.engine.test_async import MATRIX, serve

    model, kw, workload = next(p.values for p in MATRIX if p.id == case)
    sdpa, _ = serve(model, {**kw, "attention": "sdpa"}, workload, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flex_outs, figures = serve(model, {**kw, "attention": "flex"}, workload, False)
    assert not [w for w in caught if "'flex' failed" in str(w.message)]  # flex ran, never fell back
    assert flex_outs == sdpa
    assert figures["hits"] > 0 or "prefix" not in case
