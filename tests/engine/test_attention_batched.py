"""The CPU attention's batched paths against one SDPA call per request on the cache rows:
grouped calls over consecutive slots (`sdpa_attention`) and one padded call for the whole
iteration (`sdpa_padded_attention`); with different lengths, GQA and a sliding window."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from vattn.attention import AttentionMetadata, SdpaGroup, sdpa_attention, sdpa_padded_attention  # noqa: E402

# slot -> (tokens already cached, new tokens): groups of equal decodes (0-2, 9-10), a lone decode
# (4), two equal whole prompts in consecutive slots (5, 6), a chunk (7), equal decodes with a gap (12, 14)
BATCH = {0: (40, 1), 1: (40, 1), 2: (40, 1), 4: (17, 1), 5: (0, 9), 6: (0, 9), 7: (20, 6), 9: (3, 1),
         10: (3, 1), 12: (25, 1), 14: (25, 1)}
SLOT_TOKENS = 64


def per_request(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None) -> torch.Tensor:
    """One SDPA call per sequence on `k_cache[slot, lo:ctx]` with an explicit mask."""
    out = torch.empty_like(query)
    for slot, start, n, a in zip(meta.slots, meta.starts, meta.query_lens, meta.cu_query_lens):
        ctx = start + n
        lo = 0 if window is None else max(0, start - window + 1)
        q_pos, k_pos = torch.arange(start, ctx)[:, None], torch.arange(lo, ctx)[None, :]
        mask = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        o = F.scaled_dot_product_attention(query[a:a + n].transpose(0, 1)[None],
                                           k_cache[slot, lo:ctx].transpose(0, 1)[None],
                                           v_cache[slot, lo:ctx].transpose(0, 1)[None], attn_mask=mask,
                                           scale=scale, enable_gqa=query.shape[1] != k_cache.shape[2])
        out[a:a + n] = o[0].transpose(0, 1)
    return out


def make(hq: int, hkv: int, d: int = 16, seed: int = 0) -> tuple:
    g = torch.Generator().manual_seed(seed)
    B = max(BATCH) + 2
    # NaN everywhere no token was written: a kernel that reads past a context fails loudly
    k_cache = torch.full((B, SLOT_TOKENS, hkv, d), float("nan"))
    v_cache = torch.full((B, SLOT_TOKENS, hkv, d), float("nan"))
    slots = sorted(BATCH)
    for s in slots:
        ctx = sum(BATCH[s])
        k_cache[s, :ctx] = torch.randn(ctx, hkv, d, generator=g)
        v_cache[s, :ctx] = torch.randn(ctx, hkv, d, generator=g)
    meta = AttentionMetadata.build(slots, [BATCH[s][0] for s in slots], [BATCH[s][1] for s in slots], SLOT_TOKENS,
                                   torch.device("cpu"))
    q = torch.randn(meta.num_tokens, hq, d, generator=g)
    return q, k_cache, v_cache, meta


def test_groups_are_consecutive_slots_with_equal_start_and_length() -> None:
    _, _, _, meta = make(4, 2)
    groups = meta.sdpa_groups(None)
    assert [(g.slot, g.count, g.n) for g in groups] == [(0, 3, 1), (4, 1, 1), (5, 2, 9), (7, 1, 6), (9, 2, 1),
                                                       (12, 1, 1), (14, 1, 1)]
    assert all(isinstance(g, SdpaGroup) for g in groups)
    assert groups[2].causal and groups[3].mask is not None and groups[3].mask.shape == (6, 26)
    assert meta.sdpa_groups(None) is groups  # built once per iteration, shared by the layers


@pytest.mark.parametrize("window", [None, 4, 30])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (8, 2)])
def test_grouped_sdpa_equals_one_call_per_request(hq: int, hkv: int, window: int | None) -> None:
    q, k_cache, v_cache, meta = make(hq, hkv)
    ref = per_request(q, k_cache, v_cache, meta, 0.25, window)
    out = sdpa_attention(q, k_cache, v_cache, meta, 0.25, window)
    assert not out.isnan().any()
    if hq == hkv:  # the same kernel on the same rows, batched: bit for bit
        assert torch.equal(out, ref)
    else:  # decodes fold their query heads onto the KV head: the same sums in another order
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2)])
def test_padded_sdpa_equals_one_call_per_request(hq: int, hkv: int, window: int | None) -> None:
    q, k_cache, v_cache, meta = make(hq, hkv, seed=1)
    ref = per_request(q, k_cache, v_cache, meta, 0.25, window)
    out = sdpa_padded_attention(q, k_cache, v_cache, meta, 0.25, window)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_a_strided_query_and_the_fused_layout() -> None:
    """The engine's query is a transposed view, and fused-layout caches are strided per layer."""
    q, k_cache, v_cache, meta = make(8, 2, seed=2)
    B, T, H, D = k_cache.shape
    fused_k = torch.full((B, T, 3, H, D), float("nan"))  # [B, T, layers, H, D]
    fused_v = torch.full((B, T, 3, H, D), float("nan"))
    fused_k[:, :, 1], fused_v[:, :, 1] = k_cache, v_cache
    q_strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H_q, D], not contiguous
    ref = per_request(q, k_cache, v_cache, meta, 0.25, None)
    for fn in (sdpa_attention, sdpa_padded_attention):
        torch.testing.assert_close(fn(q_strided, fused_k[:, :, 1], fused_v[:, :, 1], meta, 0.25, None), ref,
                                   rtol=1e-5, atol=1e-6)


def test_the_padded_kernel_in_the_engine_matches_transformers() -> None:
    from tests.helpers import assert_matches, greedy_params, prompts, reference, run_online, tiny_config

    from vattn.engine import LLM

    with LLM(tiny_config(), seed=0, max_batch_size=4, page_size=4096, max_num_batched_tokens=64,
             attention="sdpa_padded") as llm:
        assert llm.runner.kernel.name == "sdpa_padded"
        assert_matches(run_online(llm, prompts(), greedy_params()), reference())
