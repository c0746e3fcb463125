"""The systems the end-to-end part (`vattn.bench._e2e`) compares, each run on one batch of
prompts: vattn's engine (`run_vattn`, and `interleaved`: two engines stepping in turn) and
transformers' `generate` (`run_hf_generate`) and continuous batching (`run_hf_cb`). Each
returns its times for 1 and N new tokens, its tokens, its first token's logits where it has
them, and its memory figures."""
from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from vattn.report import percentile

from ._common import sync as _sync
from ._e2e_measure import GB, MB, StepTimer, free_bytes, peak_reserved, reset_peak
from ._models import cb_config

RESULT_TIMEOUT_S = 60  # transformers' continuous batching: longest wait with no result at all


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
        first_logits = _capture_first_logits(llm.runner.sampler)

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
        reset_peak(args.device)
        tn, tokens, ids, peak_mapped, window = run(N, prompts)
        out.update(t1_s=t1, tN_s=tn, tokens=tokens, decode_window_s=window, peak_reserved_GiB=peak_reserved(args.device),
                   peak_mapped_GiB=peak_mapped / GB, kernel=llm.runner.kernel.name, page_KiB=llm.cache.page_size // 1024,
                   first_logits=[first_logits[i] for i in ids])
        out.update(_compile_and_graphs(compiled, graphs))
        if args.engine_overhead:  # a run of its own: its synchronizations would slow the timed one
            timer = StepTimer(llm, args.device)
            try:
                run(N, prompts)
            finally:
                timer.uninstall()
            out["engine_overhead"] = timer.summary()
        out.update(_close_and_count(llm, args.device))
    finally:
        _sync(args.device)
        llm.close()
    return out


def _capture_first_logits(sampler: Any) -> dict[int, torch.Tensor]:
    """Wrap `sampler.sample` to keep each request's first sampled logits `[V]` (on the device),
    by request id, in the dict returned (cleared by the caller between runs)."""
    first_logits: dict[int, torch.Tensor] = {}
    sample = sampler.sample

    def capture(logits: torch.Tensor, seq_ids: list, params: list, **history: Any) -> Any:
        for i, sid in enumerate(seq_ids):
            rid = sid[0] if isinstance(sid, tuple) else sid  # (request id, sample index)
            if rid not in first_logits:
                first_logits[rid] = logits[i].detach().float().clone()  # [V], stays on the device
        return sample(logits, seq_ids, params, **history)

    sampler.sample = capture
    return first_logits


def _compile_and_graphs(compiled: Any, graphs: Any) -> dict[str, Any]:
    """An engine's compile (`compile=`) and CUDA graphs figures, where it has them."""
    out: dict[str, Any] = {}
    if compiled is not None:
        out["compile"] = dict(mode=compiled.mode, compile_s=compiled.compile_s, compiles=compiled.num_compiles,
                              graphs=compiled.num_graphs, disabled=compiled.disabled_reason)
    if graphs is not None:
        out["cuda_graphs"] = dict(replays=graphs.num_replays, captured_sizes=graphs.captured_sizes,
                                  capture_s=graphs.capture_s, disabled=graphs.disabled_reason)
    return out


def _close_and_count(llm: Any, device: str) -> dict[str, Any]:
    """Close an engine whose requests all finished: what stayed mapped (the pages stay with
    their free slots), and on CUDA whether close() gave the pages it created back to the GPU."""
    st = llm.memory_stats()
    created = st.num_created_pages * st.group_bytes
    out: dict[str, Any] = {}
    out["after_finish"] = dict(mapped_MiB=st.mapped_bytes / MB, used_MiB=st.used_bytes / MB,
                               cached_MiB=st.num_cached_pages * st.group_bytes / MB, active=st.num_active,
                               created_MiB=created / MB)
    free0 = free_bytes(device)
    llm.close()
    free1 = free_bytes(device)
    if free0 is not None and free1 is not None:
        released = free1 - free0
        # a page group is 32 (1B) or 64 (8B) pages of 2 MiB: a slack of one group would pass with nothing back
        out["after_close"] = dict(gpu_free_rose_MiB=released / MB, created_MiB=created / MB,
                                  pages_returned=abs(released - created) <= max(8 * MB, 0.05 * created))
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
    reset_peak(args.device)
    tn, seqs, window = run(args.max_tokens, ids, mask)
    out = dict(system="hf_generate", t1_s=t1, tN_s=tn, tokens=seqs[:, P:].tolist(), decode_window_s=window,
               peak_reserved_GiB=peak_reserved(args.device))
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
        reset_peak(args.device)
        tn, tokens, window = run(N, prompts)
    finally:
        manager.stop(block=True, timeout=20)
        impl = getattr(model.config, "_attn_implementation", "") or ""
        if impl.startswith("paged"):  # continuous batching switches to a paged attention; put sdpa back
            model.set_attn_implementation("sdpa")
    return dict(system="hf_continuous_batching", t1_s=t1, tN_s=tn, tokens=tokens, decode_window_s=window,
                peak_reserved_GiB=peak_reserved(args.device))
