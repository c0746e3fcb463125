"""The engine's prefill and decode tokens/s against `transformers` on the same model, device and requests.

Three systems serve the same greedy requests, one after another in one run:
- `vattn`: `vattn.LLM` (continuous batching on the vattn cache, `max_batch_size` slots, prefill
  chunks within `max_num_batched_tokens`; its default `async_scheduling`: synchronous on the
  host, asynchronous on CUDA); `vattn_async` and `vattn_sync` (`--systems`, not run by default):
  the same with `async_scheduling=True` / `False`;
- `hf_generate`: `model.generate` with its dynamic cache, static batches of `max_batch_size`
  requests in arrival order, left-padded; a batch runs until its longest request is done (the
  tokens past a request's `max_tokens` are computed and dropped: static batching's cost);
- `hf_cb`: transformers' continuous batching (the `generate_batch` manager, paged cache), with
  each request's own `max_new_tokens`, `max_batch_tokens` = the engine's token budget.

Each system runs every request twice: with 1 new token (prefill tok/s = prompt tokens / that
time), then with its `max_tokens` (decode tok/s = (output tokens - requests) / (t_N - t_1),
which takes the prefill out; output tok/s = output tokens / t_N). Wall and CPU time are both
recorded: on a shared machine the CPU time of the whole run (all threads of the process) is
the steadier figure. Greedy agreement: each system's tokens against `hf_generate`'s (per request, its
first `max_tokens`). For vattn it also records the time per iteration outside the model's
forward (scheduling, `step`, sampling, bookkeeping).

Workloads: `mixed` (32 requests, prompts 32-512 and outputs 32-128 tokens, seeded) and `equal`
(8 prompts of 1024 tokens, 64 new tokens each). The model: a Llama-shaped config with random,
seeded weights (no download): hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 32000.
"""
from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from vattn.bench._common import agreement, progress
from vattn.bench._common import sync as _sync
from vattn.bench._models import build_model, cb_config, cb_results, llama_config
from vattn.integrations.hf_cb import memory_problem

NAME = "throughput"
HELP = "vattn.LLM prefill/decode tokens/s against transformers' generate and generate_batch"
NEEDS_GPU = False

WORKLOADS = ("mixed", "equal")
SYSTEMS = ("vattn", "hf_generate", "hf_cb")  # the default run
VATTN_VARIANTS = {"vattn": None, "vattn_async": True, "vattn_sync": False}  # system -> LLM(async_scheduling=)

Requests = list[tuple[list[int], int]]  # (prompt token ids, max new tokens)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=[*VATTN_VARIANTS, *SYSTEMS[1:]])
    p.add_argument("--requests", type=int, default=32, help="mixed: number of requests")
    p.add_argument("--prompt-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"),
                   help="mixed: prompt lengths, uniform in [MIN, MAX]")
    p.add_argument("--output-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"),
                   help="mixed: new tokens per request, uniform in [MIN, MAX]")
    p.add_argument("--equal-requests", type=int, default=8, help="equal: number of requests")
    p.add_argument("--equal-prompt", type=int, default=1024, help="equal: prompt length")
    p.add_argument("--equal-output", type=int, default=64, help="equal: new tokens per request")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--max-batch-size", type=int, default=16, help="concurrent requests (all systems)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024, help="tokens per iteration (vattn, hf_cb)")
    p.add_argument("--page-size", type=int, default=None, help="vattn page size in bytes (default: the backend's)")
    p.add_argument("--attention", default=None, help="vattn attention kernel (default: automatic)")
    p.add_argument("--seed", type=int, default=0)


# ------------------------------------------------------------------------ inputs ----
def model_config(args: argparse.Namespace) -> Any:
    return llama_config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                        num_hidden_layers=args.layers, num_attention_heads=args.heads,
                        num_key_value_heads=args.kv_heads, max_position_embeddings=4096, tie_word_embeddings=False)


def workload(name: str, args: argparse.Namespace) -> Requests:
    """The seeded requests of a workload; token ids avoid 0 (the padding id of `hf_generate`)."""
    rng = random.Random(args.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(1, args.vocab) for _ in range(n)]

    if name == "equal":
        return [(prompt(args.equal_prompt), args.equal_output) for _ in range(args.equal_requests)]
    (p0, p1), (o0, o1) = args.prompt_len, args.output_len
    return [(prompt(rng.randint(p0, p1)), rng.randint(o0, o1)) for _ in range(args.requests)]


# ----------------------------------------------------------------------- systems ----
class _Timer:
    """Wall and CPU seconds of a block (the device synchronized at both ends)."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> _Timer:
        _sync(self.device)
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        _sync(self.device)
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def run_vattn(model: Any, reqs: Requests, args: argparse.Namespace, device: str, dtype: torch.dtype,
              async_scheduling: bool | None = None) -> dict:
    from vattn import LLM, SamplingParams

    max_len = max(len(p) + n for p, n in reqs)
    llm = LLM(model, device=device, dtype=dtype, max_batch_size=args.max_batch_size, max_context_len=max_len,
              max_num_batched_tokens=args.max_num_batched_tokens, page_size=args.page_size, attention=args.attention,
              async_scheduling=async_scheduling)
    forward = [0.0, 0]  # seconds in the model's forward, forwards

    def pre(module: Any, inputs: Any) -> None:
        forward.append(time.perf_counter())

    def post(module: Any, inputs: Any, output: Any) -> None:
        forward[0] += time.perf_counter() - forward.pop()
        forward[1] += 1

    hooks = [llm.runner.model.register_forward_pre_hook(pre), llm.runner.model.register_forward_hook(post)]
    step = [0.0, 0]  # seconds in LLM._step (one iteration: what step() and generate() run), steps
    inner_step = llm._step

    def timed_step() -> Any:
        t = time.perf_counter()
        out = inner_step()
        step[0] += time.perf_counter() - t
        step[1] += 1
        return out

    llm._step = timed_step  # type: ignore[method-assign]

    def serve(reqs: Requests) -> tuple[_Timer, list[list[int]]]:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
        with _Timer(device) as t:
            outs = llm.generate([p for p, _ in reqs], params)
        return t, [o.token_ids for o in outs]

    try:
        serve([(p[:8], 2) for p, _ in reqs[:2]])  # warm-up
        t1, _ = serve([(p, 1) for p, _ in reqs])
        forward[:2], step[:2] = [0.0, 0], [0.0, 0]
        tn, tokens = serve(reqs)
        overhead = dict(iterations=step[1], step_ms=1e3 * step[0] / max(step[1], 1),
                        forward_ms=1e3 * forward[0] / max(forward[1], 1),
                        outside_forward_ms=1e3 * (step[0] - forward[0]) / max(step[1], 1),
                        kernel=llm.runner.kernel.name, async_scheduling=llm.async_scheduling)
    finally:
        for h in hooks:
            h.remove()
        llm.close()
    return dict(t1=t1, tn=tn, tokens=tokens, engine=overhead)


def run_hf_generate(model: Any, reqs: Requests, args: argparse.Namespace, device: str) -> dict:
    from transformers import GenerationConfig

    def serve(reqs: Requests) -> tuple[_Timer, list[list[int]]]:
        tokens: list[list[int]] = []
        with _Timer(device) as t, torch.inference_mode():
            for i in range(0, len(reqs), args.max_batch_size):
                batch = reqs[i:i + args.max_batch_size]
                width = max(len(p) for p, _ in batch)
                ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=device)  # [b, width]
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
                gen = GenerationConfig(max_new_tokens=max(n for _, n in batch), do_sample=False, eos_token_id=None,
                                       pad_token_id=0)
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
                tokens += [row[width:width + n] for row, (_, n) in zip(out.tolist(), batch)]
        return t, tokens

    serve([(p[:8], 2) for p, _ in reqs[:2]])
    t1, _ = serve([(p, 1) for p, _ in reqs])
    tn, tokens = serve(reqs)
    return dict(t1=t1, tn=tn, tokens=tokens)


def run_hf_cb(model: Any, reqs: Requests, args: argparse.Namespace, device: str) -> dict:
    from transformers import GenerationConfig

    max_len = max(len(p) + n for p, n in reqs)
    block = 256
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=max(n for _, n in reqs))
    cbc = cb_config(block, num_blocks=args.max_batch_size * -(-max_len // block) + 4,
                    max_batch_tokens=args.max_num_batched_tokens, max_requests_per_batch=args.max_batch_size,
                    use_cuda_graph=False)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    manager.start()
    counter = iter(range(1 << 30))

    def serve(reqs: Requests) -> tuple[_Timer, list[list[int]]]:
        with _Timer(device) as t:
            ids = [manager.add_request(p, request_id=f"r{next(counter)}", max_new_tokens=n) for p, n in reqs]
            done = cb_results(manager, ids)
        return t, [list(done[i].generated_tokens) for i in ids]

    try:
        serve([(p[:8], 2) for p, _ in reqs[:2]])
        t1, _ = serve([(p, 1) for p, _ in reqs])
        tn, tokens = serve(reqs)
    finally:
        manager.stop(block=True, timeout=30)
        if str(getattr(model.config, "_attn_implementation", "")).startswith("paged"):
            model.set_attn_implementation("sdpa")  # continuous batching switched it to its paged attention
    return dict(t1=t1, tn=tn, tokens=tokens)


# ----------------------------------------------------------------------- compare ----
def _figures(r: dict, reqs: Requests) -> dict:
    t1, tn = r.pop("t1"), r.pop("tn")
    prompt_tokens = sum(len(p) for p, _ in reqs)
    out_tokens = sum(n for _, n in reqs)
    decode_s = tn.wall - t1.wall
    return dict(prefill_s=t1.wall, total_s=tn.wall, prefill_cpu_s=t1.cpu, total_cpu_s=tn.cpu,
                prefill_tok_s=prompt_tokens / t1.wall,
                decode_tok_s=(out_tokens - len(reqs)) / decode_s if decode_s > 0 else float("nan"),
                output_tok_s=out_tokens / tn.wall, **r)


def run(args: argparse.Namespace) -> dict:
    """Every workload on every system; figures, ratios against transformers, greedy agreement."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.device = device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = build_model(model_config(args), device, dtype, args.seed, attn_implementation="sdpa")
    result: dict[str, Any] = dict(device=device, dtype=str(dtype).removeprefix("torch."),
                                  threads=torch.get_num_threads(),
                                  parameters=sum(p.numel() for p in model.parameters()), workloads={})
    problem = memory_problem() if "hf_cb" in args.systems else None
    if problem:  # transformers' own limit on this machine, not a failure of the benchmark
        print(f"hf_cb left out: {problem}", flush=True)
        result["skipped"] = {"hf_cb": problem}
    run_systems = [s for s in args.systems if not (problem and s == "hf_cb")]
    jobs = [(w, s) for w in args.workloads for s in run_systems]
    bar = progress(total=len(jobs), desc="throughput", unit="run")
    for w in args.workloads:
        reqs = workload(w, args)
        systems: dict[str, dict] = {}
        tokens: dict[str, list[list[int]]] = {}
        for s in run_systems:
            bar.set_postfix_str(f"{w}: {s}")
            if s in VATTN_VARIANTS:
                r = run_vattn(model, reqs, args, device, dtype, VATTN_VARIANTS[s])
            elif s == "hf_generate":
                r = run_hf_generate(model, reqs, args, device)
            else:
                r = run_hf_cb(model, reqs, args, device)
            tokens[s] = r.pop("tokens")
            systems[s] = _figures(r, reqs)
            bar.update(1)
        entry: dict[str, Any] = dict(requests=len(reqs), prompt_tokens=sum(len(p) for p, _ in reqs),
                                     output_tokens=sum(n for _, n in reqs), systems=systems)
        if "vattn" in systems:
            v = systems["vattn"]
            entry["vattn_over"] = {s: dict(prefill=v["prefill_tok_s"] / x["prefill_tok_s"],
                                           decode=v["decode_tok_s"] / x["decode_tok_s"],
                                           output=v["output_tok_s"] / x["output_tok_s"])
                                   for s, x in systems.items() if s != "vattn"}
        if "hf_generate" in tokens:
            entry["agreement_with_hf_generate"] = {s: agreement(t, tokens["hf_generate"])
                                                   for s, t in tokens.items() if s != "hf_generate"}
        result["workloads"][w] = entry
    bar.close()
    result["greedy_agreement"] = all(a["equal"] for e in result["workloads"].values()
                                     for a in e.get("agreement_with_hf_generate", {}).values())
    return result


def table(result: dict) -> tuple[list[str], list[list]]:
    headers = ["workload", "system", "prefill tok/s", "decode tok/s", "output tok/s", "total s", "CPU s",
               "vattn x (output tok/s)", "vattn x (CPU time)", "greedy = generate"]
    rows = []
    for w, e in result["workloads"].items():
        v = e["systems"].get("vattn")
        for s, x in e["systems"].items():
            ratio = e.get("vattn_over", {}).get(s, {}).get("output", "-")
            cpu = x["total_cpu_s"] / v["total_cpu_s"] if v is not None and s != "vattn" else "-"
            agree = e.get("agreement_with_hf_generate", {}).get(s)
            rows.append([w, s, x["prefill_tok_s"], x["decode_tok_s"], x["output_tok_s"], x["total_s"],
                         x["total_cpu_s"], ratio, cpu,
                         "-" if agree is None else f"{agree['sequences_equal']}/{agree['sequences']}"])
    return headers, rows


def plot(result: dict) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(result["workloads"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    colors = {"vattn": "tab:blue", "vattn_async": "tab:cyan", "vattn_sync": "tab:purple", "hf_generate": "tab:orange",
              "hf_cb": "tab:green"}
    for ax, key, label in zip(axes, ("prefill_tok_s", "decode_tok_s", "output_tok_s"),
                              ("prefill tokens/s", "decode tokens/s", "output tokens/s (end to end)")):
        for j, w in enumerate(workloads):
            systems = result["workloads"][w]["systems"]
            width = 0.8 / max(len(systems), 1)
            for i, (s, x) in enumerate(systems.items()):
                pos = j + (i - (len(systems) - 1) / 2) * width
                ax.bar(pos, x[key], width, color=colors.get(s), label=s if j == 0 else None)
                ax.text(pos, x[key], f"{x[key]:.0f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(workloads)), [f"{w}\n({result['workloads'][w]['requests']} requests)"
                                              for w in workloads])
        ax.set_title(label, fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"vattn.LLM vs transformers generate / continuous batching ({result['device']}, "
                 f"threads={result['threads']}, {result['parameters'] / 1e6:.0f} M parameters)", fontsize=10)
    return fig
