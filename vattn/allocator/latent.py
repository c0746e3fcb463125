"""Multi-head latent attention's layer kind (DeepSeek-V2/V3, Kimi K2; vLLM's `MLAAttentionSpec`):
full attention by its pages (its manager is `FullAttention`), whose token row is one latent
"head" of `k_width` values as K (the compressed latent, `kv_lora_rank`) and the shared RoPE
key of `v_width` values as V (`qk_rope_head_dim`), in one buffer a layer. The model's mapping
(`mapping`: finds the layers, builds these widths, installs the attention) is
`vattn.engine.latent`. Plain Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from vattn.allocator.kinds import KindSpec, LayerKind


@dataclass(frozen=True, kw_only=True)
class LatentSpec(KindSpec):
    """A latent attention kind as the cache lays it out: `heads` (1: the latent is every
    head's) x (`k_width` + `v_width`) values a token."""

    heads: int = 1
    k_width: int
    v_width: int
    # the module that maps a model's layers onto this kind (`vattn.engine.mappings`)
    mapping = "vattn.engine.latent"


@dataclass(frozen=True, kw_only=True)
class Latent(LayerKind):
    """What a model's mapping names for a latent attention layer in `CacheConfig.layer_windows`:
    full attention (no tokens are behind what a query reads: `size` 0) whose token keeps
    `kv_widths` (the cache's heads, K width and V width for every layer of it)."""

    size: int = 0
    heads: int = 1
    k_width: int
    v_width: int
    label = "latent"

    @property
    def name(self) -> str:
        return self.label

    @property
    def kv_widths(self) -> tuple[int, int, int]:
        return self.heads, self.k_width, self.v_width

    def spec(self, base: KindSpec, margin: int) -> KindSpec:
        return LatentSpec(**base.layout(), heads=self.heads, k_width=self.k_width, v_width=self.v_width)


__all__ = ["Latent", "LatentSpec"]
