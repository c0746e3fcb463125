"""End-to-end decode throughput: `vattn.LLM` against transformers' `generate` and its
continuous batching (`generate_batch`), same device, model, weights and requests.
Part of `vattn bench gpu` (not a command of its own).

Models (random weights made directly on the GPU in bf16; no checkpoint, no tokenizer):
- `llama-3.2-1b`: hidden 2048, 16 layers, 32 heads, 8 KV heads x 64, intermediate 8192,
  vocab 128256, tied embeddings;
- `llama-3-8b`: hidden 4096, 32 layers (`--layers-8b`), 32 heads, 8 KV heads x 128,
  intermediate 14336, vocab 128256.
For each batch size, `batch` prompts of `--prompt-len` random tokens, greedy, exactly
`--max-tokens` new tokens (no EOS: the configs have none). Each system runs the batch twice,
for 1 and for N new tokens, after a small warm-up; decode tokens/s = batch x (N - 1) /
(t_N - t_1), which takes the prefill and fixed costs out; every system also
`decode_tok_s_in_run`: B x (N - 1) over the time, inside the N-token run, from the
last first token to the last token (vattn's request metrics, the continuous-batching
manager's token timestamps, generate's streamer calls), the figure the table shows first
and the plot shows (t_N - t_1 where it is missing). vattn runs with its default
pages (the 2 MiB granularity) and prefills the whole batch in one iteration; transformers'
continuous batching is one manager per batch size (`init_continuous_batching`, started
once for the three runs), with a cache sized for the batch and without CUDA graphs (like
the other two; `--hf-cb-cuda-graphs` to allow them).

Also recorded: greedy agreement with `generate` (fraction of equal tokens, and of the common
prefix), the max abs difference of the first token's logits (vattn's engine vs one
transformers forward with SDPA), peak `torch.cuda.memory_reserved` per system, vattn's
peak mapped bytes, and that vattn's pages come back: after the requests finish the pages
stay mapped to their free slots (deferred reclamation, used bytes 0), and `close()` returns
them to the GPU (free memory rises by the bytes of the pages created).

`--compile`: one more vattn system, `vattn_compiled` (`compile=True`: the model's forward
under `torch.compile` with attention one opaque op, captured by vattn's CUDA graphs where they
apply), with its compile time (`compile`: seconds of the calls that compiled, compiles, graphs),
its tokens against eager vattn's and generate's, and its first-token logits against
transformers'. The bandwidth bound of a decode step (`bound`): the bytes a decode step must
read (the weights, less an untied input embedding of which it reads B rows, plus the K/V of the
batch at the mean decode context, prompt + N/2) over the device-to-device copy bandwidth
measured in the same run (`copy_GBps`, 2 x bytes / time of a large `copy_`); with
`--engine-overhead` every vattn system's decode step and forward are given against it.
`--compile --rounds R` (a shared machine): eager and compiled vattn open together, stepping in
turn through R runs of the batch, the ratio of each pair of decode steps (`interleaved`).

`--engine-overhead`: the engine's time outside the forward per decode iteration (`StepTimer`):
on CUDA the GPU's idle time between two decode forwards, from events on the stream (nothing
synchronized: asynchronous scheduling keeps its overlap); on the host the wall time of a step
less its forward. `--compare-async`: one more vattn system with the other `async_scheduling`
than the default (`vattn_sync` on CUDA, where the default schedules asynchronously; `vattn_async`
on the host), its tokens against vattn's (they must be equal); with `--rounds R` also the two
open together and stepping in turn (`interleaved_async`: the ratio async / sync of each pair of
decode steps, of the step, the forward and the time outside it).

`--device cpu` runs the same code with a tiny model (host backend, float32); `llama-512x8` (the
`vattn bench throughput` model: hidden 512, 8 layers, GQA 8/4, vocab 32000) keeps its shape
on the CPU too.

    vattn bench gpu   (runs this with the other GPU benchmarks)
"""
from __future__ import annotations

import argparse
import time
import traceback
from typing import Any

import torch

from ._common import agreement, progress
from ._common import sync as _sync
from vattn.integrations.hf_cb import memory_problem
from vattn.report import percentile

from ._models import build_model, cb_config, llama_config

NAME = "e2e"
HELP = "end-to-end decode throughput: vattn.LLM vs transformers generate and generate_batch"
NEEDS_GPU = True

MB, GB = 1 << 20, 1 << 30
RESULT_TIMEOUT_S = 60  # transformers' continuous batching: longest wait with no result at all
ASYNC_SYSTEMS = ("vattn_sync", "vattn_async")  # --compare-async: vattn with the other async_scheduling
GPU_KERNELS = ("flash_attn", "torch_flash")  # vattn's CUDA kernels; "sdpa" on CUDA means the kernel fell back
MODELS = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
# keeps its shape on the CPU (the others are TINY there): vattn bench throughput's model
HOST_MODELS = {"llama-512x8": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                                   num_key_value_heads=4, head_dim=64, tie_word_embeddings=False)}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, tie_word_embeddings=False)


def model_config(name: str, args: argparse.Namespace) -> Any:
    cuda = args.device.startswith("cuda")
    if name in HOST_MODELS:
        return llama_config(vocab_size=32000, max_position_embeddings=4096, **HOST_MODELS[name])
    shape = dict(MODELS[name]) if cuda else dict(TINY)
    if cuda and name == "llama-3-8b" and args.layers_8b:
        shape["num_hidden_layers"] = args.layers_8b
    return llama_config(vocab_size=128256 if cuda else 512, max_position_embeddings=8192 if cuda else 1024, **shape)


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


def _reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_reserved(device: str) -> float | None:
    return torch.cuda.max_memory_reserved() / GB if device.startswith("cuda") else None


def _free_bytes(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


# ------------------------------------------------------------------------- vattn ----
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


def run_vattn(model: Any, prompts: list[list[int]], args: argparse.Namespace, dtype: torch.dtype,
              cuda_graphs: bool | None = None, system: str = "vattn", compile: bool | str = False,
              async_scheduling: bool | None = None) -> dict:
    from vattn import LLM, SamplingParams

    B, P, N = len(prompts), len(prompts[0]), args.max_tokens
    out: dict[str, Any] = {"system": system}
    llm = LLM(model, device=args.device, dtype=dtype, max_batch_size=B, max_context_len=P + N,
              max_num_batched_tokens=max(B * P, B), layout=args.layout, page_size=args.page_size,
              cuda_graphs=cuda_graphs, compile=compile, async_scheduling=async_scheduling)
    out["async_scheduling"] = llm.async_scheduling
    try:
        first_logits: dict[int, torch.Tensor] = {}
        sampler = llm.runner.sampler
        sample = sampler.sample

        def capture(logits: torch.Tensor, seq_ids: list, params: list, **history: Any) -> Any:
            for i, sid in enumerate(seq_ids):
                rid = sid[0] if isinstance(sid, tuple) else sid  # (request id, sample index)
                if rid not in first_logits:
                    first_logits[rid] = logits[i].detach().float().clone()  # [V], stays on the device
            return sample(logits, seq_ids, params, **history)

        sampler.sample = capture

        def run(n_new: int, prompts: list[list[int]]) -> tuple[float, list[list[int]], list[int], int, Any]:
            params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
            _sync(args.device)
            t0 = time.perf_counter()
            ids = [llm.add_request(p, params) for p in prompts]
            done: dict[int, Any] = {}
            peak = 0
            while llm.has_unfinished():
                for o in llm.step():
                    if o.finished:
                        done[o.request_id] = o
                peak = max(peak, llm.memory_stats().mapped_bytes)
            _sync(args.device)
            dt = time.perf_counter() - t0
            window = (max(done[i].metrics.finished_time for i in ids)
                      - max(done[i].metrics.first_token_time for i in ids))
            return dt, [done[i].token_ids for i in ids], ids, peak, window

        run(2, prompts[:2])  # warm-up: kernels, the first-call check of the attention kernel
        graphs, compiled = llm.runner.graphs, llm.runner.compiled
        if graphs is not None or compiled is not None:  # captures and compiles of this batch size, not timed
            run(3, prompts)
        first_logits.clear()
        t1 = run(1, prompts)[0]
        first_logits.clear()
        _reset_peak(args.device)
        tn, tokens, ids, peak_mapped, window = run(N, prompts)
        out.update(t1_s=t1, tN_s=tn, tokens=tokens, decode_window_s=window, peak_reserved_GiB=_peak_reserved(args.device),
                   peak_mapped_GiB=peak_mapped / GB, kernel=llm.runner.kernel.name, page_KiB=llm.cache.page_size // 1024,
                   first_logits=[first_logits[i] for i in ids])
        if compiled is not None:
            out["compile"] = dict(mode=compiled.mode, compile_s=compiled.compile_s, compiles=compiled.num_compiles,
                                  graphs=compiled.num_graphs, disabled=compiled.disabled_reason)
        if graphs is not None:
            out["cuda_graphs"] = dict(replays=graphs.num_replays, captured_sizes=graphs.captured_sizes,
                                      capture_s=graphs.capture_s, disabled=graphs.disabled_reason)
        if args.engine_overhead:  # a run of its own: its synchronizations would slow the timed one
            timer = StepTimer(llm, args.device)
            try:
                run(N, prompts)
            finally:
                timer.uninstall()
            out["engine_overhead"] = timer.summary()
        st = llm.memory_stats()  # all finished: pages stay with their free slots
        created = st.num_created_pages * st.group_bytes
        out["after_finish"] = dict(mapped_MiB=st.mapped_bytes / MB, used_MiB=st.used_bytes / MB,
                                   cached_MiB=st.num_cached_pages * st.group_bytes / MB, active=st.num_active,
                                   created_MiB=created / MB)
        free0 = _free_bytes(args.device)
        llm.close()
        free1 = _free_bytes(args.device)
        if free0 is not None and free1 is not None:
            released = free1 - free0
            # a page group is 32 (1B) or 64 (8B) pages of 2 MiB: a slack of one group would pass with nothing back
            out["after_close"] = dict(gpu_free_rose_MiB=released / MB, created_MiB=created / MB,
                                      pages_returned=abs(released - created) <= max(8 * MB, 0.05 * created))
    finally:
        _sync(args.device)
        llm.close()
    return out


def interleaved(model: Any, prompts: list[list[int]], args: argparse.Namespace, dtype: torch.dtype,
                variants: dict[str, dict[str, Any]]) -> dict:
    """Two vattn engines on a shared machine (`variants`: name -> LLM arguments, the first the
    baseline; e.g. eager and compiled, or synchronous and asynchronous scheduling): both open at
    once (the same model and requests, the default CUDA graphs), warmed up, then `--rounds`
    rounds in which they take turns step by step, each step timed by `StepTimer` (host time:
    meant for the CPU, where one engine's step cannot overlap the other's). The ratio other /
    baseline of each pair of decode steps taken one after the other, and its median: a load
    that comes and goes falls on both steps of a pair, not on one engine's whole run."""
    from vattn import LLM, SamplingParams

    B, P, N = len(prompts), len(prompts[0]), args.max_tokens
    kw = dict(device=args.device, dtype=dtype, max_batch_size=B, max_context_len=P + N,
              max_num_batched_tokens=max(B * P, B), layout=args.layout, page_size=args.page_size)
    (base, base_kw), (other, other_kw) = variants.items()
    engines = {base: LLM(model, **kw, **base_kw)}
    try:
        engines[other] = LLM(model, **kw, **other_kw)
        for llm in engines.values():  # warm-up: kernels, compiles, captures of this batch size
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        timers = {name: StepTimer(llm, args.device) for name, llm in engines.items()}
        try:
            decode: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
            params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    timers[name].steps.clear()
                    for p in prompts:
                        llm.add_request(p, params)
                while any(llm.has_unfinished() for llm in engines.values()):
                    for llm in engines.values():  # one step each, in turn
                        llm.step()
                for name in engines:  # the decode steps: after the prefill, each with a forward
                    decode[name] += [d for d in timers[name].steps[1:] if d.get("forward", 0) > 0]
        finally:
            for timer in timers.values():
                timer.uninstall()
        pairs = list(zip(decode[base], decode[other]))

        def med(xs: list[float]) -> float:
            return percentile(xs, 50, interpolate=False)

        def outside(d: dict[str, float]) -> float:
            return d["step"] - d["forward"]

        res = dict(rounds=args.rounds, steps=len(pairs), baseline=base, other=other,
                   step_ms={n: 1e3 * med([d["step"] for d in ds]) for n, ds in decode.items()},
                   forward_ms={n: 1e3 * med([d["forward"] for d in ds]) for n, ds in decode.items()},
                   outside_ms={n: 1e3 * med([outside(d) for d in ds]) for n, ds in decode.items()},
                   step_ratio_median=med([o["step"] / b["step"] for b, o in pairs]),
                   forward_ratio_median=med([o["forward"] / b["forward"] for b, o in pairs]),
                   outside_ratio_median=med([outside(o) / outside(b) for b, o in pairs]))
        compiled = engines[other].runner.compiled
        if compiled is not None:
            res.update(compile_s=compiled.compile_s, compiles=compiled.num_compiles, disabled=compiled.disabled_reason)
        return res
    finally:
        for llm in engines.values():  # in the order they were made: the first puts the model's attention back
            llm.close()


# ------------------------------------------------------------------ transformers ----
def _gen_config(n_new: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)


def run_hf_generate(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    ids = torch.tensor(prompts, device=args.device)  # [B, P], equal lengths: no padding
    mask = torch.ones_like(ids)
    P = ids.shape[1]

    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        """Host time of each `put`: the prompt, then each step's new tokens (generate syncs every step)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: Any) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def run(n_new: int, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, torch.Tensor, float | None]:
        stamps = Stamps()
        _sync(args.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            seqs = model.generate(input_ids=ids, attention_mask=mask, generation_config=_gen_config(n_new),
                                  streamer=stamps)
        _sync(args.device)
        window = stamps.times[-1] - stamps.times[1] if len(stamps.times) == n_new + 1 else None
        return time.perf_counter() - t0, seqs, window

    run(2, ids[:2], mask[:2])
    t1 = run(1, ids, mask)[0]
    _reset_peak(args.device)
    tn, seqs, window = run(args.max_tokens, ids, mask)
    out = dict(system="hf_generate", t1_s=t1, tN_s=tn, tokens=seqs[:, P:].tolist(), decode_window_s=window,
               peak_reserved_GiB=_peak_reserved(args.device))
    with torch.inference_mode():  # the first token's logits, one forward with the model's own attention
        out["first_logits"] = list(model(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1].float())
    return out


def _cb_config(B: int, P: int, N: int, cuda_graphs: bool) -> Any:
    """A continuous-batching config sized for this batch: blocks of transformers' default 256
    tokens (named `block_size` on 5.17, `page_size` on 5.18+: see `cb_config`)."""
    tokens_per_block = 256
    return cb_config(tokens_per_block, num_blocks=B * -(-(P + N) // tokens_per_block) + 8,
                     max_batch_tokens=max(B * P, 256), use_cuda_graph=cuda_graphs)


def run_hf_cb(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """transformers' continuous batching through one manager for all runs of this batch (as
    `generate_batch` does inside, without starting and stopping a manager per run, which is a
    fixed cost of its own that t_N - t_1 would not take out)."""
    import inspect

    B, P, N = len(prompts), len(prompts[0]), args.max_tokens
    manager = model.init_continuous_batching(generation_config=_gen_config(N),
                                             continuous_batching_config=_cb_config(B, P, N, args.hf_cb_cuda_graphs))
    if args.hf_cb_cuda_graphs and hasattr(manager, "warmup"):
        manager.warmup()
    stamps = "record_timestamps" in inspect.signature(manager.add_request).parameters
    manager.start()
    counter = iter(range(1 << 30))

    def run(n_new: int, prompts: list[list[int]]) -> tuple[float, list[list[int]], float | None]:
        _sync(args.device)
        t0 = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"r{next(counter)}", max_new_tokens=n_new,
                                   **({"record_timestamps": True} if stamps else {})) for p in prompts]
        done: dict[str, Any] = {}
        deadline = time.perf_counter() + RESULT_TIMEOUT_S
        while len(done) < len(ids):
            r = manager.get_result(timeout=2)
            if r is None:  # nothing yet: give up when its thread died or nothing came for RESULT_TIMEOUT_S
                alive = getattr(manager, "is_running", True)
                alive = alive() if callable(alive) else alive
                if not alive or time.perf_counter() > deadline:
                    raise RuntimeError(f"transformers' continuous batching: {len(done)} of {len(ids)} requests "
                                       + (f"finished and nothing more came in {RESULT_TIMEOUT_S} s" if alive else
                                          "finished when its generation thread stopped"))
                continue
            deadline = time.perf_counter() + RESULT_TIMEOUT_S
            if r.is_finished():
                if getattr(r, "error", None):
                    raise RuntimeError(f"continuous batching: request {r.request_id}: {r.error}")
                done[r.request_id] = r
        _sync(args.device)
        dt = time.perf_counter() - t0
        times = [getattr(done[i], "timestamps", None) for i in ids]
        window = None
        if all(times):  # per-token host times: from the last first token to the last token
            window = max(t[-1] for t in times) - max(t[0] for t in times)
        return dt, [list(done[i].generated_tokens) for i in ids], window

    try:
        run(2, prompts[:2])
        t1 = run(1, prompts)[0]
        _reset_peak(args.device)
        tn, tokens, window = run(N, prompts)
    finally:
        manager.stop(block=True, timeout=20)
        impl = getattr(model.config, "_attn_implementation", "") or ""
        if impl.startswith("paged"):  # continuous batching switches to a paged attention; put sdpa back
            model.set_attn_implementation("sdpa")
    return dict(system="hf_continuous_batching", t1_s=t1, tN_s=tn, tokens=tokens, decode_window_s=window,
                peak_reserved_GiB=_peak_reserved(args.device))


# ------------------------------------------------------------------------ compare ----
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


def run_batch(name: str, model: Any, B: int, args: argparse.Namespace, dtype: torch.dtype,
              hf_cb: bool = True, copy_Bps: float | None = None) -> dict:
    gen = torch.Generator().manual_seed(B)
    prompts = torch.randint(1, model.config.vocab_size, (B, args.prompt_len), generator=gen).tolist()
    N = args.max_tokens
    res: dict[str, Any] = dict(model=name, batch=B, prompt_len=args.prompt_len, max_tokens=N, systems={}, errors={})
    runners = [("vattn", lambda: run_vattn(model, prompts, args, dtype))]
    if args.compare_eager:
        runners.append(("vattn_eager", lambda: run_vattn(model, prompts, args, dtype, False, "vattn_eager")))
    if args.compile:
        runners.append(("vattn_compiled", lambda: run_vattn(model, prompts, args, dtype, None, "vattn_compiled",
                                                            args.compile_mode)))
    if args.compare_async:  # the other side of the default (asynchronous on CUDA, synchronous on the host)
        other = "vattn_sync" if args.device.startswith("cuda") else "vattn_async"
        runners.append((other, lambda: run_vattn(model, prompts, args, dtype, system=other,
                                                 async_scheduling=other == "vattn_async")))
    if not args.skip_hf:
        runners.append(("hf_generate", lambda: run_hf_generate(model, prompts, args)))
    if hf_cb and not args.skip_hf_cb and not args.skip_hf:
        runners.append(("hf_continuous_batching", lambda: run_hf_cb(model, prompts, args)))
    tokens, logits = {}, {}
    for system, fn in runners:
        try:
            r = fn()
        except Exception as e:
            traceback.print_exc()
            res["errors"][system] = f"{type(e).__name__}: {e}"
            continue
        finally:
            if args.device.startswith("cuda"):  # a system's leftovers (a manager in a cycle) go before the next
                import gc

                gc.collect()
                torch.cuda.empty_cache()
        tokens[system] = r.pop("tokens")
        if "first_logits" in r:
            logits[system] = r.pop("first_logits")
        dt = r["tN_s"] - r["t1_s"]
        r["decode_tok_s"] = B * (N - 1) / dt if dt > 0 else float("nan")
        w = r.get("decode_window_s")  # the same, timed inside the N-token run (vattn, continuous batching)
        r["decode_tok_s_in_run"] = B * (N - 1) / w if w else None
        r["total_tok_s"] = B * N / r["tN_s"]
        res["systems"][system] = r
        in_run = r["decode_tok_s_in_run"]
        print(f"  {name} B={B} {system:24s} decode {r['decode_tok_s']:9.1f} tok/s"
              + (f" ({in_run:.1f} in-run)" if in_run else "") + f"  (t1 {r['t1_s']:.2f} s, tN {r['tN_s']:.2f} s)",
              flush=True)
    for other in ("vattn_eager", "vattn_compiled", *ASYNC_SYSTEMS):
        if "vattn" in tokens and other in tokens:
            res[f"vattn_vs_{other}"] = agreement(tokens["vattn"], tokens[other])
    for other in ("vattn_eager", "vattn_compiled", *ASYNC_SYSTEMS):  # the first step's logits: numerics or a bug?
        if "vattn" in logits and other in logits:
            res[f"first_token_logits_{other}_vs_vattn"] = logits_diff(logits[other], logits["vattn"])
    if "hf_generate" in tokens:
        for system in ("vattn", "vattn_eager", "vattn_compiled", *ASYNC_SYSTEMS, "hf_continuous_batching"):
            if system in tokens:
                res[f"{system}_vs_hf_generate"] = agreement(tokens[system], tokens["hf_generate"])
        for system in ("vattn", "vattn_compiled"):
            if system in logits and "hf_generate" in logits:
                suffix = "" if system == "vattn" else "_compiled"
                res[f"first_token_logits_vattn{suffix}_vs_hf"] = logits_diff(logits[system], logits["hf_generate"])
    if copy_Bps:
        res["bound"] = decode_bound(model, B, args.prompt_len + N / 2, copy_Bps, res["systems"])
    rounds = {"interleaved": args.compile and {"vattn": {}, "vattn_compiled": dict(compile=args.compile_mode)},
              "interleaved_async": args.compare_async and {"vattn_sync": dict(async_scheduling=False),
                                                           "vattn_async": dict(async_scheduling=True)}}
    for key, variants in rounds.items():
        if variants and args.rounds:
            try:
                res[key] = interleaved(model, prompts, args, dtype, variants)
            except Exception as e:
                traceback.print_exc()
                res["errors"][key] = f"{type(e).__name__}: {e}"
    res["tokens_sample"] = {s: t[0][:16] for s, t in tokens.items()}
    return res


# ------------------------------------------------------------------------- bench ----
def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (a tiny run of the same code)")
    ap.add_argument("--quick", action="store_true", help="fewer new tokens (the GPU suite)")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=[*MODELS, *HOST_MODELS])
    ap.add_argument("--batches", type=int, nargs="*", default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per request (N)")
    ap.add_argument("--layers-8b", type=int, default=None, help="fewer layers for the 8B shape (memory or time)")
    ap.add_argument("--layout", default="per-layer", choices=["per-layer", "fused"])
    ap.add_argument("--page-size", type=int, default=None, help="bytes; default the backend's")
    ap.add_argument("--skip-hf-cb", action="store_true", help="leave out transformers' generate_batch")
    ap.add_argument("--hf-cb-cuda-graphs", action="store_true", help="let generate_batch use CUDA graphs (+ warm-up)")
    ap.add_argument("--compare-eager", action="store_true",
                    help="also run vattn with cuda_graphs=False (system vattn_eager) beside its default")
    ap.add_argument("--compile", action="store_true",
                    help="also run vattn with compile=True (system vattn_compiled; with CUDA graphs where they apply)")
    ap.add_argument("--compile-mode", default=True, help="what vattn_compiled passes as compile= (default True)")
    ap.add_argument("--compare-async", action="store_true",
                    help="also run vattn with the other async_scheduling than the default (system vattn_sync on CUDA, "
                         "vattn_async on the host)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="with --compile (--compare-async): eager and compiled (synchronous and asynchronous) vattn open "
                         "together, stepping in turn through this many runs")
    ap.add_argument("--skip-hf", action="store_true", help="leave out transformers' generate (and generate_batch)")
    ap.add_argument("--engine-overhead", action="store_true",
                    help="one more N-token vattn run, timing each iteration's step against its forward")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new (model, batch) after this many seconds")
    ap.add_argument("--file-name", default="e2e", help="the result's file name before _<device>.json (default e2e)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = args.device.startswith("cuda")
    if cuda:
        args.batches = args.batches or [1, 8, 32, 128]
        args.prompt_len = args.prompt_len or 128
        args.max_tokens = args.max_tokens or (32 if args.quick else 128)
        dtype = torch.bfloat16
    else:
        args.batches = args.batches or [1, 3]
        args.prompt_len = args.prompt_len or 12
        args.max_tokens = args.max_tokens or 16  # t_N - t_1 of a few tokens of a tiny model drowns in the host's noise
        args.page_size = args.page_size or (16 << 10)
        dtype = torch.float32
    start = time.perf_counter()
    results: list[dict] = []
    skipped: list[str] = []
    cb_problem = None if args.skip_hf_cb or args.skip_hf else memory_problem()
    if cb_problem:  # transformers' own limit on this machine, not a failure of the benchmark
        skipped.append(f"hf_continuous_batching: {cb_problem}")
    models_info: dict[str, Any] = {}
    copy_Bps = copy_bandwidth(args.device)  # the bound's denominator, measured in this run
    print(f"device-to-device copy: {copy_Bps / 1e9:.1f} GB/s", flush=True)
    for name in args.models:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            skipped.append(f"{name}: time budget spent")
            continue
        config = model_config(name, args)
        if args.compile:  # dynamo's recompile limit counts the graphs of every model of the process
            torch._dynamo.reset()
        t0 = time.perf_counter()
        try:
            model = build_model(config, args.device, dtype)
        except Exception as e:
            traceback.print_exc()
            results.append(dict(model=name, errors={"build": f"{type(e).__name__}: {e}"}, systems={}))
            continue
        models_info[name] = dict(layers=config.num_hidden_layers, hidden=config.hidden_size,
                                 parameters=sum(p.numel() for p in model.parameters()), build_s=time.perf_counter() - t0,
                                 weights_GiB=sum(p.numel() * p.element_size() for p in model.parameters()) / GB)
        for B in progress(args.batches, desc=name, unit="batch"):
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                skipped.append(f"{name} batch {B}: time budget spent")
                continue
            results.append(run_batch(name, model, B, args, dtype, hf_cb=not cb_problem, copy_Bps=copy_Bps))
        del model
        if cuda:
            torch.cuda.empty_cache()
    failures = []
    for r in results:
        c = r["systems"].get("vattn", {}).get("after_close")
        if c and not c["pages_returned"]:
            failures.append(f"{r['model']} B={r['batch']}: pages not returned on close")
        for system, e in r["errors"].items():
            failures.append(f"{r['model']} B={r.get('batch')} {system}: {e}")
        for system in ("vattn", "vattn_compiled"):
            kern = r["systems"].get(system, {}).get("kernel")
            if cuda and kern is not None and kern not in GPU_KERNELS:  # its figures are SDPA's, not the varlen kernel's
                failures.append(f"{r['model']} B={r['batch']} {system}: the attention kernel fell back to {kern!r} "
                                "(see the RuntimeWarning in the log)")
        for other in ASYNC_SYSTEMS:  # greedy tokens do not depend on the scheduling
            a = r.get(f"vattn_vs_{other}")
            if a and not a["equal"]:
                failures.append(f"{r['model']} B={r['batch']} {other}: tokens differ from vattn's "
                                f"({a['sequences_equal']}/{a['sequences']} sequences equal)")
        off = r["systems"].get("vattn_compiled", {}).get("compile", {}).get("disabled")
        if off:  # its figures are eager ones
            failures.append(f"{r['model']} B={r['batch']} vattn_compiled: compiling was turned off: {off}")
    return dict(file_name=args.file_name, dtype=str(dtype).removeprefix("torch."), prompt_len=args.prompt_len,
                max_tokens=args.max_tokens,
                copy_GBps=copy_Bps / 1e9, models=models_info, results=results, skipped=skipped, failures=failures)


def table(result: dict[str, Any]) -> tuple[list[str], list[list]]:
    """One row per (model, batch, system): decode tokens/s, memory, agreement with generate."""
    rows = []
    for r in result["results"]:
        for system, s in r["systems"].items():
            agree = r.get(f"{system}_vs_hf_generate", {})
            rows.append([r["model"], r["batch"], system, s.get("decode_tok_s_in_run") or "-", s["decode_tok_s"],
                         s["total_tok_s"],
                         s.get("peak_reserved_GiB") if s.get("peak_reserved_GiB") is not None else "-",
                         s.get("peak_mapped_GiB", "-"), agree.get("token_match", "-")])
        for system, s in r["systems"].items():
            eo, cg, cc = s.get("engine_overhead"), s.get("cuda_graphs"), s.get("compile")
            if cc:
                print(f"{r['model']} B={r['batch']} {system}: compile ({cc['mode']}) {cc['compile_s']:.2f} s, "
                      f"{cc['compiles']} compile(s), {cc['graphs']} graph(s)" + (f", OFF: {cc['disabled']}"
                                                                              if cc["disabled"] else ""))
            if eo:
                print(f"{r['model']} B={r['batch']} {system} (async_scheduling={s.get('async_scheduling')}, "
                      f"{eo.get('method')}): decode step {eo['step_ms_median']:.3f} ms (median), "
                      f"outside the forward {eo['outside_ms_median']:.3f} ms = {100 * eo['outside_share']:.2f} % "
                      f"of the decode steps' time ({eo['iterations']} iterations); of it, ms: schedule "
                      f"{eo.get('schedule_ms_median', 0):.3f} (with cache.step "
                      f"{eo.get('cache_step_ms_median', 0):.3f}), "
                      f"sample {eo.get('sample_ms_median', 0):.3f}, outputs {eo.get('outputs_ms_median', 0):.3f}")
            if cg:
                print(f"{r['model']} B={r['batch']} {system}: CUDA graphs: {cg['replays']} replays, sizes "
                      f"{cg['captured_sizes']}, capture s {cg['capture_s']}" + (f", OFF: {cg['disabled']}"
                                                                               if cg["disabled"] else ""))
        for other in ("vattn_eager", "vattn_compiled", *ASYNC_SYSTEMS):
            a = r.get(f"vattn_vs_{other}")
            if a:
                print(f"{r['model']} B={r['batch']}: vattn tokens vs {other}: match {a['token_match']:.3f}, "
                      f"common prefix {a['prefix_match']:.3f}, {a['sequences_equal']}/{a['sequences']} sequences equal")
            lg = r.get(f"first_token_logits_{other}_vs_vattn")
            if lg:
                print(f"{r['model']} B={r['batch']}: first-token logits max |{other} - vattn| {lg['max_abs_diff']:.4g} "
                      f"(|logits| <= {lg['logits_abs_max']:.3g}), argmax equal {lg['argmax_equal']:.3f}, "
                      f"top-2 gap median {lg['top2_gap_median']:.4g}, near ties {lg['near_ties']:.3f}")
        for system in ("vattn", "vattn_compiled"):
            lg = r.get("first_token_logits_vattn_vs_hf" if system == "vattn" else "first_token_logits_vattn_compiled_vs_hf")
            if lg:
                print(f"{r['model']} B={r['batch']}: first-token logits max |{system} - hf| {lg['max_abs_diff']:.4g} "
                      f"(|logits| <= {lg['logits_abs_max']:.3g}), argmax equal {lg['argmax_equal']:.3f}")
        for key in ("interleaved", "interleaved_async"):
            il = r.get(key)
            if il:
                b, o = il["baseline"], il["other"]
                print(f"{r['model']} B={r['batch']}: interleaved ({il['rounds']} rounds, {il['steps']} pairs of decode "
                      f"steps): {o} / {b}, median of the pairs: step {il['step_ratio_median']:.3f}, forward "
                      f"{il['forward_ratio_median']:.3f}, outside the forward {il['outside_ratio_median']:.3f}; "
                      f"medians, ms: step {il['step_ms'][b]:.3f} / {il['step_ms'][o]:.3f}, outside the forward "
                      f"{il['outside_ms'][b]:.3f} / {il['outside_ms'][o]:.3f}")
        bound = r.get("bound")
        if bound:
            print(f"{r['model']} B={r['batch']}: bandwidth bound {bound['bound_ms']:.3f} ms a decode step (weights "
                  f"{bound['weights_GiB']:.3f} GiB + K/V {bound['kv_GiB']:.3f} GiB at copy bandwidth)" + "".join(
                      f"; {system} step {b['step_over_bound']:.2f}x, forward {b['forward_over_bound']:.2f}x"
                      for system, b in bound.items() if isinstance(b, dict)))
    for s in result["skipped"]:
        print("skipped", s)
    for f in result["failures"]:
        print("ERROR", f)
    print(f"\ndecode throughput: prompt {result['prompt_len']}, {result['max_tokens']} new tokens, greedy")
    return (["model", "B", "system", "decode tok/s (in run)", "decode tok/s (t_N - t_1)", "total tok/s", "peak reserved GiB", "vattn mapped GiB",
             "token match vs generate"], rows)


def decode_tok_s(system: dict[str, Any]) -> float:
    """The decode figure to show: timed inside the N-token run when it was (first tokens to last
    token: no prefill, no start or stop of the system), else B x (N - 1) / (t_N - t_1)."""
    return system.get("decode_tok_s_in_run") or system["decode_tok_s"]


def plot(result: dict[str, Any]) -> Any:
    return _plot(result["results"])


def _plot(results: list[dict]) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in results})
    if not models:
        return None
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.2), squeeze=False)
    for ax, name in zip(axes[0], models):
        rs = [r for r in results if r["model"] == name]
        for system, marker in (("vattn", "o"), ("vattn_eager", "x"), ("vattn_compiled", "D"), ("vattn_sync", "v"),
                               ("vattn_async", "P"), ("hf_generate", "s"), ("hf_continuous_batching", "^")):
            pts = [(r["batch"], decode_tok_s(r["systems"][system])) for r in rs if system in r["systems"]]
            if pts:
                ax.plot(*zip(*pts), marker=marker, label=system)
        ax.set(xscale="log", yscale="log", xlabel="batch",
               ylabel="decode tokens/s (in the N-token run; else from t_N - t_1)", title=name)
        ax.legend()
    return fig


if __name__ == "__main__":  # this part alone: python -m vattn.bench._e2e [options] [--out DIR]
    import sys

    from vattn.bench import execute, module_args

    _out = argparse.ArgumentParser(add_help=False)
    _out.add_argument("--out", default=None)
    _known, _rest = _out.parse_known_args()
    _payload = execute(sys.modules[__name__], NAME, module_args(sys.modules[__name__], _rest, out=_known.out))
    sys.exit(1 if _payload["result"].get("failures") else 0)
