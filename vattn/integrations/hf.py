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
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from vattn.attention import ForwardContext, attend, forward_context, get_forward_context
from vattn.allocator.kinds import Chunk
from vattn.cache import KVCache
from vattn.checks import as_int
from vattn.engine.mappings import model_mappings
from vattn.errors import ContextLengthError, InvalidConfigError, OutOfPhysicalMemoryError, UnsupportedModelError

ATTN_IMPLEMENTATION = "vattn"
# The layer kinds (transformers' `layer_types` names) whose only memory of earlier tokens is
# their K/V, which vattn keeps; "dummy" layers (an MLP-only layer, or one that reads another
# layer's K/V) keep nothing. Everything else keeps a state vattn does not (see `check_model`).
SUPPORTED_LAYER_KINDS = ("full_attention", "sliding_attention", "dummy")
# Kinds vattn's engine on one rank runs besides (`check_model(engine=True)`): Llama 4's chunked
# local attention (its pages kept as a window of the chunk size, its attention masked to the chunk).
ENGINE_KINDS = ("chunked_attention",)
# What the kinds vattn refuses are, for its message.
_KIND_NAMES = {"linear_attention": "state-space or linear-attention (Mamba, Mamba2, gated delta-net)",
               "hybrid": "attention beside Mamba", "conv": "short-convolution", "chunked_attention": "chunked-attention",
               "indexed_attention": "sparse-attention"}
# Layer kinds whose per-request state vattn's engine keeps in its memory (vattn.engine.states),
# for the mixers it was checked with (greedy equality with generate, tests/test_model_support.py).
STATE_KINDS = ("linear_attention", "hybrid")
STATE_MIXERS = ("BambaMixer", "FalconH1Mixer", "Mamba2Mixer", "Qwen3NextGatedDeltaNet")
# A module's own parameters that only state-space layers have (Mamba, Mamba2, gated delta-net).
_SSM_PARAMETERS = ("A_log", "dt_bias")


def vattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: query `[1, H_q, T, D]`, key/value `[1, H_kv, T, D]`
    for the T packed tokens of this iteration. Returns `([1, T, H_q, D], None)` like
    transformers' own `sdpa_attention_forward`."""
    layer = module.layer_idx
    if kwargs.get("softcap") is not None:
        raise UnsupportedModelError("vattn attention does not support attention logit softcapping (Gemma 2 style)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        query = _retune_temperature(module, query)
    attend_history = getattr(module, "vattn_attend", None)
    if attend_history is not None:  # a model mapping's own attention (vattn.engine.mappings: install)
        return attend_history(query, key, value, scale), None
    out = attend(layer, query[0].transpose(0, 1),  # [T, H_q, D]
                 key[0].transpose(0, 1),  # [T, H_kv, D]
                 value[0].transpose(0, 1), scale, sliding_window, kwargs.get("s_aux"),  # (gpt-oss: sinks [H_q])
                 _attention_chunk(module))
    return out.unsqueeze(0), None  # [1, T, H_q, D]


def layer_windows(config: Any) -> tuple[int | Chunk | None, ...]:
    """Per layer of a transformers config, the sliding window its attention uses (None: full
    attention): `layer_types` where the config has them (Gemma-2/3, Qwen2's
    use_sliding_window, Ministral, gpt-oss), else `sliding_window` for every layer (Mistral).
    A chunked layer (Llama 4) reads its own chunk of `attention_chunk_size` tokens: a
    `Chunk`, the cache's chunked kind (whole chunks behind a query's go back)."""
    text = config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is None:
        return (window,) * text.num_hidden_layers
    chunk = getattr(text, "attention_chunk_size", None)
    return tuple(window if t == "sliding_attention" else Chunk(chunk) if t == "chunked_attention" and chunk else None
                 for t in types)


def _attention_chunk(module: torch.nn.Module) -> int | None:
    """The chunk of a chunked local attention layer (Llama 4: a query at p sees keys from
    floor(p / chunk) * chunk on), None for any other layer."""
    config = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    if types is None or types[module.layer_idx] != "chunked_attention":
        return None
    return config.attention_chunk_size


def _retune_temperature(module: torch.nn.Module, query: torch.Tensor) -> torch.Tensor:
    """Llama 4's NoPE layers scale each query by a temperature of its position, which the module
    computes from its cache's length (0 without one: positions 0 .. T-1 of the packed batch).
    query `[1, H, T, D]` -> scaled by the temperature of each token's own position instead."""
    meta = get_forward_context().metadata
    if meta is None:  # the load-time probe: every query sees only its own value
        return query

    def temperature(positions: torch.Tensor) -> torch.Tensor:  # [T] -> [1, 1, T, 1], as transformers computes it
        t = torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
        return t.view(1, 1, -1, 1)

    packed = torch.arange(query.shape[2], device=query.device)
    return (query * (temperature(meta.positions) / temperature(packed))).to(query.dtype)


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
        raise UnsupportedModelError(f"{type(model).__name__} cannot use the vattn attention: {e}") from None
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise UnsupportedModelError(
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


# ------------------------------------------------------------ which models run ----
def layer_kinds(config: Any) -> list[str]:
    """Each decoder layer's kind as transformers' caches see it ("full_attention",
    "sliding_attention", "linear_attention" for Mamba/Mamba2/gated delta-net layers, "hybrid"
    for attention and Mamba side by side, "conv", "chunked_attention", ...). A config that
    names no kinds says "full_attention" (or "sliding_attention") for every layer."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    try:
        return list(get_layer_types_and_kwargs(text)[0])
    except (AttributeError, TypeError, ValueError):  # a config transformers' caches cannot read
        n = getattr(text, "num_hidden_layers", None) or 0
        return list(getattr(text, "layer_types", None) or ["full_attention"] * n)


def state_modules(model: torch.nn.Module) -> list[str]:
    """The decoder's modules that keep a state of earlier tokens other than attention K/V,
    found by what they are made of: a causal convolution (`Conv1d`: Mamba, gated delta-net,
    short-conv layers) or state-space parameters (`A_log`, `dt_bias`). As "Class (path)"."""
    return [f"{type(m).__name__} ({path})" for path, m in _state_modules(model).items()]


def _state_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    found: dict[str, torch.nn.Module] = {}
    for path, module in decoder.named_modules():
        owner = None
        if isinstance(module, torch.nn.Conv1d):
            owner = path.rpartition(".")[0]
        elif any(name in _SSM_PARAMETERS for name, _ in module.named_parameters(recurse=False)):
            owner = path
        if owner is not None and not any(owner.startswith(p + ".") for p in found):
            found.setdefault(owner, decoder.get_submodule(owner))
    return found


def state_mixers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The state modules vattn's engine runs on states in its memory (`STATE_MIXERS`, each
    with the layer index its cache calls name); raises `UnsupportedModelError` for others."""
    found = _state_modules(model)
    other = [f"{type(m).__name__} ({p})" for p, m in found.items()
             if type(m).__name__ not in STATE_MIXERS or not isinstance(getattr(m, "layer_idx", None), int)]
    if other:
        raise UnsupportedModelError(
            f"vattn cannot run {type(model).__name__}: vattn keeps the recurrent state of {', '.join(STATE_MIXERS)} "
            f"layers only (each checked token for token against generate), not of {', '.join(other)}; run it with "
            "transformers' generate")
    return list(found.values())


def has_attention_sinks(model: torch.nn.Module) -> bool:
    """Whether an attention module of `model` has learned sinks (gpt-oss's `sinks`, handed to the
    attention as `s_aux`): vattn runs them in its sdpa path, eagerly (no CUDA graphs, no compile)."""
    return any(name.rpartition(".")[2] == "sinks" for name, _ in model.named_parameters())


def sdpa_only(model: torch.nn.Module) -> str | None:
    """What of `model` only vattn's sdpa path runs (no library kernel, CUDA graphs or compile),
    named for an error, or None: attention sinks (gpt-oss), chunked local attention (Llama 4)."""
    return next((what for what, present in (
        ("attention sinks", has_attention_sinks(model)),
        ("chunked attention", "chunked_attention" in layer_kinds(model.config))) if present), None)


class _SelfOnly:
    """A stand-in attention kernel: each query sees only its own token's value."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any) -> torch.Tensor:
        return value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)  # [T, H_q, D]


class _NoCaches:
    def __getitem__(self, layer: int) -> None:
        return None


@torch.inference_mode()
def mixes_tokens_outside_attention(model: PreTrainedModel) -> bool:
    """Whether `model` carries anything from one token to the next other than through its
    attention (a state-space or recurrent layer, an attention that does not go through
    vattn's hook): run with vattn's attention made to see each token alone, a token must
    give the same logits after other tokens as alone. One forward of 5 tokens, run as
    vattn's engine runs the model (packed, no cache)."""
    vocab = model.get_input_embeddings().num_embeddings
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3, 4, 1]], device=device) % vocab  # [1, 5]: token 1 alone, then after others
    keep = torch.tensor([0, 4], device=device)
    previous = use_vattn_attention(model)
    try:
        with forward_context(ForwardContext(_NoCaches(), _NoCaches(), None, _SelfOnly())):
            logits = model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False,
                           logits_to_keep=keep).logits[0].float()  # [2, V]
    finally:
        restore_attention(model, previous)
    tol = 1e-4 if model.dtype == torch.float32 else 2e-2  # relative; a state's effect is far larger
    return bool((logits[0] - logits[1]).abs().max() > tol * logits.abs().max() + 1e-6)


def check_model(model: PreTrainedModel, probe: bool = True, states: bool = False, engine: bool = False) -> bool:
    """Raise `UnsupportedModelError` unless every layer of `model` is attention that vattn
    runs (`SUPPORTED_LAYER_KINDS`): state-space (Mamba, Mamba2: Bamba, Falcon-H1, Jamba),
    linear-attention (gated delta-net: Qwen3-Next), convolution and other recurrent layers
    keep a per-request state that vattn does not keep, so their tokens would differ from
    `generate`. Decided by the config's layer kinds, by the modules the decoder is made of
    (`state_modules`) and, with `probe`, by running it (`mixes_tokens_outside_attention`),
    which refuses an unknown hybrid too.

    `states`: the caller keeps recurrent states (vattn's engine, `vattn.engine.states`):
    `STATE_KINDS` layers of `STATE_MIXERS` pass too (the probe cannot tell them apart from
    other state, so a model with them is not probed). Returns whether the model has them.
    `engine`: the caller is vattn's engine on one rank, which also runs `ENGINE_KINDS` (chunked
    attention) and the layers of its model mappings (`vattn.engine.mappings`: latent attention's
    latent); without it a model with them is refused (each mapping's `problem` says why)."""
    kinds = layer_kinds(model.config)
    has_states = states and any(k in STATE_KINDS for k in kinds)
    allowed = SUPPORTED_LAYER_KINDS + (STATE_KINDS if has_states else ()) + (ENGINE_KINDS if engine else ())
    by_kind: dict[str, list[int]] = {}
    for i, kind in enumerate(kinds):
        if kind not in allowed:
            by_kind.setdefault(kind, []).append(i)
    problems = [f"{len(ids)} {kind} layer{'s' * (len(ids) > 1)} ({_KIND_NAMES.get(kind, 'not attention')}: "
                f"{_layers(ids)})" for kind, ids in by_kind.items()]
    mapped = [p for p in (m.problem(model, engine) for m in model_mappings()) if p]  # e.g. latent attention
    problems += mapped
    if has_states and not by_kind and not mapped:
        state_mixers(model)  # raises for a state module vattn was not checked with
        return True
    modules = state_modules(model)
    if modules:
        shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
        problems.append(f"modules that keep a state of earlier tokens besides attention K/V: {shown}")
    if not problems and probe and _probe_mixes(model):
        problems.append("a forward that carries tokens' information outside its attention layers (a recurrent, "
                        "state-space or convolution layer, or an attention that does not use transformers' "
                        "AttentionInterface)")
    if problems:
        raise UnsupportedModelError(
            f"vattn cannot run {type(model).__name__}: it has {'; '.join(problems)}. vattn keeps the K/V of "
            f"attention layers only ({', '.join(SUPPORTED_LAYER_KINDS[:2])}) here, so such a model would give wrong "
            "tokens. vattn.LLM on one rank keeps the states of Mamba2 and gated delta-net layers (Bamba, Falcon-H1, "
            "Mamba2, Qwen3-Next); otherwise run it with transformers' generate, or pick an attention-only model "
            "(Llama, Qwen2, Mistral, ...)")
    return False


def _probe_mixes(model: PreTrainedModel) -> bool:
    try:
        return mixes_tokens_outside_attention(model)
    except InvalidConfigError:  # vattn's own refusals (no AttentionInterface, softcapping, ...) as they are
        raise
    except Exception as e:  # noqa: BLE001 - the engine's forward would fail the same way
        raise UnsupportedModelError(f"vattn cannot run {type(model).__name__}: its forward fails when run as vattn's "
                                    f"engine runs it (packed tokens, position_ids, no cache): {type(e).__name__}: {e}"
                                    ) from e


def _layers(ids: list[int]) -> str:
    shown = ", ".join(map(str, ids[:8]))
    return f"layer{'s' * (len(ids) > 1)} {shown}" + (f", ... {ids[-1]}" if len(ids) > 8 else "")


class _VAttnLayer(CacheLayerMixin):
    """One layer of a `VAttnCache`: its K/V live in the vattn cache's views of that layer."""

    is_sliding = False

    def __init__(self, owner: VAttnCache, layer: int) -> None:
        super().__init__()
        self.owner, self.layer = owner, layer
        self.length = 0  # tokens cached for every row of the batch

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner._open(key_states, value_states)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """key/value: `[B, H, T, D]`. Writes them at this layer's positions of the batch's
        slots and returns the whole history `[B, H, length, D]` (views, no copy)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        start, end = self.length, self.length + key_states.shape[-2]
        if key_states.shape[0] != owner.batch_size:
            raise InvalidConfigError(f"VAttnCache holds a batch of {owner.batch_size}, got key states for "
                                     f"{key_states.shape[0]} rows; use one VAttnCache per batch")
        owner._back(end)
        k, v = owner.kv.k_cache(self.layer), owner.kv.v_cache(self.layer)  # [max_batch, max_len, H, D]
        rows = slice(0, owner.batch_size)
        k[rows, start:end] = key_states.transpose(1, 2)
        v[rows, start:end] = value_states.transpose(1, 2)
        self.length = end
        self.keys, self.values = k[rows, :end].transpose(1, 2), v[rows, :end].transpose(1, 2)  # [B, H, end, D]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # like DynamicLayer: masks are sized by get_mask_sizes, not by a static length

    def reset(self) -> None:
        self.length = 0
        self.keys = self.values = None

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise InvalidConfigError("crop() takes a negative number of tokens to remove")
        self.length = max(0, self.length + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.length:
            rows = slice(0, self.owner.batch_size)
            idx = beam_idx.to(self.device)
            for t in (self.owner.kv.k_cache(self.layer), self.owner.kv.v_cache(self.layer)):
                t[rows, :self.length] = t[rows, :self.length].index_select(0, idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise InvalidConfigError("VAttnCache cannot grow its batch after the first forward (contrastive search, "
                                 "num_return_sequences with an existing cache); use DynamicCache there")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise InvalidConfigError("VAttnCache cannot drop rows of its batch; use DynamicCache there")


class VAttnCache(Cache):
    """A transformers `Cache` whose K/V live in a vattn `KVCache` (the slot API): each row of
    the batch is a slot, contiguous in virtual memory, backed by pages as it grows.

    ```
    cache = VAttnCache(model.config, max_cache_len=2048, page_size=64 << 10)
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=64)
    cache.stats(); cache.close()    # or `with VAttnCache(...) as cache:`
    ```
    The vattn cache is built at the first forward from the key states' batch size, dtype
    and device (`max_batch_size` reserves more rows). Full-attention models (Llama, Qwen2,
    Mistral, ...); beam search works (rows are reordered in place); operations that change
    the batch size after the first forward raise. One cache per `generate` call.
    """

    def __init__(self, config: Any, max_cache_len: int, *, max_batch_size: int | None = None,
                 page_size: int | None = None, physical_memory: int | None = None, layout: str = "per-layer",
                 background: bool = True) -> None:
        layer_types = layer_kinds(config)
        unsupported = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unsupported:
            raise UnsupportedModelError(f"VAttnCache supports attention layers only, not {unsupported}")
        # (stored under names of our own: transformers 5.17's Cache has read-only properties of these names)
        self._max_len = as_int(max_cache_len, "max_cache_len", InvalidConfigError, low=1)
        self._max_rows = (None if max_batch_size is None
                          else as_int(max_batch_size, "max_batch_size", InvalidConfigError, low=1))
        self._options = dict(page_size=page_size, physical_memory=physical_memory, layout=layout, background=background)
        self.kv: KVCache | None = None
        self.slots: list[int] = []
        self.backed = 0  # tokens every slot has pages for
        super().__init__(layers=[_VAttnLayer(self, i) for i in range(len(layer_types))])

    @property
    def max_cache_len(self) -> int:
        """Tokens a row can hold."""
        return self._max_len

    @property
    def max_batch_size(self) -> int | None:
        """Rows reserved (None: the batch size of the first forward)."""
        return self._max_rows

    @property
    def batch_size(self) -> int:
        return len(self.slots) if self.slots else -1

    def _open(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Build the vattn cache at the first forward: `[B, H, T, D]` key states (value states
        of another width: a latent attention's, in one buffer with K)."""
        if self.kv is not None:
            return
        b, h, _, d = key_states.shape
        self.kv = KVCache(num_layers=len(self.layers), num_kv_heads=h, head_dim=d, v_head_dim=value_states.shape[-1],
                          max_batch_size=self.max_batch_size or b, max_context_len=self.max_cache_len,
                          dtype=key_states.dtype, device=str(key_states.device), **self._options)
        self.slots = [self.kv.alloc_reqid() for _ in range(b)]
        if self.slots != list(range(b)):  # a fresh cache hands out slots 0..B-1 in order
            raise InvalidConfigError(f"VAttnCache expected slots 0..{b - 1}, got {self.slots}")

    def _back(self, length: int) -> None:
        """Make sure every row has pages for `length` tokens (the first layer of a forward maps)."""
        if length <= self.backed:
            return
        if length > self.max_cache_len:
            raise ContextLengthError(f"VAttnCache holds {self.max_cache_len} tokens a row and this forward needs "
                                     f"{length}; create it with a larger max_cache_len")
        res = self.kv.step({r: length for r in self.slots})
        if not res:
            raise OutOfPhysicalMemoryError(
                f"vattn has no pages for {len(res.failed)} of {len(self.slots)} rows at {length} tokens; raise "
                "physical_memory or generate a smaller batch")
        self.backed = length

    def stats(self) -> Any:
        """The vattn cache's `MemoryStats` (None before the first forward)."""
        return self.kv.stats() if self.kv is not None else None

    def close(self) -> None:
        """Release the vattn cache's memory (idempotent); the cache is empty afterwards."""
        if self.kv is not None:
            self.kv.close()
            self.kv = None
        self.slots, self.backed = [], 0
        for layer in self.layers:
            layer.reset()
            layer.is_initialized = False

    def __enter__(self) -> VAttnCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED_LAYER_KINDS", "STATE_KINDS", "STATE_MIXERS", "layer_kinds",
           "state_modules", "state_mixers", "layer_windows",
           "mixes_tokens_outside_attention", "check_model", "vattn_attention_forward", "vattn_mask", "register",
           "use_vattn_attention", "restore_attention", "VAttnCache"]
