"""The model's forward under `torch.compile` (`EngineConfig.compile`).

Attention is one opaque op (`torch.ops.vattn.attention`, see `vattn.attention`), so inductor
compiles the rest of the transformers model around it (embeddings, norms, rotary, MLP, the
logits) into fused kernels, and the attention runs vattn's kernel on the virtual cache as it
does eagerly.

```
compiled graph:  embed -> [ norm, qkv, rotary | vattn::attention | o_proj, norm, mlp ] x L -> logits
                                              (reads the forward context: slots, starts, plans)
```

Batch sizes: the token count T and the sampled rows S are dynamic sizes (`maybe_mark_dynamic`),
and so are the cache tensors' slot and token dims (engines of other sizes reuse the code).
Dynamo specialises sizes 0 and 1, so a model gets a handful of graphs (a decode of one
sequence, a prompt chunk sampling one row or none, the general one; the CUDA-graph path, which
keeps every row, its own), never one per batch size. CUDA graphs (`EngineConfig.cuda_graphs`)
capture the compiled forward once per padded batch size, as they capture the eager one.
Compiled code is kept for the process on `_logits`, shared by engines of the same model
shapes; past dynamo's `recompile_limit` (8 graphs for all models of a process) compiling
turns off with a warning (`torch._dynamo.reset()` forgets all compiled code).

Compile time: `CompiledForward.compile_s` (seconds of the calls that compiled, their one
forward included) and `num_compiles`, logged at INFO. Inductor caches its compiled code on
disk (its FX graph and AOTAutograd caches, on by default, in `TORCHINDUCTOR_CACHE_DIR`, by
default `/tmp/torchinductor_<user>`), so a later process with the same model shapes skips
inductor's code generation and C++/Triton builds; dynamo's tracing runs in every process.

A compile that fails turns compiling off for the engine with a warning, and the iteration
runs eagerly: compiling never changes what is served.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import torch

from vattn.compiling import raise_past_recompile_limit
from vattn.errors import InvalidConfigError

logger = logging.getLogger(__name__)

# what EngineConfig.compile takes besides True / False: inductor's modes without its own CUDA graphs
# (vattn captures the decode itself, `cuda_graphs=`, where the cache's addresses are known not to move)
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")


class CompileSettings(Protocol):
    """What `compile_mode` reads of an `EngineConfig` (a protocol, so that this module, which
    `vattn.engine.config` imports to check `compile=`, does not import it back)."""

    @property
    def compile(self) -> bool | str: ...

    @property
    def tensor_parallel_size(self) -> int: ...


def compile_mode(config: CompileSettings, has_states: bool = False) -> str | None:
    """Inductor's mode for `config.compile`, or None (eager). Raises InvalidConfigError for a
    value it does not take, and for what it does not cover: a model with recurrent states
    (their mixers run per request in Python, `vattn.engine.states`) and tensor parallelism."""
    mode = parse_compile(config.compile)
    if mode is not None and (has_states or config.tensor_parallel_size > 1):
        what = "models with recurrent states" if has_states else "tensor parallelism"
        raise InvalidConfigError(f"compile={config.compile!r} does not cover {what} yet; pass compile=False "
                                 "(they run eagerly)")
    return mode


def parse_compile(value: bool | str) -> str | None:
    """`EngineConfig.compile` -> inductor's mode, or None (eager). Raises InvalidConfigError."""
    if value is False:
        return None
    if value is True:
        return "default"
    if isinstance(value, str) and value in COMPILE_MODES:
        return value
    hint = ("; vattn captures CUDA graphs itself (cuda_graphs=), compose them with compile=True"
            if value in ("reduce-overhead", "max-autotune") else "")
    raise InvalidConfigError(f"compile must be True, False or one of {COMPILE_MODES}, got {value!r}{hint}")


def _logits(model: Any, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | int) -> torch.Tensor:
    """What is compiled: the model an argument, so that dynamo's compiled code (kept on this
    function's code object, for the process) holds no engine and serves every engine of the same
    model shapes."""
    return model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=keep).logits[0]  # [S, V]


class _Inductor:
    """Inductor in one mode, counting the graphs it compiles. One per mode for the process:
    dynamo reuses compiled code only for the backend that compiled it."""

    def __init__(self, mode: str) -> None:
        self.mode, self.patches = mode, torch._inductor.list_mode_options(mode)
        self.num_graphs = 0

    def __repr__(self) -> str:
        return f"inductor (mode {self.mode!r})"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._inductor.compile_fx import compile_fx

        self.num_graphs += 1
        return compile_fx(gm, example_inputs, config_patches=self.patches)


def _why(e: BaseException) -> str:
    """An exception's first line, and that of the one at the root of its causes."""
    def line(x: BaseException) -> str:
        text = str(x).strip()
        return f"{type(x).__name__}: {text.splitlines()[0]}" if text else type(x).__name__

    root = e
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:  # dynamo's: inner_exception
        root = inner
    return line(e) if root is e else f"{line(e)} ({line(root)})"


# what a call raises when dynamo or inductor could not compile (not the model failing at run time)
_COMPILE_ERRORS = tuple(getattr(torch._dynamo.exc, name) for name in ("TorchDynamoException", "FailOnRecompileLimitHit")
                        if hasattr(torch._dynamo.exc, name))

_compiled: dict[str, tuple[_Inductor, Any]] = {}  # mode -> (its backend, torch.compile(_logits) with it)


def _compiled_logits(mode: str) -> tuple[_Inductor, Any]:
    if mode not in _compiled:
        backend = _Inductor(mode)
        _compiled[mode] = (backend, torch.compile(_logits, backend=backend, dynamic=None))
    return _compiled[mode]


class CompiledForward:
    """`model(input_ids, position_ids, logits_to_keep).logits[0]` under `torch.compile`.

    Call it inside a vattn forward context, like the eager model. `num_graphs` counts the
    graphs inductor compiled in this engine's calls (more than `num_compiles`, the calls that
    compiled, means the model broke its graph). Code compiled for another engine of the same
    model shapes is reused: then nothing compiles."""

    def __init__(self, model: Any, mode: str, caches: list[torch.Tensor]) -> None:
        self.model, self.mode = model, mode
        for cache in caches:  # [B, T_max, H_kv, D]: engines of other sizes reuse the code
            torch._dynamo.maybe_mark_dynamic(cache, 0)
            torch._dynamo.maybe_mark_dynamic(cache, 1)
        self.num_compiles = 0  # calls that compiled something
        self.num_graphs = 0  # graphs handed to inductor in those calls
        self.compile_s = 0.0  # seconds of the calls that compiled (their forward included)
        self.disabled_reason: str | None = None
        self._backend, self._fn = _compiled_logits(mode)

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor | int) -> torch.Tensor:
        """ids, positions `[1, T]`, keep `[S]` (or 0: every row). Returns logits `[S, V]`;
        eagerly once compiling failed."""
        if self.disabled_reason is not None:
            return _logits(self.model, ids, positions, keep)
        torch._dynamo.maybe_mark_dynamic(ids, 1)  # T: a dynamic size from the first call with T >= 2
        torch._dynamo.maybe_mark_dynamic(positions, 1)
        if isinstance(keep, torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(keep, 0)
        graphs, t0 = self._backend.num_graphs, time.perf_counter()
        try:
            with raise_past_recompile_limit():  # never eager while counted compiled
                out = self._fn(self.model, ids, positions, keep)
        except _COMPILE_ERRORS as e:
            self.disable(_why(e))  # eagerly from now on
            return _logits(self.model, ids, positions, keep)
        new = self._backend.num_graphs - graphs
        if new:
            dt = time.perf_counter() - t0
            self.num_compiles += 1
            self.num_graphs += new
            self.compile_s += dt
            logger.info("vattn: compiled the forward of %d tokens (%d graph(s), mode %s) in %.2f s",
                        ids.shape[1], new, self.mode, dt)
        return out

    def disable(self, reason: str) -> None:
        """Run eagerly from now on."""
        if self.disabled_reason is None:
            logger.warning("vattn: torch.compile is off for this engine: %s", reason)
            self.disabled_reason = reason


__all__ = ["CompiledForward", "compile_mode", "parse_compile", "COMPILE_MODES"]
