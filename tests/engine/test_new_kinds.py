"""Layer kinds of the families served in 2026 (issue 39): tiny random configs of the real
families, greedy tokens equal to transformers' generate on the same weights, with
continuous batching, chunked prefill, prefix caching, n > 1 (forks) and preemption by swap
and by recompute.

- Multi-head latent attention (DeepSeek-V3, DeepSeek-V2; MoE layers after the first): the
  cache keeps per token what transformers' own cache keeps, the latent (K) and the shared
  RoPE key (V), of different widths in one buffer a layer (`vattn.engine.latent`).
- Attention sinks with alternating windows (GPT-OSS; MoE): a learned logit per head in every
  softmax's denominator (`vattn.attention.sink_attention`), the window layers giving their
  pages back as any sliding window's.
- Chunked local attention (Llama 4 text; MoE every other layer, NoPE layers with temperature
  tuning): a token sees only its own chunk; the chunked layers (a kind of their own) give back
  whole chunks behind a query's own and their attention is masked to the chunk.
"""
from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import transformers as tf

from tests.helpers import MAX_TOKENS, PAGE, build_model, hf_greedy, prompts, run_online
from vattn.engine import LLM, SamplingParams
from vattn.engine.loader import cache_keyword
from vattn.errors import UnsupportedModelError
from vattn.integrations.hf import VAttnCache, check_model

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, max_position_embeddings=512,
               initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=0)
# latent 24 + RoPE key 8 values: 128-byte tokens in float32, 32 a page
_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, q_lora_rank=24, qk_rope_head_dim=8,
            v_head_dim=16, qk_nope_head_dim=16)
_MOE = dict(moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2)


def kind_config(family: str) -> Any:
    """A tiny config of each family (no EOS: generation runs to max_tokens)."""
    if family == "deepseek_v3":  # layer 0 dense, 1-2 MoE (grouped routing)
        return tf.DeepseekV3Config(**_COMMON, **_MLA, **_MOE, num_hidden_layers=3, n_group=2, topk_group=1,
                                   first_k_dense_replace=1)
    if family == "deepseek_v2":
        return tf.DeepseekV2Config(**_COMMON, **_MLA, **_MOE, num_hidden_layers=3, first_k_dense_replace=1)
    if family == "gpt_oss":  # sliding window 8 at layer 0, full attention at 1 (32 tokens a page)
        return tf.GptOssConfig(**{**_COMMON, "max_position_embeddings": 4096}, num_hidden_layers=2, head_dim=16,
                               num_attention_heads=4, num_key_value_heads=2, sliding_window=8, num_local_experts=4,
                               num_experts_per_tok=2)
    if family == "llama4":  # chunked (16 tokens) at 0-2 with RoPE, full NoPE at 3; temperature from position 3 on
        return tf.Llama4TextConfig(**_COMMON, intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                                   interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=4, attn_scale=0.5)
    raise KeyError(family)


FAMILIES = ["deepseek_v3", "deepseek_v2"]
# generate's keyword for a cache: `cache` from transformers 5.24 on, `past_key_values` before
CACHE_KW = cache_keyword(tf.DeepseekV3Model.forward)
_REFS: dict[str, list[list[int]]] = {}


def reference(family: str) -> list[list[int]]:
    """generate's greedy tokens for `prompts()` (cached per family)."""
    if family not in _REFS:
        model = build_model(kind_config(family))
        _REFS[family] = [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS)]
    return _REFS[family]


def greedy(n: int = 1, max_tokens: tuple[int, ...] = MAX_TOKENS) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, n=n, ignore_eos=True) for m in max_tokens]


def shared_prompts() -> list[list[int]]:
    """Prompts sharing a 70-token prefix (two whole 32-token blocks and more), each longer."""
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 128, (70,), generator=g).tolist()
    return [prefix + torch.randint(3, 128, (n,), generator=g).tolist() for n in (7, 30, 3, 45, 12, 21)]


def served_with_everything(family: str, memory: int, mode: str, **kw: Any) -> tuple[list[Any], Any, int]:
    """The shared-prefix prompts arriving over time, prefix caching, n=2 greedy samples,
    40-token chunks, under `memory` bytes that preempt by `mode`. Returns (outputs, prefix
    stats, preemptions)."""
    with LLM(kind_config(family), seed=0, max_batch_size=6, page_size=PAGE, physical_memory=memory,
             preemption_mode=mode, enable_prefix_caching=True, max_num_batched_tokens=40, **kw) as llm:
        outs = run_online(llm, shared_prompts(), greedy(n=2))
        llm.cache.allocator.check_invariants()
        return outs, llm.prefix_cache_stats(), llm.num_preemptions


def check_everything(family: str, memory: int, mode: str, **kw: Any) -> None:
    model = build_model(kind_config(family))
    ref = [hf_greedy(model, p, m) for p, m in zip(shared_prompts(), MAX_TOKENS)]
    outs, stats, preemptions = served_with_everything(family, memory, mode, **kw)
    assert stats.num_hit_tokens > 0 and preemptions > 0
    for out, r in zip(outs, ref):
        assert [o.token_ids for o in out.outputs] == [r, r] and out.error is None


# ------------------------------------------------------------------ latent attention ----
@pytest.mark.parametrize("family", FAMILIES)
def test_latent_attention_matches_generate_with_continuous_batching(family: str) -> None:
    """Requests arriving over time, prompts in chunks of 16 tokens beside decodes."""
    with LLM(kind_config(family), seed=0, max_batch_size=4, max_num_seqs=3, max_num_batched_tokens=16,
             page_size=PAGE) as llm:
        c = llm.cache.config
        assert (c.num_kv_heads, c.head_dim, c.v_head_dim) == (1, 24, 8)  # what transformers' cache keeps
        outs = run_online(llm, prompts(), greedy())
    assert [o.token_ids for o in outs] == reference(family)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_latent_attention_with_prefix_caching_forks_and_preemption(mode: str) -> None:
    check_everything("deepseek_v3", 8 * 3 * PAGE, mode)  # 8 page groups (3 layers)


def test_latent_bytes_per_token_against_full_kv() -> None:
    """The cache keeps (kv_lora_rank + qk_rope_head_dim) values a token and layer; full K/V
    would be heads x (qk_nope + qk_rope + v_head_dim): 71x more at DeepSeek-V3's sizes."""
    with LLM(kind_config("deepseek_v3"), seed=0, max_batch_size=2, page_size=PAGE) as llm:
        g = llm.cache.geometry
        assert g.num_buffers == 3 and g.held_bytes(1) == 3 * (24 + 8) * 4
        assert llm.cache.k_cache(0).shape[-2:] == (1, 24) and llm.cache.v_cache(0).shape[-2:] == (1, 8)
        # the latent kind (`vattn.allocator.latent`), run by the full-attention manager
        assert llm.cache.kind_names == ["latent"] and type(llm.cache.allocator.kinds[0]).__name__ == "FullAttention"
    v3 = tf.DeepseekV3Config()
    latent = v3.kv_lora_rank + v3.qk_rope_head_dim
    full = v3.num_attention_heads * (v3.qk_nope_head_dim + v3.qk_rope_head_dim + v3.v_head_dim)
    assert (latent, full, round(full / latent)) == (576, 40960, 71)


@pytest.mark.parametrize("layout", ["per-layer", "fused"])
def test_cache_with_v_of_another_width(layout: str) -> None:
    """`v_head_dim`: K and V of a layer in one buffer (a token's row its K, then its V); writes to
    one never reach the other, and a swap out and back (its slot taken meanwhile) keeps both."""
    import vattn

    with vattn.KVCache(num_layers=3, num_kv_heads=1, head_dim=16, v_head_dim=8, max_batch_size=3, max_context_len=100,
                       dtype="float32", page_size=PAGE, layout=layout, prefetch=False) as c:
        g = c.geometry
        assert g.num_buffers == (3 if layout == "per-layer" else 1) and g.held_bytes(1) == 3 * (16 + 8) * 4
        assert c.k_cache(0).shape == (3, 100, 1, 16) and c.v_cache(2).shape == (3, 100, 1, 8)
        r = c.alloc_reqid()
        assert c.step({r: 50})
        for layer in range(3):
            c.k_cache(layer)[r, :50], c.v_cache(layer)[r, :50] = layer + 1, -(layer + 1)
        handle = c.swap_out(r, 50)
        other = c.alloc_reqid()
        assert c.step({other: 80})
        c.k_cache(0)[other, :80] = 9
        r = c.swap_in(handle)
        assert handle.copied_in
        for layer in range(3):
            assert (c.k_cache(layer)[r, :50] == layer + 1).all() and (c.v_cache(layer)[r, :50] == -(layer + 1)).all()


def test_latent_attention_outside_the_engine() -> None:
    """transformers' batching hooks (`hf_cb`: its paged cache keeps K/V of one width per head)
    refuse it at load (`check_model` without `latent`); `VAttnCache` keeps the latent too (K and V
    of their widths) and generates as transformers' own cache does, beams included."""
    model = build_model(kind_config("deepseek_v3"))
    with pytest.raises(UnsupportedModelError, match="latent attention"):
        check_model(model)
    assert check_model(model, engine=True) is False
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    for beams in (1, 3):
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, num_beams=beams,
                  pad_token_id=0)
        ref = model.generate(ids, **kw)
        with VAttnCache(model.config, max_cache_len=64, page_size=PAGE) as cache:
            assert torch.equal(model.generate(ids, **{CACHE_KW: cache}, **kw), ref)
            assert (cache.kv.config.head_dim, cache.kv.config.v_head_dim) == (24, 8)


# ------------------------------------------------------------------ attention sinks ----
def test_sink_attention_is_gpt_oss_eager_attention() -> None:
    """`sink_attention` against transformers' gpt-oss eager attention (GQA, a causal mask)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from vattn.attention import sink_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 16, generator=g) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=g) * 3
    module = types.SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    ref, _ = eager_attention_forward(module, q, k, v, torch.zeros(5, 5).masked_fill(~causal, float("-inf")), 0.25)
    out = sink_attention(q, k, v, causal, 0.25, sinks)  # [2, 4, 5, 16]
    torch.testing.assert_close(out.transpose(1, 2), ref)


def test_attention_sinks_with_windows_match_generate() -> None:
    """Sinks of 3x the spread that decide tokens (without them generate's tokens differ),
    requests over time in 16-token chunks: generate's tokens, and the window layer holds
    fewer pages than the full one."""
    model = build_model(kind_config("gpt_oss"))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 3, generator=torch.Generator().manual_seed(layer.self_attn.layer_idx))
    ref = [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS)]
    sinks = [layer.self_attn.sinks.clone() for layer in model.model.layers]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(float("-inf"))  # a sink that takes nothing: plain attention
        assert [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS)] != ref
        for layer, saved in zip(model.model.layers, sinks):
            layer.self_attn.sinks.copy_(saved)
    with LLM(model, max_batch_size=4, max_num_seqs=3, max_num_batched_tokens=16, page_size=PAGE,
             prefetch=False) as llm:
        assert llm.cache.kind_names == ["full", "window=8"]
        outs = run_online(llm, prompts(), greedy())
        st = llm.cache.stats()
    assert [o.token_ids for o in outs] == ref
    assert st.kinds["window=8"].num_mapped_pages < st.kinds["full"].num_mapped_pages


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_attention_sinks_with_prefix_caching_forks_and_preemption(mode: str) -> None:
    check_everything("gpt_oss", 6 * 4 * PAGE, mode)  # 6 page groups (2 layers, K and V)


# ---------------------------------------------------------- chunked local attention ----
def test_chunked_attention_matches_generate() -> None:
    """Requests over time in 16-token chunks of prefill: generate's tokens (which chunking and
    the NoPE layers' temperature both change), the chunked layers holding fewer pages than the
    full one."""
    config = kind_config("llama4")
    assert config.layer_types == ["chunked_attention"] * 3 + ["full_attention"] and config.moe_layers == [1, 3]
    ref = [hf_greedy(build_model(config), p, m) for p, m in zip(prompts(), MAX_TOKENS)]
    for other in (dict(attention_chunk_size=512), dict(attn_temperature_tuning=False)):
        changed = build_model(tf.Llama4TextConfig(**{**config.to_dict(), **other}))
        assert [hf_greedy(changed, p, m) for p, m in zip(prompts(), MAX_TOKENS)] != ref, other
    with LLM(config, seed=0, max_batch_size=4, max_num_seqs=3, max_num_batched_tokens=16, page_size=PAGE,
             prefetch=False) as llm:
        assert llm.cache.kind_names == ["full", "chunk=16"]
        outs = run_online(llm, prompts(), greedy())
        st = llm.cache.stats()
    assert [o.token_ids for o in outs] == ref
    assert st.kinds["chunk=16"].num_mapped_pages < 3 * st.kinds["full"].num_mapped_pages


def test_nope_layers_need_each_tokens_own_temperature(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without `_retune_temperature` (the module's own temperature of packed positions 0..T-1)
    the engine's tokens differ from generate's."""
    import vattn.integrations.hf as hf

    monkeypatch.setattr(hf, "_retune_temperature", lambda module, query: query)
    with LLM(kind_config("llama4"), seed=0, max_batch_size=4, max_num_batched_tokens=16, page_size=PAGE) as llm:
        outs = run_online(llm, prompts(), greedy())
    model = build_model(kind_config("llama4"))
    assert [o.token_ids for o in outs] != [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS)]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_chunked_attention_with_prefix_caching_forks_and_preemption(mode: str) -> None:
    # 6 pages of each of the 8 buffers (at 8 nothing is preempted since the chunked layers
    # give back whole chunks at their boundaries, not a window of a chunk's size behind)
    check_everything("llama4", 6 * 8 * PAGE, mode)


@pytest.mark.parametrize("family, what", [("gpt_oss", "attention sinks"), ("llama4", "chunked attention"),
                                          ("deepseek_v3", "latent attention")])
def test_compile_is_refused_where_only_the_sdpa_path_runs(family: str, what: str) -> None:
    """Attention sinks, chunked attention and the latent run eagerly on the sdpa path: compile=
    says which one it does not cover, before any cache exists."""
    from vattn.errors import InvalidConfigError

    with pytest.raises(InvalidConfigError, match=what):
        LLM(kind_config(family), seed=0, max_batch_size=2, page_size=PAGE, compile=True)
