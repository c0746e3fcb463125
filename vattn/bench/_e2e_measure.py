"""What the end-to-end part (`vattn.bench._e2e`) measures with: the device's memory peaks and
free bytes, its copy bandwidth and a decode step's bytes (`decode_bound`: the bandwidth bound
of a decode step), logits compared (`logits_diff`), and `StepTimer`, the engine's time outside
the forward per decode iteration."""
from __future__ import annotations

import time
from typing import Any

import torch

from vattn.report import percentile

from ._common import sync as _sync

MB, GB = 1 << 20, 1 << 30


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_reserved(device: str) -> float | None:
    return torch.cuda.max_memory_reserved() / GB if device.startswith("cuda") else None


def free_bytes(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def copy_bandwidth(device: str, mib: int | None = None, repeats: int = 10) -> float:
    """The device's memory bandwidth as a copy measures it, bytes/s: 2 x bytes (read and written)
    over the best time of `repeats` copies of a `mib` MiB buffer (default 1 GiB on CUDA, 256 MiB
    on the host: past the caches)."""
    mib = mib or (1024 if device.startswith("cuda") else 256)
    src = torch.empty(mib * MB, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first copy touches dst's pages: a warm-up
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def decode_bytes(model: Any, B: int, context: float) -> dict[str, float]:
    """The bytes one decode step of B sequences at `context` tokens each must read: the weights
    (not an untied input embedding, of which a step reads B rows) and the K/V of the batch."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    if not c.tie_word_embeddings:
        weights -= embed.numel() * embed.element_size()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * embed.element_size()  # K and V
    return dict(weights=float(weights), kv=float(B * context * per_token))


def decode_bound(model: Any, B: int, context: float, copy_Bps: float, systems: dict[str, Any]) -> dict[str, Any]:
    """The decode step's bandwidth bound (`decode_bytes` over the copy bandwidth) and each vattn
    system's median decode step and forward (`--engine-overhead`) against it."""
    nbytes = decode_bytes(model, B, context)
    bound_ms = 1e3 * (nbytes["weights"] + nbytes["kv"]) / copy_Bps
    out: dict[str, Any] = dict(bound_ms=bound_ms, weights_GiB=nbytes["weights"] / GB, kv_GiB=nbytes["kv"] / GB,
                               context=context)
    for system, s in systems.items():
        eo = s.get("engine_overhead")
        if eo:
            out[system] = dict(step_over_bound=eo["step_ms_median"] / bound_ms,
                               forward_over_bound=eo["forward_ms_median"] / bound_ms)
    return out


def logits_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    x = torch.stack([t.float().cpu() for t in a])
    y = torch.stack([t.float().cpu() for t in b])
    top2 = y.topk(2, dim=-1).values  # [B, 2]: the reference's two best logits of each row
    gap = top2[:, 0] - top2[:, 1]  # [B]: how near a tie each row's greedy choice is
    diff = (x - y).abs().amax(-1)  # [B]
    return dict(max_abs_diff=float(diff.max()), logits_abs_max=float(y.abs().max()),
                argmax_equal=float((x.argmax(-1) == y.argmax(-1)).float().mean()),
                top2_gap_median=float(gap.median()),
                # rows whose top-2 gap is under twice their difference: a greedy choice numerics may flip
                near_ties=float((gap < 2 * diff).float().mean()))


class StepTimer:
    """The engine's time outside the model's forward, per decode iteration, and where the
    host's part of it goes (host time of the scheduler, the cache's step, sampling, taking the
    outputs). Installed on one engine; `uninstall` puts its methods back.

    On the host (CPU): `LLM._step`'s wall time against the forward inside it (the eager
    `ModelRunner._forward`): the host's time per iteration outside the forward.
    On CUDA: the GPU's idle time between two decode forwards, from CUDA events recorded on the
    stream around each forward (the eager `ModelRunner._forward` or a CUDA graph's replay);
    nothing is synchronized, so asynchronous scheduling keeps its overlap while it is measured.
    A step is the time from one decode forward's start to the next's; outside the forward is
    the time from one's end to the next's start (sampling, copies, and the GPU waiting for the
    host)."""

    def __init__(self, llm: Any, device: str) -> None:
        self.llm, self.cuda = llm, device.startswith("cuda")
        self.steps: list[dict[str, Any]] = []  # per step(): seconds of the step and of each host part
        self.forwards: list[tuple[Any, Any]] = []  # CUDA: (start, end) events of every forward, in order
        self._now: dict[str, Any] = {}
        runner = llm.runner
        parts = {"forward": [(runner, "_forward")] + ([(runner.graphs, "_replay")] if runner.graphs else []),
                 "schedule": [(llm.scheduler, "schedule")], "cache_step": [(runner.cache, "step")],
                 "sample": [(runner.sampler, "sample")], "outputs": [(llm, "_postprocess")]}
        self._patched = [(llm, "_step")]
        llm._step = self._wrap(llm._step, "step")
        for part, targets in parts.items():
            for obj, name in targets:
                setattr(obj, name, self._wrap(getattr(obj, name), part))
                self._patched.append((obj, name))

    def _wrap(self, fn: Any, part: str) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            if part == "step":
                self._now = {}
            if part == "forward" and self.cuda:  # on the stream: nothing waits for it
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    return fn(*a, **kw)
                finally:
                    end.record()
                    self.forwards.append((start, end))
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self._now[part] = self._now.get(part, 0.0) + time.perf_counter() - t0
                if part == "step":
                    self.steps.append(self._now)
        return timed

    def uninstall(self) -> None:
        for obj, name in self._patched:
            obj.__dict__.pop(name, None)  # the class's method again

    def summary(self, skip: int = 1) -> dict[str, Any]:
        """Figures of the iterations after the first `skip` (the prefill): medians in ms, and
        the share of the decode steps' time spent outside the forward."""
        its = [d for d in self.steps[skip:] if d.get("forward", 0) > 0]  # steps that launched a forward
        if not its:
            return {}
        if self.cuda:
            torch.cuda.synchronize()
            pairs = list(zip(self.forwards[skip:], self.forwards[skip + 1:]))  # consecutive decode forwards
            steps = [a[0].elapsed_time(b[0]) / 1e3 for a, b in pairs]  # start to next start
            forward = [a[0].elapsed_time(a[1]) / 1e3 for a, _ in pairs]
            out = [a[1].elapsed_time(b[0]) / 1e3 for a, b in pairs]  # the GPU between them
            method = "CUDA events: the GPU's time between decode forwards"
        else:
            steps, forward = [d["step"] for d in its], [d["forward"] for d in its]
            out = [s - f for s, f in zip(steps, forward)]
            method = "host wall time of step() less its forward"
        if not steps:
            return {}
        res = dict(method=method, iterations=len(steps), step_ms_median=median_ms(steps),
                   forward_ms_median=median_ms(forward), outside_ms_median=median_ms(out),
                   outside_share=sum(out) / sum(steps))  # all iterations together
        for part in ("schedule", "cache_step", "sample", "outputs"):  # the host's, per step()
            res[f"{part}_ms_median"] = median_ms([d.get(part, 0.0) for d in its])
        return res


def median_ms(xs: list[float]) -> float:
    return 1e3 * percentile(xs, 50, interpolate=False)  # one that happened
