"""`run_demo`: continuous batching on a tiny built-in Llama-style model, with figures.

Requests of mixed prompt and output lengths arrive a few per iteration; the engine
batches them continuously on the vattn cache; the table reports throughput, latency
(TTFT, TPOT), preemptions and the KV memory the cache mapped.
"""
from __future__ import annotations

import importlib.util
import random
import time
from typing import Any

import torch

from vattn.checks import as_int
from vattn.engine.llm import LLM
from vattn.engine.sampling_params import SamplingParams
from vattn.engine.sequence import RequestOutput
from vattn.errors import InvalidConfigError
from vattn.report import key_value_table, percentile

MIB = 1 << 20


def demo_model_config(vocab_size: int = 2048) -> Any:
    """A small Llama-style config (GQA, 4 layers); weights are random, seeded by the engine."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab_size, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                       initializer_range=0.2)


def default_device() -> str:
    """'cuda' when a GPU and vattn's CUDA backend are there, else 'cpu' (host backend)."""
    if torch.cuda.is_available() and importlib.util.find_spec("vattn.vmem.cuda") is not None:
        return "cuda"
    return "cpu"


def run_demo(num_requests: int = 32, seed: int = 0, device: str | None = None, *,
             max_batch_size: int = 8, max_num_batched_tokens: int = 256, page_size: int | None = None,
             layout: str = "per-layer", physical_memory: int | None = None, arrivals_per_step: int = 2,
             min_prompt: int = 16, max_prompt: int = 256, min_output: int = 16, max_output: int = 128,
             show_progress: bool = True, verbose: bool = True, tensor_parallel_size: int = 1) -> dict[str, Any]:
    """Run `num_requests` requests through the engine and return the figures as a dict
    (also printed as a table when `verbose`). Requests arrive 0 .. 2 * arrivals_per_step
    per iteration; half decode greedily, half sample with a per-request seed. The result's
    "num_errors" counts requests that finished with an error; "errors" lists their messages.
    With tensor_parallel_size > 1 (under torchrun) rank 0 prints and counts; the others' figures are empty."""
    num_requests = as_int(num_requests, "num_requests", InvalidConfigError, low=1)
    device = device or default_device()
    rng = random.Random(seed)
    dtype = torch.float32 if device == "cpu" else torch.float16
    config = demo_model_config()
    requests = _demo_requests(num_requests, rng, config.vocab_size, seed, (min_prompt, max_prompt),
                              (min_output, max_output))
    llm = LLM(config, seed=seed, device=device, dtype=dtype, max_batch_size=max_batch_size,
              max_context_len=max_prompt + max_output, max_num_batched_tokens=max_num_batched_tokens,
              page_size=page_size, layout=layout, physical_memory=physical_memory,
              tensor_parallel_size=tensor_parallel_size)
    verbose, show_progress = verbose and llm.is_output_rank, show_progress and llm.is_output_rank
    bar = None
    if show_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=num_requests, desc="vattn demo", unit="req")
    finished: list[RequestOutput] = []
    try:
        start = time.perf_counter()
        iterations, peak_mapped, peak_used, frag = _serve(llm, list(requests), rng, arrivals_per_step, bar, finished)
        if device != "cpu":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        stats = llm.memory_stats()
        kernel = llm.runner.kernel.name
        page = llm.cache.page_size
    finally:
        if bar is not None:
            bar.close()
        llm.close()

    result = {
        "device": device,
        "attention_kernel": kernel,
        "layout": layout,
        "page_size": page,
        **_request_figures(finished, iterations, wall),
        "kv_mapped_mib_peak": peak_mapped / MIB,
        "kv_used_mib_peak": peak_used / MIB,
        "kv_fragmentation_pct_mean": 100 * sum(frag) / len(frag) if frag else 0.0,
        "kv_created_mib_end": stats.created_bytes / MIB,
    }
    if verbose:
        print(format_table(result))
    return result


def _demo_requests(num_requests: int, rng: random.Random, vocab_size: int, seed: int, prompt_lens: tuple[int, int],
                   output_lens: tuple[int, int]) -> list[tuple[list[int], SamplingParams]]:
    """Random prompts and output lengths within the (low, high) bounds; even requests decode
    greedily, odd ones sample with a per-request seed."""
    requests = []
    for i in range(num_requests):
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_lens))]
        params = SamplingParams(temperature=0.0 if i % 2 == 0 else 0.8, top_p=0.95,
                                max_tokens=rng.randint(*output_lens), ignore_eos=True, seed=seed + i)
        requests.append((prompt, params))
    return requests


def _serve(llm: LLM, pending: list[tuple[list[int], SamplingParams]], rng: random.Random, arrivals_per_step: int,
           bar: Any, finished: list[RequestOutput]) -> tuple[int, int, int, list[float]]:
    """Step `llm` until `pending` requests (0 .. 2 * arrivals_per_step arriving per iteration)
    all finished, each appended to `finished`. Returns (iterations, peak mapped bytes, peak
    used bytes, the fragmentation of every iteration with requests active)."""
    peak_mapped = peak_used = iterations = 0
    frag: list[float] = []
    while pending or llm.has_unfinished():
        for _ in range(min(len(pending), rng.randint(0, 2 * arrivals_per_step))):
            llm.add_request(*pending.pop(0))
        if not llm.has_unfinished():
            continue
        for out in llm.step():
            if out.finished:
                finished.append(out)
                if bar is not None:
                    bar.update(1)
        iterations += 1
        st = llm.memory_stats()
        peak_mapped = max(peak_mapped, st.mapped_bytes)
        peak_used = max(peak_used, st.used_bytes)
        if st.num_active:
            frag.append(st.fragmentation)
    return iterations, peak_mapped, peak_used, frag


def _request_figures(finished: list[RequestOutput], iterations: int, wall: float) -> dict[str, Any]:
    """The demo's figures of the `finished` requests, in `wall` seconds of `iterations`:
    counts, errors, tokens, throughput, latency percentiles, preemptions."""
    ttft = [o.metrics.time_to_first_token for o in finished if o.metrics.time_to_first_token is not None]
    tpot = [o.metrics.time_per_output_token for o in finished if o.metrics.time_per_output_token is not None]
    out_tokens = sum(len(o.token_ids) for o in finished)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in finished)
    return {
        "num_requests": len(finished),
        "num_errors": sum(o.finish_reason == "error" for o in finished),
        "errors": [o.error for o in finished if o.finish_reason == "error"],
        "iterations": iterations,
        "wall_s": wall,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "output_throughput_tok_s": out_tokens / wall if wall else 0.0,
        "total_throughput_tok_s": (out_tokens + prompt_tokens) / wall if wall else 0.0,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50),
        "ttft_p90_ms": 1e3 * percentile(ttft, 90),
        "tpot_p50_ms": 1e3 * percentile(tpot, 50),
        "tpot_p90_ms": 1e3 * percentile(tpot, 90),
        "num_preemptions": sum(o.num_preemptions for o in finished),
    }


def format_table(result: dict[str, Any]) -> str:
    """The demo's figures as a two-column text table."""
    rows = [
        ("device / kernel", f"{result['device']} / {result['attention_kernel']}"),
        ("layout / page size", f"{result['layout']} / {result['page_size'] // 1024} KiB"),
        ("requests (errors)", f"{result['num_requests']} ({result['num_errors']})"),
        ("iterations", f"{result['iterations']}"),
        ("wall time", f"{result['wall_s']:.2f} s"),
        ("tokens in / out", f"{result['prompt_tokens']} / {result['output_tokens']}"),
        ("output throughput", f"{result['output_throughput_tok_s']:.1f} tok/s"),
        ("total throughput", f"{result['total_throughput_tok_s']:.1f} tok/s"),
        ("TTFT p50 / p90", f"{result['ttft_p50_ms']:.1f} / {result['ttft_p90_ms']:.1f} ms"),
        ("TPOT p50 / p90", f"{result['tpot_p50_ms']:.2f} / {result['tpot_p90_ms']:.2f} ms"),
        ("preemptions", f"{result['num_preemptions']}"),
        ("KV mapped (peak)", f"{result['kv_mapped_mib_peak']:.2f} MiB"),
        ("KV used (peak)", f"{result['kv_used_mib_peak']:.2f} MiB"),
        ("KV fragmentation (mean)", f"{result['kv_fragmentation_pct_mean']:.1f} %"),
    ]
    return key_value_table(rows)


if __name__ == "__main__":
    run_demo()
