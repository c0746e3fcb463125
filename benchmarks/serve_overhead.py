"""`vattn serve` (vattn's engine) against the same engine in process: what serving costs.

The same checkpoint (a tiny seeded Llama, character tokenizer), the same requests (random
text prompts, greedy, `--max-tokens` each, `ignore_eos`) and the same batch size: in process,
`vattn.LLM.generate` of every prompt at once (the engine keeps `--concurrency` running);
served, `python -m vattn serve --max-num-seqs C` in a process of its own, loaded with
`serve_load.py`'s HTTP/1.1 client at concurrency C (streamed). Output tokens per second of
each, alternating for `--rounds` (the order flips each round); the ratio served / in process
per round and their geometric mean. The target (issue 36): at least 0.9x.

    OMP_NUM_THREADS=1 python benchmarks/serve_overhead.py [--requests 128] [--concurrency 16] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import string
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_load  # noqa: E402  (its client and server process helpers)


def in_process(ckpt: str, prompts: list[str], args: argparse.Namespace) -> float:
    """Output tokens per second of `vattn.LLM.generate` over every prompt."""
    from vattn.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    with LLM(ckpt, device="cpu", max_batch_size=args.concurrency,
             max_num_batched_tokens=args.max_batch_tokens, enable_prefix_caching=True) as llm:
        llm.generate(prompts[:args.concurrency], params)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        span = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / span


def served(ckpt: str, prompts: list[str], args: argparse.Namespace, log: Path) -> float:
    """Output tokens per second of `vattn serve` (vattn engine) over every prompt, streamed."""
    args.vattn_engine, args.before, args.vattn_args = "vattn", None, []
    proc, port = serve_load.start("vattn", ckpt, args, log)
    try:
        bodies = [{"model": ckpt, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                   "stream_options": {"include_usage": True}} for p in prompts]
        asyncio.run(serve_load.load(port, bodies[:args.concurrency], args.concurrency))  # warm-up
        results = asyncio.run(serve_load.load(port, bodies, args.concurrency))
    finally:
        serve_load.stop(proc)
    summary = serve_load._summary("vattn", results, 0.0)
    if summary["served"] != len(bodies):
        raise SystemExit(f"the server answered {summary['served']} of {len(bodies)}: {summary['errors']}")
    return summary["output_tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--prompt-chars", type=int, nargs=2, default=(64, 256))
    args = ap.parse_args()

    from vattn.bench._models import char_checkpoint

    rng = random.Random(0)
    letters = string.ascii_letters + string.digits + " "
    prompts = ["".join(rng.choice(letters) for _ in range(rng.randint(*args.prompt_chars)))
               for _ in range(args.requests)]
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = char_checkpoint(Path(tmp) / "ckpt", max_position_embeddings=1024)
        for r in range(args.rounds):
            order = ("engine", "server") if r % 2 == 0 else ("server", "engine")
            tok_s = {}
            for kind in order:
                tok_s[kind] = in_process(ckpt, prompts, args) if kind == "engine" else \
                    served(ckpt, prompts, args, Path(tmp) / f"server-{r}.log")
            ratios.append(tok_s["server"] / tok_s["engine"])
            print(f"round {r}: in process {tok_s['engine']:.0f} tok/s, served {tok_s['server']:.0f} tok/s, "
                  f"ratio {ratios[-1]:.3f}x", flush=True)
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"served / in process, geometric mean of {len(ratios)} rounds: {geo:.3f}x (target >= 0.9x)")


if __name__ == "__main__":
    main()
