"""`EngineConfig`: what `LLM(model, **config)` was asked for."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

import torch

from vattn import checks
from vattn.attention import KERNELS
from vattn.budget import Budget
from vattn.checks import SEED_MAX, SEED_MIN, as_float, as_int
from vattn.config import LAYOUTS, PREFETCH_TOKENS, parse_dtype
from vattn.engine.compile import parse_compile
from vattn.engine.scheduler import SchedulerConfig
from vattn.engine.spec_decode import parse_speculative_config
from vattn.errors import InvalidConfigError
from vattn.idle import delay_seconds
from vattn.prefix_cache import check_offload

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. The cache's own arguments keep `vattn.init`'s names.

    Cache: max_batch_size (slots), max_context_len (None: the model's
    max_position_embeddings, at most 4096), page_size (bytes, None: the backend's),
    layout ('per-layer' | 'fused'), physical_memory (bytes of KV pages at most, None: no
    cap), background / prefetch / prefetch_tokens (pre-mapping, see `vattn.init`).
    Engine: device (None: 'cuda' when available, else 'cpu'), dtype (None: a loaded
    model's own; else float32 on CPU, and on CUDA the checkpoint's float16/bfloat16 or float16), max_num_seqs (None:
    max_batch_size), max_num_batched_tokens (token budget per iteration = the prefill chunk
    size), seed (random weights of a model built from a config, and sampling without a
    per-request seed; an int in [-2**63, 2**64 - 1]), attention (kernel: None = automatic, or one of
    'flash_attn' | 'torch_flash' | 'sdpa' | 'sdpa_padded' | 'flash_attn_4' | 'flex': the host's decodes
    through FlexAttention, `vattn.flex_decode`), enable_prefix_caching (map the cached blocks
    of a new sequence's prefix instead of computing them; a block is the cache's sharing unit, the
    fewest whole tokens that fill whole pages, so any page size works: see `vattn.prefix_cache`;
    with Mamba2 / gated delta-net states, blocks keep state snapshots: `vattn.engine.states`),
    preemption_mode ('recompute' | 'swap': what a sequence preempted for memory does, see
    `vattn.engine.scheduler`), idle_trim_s (None, or seconds without work after which the
    engine gives the cache's unused pages back: `KVCache.trim()`, cached prefixes included;
    more seconds than a timer can wait, `threading.TIMEOUT_MAX` (about 292 years), mean never, as None),
    budget (None, or a `vattn.Budget` shared with other engines, caches and elastic pools:
    the cache creates pages only within it, and pages one engine no longer needs go to
    another that is short; see `KVCache(budget=)`), cuda_graphs (decode iterations replay
    CUDA graphs captured per padded batch size, see `vattn.engine.cuda_graphs`: None = where
    they apply (CUDA, the torch_flash kernel, one rank), True = required (InvalidConfigError
    where they cannot), False = never), compile (the model's forward under `torch.compile`, attention
    one opaque op, see `vattn.engine.compile`: False = eager, True = inductor's default mode, or a
    mode name of `vattn.engine.compile.COMPILE_MODES`; with cuda_graphs the graphs capture the
    compiled forward; not with recurrent states or tensor parallelism), async_scheduling (the host
    schedules iteration N+1 and launches it before it takes N's outputs, N's sampled tokens feeding
    N+1's inputs on the device, so the host's work hides under the device's: None = where it
    hides something (CUDA, one rank), True = always (on the host's CPU, and under tensor
    parallelism where rank 0's tokens reach the other ranks on the host, the same outputs with
    nothing hidden), False = never; see `LLM.step`), cpu_linear (on the host: "auto" = the
    model's linear layers on oneDNN with packed weights where it runs, as vLLM's CPU build does,
    2x transformers' MKL matmul on AMD hosts; "onednn" = required; "default" = transformers'
    `F.linear`: see `vattn.engine.cpu_gemm`).
    Offload tiers under the prefix cache (`vattn.offload`): offload_bytes (None, or bytes of
    host memory for cached blocks evicted from device memory and for swapped-out requests,
    one budget; pinned on CUDA), offload_dir and offload_dir_bytes (a directory, and the
    bytes of files in it, for the blocks evicted from host memory; kept across restarts,
    shareable by processes; needs offload_bytes). They need enable_prefix_caching (a swap-only
    engine may give offload_bytes alone: its swapped-out requests' budget).
    Speculative decoding: speculative_config (None, or vLLM's dict {"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_max": ..., "prompt_lookup_min": ...}: drafts by
    n-gram prompt lookup verified in one forward, see `vattn.engine.spec_decode`; not with
    async_scheduling=True, cuda_graphs=True, tensor parallelism or recurrent states).
    Tensor parallelism (`vattn.engine.parallel`): tensor_parallel_size (ranks the attention
    heads and MLP are split over; > 1 runs under `torchrun --nproc-per-node N`; prefix
    caching and both preemption modes work, their per-rank outcomes agreed between the
    ranks), distributed_timeout_s (seconds a collective may wait
    for the other ranks before it fails: the engine's control messages always, the model's
    all-reduces when vattn creates the process group; on NCCL also how long a rank blocked
    in an all-reduce waits when a peer failed).
    """

    max_batch_size: int = 16
    max_context_len: int | None = None
    page_size: int | None = None
    layout: str = "per-layer"
    physical_memory: int | None = None
    background: bool = True
    prefetch: bool = True
    prefetch_tokens: int = PREFETCH_TOKENS
    device: str | None = None
    dtype: str | torch.dtype | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 1024
    seed: int = 0
    attention: str | None = None
    enable_prefix_caching: bool = False
    preemption_mode: str = "recompute"
    idle_trim_s: float | None = None
    tensor_parallel_size: int = 1
    distributed_timeout_s: float = 300.0
    budget: Any = None  # a vattn.Budget (compared by identity)
    cuda_graphs: bool | None = None
    compile: bool | str = False
    async_scheduling: bool | None = None
    cpu_linear: str = "auto"
    offload_bytes: int | None = None
    offload_dir: str | os.PathLike | None = None
    offload_dir_bytes: int | None = None
    speculative_config: Any = None  # vLLM's dict, parsed into a `vattn.engine.spec_decode.SpecConfig`

    def __post_init__(self) -> None:
        if self.budget is not None and not isinstance(self.budget, Budget):
            raise InvalidConfigError(f"budget must be a vattn.Budget or None, got {self.budget!r}")
        for name in ("max_batch_size", "max_num_batched_tokens", "prefetch_tokens"):
            object.__setattr__(self, name, checks.positive(getattr(self, name), name))
        for name in ("max_context_len", "page_size", "physical_memory", "max_num_seqs"):
            object.__setattr__(self, name, checks.positive(getattr(self, name), name, optional=True))
        checks.one_of(self.layout, "layout", LAYOUTS)
        for name in ("background", "prefetch", "enable_prefix_caching"):
            checks.flag(getattr(self, name), name)
        for name in ("cuda_graphs", "async_scheduling"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise InvalidConfigError(f"{name} must be None, True or False, got {value!r}")
        parse_compile(self.compile)
        checks.one_of(self.cpu_linear, "cpu_linear", ("auto", "onednn", "default"))
        object.__setattr__(self, "device", checks.device(self.device, optional=True))
        if self.dtype is not None:
            dtype = parse_dtype(self.dtype)
            if dtype not in MODEL_DTYPES:
                raise InvalidConfigError(f"dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
            object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "seed", as_int(self.seed, "seed", InvalidConfigError, low=SEED_MIN, high=SEED_MAX,
                                                what="an int in [-2**63, 2**64 - 1] (what torch.manual_seed takes)"))
        if self.idle_trim_s is not None:
            seconds = as_float(self.idle_trim_s, "idle_trim_s", InvalidConfigError,
                               what="None or a finite number of seconds >= 0")
            object.__setattr__(self, "idle_trim_s", delay_seconds(seconds, "idle_trim_s", negative_means_never=False))
        if self.attention is not None and self.attention not in KERNELS:
            raise InvalidConfigError(f"attention must be None or one of {KERNELS}, got {self.attention!r}")
        if self.attention == "flex" and self.device is not None and torch.device(self.device).type != "cpu":
            raise InvalidConfigError("attention='flex' runs on the host (device='cpu'); on CUDA use 'torch_flash' "
                                     "or 'flash_attn', or leave attention=None")
        if self.max_num_seqs is not None and self.max_num_seqs > self.max_batch_size:
            raise InvalidConfigError(
                f"max_num_seqs={self.max_num_seqs} is more than max_batch_size={self.max_batch_size} "
                "(each running sequence holds one cache slot)")
        self._check_parallel()
        self._check_speculative()
        self.scheduler_config()  # validates the token budget and the preemption mode
        self._check_offload()

    def _check_offload(self) -> None:
        values = check_offload(self.offload_bytes, self.offload_dir, self.offload_dir_bytes)
        for name, value in zip(("offload_bytes", "offload_dir", "offload_dir_bytes"), values):
            object.__setattr__(self, name, value)
        if self.offload_bytes is not None and not (self.enable_prefix_caching or self.preemption_mode == "swap"):
            raise InvalidConfigError(
                "offload_bytes holds cached prefix blocks and swapped-out requests: give enable_prefix_caching=True "
                "(or preemption_mode='swap')")
        if self.offload_dir is not None and not self.enable_prefix_caching:
            raise InvalidConfigError("offload_dir holds cached prefix blocks: give enable_prefix_caching=True")

    def _check_speculative(self) -> None:
        spec = parse_speculative_config(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if spec is None:
            return
        for asked, why in ((self.async_scheduling, "async_scheduling=True: drafts are proposed from the tokens the "
                                                    "host has, and the step before's are still on the device; pass "
                                                    "async_scheduling=None or False"),
                           (self.cuda_graphs, "cuda_graphs=True: the verification forwards (1 + k tokens a sequence) "
                                              "are not captured yet; pass cuda_graphs=None or False"),
                           (self.tensor_parallel_size > 1, f"tensor_parallel_size={self.tensor_parallel_size}: the "
                                                           "ranks do not agree on accepted drafts yet; pass "
                                                           "tensor_parallel_size=1")):
            if asked:
                raise InvalidConfigError(f"speculative_config cannot run with {why} (or speculative_config=None)")

    def _check_parallel(self) -> None:
        object.__setattr__(self, "tensor_parallel_size", checks.positive(self.tensor_parallel_size,
                                                                         "tensor_parallel_size"))
        timeout = as_float(self.distributed_timeout_s, "distributed_timeout_s", InvalidConfigError,
                           what="a finite number of seconds > 0")
        if timeout <= 0:
            raise InvalidConfigError(f"distributed_timeout_s must be > 0 seconds, got {self.distributed_timeout_s!r}")
        object.__setattr__(self, "distributed_timeout_s", timeout)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise InvalidConfigError(f"unknown engine argument(s) {unknown}; valid ones: {sorted(names)}")
        return cls(**kwargs)  # type: ignore[arg-type]

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs or self.max_batch_size,
                               max_num_batched_tokens=self.max_num_batched_tokens,
                               preemption_mode=self.preemption_mode)

    def uses_async_scheduling(self) -> bool:
        """Whether the engine schedules asynchronously (`async_scheduling`: None = on CUDA with
        one rank, where the device runs while the host works)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        if self.speculative_config is not None:  # (not with speculative decoding: see _check_speculative)
            return False
        return self.torch_device().type == "cuda" and self.tensor_parallel_size == 1

    def torch_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
