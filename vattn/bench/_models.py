"""The benchmarks' models: Llama-shaped configs with random, seeded weights made directly on the
device (no download, no checkpoint). Used by overlap, throughput and the end-to-end part of
`vattn bench gpu`; transformers is imported only when a model is made. `char_checkpoint`
saves one with a character-level tokenizer, for servers (`vattn serve`) and their tests."""
from __future__ import annotations

from typing import Any

import torch


def llama_config(*, vocab_size: int, hidden_size: int, intermediate_size: int, num_hidden_layers: int,
                 num_attention_heads: int, num_key_value_heads: int, max_position_embeddings: int,
                 **extra: Any) -> Any:
    """A `LlamaConfig` without special tokens (greedy decoding never stops early); `extra`:
    head_dim, tie_word_embeddings, ..."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                       num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None, **extra)


def build_model(config: Any, device: str, dtype: torch.dtype, seed: int = 0, attn_implementation: str | None = None
                ) -> Any:
    """Random weights from `seed` (the global RNGs are left as they were), made on `device` in
    `dtype` (no host copy), in eval mode (`vattn.engine.loader.seeded_model`)."""
    from vattn.engine.loader import seeded_model

    kw = {} if attn_implementation is None else dict(attn_implementation=attn_implementation)
    return seeded_model(config, seed, device, dtype, **kw).eval()


def cb_results(manager: Any, ids: list[str], timeout_s: float = 120) -> dict[str, Any]:
    """Wait for transformers' continuous batching (`manager`, started) to finish requests `ids`:
    {request id: its finished result}; an error when one failed or nothing came in `timeout_s`."""
    done: dict[str, Any] = {}
    while len(done) < len(ids):
        r = manager.get_result(timeout=timeout_s)
        if r is None:
            raise RuntimeError(f"transformers' continuous batching returned nothing in {timeout_s:g} s")
        if r.is_finished():
            if r.error is not None:
                raise RuntimeError(f"transformers' continuous batching: request {r.request_id}: {r.error}")
            done[r.request_id] = r
    return done


def cb_config(block_tokens: int | None = None, **fields: Any) -> Any:
    """transformers' `ContinuousBatchingConfig(**fields)` with `block_tokens` tokens per cache
    block. The field's name differs: `page_size` from transformers 5.18 on (5.18-5.23 keep
    `block_size` only as a deprecated alias that warns), `block_size` on 5.17 (no
    `page_size`). None: transformers' default (256)."""
    import dataclasses

    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    if block_tokens is not None:
        names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        fields["page_size" if "page_size" in names else "block_size"] = block_tokens
    return ContinuousBatchingConfig(**fields)


def cb_cache_bytes(cache: Any) -> int:
    """Bytes of a transformers continuous-batching cache's own KV tensors (`PagedAttentionCache`):
    one flat `cache_tensor` on 5.18-5.23, per-layer `key_cache` / `value_cache` lists on 5.17."""
    if hasattr(cache, "cache_tensor"):
        tensors = [cache.cache_tensor]
    else:
        tensors = [*cache.key_cache, *cache.value_cache]
    return sum(t.numel() * t.element_size() for t in tensors)


def char_checkpoint(path: Any, *, seed: int = 0, hidden_size: int = 64, intermediate_size: int = 128,
                    num_hidden_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                    max_position_embeddings: int = 512, dtype: str | None = None) -> str:
    """Save a tiny seeded Llama with a character-level tokenizer (printable ASCII, one token a
    character) and a chat template in directory `path` (no hub); returns it as a string.
    `dtype` ("bfloat16", "float16"): the weights saved in it (default float32)."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(string.printable[:95])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    config = LlamaConfig(vocab_size=128, hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
                         num_key_value_heads=num_key_value_heads, max_position_embeddings=max_position_embeddings,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.bos_token_id, model.generation_config.eos_token_id = 1, 2
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)
