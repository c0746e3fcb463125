"""Which models vattn runs, and the ones with recurrent states.

Hybrids and state-space models (Mamba2 in Bamba and Falcon-H1, gated delta-net in
Qwen3-Next, Mamba2 alone) keep a per-request state besides attention K/V. vattn's engine
keeps it in vattn memory (a layer kind of the cache's allocator, run by `vattn.engine.states`)
and must give `generate`'s greedy tokens
(continuous batching, chunked prefill, n > 1, preemption by swap or recompute, prefix
caching with state snapshots at block ends). Everything else that keeps a state (and every such model
outside the engine: `hf_cb`, `VAttnCache`, tensor parallelism) is refused at load with
`UnsupportedModelError`, never served with tokens that differ from `generate`. Tiny configs
built here, random seeded weights, no download; transformers' PyTorch fallbacks run the
mixers on the CPU.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers as tf

from tests.helpers import MAX_TOKENS, PAGE, build_model, hf_greedy, prompts, run_online, tiny_config
from vattn.engine import LLM, SamplingParams
from vattn.errors import InvalidConfigError, UnsupportedModelError
from vattn.integrations import hf_cb
from vattn.integrations.hf import VAttnCache, check_model, mixes_tokens_outside_attention

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=0)
_MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
              mamba_chunk_size=16)


def hybrid_config(family: str, **kw: Any) -> Any:
    """A tiny config of each state-carrying family (no EOS: generation runs to max_tokens);
    `kw` overrides its fields."""
    config = _hybrid_config(family)
    for name, value in kw.items():
        setattr(config, name, value)
    return config


def _hybrid_config(family: str) -> Any:
    if family == "bamba":  # Mamba2 layers 0 and 2, attention at 1
        return tf.BambaConfig(**_COMMON, **_MAMBA, num_hidden_layers=3, attn_layer_indices=[1])
    if family == "falcon_h1":  # attention and Mamba2 side by side in every layer
        return tf.FalconH1Config(**_COMMON, **_MAMBA, num_hidden_layers=2, head_dim=16, mamba_d_ssm=128)
    if family == "qwen3_next":  # gated delta-net at 0, attention at 1
        return tf.Qwen3NextConfig(**_COMMON, num_hidden_layers=2, head_dim=16,
                                  layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                                  linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                                  linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if family == "mamba2":  # no attention at all
        return tf.Mamba2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
                               n_groups=1, state_size=16, conv_kernel=4, expand=2, chunk_size=16,
                               eos_token_id=None, bos_token_id=None, pad_token_id=0)
    raise KeyError(family)


# family -> (the kind transformers names its state layers, the module that keeps the state)
HYBRIDS = {"bamba": ("linear_attention", "BambaMixer"), "falcon_h1": ("hybrid", "FalconH1Mixer"),
           "qwen3_next": ("linear_attention", "Qwen3NextGatedDeltaNet"), "mamba2": ("linear_attention", "Mamba2Mixer")}


KV_LAYERS = {"bamba": 1, "falcon_h1": 2, "qwen3_next": 1, "mamba2": 1}  # (Mamba2: a stand-in for the slots)
# bytes of a slot's state row (its states in whole 4 KiB pages): physical_memory holds them too
STATE_ROW = {"bamba": 24 << 10, "falcon_h1": 24 << 10, "qwen3_next": 8 << 10, "mamba2": 24 << 10}


def memory_cap(family: str, kv_pages: int, rows: int) -> int:
    """physical_memory for `kv_pages` pages of `PAGE` bytes (K/V) and `rows` state rows (a
    slot's states, or a snapshot)."""
    return kv_pages * PAGE + rows * STATE_ROW[family]
_REFERENCES: dict[str, list[list[int]]] = {}


def reference(family: str) -> list[list[int]]:
    """generate's greedy tokens for `prompts()` (cached per family)."""
    if family not in _REFERENCES:
        model = build_model(hybrid_config(family))
        _REFERENCES[family] = [hf_greedy(model, p, m) for p, m in zip(prompts(), MAX_TOKENS)]
    return _REFERENCES[family]


def state_books(llm: LLM) -> Any:
    """The books of the cache's recurrent-state kind (slots' rows and snapshot rows)."""
    return next(kind.books for kind in llm.cache.allocator.kinds if kind.name == "state")


def states_given_back(llm: LLM) -> bool:
    """Every slot is free, and no snapshot row is held by a slot (only cached ones remain)."""
    books = state_books(llm)
    return (llm.cache.num_free_reqids == llm.cache.config.max_batch_size and llm.cache.stats().kinds["state"].used_bytes == 0
            and not books.taken and not books.planned and not books.wants)


def greedy(n: int = 1) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=m, n=n, ignore_eos=True) for m in MAX_TOKENS]


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_state_models_match_generate_with_continuous_batching(family: str) -> None:
    """Requests arriving over time, prompts in chunks of 16 tokens beside decodes."""
    with LLM(hybrid_config(family), seed=0, max_batch_size=4, max_num_seqs=3, max_num_batched_tokens=16,
             page_size=PAGE) as llm:
        outs = run_online(llm, prompts(), greedy())
        assert states_given_back(llm)  # every slot's states given back
        assert llm.runner.cache.geometry.config.num_layers == KV_LAYERS[family]  # no K/V for state layers
    assert [o.token_ids for o in outs] == reference(family)


def count_calls(obj: Any, *names: str) -> dict[str, int]:
    """Count the calls of these methods of `obj` (the counts go on as it runs)."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        def counted(*a: Any, _name: str = name, _f: Any = getattr(obj, name)) -> Any:
            calls[_name] += 1
            return _f(*a)
        setattr(obj, name, counted)
    return calls


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("family", list(HYBRIDS))
def test_state_models_fork_and_preempt(family: str, mode: str) -> None:
    """n=3 greedy samples fork the state at the prompt's end; a memory cap preempts: by
    swapping (the states go to the host with the K/V and come back) or by recomputing."""
    cap = memory_cap(family, 4 if family == "mamba2" else 24, rows=4)  # (Mamba2: one small stand-in K/V layer)
    with LLM(hybrid_config(family), seed=0, max_batch_size=6, page_size=PAGE, physical_memory=cap,
             preemption_mode=mode) as llm:
        assert llm.cache.states.row_bytes == STATE_ROW[family]
        calls = count_calls(llm.scheduler.kv, "fork", "swap_in")
        outs = run_online(llm, prompts(), greedy(n=3))
        assert llm.num_preemptions > 0 and calls["fork"] > 0 and (calls["swap_in"] > 0) == (mode == "swap")
        assert states_given_back(llm)
    for out, ref in zip(outs, reference(family)):
        assert [o.token_ids for o in out.outputs] == [ref] * 3


def test_seeded_samples_of_a_state_model_are_runs_with_seed_plus_index() -> None:
    p = prompts()[2]
    seeded = lambda seed, n=1: SamplingParams(temperature=0.9, max_tokens=12, seed=seed, n=n, ignore_eos=True)  # noqa: E731
    with LLM(hybrid_config("qwen3_next"), seed=0, max_batch_size=4, page_size=PAGE) as llm:
        alone = [llm.generate(p, seeded(100 + i))[0].token_ids for i in range(3)]
        together = llm.generate(p, seeded(100, n=3))[0]
    assert [o.token_ids for o in together.outputs] == alone
    assert len(set(map(tuple, alone))) > 1


SHARED_SUFFIXES = (7, 30, 3, 45, 12, 21)  # after a 90-token prefix: 2 whole blocks of 32 tokens and more
SHARED_MAX_TOKENS = (10, 6, 12, 8, 9, 7)
SHARED_ARRIVALS = (0, 3, 5, 6, 9, 12)
# weights 10x the default spread: with the default, these tiny models' tokens hardly depend on
# the recurrent state (a hit that skipped restoring it gave generate's tokens for Falcon-H1 and Mamba2)
SHARED_INIT = 0.2


def shared_prompts() -> list[list[int]]:
    """Prompts sharing a 90-token prefix (a request can be computed from its block ends)."""
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 128, (90,), generator=g).tolist()
    return [prefix + torch.randint(3, 128, (n,), generator=g).tolist() for n in SHARED_SUFFIXES]


_SHARED_REFERENCES: dict[str, list[list[int]]] = {}
# (K/V pages, state rows) of physical_memory that make these prompts preempt and still keep
# snapshots (they count against it like any page); Mamba2: one small stand-in K/V layer
# (mamba2: with 6 state rows every request that admission plans beside the running ones
# finishes without a preemption, and the test wants some)
SHARED_CAP = {"bamba": (16, 8), "falcon_h1": (28, 9), "qwen3_next": (16, 10), "mamba2": (6, 5)}


def shared_reference(family: str) -> list[list[int]]:
    if family not in _SHARED_REFERENCES:
        model = build_model(hybrid_config(family, initializer_range=SHARED_INIT))
        _SHARED_REFERENCES[family] = [hf_greedy(model, p, m) for p, m in zip(shared_prompts(), SHARED_MAX_TOKENS)]
    return _SHARED_REFERENCES[family]


def run_shared(family: str, mode: str = "swap") -> tuple[list, Any, dict[str, int]]:
    """The shared-prefix prompts arriving over time with prefix caching, n=2 greedy samples,
    prompt chunks of 40 tokens (their ends fall inside blocks) and preemption (`mode`) under a
    memory cap. Returns outputs, prefix stats and the cache calls counted."""
    cap = memory_cap(family, *SHARED_CAP[family])
    with LLM(hybrid_config(family, initializer_range=SHARED_INIT), seed=0, max_batch_size=6, page_size=PAGE,
             physical_memory=cap, preemption_mode=mode, enable_prefix_caching=True, max_num_batched_tokens=40) as llm:
        calls = count_calls(llm.scheduler.kv, "fork", "swap_in")
        params = [SamplingParams(temperature=0, max_tokens=m, n=2, ignore_eos=True) for m in SHARED_MAX_TOKENS]
        outs = run_online(llm, shared_prompts(), params, SHARED_ARRIVALS)
        assert states_given_back(llm)  # every slot's snapshots settled
        kept = sum(map(llm.cache.snapshots.is_pinned, llm.prefix_cache.snapshots.values()))
        assert len(state_books(llm).cached) == kept  # only cached blocks keep snapshots (pressure may evict them all)
        calls["preemptions"] = llm.num_preemptions
        return outs, llm.prefix_cache_stats(), calls


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("family", list(HYBRIDS))
def test_prefix_caching_over_states_matches_generate(family: str, mode: str) -> None:
    """A hit maps the cached K/V and restores the state snapshot of its last block; every
    sample equals generate's greedy tokens (forks, preemptions and hits together)."""
    outs, stats, calls = run_shared(family, mode)
    assert stats.num_hit_tokens > 0 and stats.num_hit_tokens % stats.block_tokens == 0
    assert calls["fork"] > 0 and calls["preemptions"] > 0 and (calls["swap_in"] > 0) == (mode == "swap")
    for out, ref in zip(outs, shared_reference(family)):
        assert [o.token_ids for o in out.outputs] == [ref] * 2


def test_state_snapshots_are_evicted_least_recently_used_first() -> None:
    """Four prefixes, three prompts each, one at a time, then the first prefix again: a
    request snapshots its last block and where it parts from a cached prompt (4 snapshots a
    prefix), so the pool of SNAPSHOTS_PER_SLOT x max_batch_size snapshots evicts the oldest; a
    block whose snapshot is gone is a miss, and every output still equals generate's."""
    from vattn.engine.states import SNAPSHOTS_PER_SLOT

    g = torch.Generator().manual_seed(11)
    rand = lambda n: torch.randint(3, 128, (n,), generator=g).tolist()  # noqa: E731
    prefixes = [rand(100) for _ in range(4)]
    work = [p + rand(40) for p in prefixes for _ in range(3)] + [prefixes[0] + rand(40)]
    config = hybrid_config("bamba", initializer_range=SHARED_INIT)
    model = build_model(config)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(config, seed=0, max_batch_size=2, page_size=PAGE, enable_prefix_caching=True) as llm:
        pc = llm.prefix_cache
        hits, kept = [], []
        for prompt in work:
            before = pc.num_hit_tokens
            assert llm.generate(prompt, params)[0].token_ids == hf_greedy(model, prompt, 6)
            hits.append(pc.num_hit_tokens - before)
            kept.append(len(pc.snapshots))
        books = state_books(llm)
        assert len(books.cached) == len(pc.snapshots)
        llm.runner.cache.trim()  # (what the idle engine does) evicts every cached block and snapshot
        assert not books.cached and not any(llm.cache.snapshots.is_pinned(h) for h in pc.snapshots.values())
        assert llm.cache.stats().kinds["state"].num_created_pages == 0
    assert hits[:12] == [0, 0, 96] * 4  # the third prompt of a prefix restores the state at 96 tokens
    assert max(kept) == 2 * SNAPSHOTS_PER_SLOT and hits[12] == 0  # the first prefix's snapshots were evicted: a miss


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_prefix_hits_without_their_state_give_other_tokens(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutation check: hits that map the K/V but keep the slot's state as it was (no
    restore) give other tokens, so the test above sees the state."""
    from vattn.allocator import Snapshots

    def no_restore(self: Snapshots, reqid: int, handle: tuple[int, int]) -> bool:
        return self.is_pinned(handle)

    monkeypatch.setattr(Snapshots, "restore", no_restore)
    outs, stats, _ = run_shared(family)
    assert stats.num_hit_tokens > 0
    assert [[o.token_ids for o in out.outputs] for out in outs] != [[r] * 2 for r in shared_reference(family)]


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_state_models_outside_the_engine_are_refused(family: str) -> None:
    """Where nothing keeps the states (hf_cb, vattn serve, VAttnCache, tensor parallelism):
    the load-time check without states names the layers and their modules."""
    kind, mixer = HYBRIDS[family]
    model = build_model(hybrid_config(family))
    with pytest.raises(UnsupportedModelError, match=f"{kind} layer.*{mixer}.*generate") as e:
        check_model(model)
    assert isinstance(e.value, InvalidConfigError)  # those who caught the config errors still do


def test_a_state_module_vattn_was_not_checked_with_is_refused() -> None:
    model = build_model(hybrid_config("bamba"))
    mixer = model.model.layers[0].mamba
    mixer.__class__ = type("OtherMixer", (type(mixer),), {})
    with pytest.raises(UnsupportedModelError, match=r"not of OtherMixer \(layers.0.mamba\)"):
        LLM(model, max_batch_size=2)


@pytest.mark.parametrize("family", list(HYBRIDS))
def test_the_probe_alone_sees_every_state_layer(family: str) -> None:
    """What refuses an unknown hybrid: run with attention seeing each token alone, the model
    still carries tokens forward."""
    assert mixes_tokens_outside_attention(build_model(hybrid_config(family)))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_attention_models_pass_the_probe(family: str) -> None:
    kw = {"sliding_window": 8} if family == "mistral" else {}
    model = build_model(tiny_config(family, **kw))
    assert not mixes_tokens_outside_attention(model)
    check_model(model)
    assert model.config._attn_implementation != "vattn"  # the probe put the attention back


class _RunningMean(torch.nn.Module):
    """An unknown layer that carries tokens forward: no Conv1d, no SSM parameters, no config kind."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        y = self.mlp(x)
        steps = torch.arange(1, y.shape[1] + 1, device=y.device, dtype=y.dtype)[None, :, None]
        return y.cumsum(1) / steps


def test_an_unknown_hybrid_is_refused_by_running_it() -> None:
    model = build_model(tiny_config("llama"))
    model.model.layers[1].mlp = _RunningMean(model.model.layers[1].mlp)
    with pytest.raises(UnsupportedModelError, match="outside its attention layers"):
        LLM(model, max_batch_size=2)


def test_continuous_batching_hooks_refuse_state_layers() -> None:
    """hf_cb (and so `vattn serve`, which enables every model it loads) refuses them too;
    transformers' own continuous batching would raise a bare ValueError at its cache."""
    model = build_model(hybrid_config("bamba"))
    with pytest.raises(UnsupportedModelError, match="BambaMixer"):
        hf_cb.enable(model)
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        hf_cb.caches._check_layer_kinds(model.config)
    with pytest.raises(UnsupportedModelError, match="attention layers only"):
        VAttnCache(model.config, max_cache_len=64)


def test_models_that_bypass_the_attention_hook_are_refused() -> None:
    """RWKV (no attention layers to hook, a recurrent state of its own; its config names no
    layer kinds) and Gemma 2 (logit softcapping) are refused at load, before any request."""
    rwkv = tf.RwkvConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, attention_hidden_size=64,
                         intermediate_size=128)
    with pytest.raises(UnsupportedModelError, match="AttentionInterface"):
        LLM(rwkv, seed=0, max_batch_size=2)
    gemma2 = tf.Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    with pytest.raises(UnsupportedModelError, match="softcapping"):
        LLM(gemma2, seed=0, max_batch_size=2)


def test_a_failed_forward_fails_its_batch_and_the_engine_serves_on() -> None:
    """The layers that ran before the failure moved their states on: the batch is not run
    again request by request (as for attention-only models), its requests fail; the slots'
    blocks are given back, and later requests in them give generate's tokens."""
    with LLM(hybrid_config("bamba"), seed=0, max_batch_size=4, page_size=PAGE) as llm:
        mixer = llm.runner.model.model.layers[2].mamba
        installed, calls = mixer.forward, [0]

        def failing(*args: Any, **kwargs: Any) -> torch.Tensor:
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected")
            return installed(*args, **kwargs)

        mixer.forward = failing
        failed = llm.generate(prompts()[:2], greedy()[:2])
        assert [o.finish_reason for o in failed] == ["error", "error"]
        assert all("not run again" in o.error for o in failed)
        assert states_given_back(llm)
        mixer.forward = installed
        outs = llm.generate(prompts(), greedy())
    assert [o.token_ids for o in outs] == reference("bamba")
