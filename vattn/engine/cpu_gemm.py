"""The host's linear layers on oneDNN with packed weights, as vLLM's CPU build runs them.

transformers' `nn.Linear` calls `F.linear`, which on the host is MKL's sgemm: on this repo's
AMD EPYC CI machine 2.0-2.5x slower than oneDNN's matmul with its weights reordered once into
oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight` and
`_linear_pointwise`, the ops inductor's CPU freezing pass emits), measured at the shapes of
`vattn bench throughput`'s model (hidden 512, batches of 7 to 1024 rows), one thread. vLLM's
CPU backend packs its linear weights for oneDNN the same way; `vattn bench peers` found the
prefill GEMMs the largest part of the gap to it.

`pack_linears(model)` packs every float32 / bfloat16 `nn.Linear` of a model on the host and
routes its forward through the packed weight when the input has at least `MIN_ROWS` rows (a
single row is a matrix-vector product, where MKL's gemv is as fast or faster); `unpack()`
puts the layers back (the engine's close). The results are oneDNN's: equal to `F.linear`
within float rounding (a self-test at packing checks 1e-4 relative), not bit for bit, like
vLLM's. The packed copy of the weights is extra memory (as large as the linear weights);
`LLM(cpu_linear="default")` keeps transformers' `F.linear`. A layer whose weight changes
after packing keeps the packed (old) weight until the engine closes.

Sibling projections of one input run as one matmul, as vLLM's `qkv_proj` and `gate_up_proj`
do: `FUSED` names them (a transformers attention's q/k/v, an MLP's gate/up). Their weights
are packed as one `[sum(out), in]` matrix; the first of them to be called on an input computes
every sibling's rows and keeps the others' for their calls on the *same* tensor object (the
model calls them one after another on one `hidden_states`); a call on any other input computes
afresh. A call's result is a column slice of the fused output (a view, last dim contiguous).
Fewer, wider GEMMs read the input once and cost less per call (at the throughput model's
shapes, one thread: 6.1 -> 5.8 ms a decode step's 8 layers at 16 rows, 48.7 -> 46.7 ms at 256).
"""
from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger("vattn.engine")

MIN_ROWS = 2  # rows (tokens) from which the packed matmul runs: one row is a gemv
CPU_LINEAR = ("auto", "onednn", "default")
# sibling linears of one module that a model calls on the same input: packed and run as one matmul
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def onednn_available() -> bool:
    """Whether this torch has oneDNN's packed linear ops (the x86 CPU builds do)."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def _on_f_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a packed layer runs `x` through F.linear: under torch.compile (another engine
    compiling the same model object, e.g. the e2e bench's eager and compiled engines side by
    side: inductor lowers F.linear itself, and its oneDNN lowering asserts on a packed weight
    that is not a graph constant), another dtype, one row (a gemv), or autograd."""
    return torch.compiler.is_compiling() or x.dtype != weight.dtype or x.numel() < MIN_ROWS * x.shape[-1] \
        or x.requires_grad


def _packable(module: Any, dtype: torch.dtype) -> bool:
    """A plain `nn.Linear` of the host in `dtype`."""
    return type(module) is torch.nn.Linear and module.weight.device.type == "cpu" and module.weight.dtype == dtype


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> Callable:
    def forward(x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out]
        if _on_f_linear(x, weight):
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return forward


class _Fused:
    """Sibling linears packed as one weight; `forward(i)` is member i's forward.

    `stash` keeps the last input and the members' outputs not yet taken, so each sibling
    called on that same tensor gets its slice without another matmul."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> None:
        self.weights, self.biases = weights, biases
        self.sizes = [w.shape[0] for w in weights]
        self.bias = None if biases[0] is None else torch.cat(biases)  # all or none (checked by the caller)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat(weights), None)  # [sum(out), in]
        self.stash: tuple[torch.Tensor, list[torch.Tensor | None]] | None = None

    def forward(self, i: int) -> Callable:
        w, b = self.weights[i], self.biases[i]

        def forward(x: torch.Tensor) -> torch.Tensor:  # x: [..., in] -> [..., out_i]
            if _on_f_linear(x, w):
                return F.linear(x, w, b)
            stash = self.stash
            if stash is not None and stash[0] is x and stash[1][i] is not None:
                part, stash[1][i] = stash[1][i], None
                if all(p is None for p in stash[1]):
                    self.stash = None  # every sibling served: drop the input and the outputs
                return part
            parts: list[torch.Tensor | None] = list(torch.ops.mkldnn._linear_pointwise(
                x, self.packed, self.bias, "none", [], "").split(self.sizes, dim=-1))
            part, parts[i] = parts[i], None
            self.stash = (x, parts)
            return part
        return forward


def _fused_groups(model: Any, dtype: torch.dtype) -> list[list[torch.nn.Linear]]:
    """`FUSED`'s sibling sets in `model`: same input width, dtype and bias presence."""
    groups = []
    for module in model.modules():
        for names in FUSED:
            members = [getattr(module, n, None) for n in names]
            if not all(_packable(m, dtype) for m in members):
                continue
            if len({m.in_features for m in members}) == 1 and len({m.bias is None for m in members}) == 1:
                groups.append(members)
    return groups


def _self_test(dtype: torch.dtype) -> str | None:
    """Why the packed matmul cannot stand in for F.linear here (None: it can)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).to(dtype)
    x = torch.randn(5, 64, generator=g).to(dtype)
    try:
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, None), None,
                                                "none", [], "")
    except RuntimeError as e:
        return f"oneDNN's linear failed: {e}"
    ref = F.linear(x.float(), w.float())
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = float((y.float() - ref).abs().max() / ref.abs().max())
    return None if err <= tol else f"oneDNN's linear differs from F.linear by {err:.2g} (relative)"


class PackedLinears:
    """The linear layers of a model routed through oneDNN packed weights (`unpack()` undoes it)."""

    def __init__(self, model: Any, dtype: torch.dtype) -> None:
        self.modules: list[torch.nn.Module] = []
        self.bytes = 0
        self.fused = 0  # sibling sets run as one matmul (`FUSED`)
        with torch.no_grad():
            grouped = set()
            for members in _fused_groups(model, dtype):
                fused = _Fused([m.weight.detach() for m in members],
                               [None if m.bias is None else m.bias.detach() for m in members])
                for i, m in enumerate(members):
                    m.forward = fused.forward(i)  # an instance attribute: unpack() deletes it
                    self.modules.append(m)
                    self.bytes += m.weight.numel() * m.weight.element_size()
                    grouped.add(id(m))
                self.fused += 1
            for module in model.modules():
                if not _packable(module, dtype) or id(module) in grouped:
                    continue
                w = module.weight.detach()
                packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
                bias = None if module.bias is None else module.bias.detach()
                module.forward = _packed_forward(w, bias, packed)  # an instance attribute: unpack() deletes it
                self.modules.append(module)
                self.bytes += w.numel() * w.element_size()

    def unpack(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
        self.modules = []


def pack_linears(model: Any, dtype: torch.dtype, device: torch.device, setting: str) -> PackedLinears | None:
    """Pack `model`'s linear layers for oneDNN when `setting` asks for it ("auto": on the host
    for float32 / bfloat16 where oneDNN passes its self-test; "onednn": the same, and an error
    if it cannot; "default": never). None when nothing was packed."""
    from vattn.errors import InvalidConfigError

    if setting not in CPU_LINEAR:
        raise InvalidConfigError(f"cpu_linear must be one of {CPU_LINEAR}, got {setting!r}")
    if setting == "default" or device.type != "cpu":
        return None
    why = None
    if dtype not in (torch.float32, torch.bfloat16):
        why = f"the model's dtype is {dtype} (oneDNN's packed linear: float32 or bfloat16)"
    elif not onednn_available():
        why = "this torch has no oneDNN (torch.backends.mkldnn)"
    else:
        why = _self_test(dtype)
    if why is not None:
        if setting == "onednn":
            raise InvalidConfigError(f"cpu_linear='onednn' cannot run here: {why}; use cpu_linear='default'")
        logger.info("vattn: the host's linear layers stay on F.linear: %s", why)
        return None
    packed = PackedLinears(model, dtype)
    return packed if packed.modules else None
