"""transformers' continuous batching on vattn memory: `generate_batch` gives the same tokens as
on transformers' own cache (greedy, tiny seeded Llama and Qwen2), memory follows the load,
a memory limit makes requests wait instead of failing, two models share one budget."""
from __future__ import annotations

import copy
import gc
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402
from transformers.generation.continuous_batching import cache as cache_mod  # noqa: E402
from transformers.generation.continuous_batching import continuous_api  # noqa: E402

import vattn  # noqa: E402
from vattn.integrations import hf_cb  # noqa: E402

try:
    hf_cb.check_transformers()
except vattn.InvalidConfigError as e:  # pragma: no cover - another transformers
    pytest.skip(str(e), allow_module_level=True)

PAGE = 4096
PROMPT_LENS = (5, 17, 33, 48, 70, 3)
# 16 tokens a block: 2 layers x 2 KV heads x 16 x fp32 x K and V = 8 KiB, one block a sector
SECTOR = 2 * 2 * 16 * 4 * 16 * 2
FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config}


def tiny(family: str, seed: int = 0):
    config = FAMILIES[family](vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                              initializer_range=0.2)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]


GEN = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=-1, pad_token_id=0)
CB = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=128, page_size=16)


def generate(model, persistent: bool = False, **cb) -> list[list[int]]:
    config = copy.deepcopy(CB)
    for k, v in cb.items():
        setattr(config, k, v)
    out = model.generate_batch(prompts(), generation_config=GEN, continuous_batching_config=config,
                               persistent_manager=persistent)
    assert len(out) == len(PROMPT_LENS)
    return [o.generated_tokens for o in out.values()]  # in the order of the prompts


@pytest.fixture(scope="module")
def models():
    ms = {f: tiny(f, seed) for seed, f in enumerate(FAMILIES)}
    refs = {f: generate(m) for f, m in ms.items()}  # transformers' own cache
    yield ms, refs
    for m in ms.values():
        hf_cb.disable(m)


@pytest.fixture
def cleanup(models):
    yield
    for m in models[0].values():
        m.destroy_cached_continuous_batching_manager()
        hf_cb.disable(m)
    gc.collect()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_same_tokens_and_memory_follows_the_load(models, family, cleanup):
    ms, refs = models
    model = ms[family]
    cb = hf_cb.enable(model, page_size=PAGE)
    assert generate(model, persistent=True) == refs[family]
    assert cb.num_caches == 1 and isinstance(cb.pool, vattn.ElasticPool)
    s = cb.stats()
    trash = hf_cb.TRASH_SECTORS * SECTOR
    assert s.block_bytes == SECTOR and s.num_blocks == 64 + hf_cb.TRASH_SECTORS
    assert s.peak_mapped_bytes >= trash + sum(-(-(n + 20) // 16) for n in PROMPT_LENS) * SECTOR // 2
    assert s.mapped_bytes <= s.peak_mapped_bytes
    manager = model._cached_continuous_batching_manager
    assert cb.trim(manager) > 0  # with the prefix-sharing blocks evicted, only the trash sectors stay
    s = cb.stats()
    assert s.mapped_bytes == trash and s.num_used_blocks == hf_cb.TRASH_SECTORS
    # the same manager serves again on the same (virtual) tensor
    cache = manager.batch_processor.cache
    addr = cache.cache_tensor.data_ptr()
    assert generate(model, persistent=True) == refs[family]
    assert manager.batch_processor.cache.cache_tensor.data_ptr() == addr and cb.stats().peak_mapped_bytes > trash


def test_memory_limit_makes_requests_wait(models, cleanup):
    ms, refs = models
    model = ms["llama"]
    # room for the longest request (70 + 20 tokens: 6 blocks) and the trash, not for all at once
    cb = hf_cb.enable(model, page_size=PAGE, memory_limit=8 * SECTOR)
    assert generate(model, persistent=True) == refs["llama"]
    s = cb.stats()
    assert s.peak_mapped_bytes <= 8 * SECTOR and s.limit == 8 * SECTOR
    cb.set_limit(4 * SECTOR)  # lowered at run time: free pages go back at once
    assert cb.stats().mapped_bytes <= max(4 * SECTOR, s.used_bytes)


def test_two_models_share_one_budget(models, cleanup):
    ms, refs = models
    budget = vattn.Budget(16 * SECTOR)
    cbs = {f: hf_cb.enable(m, page_size=PAGE, budget=budget) for f, m in ms.items()}
    # No prefix sharing: transformers would keep finished requests' complete blocks (and their sectors)
    assert generate(ms["llama"], persistent=True, allow_block_sharing=False) == refs["llama"]
    held = budget.used
    assert held > 0 and cbs["llama"].stats().num_cached_pages > 0  # llama keeps its free pages mapped
    assert generate(ms["qwen2"], persistent=True, allow_block_sharing=False) == refs["qwen2"]  # takes them
    assert cbs["llama"].stats().mapped_bytes < held
    assert budget.used <= 16 * SECTOR


def test_models_not_enabled_keep_transformers_memory(models, cleanup):
    ms, refs = models
    cb = hf_cb.enable(ms["llama"], page_size=PAGE)
    assert continuous_api.PagedAttentionCache is not cache_mod.PagedAttentionCache
    assert generate(ms["qwen2"]) == refs["qwen2"]
    assert cb.num_caches == 0  # qwen2's cache was transformers' own
    cb.disable()
    assert continuous_api.PagedAttentionCache is cache_mod.PagedAttentionCache  # nothing left installed


def test_unknown_transformers_is_a_clear_error(models, monkeypatch):
    model = models[0]["llama"]
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.17.0")  # (the module may have been replaced)
    with pytest.raises(vattn.InvalidConfigError, match="supports transformers 5.23"):
        hf_cb.enable(model)
    monkeypatch.undo()
    monkeypatch.delattr(cache_mod.CachePool, "try_to_free_sectors")
    with pytest.raises(vattn.InvalidConfigError, match="CachePool.try_to_free_sectors"):
        hf_cb.enable(model)


@pytest.mark.parametrize("kw, match", [
    (dict(memory_limit=-1), "memory_limit"),
    (dict(memory_limit=1.5), "memory_limit"),
    (dict(budget=5), "budget"),
])
def test_bad_arguments(models, kw, match):
    with pytest.raises(vattn.InvalidConfigError, match=match):
        hf_cb.enable(models[0]["llama"], **kw)
    with pytest.raises(vattn.InvalidConfigError, match="not a transformers model"):
        hf_cb.enable(object())
