"""transformers on vattn memory.

- Continuous batching (`hf_cb`): `generate_batch` gives the same tokens as on transformers'
  own cache (greedy, tiny seeded Llama and Qwen2), memory follows the load, a memory limit
  makes requests wait instead of failing, two models share one budget.
- `VAttnCache` (the slot API as a transformers `Cache`): `generate` with a padded batch
  (greedy and beam search) gives the same tokens as the default cache.
"""
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
from vattn.integrations.hf import VAttnCache  # noqa: E402

try:
    hf_cb.check_transformers()
    CB_SKIP = ""
except vattn.InvalidConfigError as e:  # pragma: no cover - another transformers
    CB_SKIP = str(e)
needs_cb = pytest.mark.skipif(bool(CB_SKIP), reason=CB_SKIP)

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
    if CB_SKIP:  # pragma: no cover
        pytest.skip(CB_SKIP)
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


@needs_cb
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


@needs_cb
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


@needs_cb
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


@needs_cb
def test_models_not_enabled_keep_transformers_memory(models, cleanup):
    ms, refs = models
    cb = hf_cb.enable(ms["llama"], page_size=PAGE)
    assert continuous_api.PagedAttentionCache is not cache_mod.PagedAttentionCache
    assert generate(ms["qwen2"]) == refs["qwen2"]
    assert cb.num_caches == 0  # qwen2's cache was transformers' own
    cb.disable()
    assert continuous_api.PagedAttentionCache is cache_mod.PagedAttentionCache  # nothing left installed


@needs_cb
def test_enable_all_covers_every_model(models, cleanup):
    ms, refs = models
    cb = hf_cb.enable_all(page_size=PAGE, memory_limit=12 * SECTOR)
    try:
        assert generate(ms["qwen2"]) == refs["qwen2"]
        assert cb.num_caches == 1
    finally:
        hf_cb.disable_all()
    assert continuous_api.PagedAttentionCache is cache_mod.PagedAttentionCache


@needs_cb
def test_unknown_transformers_is_a_clear_error(models, monkeypatch):
    model = models[0]["llama"]
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.17.0")  # (the module may have been replaced)
    with pytest.raises(vattn.InvalidConfigError, match="supports transformers 5.23"):
        hf_cb.enable(model)
    monkeypatch.undo()
    monkeypatch.delattr(cache_mod.CachePool, "try_to_free_sectors")
    with pytest.raises(vattn.InvalidConfigError, match="CachePool.try_to_free_sectors"):
        hf_cb.enable(model)


@needs_cb
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


# ----------------------------------------------------------------- VAttnCache ----
def padded_batch(lens=(5, 17, 33, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts and their attention mask."""
    g = torch.Generator().manual_seed(2)
    n = max(lens)
    ids = torch.zeros(len(lens), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, k in enumerate(lens):
        ids[i, n - k:] = torch.randint(3, 128, (k,), generator=g)
        mask[i, n - k:] = 1
    return ids, mask


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("beams", [1, 3])
def test_vattn_cache_generates_like_the_default_cache(family, beams):
    model = tiny(family)
    ids, mask = padded_batch()
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, num_beams=beams, pad_token_id=0)
    ref = model.generate(ids, **kw)
    with VAttnCache(model.config, max_cache_len=64, page_size=PAGE) as cache:
        out = model.generate(ids, past_key_values=cache, **kw)
        assert torch.equal(out, ref)
        s = cache.stats()
        assert s.num_active == len(ids) * beams and s.mapped_bytes > 0
        assert cache.get_seq_length() == ids.shape[1] + 12 - 1  # the last token is never fed back
    assert cache.kv is None  # closed: memory given back


def test_vattn_cache_errors():
    model = tiny("llama")
    ids, mask = padded_batch()
    with VAttnCache(model.config, max_cache_len=40, page_size=PAGE) as cache:
        with pytest.raises(vattn.ContextLengthError, match="max_cache_len"):
            model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=20, do_sample=False,
                           pad_token_id=0)
    with VAttnCache(model.config, max_cache_len=64, page_size=PAGE, physical_memory=2 * 4 * PAGE) as cache:
        with pytest.raises(vattn.OutOfPhysicalMemoryError, match="physical_memory"):
            model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False,
                           pad_token_id=0)
    with VAttnCache(model.config, max_cache_len=64, page_size=PAGE) as cache:
        model(ids[:2], attention_mask=mask[:2], past_key_values=cache)
        with pytest.raises(vattn.InvalidConfigError, match="batch of 2"):
            model(ids, attention_mask=mask, past_key_values=cache)


# -------------------------------------------------------------------- serving ----
def char_checkpoint(path) -> str:
    """A tiny seeded Llama with a character-level tokenizer and a chat template, saved locally."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(string.printable[:95])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    model = tiny("llama")
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)


def _post(url: str, body: dict) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@needs_cb
def test_serve_answers_over_http_from_vattn_memory(tmp_path):
    import importlib.util
    import socket
    import time
    import urllib.request

    missing = [m for m in hf_cb.SERVING_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"transformers serve needs {missing} (pip install 'transformers[serving]')")
    path = char_checkpoint(tmp_path / "ckpt")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = hf_cb.serve(path, port=port, device="cpu", num_blocks=64, page_size=PAGE, memory_limit=2 << 20,
                         non_blocking=True)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        out = _post(base + "/v1/completions", {"model": path, "prompt": "hello world", "max_tokens": 12,
                                               "temperature": 0})
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        ids = tok("hello world", return_tensors="pt").input_ids
        ref = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
        assert out["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
        assert server.vattn.num_caches >= 1 and server.vattn.stats().peak_mapped_bytes > 0
        chat = _post(base + "/v1/chat/completions", {"model": path, "max_tokens": 8, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "hi"}]})
        assert chat["choices"][0]["message"]["role"] == "assistant"
    finally:
        server.kill_server()
        hf_cb.disable_all()
