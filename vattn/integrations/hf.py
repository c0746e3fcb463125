"""Hugging Face `transformers` integration: the "vattn" attention implementation.

The model's own modules run unchanged (embeddings, norms, RoPE from `position_ids`, MLP,
projections). Each attention layer calls `vattn_attention_forward` through
`transformers.AttentionInterface` with its new Q/K/V of the packed batch; the function
writes K/V into the vattn cache and runs a library kernel (see `vattn.attention`) on
each request's contiguous cache row. The mask function returns None: which keys a query
sees follows from the per-iteration metadata, not from a 4D mask.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from vattn.attention import get_forward_context
from vattn.errors import InvalidConfigError

ATTN_IMPLEMENTATION = "vattn"


def vattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: query `[1, H_q, T, D]`, key/value `[1, H_kv, T, D]`
    for the T packed tokens of this iteration. Returns `([1, T, H_q, D], None)` like
    transformers' own `sdpa_attention_forward`."""
    ctx = get_forward_context()
    layer = module.layer_idx
    if kwargs.get("softcap") is not None:
        raise InvalidConfigError("vattn attention does not support attention logit softcapping")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ctx.kernel.forward(
        query[0].transpose(0, 1),  # [T, H_q, D]
        key[0].transpose(0, 1),  # [T, H_kv, D]
        value[0].transpose(0, 1),
        ctx.k_caches[layer], ctx.v_caches[layer], ctx.metadata, scale, sliding_window)
    return out.unsqueeze(0), None  # [1, T, H_q, D]


def vattn_mask(*args: Any, **kwargs: Any) -> None:
    """Mask function for "vattn": no mask; the metadata says which keys each query sees."""
    return None


def register() -> None:
    """Register the "vattn" attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, vattn_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, vattn_mask)


def use_vattn_attention(model: PreTrainedModel) -> str:
    """Switch `model` to the "vattn" attention; returns the implementation it had."""
    register()
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    except (ValueError, ImportError) as e:
        raise InvalidConfigError(f"{type(model).__name__} cannot use the vattn attention: {e}") from None
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise InvalidConfigError(
            f"{type(model).__name__} does not route its attention through transformers' "
            "AttentionInterface, so vattn cannot plug in; use a Llama, Qwen2 or Mistral style model")
    return previous


def restore_attention(model: PreTrainedModel, implementation: str | None) -> None:
    """Put back the implementation `use_vattn_attention` replaced."""
    if implementation and implementation != ATTN_IMPLEMENTATION:
        try:
            model.set_attn_implementation(implementation)
        except (ValueError, ImportError):
            pass


__all__ = ["ATTN_IMPLEMENTATION", "vattn_attention_forward", "vattn_mask", "register",
           "use_vattn_attention", "restore_attention"]
