"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) on vattn's cache: the model mapping
(`vattn.engine.mappings`) of the layer kind whose cache keeps a compressed latent per token,
not K and V per head (`vattn.allocator.latent.Latent`). Everything of latent attention on the
model's side is here: which modules are latent (`find`), which it runs (`problem`), the widths
its cache keeps (`layer_kinds`) and its attention (`install`).

transformers' latent attention hands its cache the latent before expanding it
(`cache.update(kv_nope, k_rot, layer_idx)`: one "head" of `kv_lora_rank` values and one of
`qk_rope_head_dim`), then up-projects what the cache returns into every head's K and V
(`expand_kv`). vattn's cache keeps exactly those two per token, as K (the latent) and V
(the shared RoPE key) of different widths in one buffer a layer (`Latent.kv_widths`):

```
 a layer's buffer, slot s:  [ token 0: kv_nope (R) | k_rot (r) ][ token 1: ... ] ...
 iteration: new latents -> written at (slot, position)          (_LatentCache.update)
            each sequence's history 0 .. ctx-1, packed -> [1, 1, L, R], [1, 1, L, r]
            expand_kv (the model's own)  -> K [1, H, L, Dqk], V [1, H, L, Dv]
            attention per sequence over its rows of K/V  (attend_history)
```
Bytes per token and layer: (R + r) x dtype, against H x (Dqk + Dv) for full K/V: at
DeepSeek-V3's sizes 576 values against 128 x (192 + 128) = 40,960, 71x fewer. The history
is expanded at every step, as transformers' own cache path does (the absorbed read,
attention over the latent itself, is not done here). Pages, prefix caching, forks, swaps
and preemption are the cache's as for any K/V: only the attention layer differs.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn.functional as F

from vattn.allocator.latent import Latent
from vattn.attention import get_forward_context
from vattn.engine.loader import cache_keyword
from vattn.errors import UnsupportedModelError


LABEL = "latent attention"
# Multi-head latent attention modules (their cache keeps a latent they expand: `expand_kv`) that
# vattn's engine runs with the latent in its cache, checked against generate.
LATENT_ATTENTIONS = ("DeepseekV2Attention", "DeepseekV3Attention")


def find(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's attention modules whose cache keeps a compressed latent they expand into
    K and V themselves (`expand_kv`: DeepSeek-V2/V3's multi-head latent attention)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    return [m for m in decoder.modules() if callable(getattr(m, "expand_kv", None))]


def problem(model: torch.nn.Module, engine: bool) -> str | None:
    """Why `model`'s latent attention layers cannot run (None: it has none, or runs them);
    `engine`: the caller is vattn's engine on one rank, which keeps the latent."""
    found = find(model)
    if not found:
        return None
    other = sorted({type(m).__name__ for m in found} - set(LATENT_ATTENTIONS))
    if engine and not other and all(isinstance(getattr(m, "layer_idx", None), int) for m in found):
        return None
    why = (f"vattn's engine on one rank keeps the latent of {', '.join(LATENT_ATTENTIONS)} only" if engine
           else "vattn.LLM on one rank keeps the latent; here K/V of one width per head are kept")
    return (f"{len(found)} multi-head latent attention layer{'s' * (len(found) > 1)} "
            f"({', '.join(sorted({type(m).__name__ for m in found}))}: their cache keeps a latent they expand; {why})")


def layer_kinds(model: Any, found: list[torch.nn.Module], windows: tuple[Any, ...]) -> tuple[Any, ...]:
    """`windows` (per layer of the model, `CacheConfig.layer_windows`' entries) with each latent
    layer's a `Latent` of the widths transformers' own cache keeps (`latent_kind`): one latent
    "head" as K and the shared RoPE key as V."""
    kind = latent_kind(model, found)
    latent = {m.layer_idx for m in found}
    return tuple(kind if i in latent else w for i, w in enumerate(windows))


def latent_kind(model: Any, modules: list[torch.nn.Module]) -> Latent:
    """The K and V shapes transformers' `DynamicCache` keeps for the latent layers `modules`,
    read after one 3-token forward (with the model's own attention) of a batch of one."""
    from transformers.cache_utils import DynamicCache

    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3]], device=device), use_cache=True, **{cache_keyword(model.forward): cache})
    shapes = {(tuple(cache.layers[m.layer_idx].keys.shape[1::2]), tuple(cache.layers[m.layer_idx].values.shape[1::2]))
              for m in modules}
    if len(shapes) != 1 or any(k[0] != v[0] for k, v in shapes):
        raise UnsupportedModelError(f"the latent attention layers of {type(model).__name__} keep K/V of shapes "
                                    f"{sorted(shapes)} in transformers' cache; vattn keeps one shape for every layer")
    (heads, k_width), (_, v_width) = shapes.pop()
    return Latent(heads=heads, k_width=k_width, v_width=v_width)


class _LatentCache:
    """The one `Cache` call a latent attention layer makes, on the current forward's cache
    views: writes the iteration's latents, returns every sequence's history packed."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value `[1, 1, T, R]`, `[1, 1, T, r]` of the packed new tokens -> `[1, 1, L, R]`,
        `[1, 1, L, r]`: sequence i's tokens 0 .. ctx_i - 1, in the batch's order."""
        ctx = get_forward_context()
        meta, k_cache, v_cache = ctx.metadata, ctx.k_caches[layer_idx], ctx.v_caches[layer_idx]
        k_cache[meta.slot_ids, meta.positions] = key_states[0].transpose(0, 1)  # [T, 1, R] into [B, T_max, 1, R]
        v_cache[meta.slot_ids, meta.positions] = value_states[0].transpose(0, 1)
        slots, positions = _history(meta)  # [L] each
        return k_cache[slots, positions].transpose(0, 1)[None], v_cache[slots, positions].transpose(0, 1)[None]


def _history(meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, position) of every key of the iteration's sequences, packed (built once per
    iteration, shared by the layers)."""
    plan = meta._plans.get("latent")
    if plan is None:
        slots = torch.tensor(meta.slots, device=meta.device).repeat_interleave(
            torch.tensor(meta.context_lens, device=meta.device))
        positions = torch.cat([torch.arange(c, device=meta.device) for c in meta.context_lens])
        plan = meta._plans["latent"] = (slots, positions)
    return plan


def attend_history(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """query `[1, H, T, Dqk]` of the packed new tokens, key/value `[1, H, L, D]` of each
    sequence's history packed (`_LatentCache.update`, expanded by the model) -> `[1, T, H, Dv]`:
    query j of a sequence at position p sees its keys 0 .. p."""
    meta = get_forward_context().metadata
    T, H, Dv = query.shape[2], query.shape[1], value.shape[-1]
    out = query.new_empty(T, H, Dv)
    a = b = 0
    for start, n in zip(meta.starts, meta.query_lens):
        ctx = start + n
        q, k, v = query[0, :, a:a + n], key[0, :, b:b + ctx], value[0, :, b:b + ctx]  # [H, n | ctx, D]
        mask = None
        if 1 < n < ctx:  # a later chunk of a prompt: causal aligned to the end
            mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(start, ctx, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=n > 1 and n == ctx, scale=scale)
        out[a:a + n] = o.transpose(0, 1)  # [n, H, Dv]
        a, b = a + n, b + ctx
    return out[None]


def install(modules: list[torch.nn.Module]) -> Callable[[], None]:
    """Make each latent attention module run on vattn's cache: its forward gets `_LatentCache`
    as its cache, and its attention (`vattn.integrations.hf.vattn_attention_forward`) runs
    `attend_history` on the expanded histories. Returns the function that undoes it."""
    cache = _LatentCache()
    for module in modules:
        original = module.forward
        name = cache_keyword(original)

        def forward(self: torch.nn.Module, *args: Any, _original: Any = original, _name: str = name,
                    **kwargs: Any) -> Any:
            kwargs.pop("past_key_values", None)
            kwargs.pop("cache", None)
            kwargs[_name] = cache
            return _original(*args, **kwargs)

        module.forward = types.MethodType(forward, module)
        module.vattn_attend = attend_history

    def uninstall() -> None:
        for m in modules:
            m.__dict__.pop("forward", None)
            m.__dict__.pop("vattn_attend", None)

    return uninstall
