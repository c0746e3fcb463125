"""Sharding a model over the tensor-parallel ranks: which slice of each weight a rank holds,
and building the rank's model from a checkpoint or from the full model.

Sharding (Megatron-style, rank r of N, plain tensors: no DTensor):

```
  q/k/v_proj   colwise  rank r keeps query heads [r*H/N, (r+1)*H/N) and kv heads likewise;
                        with fewer kv heads than ranks, kv head r*H_kv//N (replicated, as vLLM)
  o_proj       rowwise  the input columns of its heads; output all-reduced, bias added once
  gate/up_proj colwise  intermediate features [r*I/N, (r+1)*I/N)
  down_proj    rowwise  all-reduced
  embeddings, norms, lm_head: replicated
```

Which module splits how comes from the model's own transformers plan
(`config.base_model_tp_plan`: "colwise" / "rowwise"), or the Llama names above when it has
none. The model each rank builds is the model's own class from a config with H/N heads,
H_kv/N (at least 1) kv heads and I/N intermediate features, so the attention hook and the
cache (`num_kv_heads` = the local count) need nothing special. A checkpoint directory is
read slice by slice (safetensors): each rank reads only its shard.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any, NamedTuple

import torch

from vattn.engine.config import EngineConfig
from vattn.engine.loader import LoadedModel, load_model, load_tokenizer, run_dtype
from vattn.errors import InvalidConfigError

logger = logging.getLogger(__name__)

# transformers' own plan for Llama-like models: what a model without `base_model_tp_plan` gets
DEFAULT_PLAN = {
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise",
}


def load_shard(model: Any, config: EngineConfig, rank: int, world: int, device: Any, tp: Any) -> LoadedModel:
    """Rank `rank`'s shard of `model` (a checkpoint directory, a config or a loaded model);
    its rowwise modules all-reduce through `tp` (`TensorParallel.all_reduce_`)."""
    from transformers import AutoConfig, GenerationConfig

    if isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        path = os.fspath(model)
        try:
            hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError, KeyError) as e:
            raise InvalidConfigError(f"cannot read the model config in {path!r}: {e}") from None
        source = _SafetensorsSource.open(path)
        if source is not None:
            dtype = run_dtype(getattr(hf_config, "dtype", None), config, device)
            shard = shard_model(hf_config, source, rank, world, dtype, tp)
            try:
                shard.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
            except OSError:  # no generation_config.json: the one built from the config stays
                pass
            return LoadedModel(shard, load_tokenizer(path), dtype)
        logger.warning("vattn: %s has no safetensors weights: every rank reads the whole checkpoint", path)
    # a config: the seeded full weights, as at TP 1 (on the host in float32; on CUDA made on
    # this rank's GPU in the run dtype, the whole model for a moment before it is sliced);
    # the wrong type raises load_model's error
    full = load_model(model, config, device)
    shard = shard_model(full.model.config, _StateDictSource(full.model.state_dict()), rank, world, full.dtype, tp)
    shard.generation_config = copy.deepcopy(full.model.generation_config)
    return LoadedModel(shard, full.tokenizer, full.dtype)


class _Slice(NamedTuple):
    dim: int | None  # None: the whole tensor
    start: int
    stop: int


class _StateDictSource:
    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        self.state = state

    def keys(self) -> set[str]:
        return set(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def read(self, name: str, s: _Slice) -> torch.Tensor:
        t = self.state[name]
        return t if s.dim is None else t.narrow(s.dim, s.start, s.stop - s.start)


class _SafetensorsSource:
    """The tensors of a safetensors checkpoint (one file or an index), read slice by slice."""

    def __init__(self, files: dict[str, Any]) -> None:
        self.files = files  # tensor name -> open safe_open handle

    @classmethod
    def open(cls, path: str) -> _SafetensorsSource | None:
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            weight_map = None
        else:
            return None
        handles: dict[str, Any] = {}
        names = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        opened = {n: safe_open(os.path.join(path, n), framework="pt") for n in names}
        for n, h in opened.items():
            for key in h.keys():
                handles[key] = h
        return cls(handles)

    def keys(self) -> set[str]:
        return set(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.files[name].get_slice(name).get_shape())

    def read(self, name: str, s: _Slice) -> torch.Tensor:
        sl = self.files[name].get_slice(name)
        if s.dim is None:
            return sl[:]
        index = tuple([slice(None)] * s.dim + [slice(s.start, s.stop)])
        return sl[index]


def shard_config(hf_config: Any, world: int) -> Any:
    """The config of one rank's model: H/N heads, H_kv/N kv heads (1 when a kv head is
    replicated), I/N intermediate features, head_dim kept. Raises InvalidConfigError when
    the sizes do not divide."""
    h = hf_config.num_attention_heads
    h_kv = getattr(hf_config, "num_key_value_heads", None) or h
    inter = hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // h
    if h % world:
        raise InvalidConfigError(f"num_attention_heads={h} is not divisible by tensor_parallel_size={world}; "
                                 f"use a tensor_parallel_size that divides it")
    if h_kv % world and world % h_kv:
        raise InvalidConfigError(
            f"num_key_value_heads={h_kv} and tensor_parallel_size={world}: one must divide the other (each rank "
            "holds kv_heads / N heads, or, with fewer kv heads than ranks, one kv head shared by N / kv_heads ranks)")
    if inter % world:
        raise InvalidConfigError(f"intermediate_size={inter} is not divisible by tensor_parallel_size={world}")
    local = copy.deepcopy(hf_config)
    local.num_attention_heads = h // world
    local.num_key_value_heads = max(1, h_kv // world)
    local.intermediate_size = inter // world
    local.head_dim = head_dim
    return local


def tp_plan(hf_config: Any) -> dict[str, str]:
    """The model's transformers plan (module pattern -> "colwise" | "rowwise"), or the
    Llama one. Raises InvalidConfigError for a style vattn does not shard (e.g. experts)."""
    plan = dict(getattr(hf_config, "base_model_tp_plan", None) or DEFAULT_PLAN)
    odd = {k: v for k, v in plan.items() if v not in ("colwise", "rowwise")}
    if odd:
        raise InvalidConfigError(f"vattn shards only 'colwise' / 'rowwise' modules; this model's plan has {odd}: "
                                 "use tensor_parallel_size=1")
    return plan


def shard_model(hf_config: Any, source: Any, rank: int, world: int, dtype: torch.dtype, tp: Any) -> Any:
    """Build this rank's model from `source` (the full model's tensors by name): planned
    modules sliced, the rest copied; rowwise modules all-reduce their output (`tp.all_reduce_`)."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    plan = tp_plan(hf_config)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(shard_config(hf_config, world), dtype=dtype)
    prefix = model.base_model_prefix + "."
    styles: dict[str, str] = {}  # module name -> style
    for name, _ in model.named_modules():
        rel = name[len(prefix):] if name.startswith(prefix) else None
        style = next((s for pat, s in plan.items() if rel is not None and fnmatchcase(rel, pat)), None)
        if style is not None:
            styles[name] = style
    if not styles:
        raise InvalidConfigError(f"no module of {type(model).__name__} matches its tensor-parallel plan {plan}")
    available = source.keys()
    state = model.state_dict()
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in state.items():
            if name not in available:
                continue
            module, _, kind = name.rpartition(".")
            s = _slice_of(name, styles.get(module), kind, source.shape(name), tuple(tensor.shape), rank, world)
            tensor.copy_(source.read(name, s))
            loaded.add(name)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ids = {id(params[n]) for n in loaded if n in params}
    missing = [n for n in state if n not in loaded and not (n in params and id(params[n]) in loaded_ids)]
    if missing:
        raise InvalidConfigError(f"the checkpoint lacks {missing[:5]}: load the model yourself and pass it to LLM")
    for name, style in styles.items():
        if style == "rowwise":
            _all_reduce_output(model.get_submodule(name), tp)
    return model.eval()


def _slice_of(name: str, style: str | None, kind: str, full: tuple[int, ...], local: tuple[int, ...],
              rank: int, world: int) -> _Slice:
    """Which part of the full tensor `name` this rank's tensor holds."""
    if style is None or (style == "rowwise" and kind == "bias"):
        if full != local:
            raise InvalidConfigError(f"{name}: the shard has shape {local}, the model {full}: the model's sizes "
                                     "do not shard the way its tensor-parallel plan says")
        return _Slice(None, 0, 0)
    dim = 0 if style == "colwise" else 1
    blocks = full[dim] // local[dim]
    if full[dim] % local[dim] or world % blocks or (style == "rowwise" and blocks != world):
        raise InvalidConfigError(f"{name}: {style} shard of shape {local} does not divide the model's {full}")
    start = (rank * blocks // world) * local[dim]  # blocks < world: a replicated kv head
    return _Slice(dim, start, start + local[dim])


def _all_reduce_output(module: torch.nn.Module, tp: Any) -> None:
    """A rowwise module: its partial output is summed over the ranks, then its bias added once."""
    bias = module.bias
    module.bias = None
    module._vattn_tp_bias = bias  # a parameter of the module still: .to() moves it

    def hook(mod: torch.nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
        tp.all_reduce_(out)
        return out if mod._vattn_tp_bias is None else out + mod._vattn_tp_bias

    module.register_forward_hook(hook)
