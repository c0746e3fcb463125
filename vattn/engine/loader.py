"""Loading a model for the engine, and what names it: the model (from a checkpoint directory,
a transformers config with seeded random weights, or a loaded model), its tokenizer and the
dtype it runs in (`load_model`); the prefix cache's salt (`prefix_salt`: the config and
dtype, what makes K/V of the same tokens differ) and the disk tier's (`weights_fingerprint`:
the weights themselves, since the tier's files outlive the process).

transformers is imported inside the functions that need it, when a model is loaded.
"""
from __future__ import annotations

import copy
import hashlib
import inspect
import itertools
import os
from typing import Any, NamedTuple

import torch

from vattn.engine.config import MODEL_DTYPES, EngineConfig
from vattn.errors import InvalidConfigError


class LoadedModel(NamedTuple):
    """What `load_model` gives: the model, its tokenizer (or None) and its run dtype."""

    model: Any  # a transformers PreTrainedModel (causal LM)
    tokenizer: Any  # or None
    dtype: torch.dtype  # what the model and the cache run in


def load_model(model: Any, config: EngineConfig, device: torch.device) -> LoadedModel:
    """The model (and a checkpoint's tokenizer) from a local checkpoint directory, a
    transformers config (random weights seeded by `config.seed`) or a loaded model, and
    the dtype to run it in (see EngineConfig.dtype)."""
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return LoadedModel(model, None, _check_dtype(config.dtype or model.dtype))
    default = torch.float16 if device.type == "cuda" else torch.float32
    if isinstance(model, PretrainedConfig):
        dtype = _check_dtype(config.dtype or default)
        # On CUDA the weights are made on the device in the run dtype: an 8B model built on
        # the host in float32 first takes ~32 GB and minutes. On the host, as before (float32,
        # then cast), so the seeded weights equal transformers' own from_config.
        try:
            hf_model = (seeded_model(model, config.seed, device, dtype) if device.type == "cuda"
                        else seeded_model(model, config.seed))
        except ValueError as e:
            raise InvalidConfigError(f"cannot build a causal LM from {type(model).__name__}: {e}") from None
        return LoadedModel(hf_model, None, dtype)
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise InvalidConfigError(
                f"model {path!r} is not a local checkpoint directory; vattn loads models offline "
                "(local_files_only=True): give a directory written by save_pretrained(), a "
                "transformers config, or a loaded PreTrainedModel")
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                            dtype=config.dtype or "auto")
        except (OSError, ValueError, KeyError) as e:
            raise InvalidConfigError(f"cannot load a causal LM from {path!r}: {e}") from None
        return LoadedModel(hf_model, load_tokenizer(path), run_dtype(hf_model.dtype, config, device))
    raise InvalidConfigError(
        f"model must be a checkpoint directory, a transformers PretrainedConfig or a PreTrainedModel, "
        f"got {type(model).__name__}")


def seeded_model(config: Any, seed: int, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, **kwargs: Any) -> Any:
    """A causal LM from a transformers config with random weights from `seed`, made on
    `device` (default: the host) in `dtype` (default: transformers' float32), with no host
    copy. `config` is copied (the model keeps and edits its own); the global RNGs, the
    device's too, are left as they were. `kwargs`: more `from_config` arguments."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device if device is not None else "cpu")
    gpus = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    if dtype is not None:
        kwargs["dtype"] = dtype
    with torch.random.fork_rng(devices=gpus), dev:  # manual_seed seeds the GPU's generator too
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), **kwargs)


def weights_fingerprint(model: Any) -> bytes:
    """16 bytes that differ between models whose weights differ (the disk tier's salt): a hash
    of every parameter's and buffer's name, dtype, shape and bytes (on CUDA, of two
    position-weighted sums of each tensor's bytes, computed on the device)."""
    h = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8)  # [bytes]
            if raw.device.type == "cpu":
                h.update(memoryview(raw.numpy()))
            else:
                h.update(_device_digest(raw))
    return h.digest()


def _device_digest(raw: torch.Tensor, chunk: int = 1 << 26) -> bytes:
    """Two sums of `raw`'s bytes (`[N]` uint8 on a device), each byte weighted by a function
    of its position, wrapping in int64: a checksum that moves when any byte does."""
    sums = torch.zeros(2, dtype=torch.int64, device=raw.device)
    for start in range(0, raw.numel(), chunk):
        x = raw[start:start + chunk].to(torch.int64) + 1  # [n]
        pos = torch.arange(start, start + x.numel(), dtype=torch.int64, device=raw.device)
        w1 = pos * 0x1E3779B97F4A7C15 % 0x7FFFFFFFFFFFFFE7 + 1
        w2 = (pos ^ 0x5DEECE66D) * 0x2545F4914F6CDD1D % 0x7FFFFFFFFFFFFFC5 + 1
        sums += torch.stack([(x * w1).sum(), (x * x * w2).sum()])
    return b"".join(int(v).to_bytes(8, "little", signed=True) for v in sums.tolist())


def load_tokenizer(path: str) -> Any:
    """A checkpoint directory's tokenizer, or None when it has none (token-id prompts only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:  # noqa: BLE001 - no tokenizer files
        return None


def run_dtype(checkpoint_dtype: torch.dtype | None, config: EngineConfig, device: torch.device) -> torch.dtype:
    """What a checkpoint runs in: config.dtype, else its half type on CUDA, float32 on CPU."""
    dtype = config.dtype
    if dtype is None:
        is_half = checkpoint_dtype in (torch.float16, torch.bfloat16)
        dtype = checkpoint_dtype if device.type == "cuda" and is_half else torch.float32
    return _check_dtype(dtype)


def prefix_salt(model: Any, dtype: torch.dtype) -> bytes:
    """What makes K/V of the same tokens differ between models: the config's class, every
    value of the config, and the dtype the model runs in (the prefix cache's salt)."""
    config = model.config
    h = hashlib.sha256(type(config).__name__.encode())
    h.update(config.to_json_string(use_diff=False).encode())
    h.update(str(dtype).encode())
    return h.digest()


def _check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in MODEL_DTYPES:
        raise InvalidConfigError(f"the model's dtype {dtype} is not supported; pass dtype= one of {MODEL_DTYPES}")
    return dtype


def cache_keyword(forward: Any) -> str:
    """The keyword a transformers `forward` takes its cache by: `cache` from transformers 5.24
    on (`past_key_values` and `cache_params` its deprecated names), `past_key_values` before
    (5.17-5.23), `cache_params` alone in 5.17's Mamba2ForCausalLM (given as past_key_values
    there it was ignored: no state found)."""
    params = inspect.signature(forward).parameters
    return next((n for n in ("cache", "cache_params", "past_key_values") if n in params), "past_key_values")
