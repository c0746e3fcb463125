"""`vattn serve` (vattn's engine) against the same engine in process: what serving costs.

The same checkpoint (a seeded Llama with a character tokenizer: `tiny`, hidden 64 x 2 layers,
or `llama-512x8`, `vattn bench throughput`'s shape: hidden 512 x 8 layers), the same requests
(random text prompts, greedy, `--max-tokens` each, `ignore_eos`), the same batch size
(`--concurrency` running at most, `--max-batch-tokens` a step), prefix caching on in both:

- in process: `vattn.LLM.generate` of every prompt at once (the engine keeps `--concurrency`
  running, the rest wait in its queue);
- served: `python -m vattn serve --max-num-seqs C` in a process of its own, sent every request
  at once too (one HTTP/1.1 connection each; the server's engine queues what exceeds C), both
  streamed (server-sent events, `include_usage`) and not streamed.

The client is as light as it can be (it shares the CPUs with the server): it reads every byte
of each answer and takes the completion tokens from the usage it carries, nothing else parsed.
Output tokens per second of each, alternating for `--rounds` (the order rotates each round);
the ratios served / in process per round and their geometric mean. The target (issue 36): at
least 0.9x. Writes benchmarks/results/serve_overhead_cpu.json and .png.

Fixed in this version (the first one compared unlike things): the client sent at most C
requests at a time (a new one after each answer, so the engine ran short of C while a
connection closed and the next one opened, tokenized and queued) where `generate` had them all
queued; it parsed every event as JSON on the CPUs the server shares; only streamed answers. Each
server run has a server of its own, warmed up with the first C prompts as `generate` is: one
server for both runs would serve the second from its prefix cache.

On a GPU (`--device cuda`, the GPU suite's serve_overhead stage): `llama-1b`, Llama-3.2-1B's
layers with a character vocabulary, bfloat16; the server runs asynchronous scheduling and CUDA
graphs as `vattn.LLM` does there by default.

    OMP_NUM_THREADS=1 python benchmarks/serve_overhead.py [--device cuda] [--model tiny llama-512x8] [--requests 64]
        [--concurrency 16] [--rounds 3] [--max-tokens 64] [--before DIR (an earlier checkout serves)] [--no-save]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_load  # noqa: E402  (its server process helpers)
from _common import environment, save  # noqa: E402

MODELS = {
    "tiny": {},  # char_checkpoint's default: hidden 64, 2 layers
    "llama-512x8": dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                        num_key_value_heads=4),
    # Llama-3.2-1B's layers (a 128-character vocabulary), saved in bfloat16: the GPU's shape
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, dtype="bfloat16"),
}
MODES = ("engine", "streamed", "whole")
USAGE = re.compile(rb'"completion_tokens":(\d+)')


def in_process(ckpt: str, prompts: list[str], args: argparse.Namespace) -> dict[str, float]:
    """Output tokens per second of `vattn.LLM.generate` over every prompt."""
    from vattn.engine import SamplingParams
    from vattn.serve import build_llm

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    # the server's own engine construction: the same defaults (and the same layout where prefix
    # caching needs the fused one on 2 MiB GPU pages)
    with build_llm(ckpt, device=args.device, max_num_seqs=args.concurrency,
                   max_num_batched_tokens=args.max_batch_tokens, enable_prefix_caching=True) as llm:
        llm.generate(prompts[:args.concurrency], params)  # warm-up
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params)
        span, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / span, "tokens": tokens, "span_s": span, "cpu_ms_per_token": 1e3 * cpu / tokens}


async def _one(port: int, body: bytes) -> int:
    """One completion over plain HTTP/1.1 (Connection: close): every byte read, its completion tokens."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    data = b""
    while chunk := await reader.read(1 << 16):
        data += chunk
    writer.close()
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(data[:200].decode(errors="replace"))
    found = USAGE.findall(data)
    if not found:
        raise RuntimeError("no usage in the answer")
    return int(found[-1])


async def _all_at_once(port: int, bodies: list[bytes]) -> tuple[int, float]:
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(_one(port, b) for b in bodies))
    return sum(counts), time.perf_counter() - t0


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of a process, the main one (the event loop) and the others by id (Linux /proc)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = "main" if task.name == str(pid) else f"thread-{task.name}"
        fields = stat.rsplit(")", 1)[1].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def served(proc: Any, port: int, ckpt: str, prompts: list[str], args: argparse.Namespace,
           stream: bool) -> dict[str, float]:
    """Output tokens per second of `vattn serve` over every prompt, all sent at once."""
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    bodies = [json.dumps({"model": ckpt, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0,
                          "ignore_eos": True, **extra}).encode() for p in prompts]
    c0, client0, threads0 = serve_load.cpu_seconds(proc.pid), time.process_time(), thread_cpu(proc.pid)
    tokens, span = asyncio.run(_all_at_once(port, bodies))
    cpu, client = serve_load.cpu_seconds(proc.pid) - c0, time.process_time() - client0
    threads = {k: round(1e3 * (v - threads0.get(k, 0.0)) / tokens, 4) for k, v in thread_cpu(proc.pid).items()}
    return {"tok_s": tokens / span, "tokens": tokens, "span_s": span, "cpu_ms_per_token": 1e3 * cpu / tokens,
            "client_cpu_ms_per_token": 1e3 * client / tokens,
            "thread_cpu_ms_per_token": {k: v for k, v in threads.items() if v}}


def run_model(name: str, args: argparse.Namespace, prompts: list[str], tmp: Path) -> dict[str, Any]:
    from vattn.bench._models import char_checkpoint

    ckpt = char_checkpoint(tmp / name, max_position_embeddings=2048, **MODELS[name])
    rounds = []
    for r in range(args.rounds):
        args.vattn_engine, args.vattn_args = "vattn", list(args.server_args)
        kind = "vattn-before" if args.before else "vattn"
        got = {}
        order = MODES[r % 3:] + MODES[:r % 3]  # rotates: each mode first once in three rounds
        for mode in order:
            if mode == "engine":
                got[mode] = in_process(ckpt, prompts, args)
                continue
            # a fresh server for each: what one run left in its prefix cache would spare the next its prefills
            proc, port = serve_load.start(kind, ckpt, args, tmp / f"server-{name}-{r}-{mode}.log")
            try:
                stream = mode == "streamed"
                served(proc, port, ckpt, prompts[:args.concurrency], args, stream)  # warm-up, as in process
                got[mode] = served(proc, port, ckpt, prompts, args, stream)
            finally:
                serve_load.stop(proc)
        expected = len(prompts) * args.max_tokens
        for mode, g in got.items():
            if g["tokens"] != expected:
                raise SystemExit(f"{name} {mode}: {g['tokens']} output tokens, expected {expected}")
        ratio = {m: got[m]["tok_s"] / got["engine"]["tok_s"] for m in ("streamed", "whole")}
        rounds.append({"order": list(order), **{m: got[m] for m in MODES}, "ratio": ratio})
        print(f"{name} round {r}: in process {got['engine']['tok_s']:.0f} tok/s, streamed "
              f"{got['streamed']['tok_s']:.0f} ({ratio['streamed']:.3f}x), not streamed {got['whole']['tok_s']:.0f} "
              f"({ratio['whole']:.3f}x); CPU ms/token (server process, all threads): in process "
              f"{got['engine']['cpu_ms_per_token']:.3f}, streamed {got['streamed']['cpu_ms_per_token']:.3f}, "
              f"not streamed {got['whole']['cpu_ms_per_token']:.3f}; by thread: streamed "
              f"{got['streamed']['thread_cpu_ms_per_token']}, not streamed {got['whole']['thread_cpu_ms_per_token']}",
              flush=True)
    geo = {m: math.exp(sum(math.log(x["ratio"][m]) for x in rounds) / len(rounds)) for m in ("streamed", "whole")}
    print(f"{name}: served / in process, geometric mean of {len(rounds)} rounds: streamed {geo['streamed']:.3f}x, "
          f"not streamed {geo['whole']:.3f}x (target >= 0.9x)", flush=True)
    return {"model": name, "shape": MODELS[name] or "char_checkpoint default (hidden 64, 2 layers)",
            "rounds": rounds, "geomean_ratio": geo}


def plot(results: list[dict], args: argparse.Namespace) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    width = 0.35
    for i, res in enumerate(results):
        for j, mode in enumerate(("streamed", "whole")):
            x = i + (j - 0.5) * width
            ax.bar(x, res["geomean_ratio"][mode], width, color=("C0", "C1")[j],
                   label=("streamed", "not streamed")[j] if i == 0 else None)
            ax.scatter([x] * len(res["rounds"]), [r["ratio"][mode] for r in res["rounds"]], color="k", s=8, zorder=3)
            ax.text(x, res["geomean_ratio"][mode] + 0.02, f"{res['geomean_ratio'][mode]:.2f}", ha="center", fontsize=8)
    ax.axhline(0.9, color="r", ls="--", lw=1, label="target 0.9x")
    ax.set_xticks(range(len(results)), [r["model"] for r in results])
    ax.set_ylabel("served / in process (output tok/s)")
    top = max(r["ratio"][m] for res in results for r in res["rounds"] for m in ("streamed", "whole"))
    ax.set_ylim(0, max(1.2, top + 0.15))
    ax.set_title(f"vattn serve vs vattn.LLM.generate: {args.requests} requests at once, max_num_seqs "
                 f"{args.concurrency}, {args.max_tokens} tokens ({args.device})", fontsize=8)
    ax.legend(fontsize=8, loc="lower right")
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", choices=list(MODELS), default=None,
                    help="default: tiny and llama-512x8 on the host, llama-1b on a GPU")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the server and the engine in process)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--prompt-chars", type=int, nargs=2, default=(64, 256))
    ap.add_argument("--server-args", nargs="*", default=[], help="more `vattn serve` arguments")
    ap.add_argument("--before", metavar="DIR", help="serve from this (earlier) vattn checkout instead")
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    if args.model is None:
        args.model = ["llama-1b"] if args.device.startswith("cuda") else ["tiny", "llama-512x8"]

    rng = random.Random(0)
    letters = string.ascii_letters + string.digits + " "
    prompts = ["".join(rng.choice(letters) for _ in range(rng.randint(*args.prompt_chars)))
               for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_model(name, args, prompts, Path(tmp)) for name in args.model]
    if not args.no_save:
        payload = {"environment": environment(args.device), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                   "load_average": os.getloadavg(), "args": vars(args), "results": results}
        save(f"serve_overhead_{args.device.split(':')[0]}", payload, plot(results, args))


if __name__ == "__main__":
    main()
