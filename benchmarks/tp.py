"""Decode tokens/s at tensor_parallel_size 1 and 2 on the host (gloo), same model, same requests.

TP 1 runs in this process (1 torch thread, then as many threads as ranks); TP 2 spawns two
ranks with torch.multiprocessing, gloo on 127.0.0.1, 1 thread each. Decode tokens/s counts the
iterations after every prompt is computed (each running request gets one token a step).

    OMP_NUM_THREADS=1 python benchmarks/tp.py [--quick] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import socket
import time

import torch
from _common import environment, print_table, save
from transformers import LlamaConfig

from vattn import LLM, SamplingParams

WORLD = 2


def model_config(quick: bool) -> LlamaConfig:
    return LlamaConfig(vocab_size=4096, hidden_size=256 if quick else 512, intermediate_size=768 if quick else 1536,
                       num_hidden_layers=2 if quick else 4, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=1024)


def decode_rate(llm: LLM, batch: int, prompt_len: int, max_tokens: int) -> dict:
    """Run `batch` requests; time the iterations that only decode."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        llm.add_request(torch.randint(3, 4096, (prompt_len,), generator=g).tolist(), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in llm.scheduler.running + list(llm.scheduler.waiting)):
        llm.step()  # prefill
    steps, tokens, t = 0, 0, time.perf_counter()
    while llm.has_unfinished():
        tokens += len(llm.scheduler.running)
        llm.step()
        steps += 1
    seconds = time.perf_counter() - t
    return dict(decode_tokens=tokens, decode_steps=steps, seconds=seconds, tokens_per_s=tokens / seconds,
                ms_per_step=1e3 * seconds / steps)


def _rank(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    with LLM(model_config(args.quick), tensor_parallel_size=WORLD, max_batch_size=args.batch,
             page_size=64 << 10, distributed_timeout_s=120) as llm:
        decode_rate(llm, args.batch, args.prompt_len, 8)  # warm-up
        r = decode_rate(llm, args.batch, args.prompt_len, args.max_tokens)
    if rank == 0:
        queue.put(r)


def run_tp2(args: argparse.Namespace) -> dict:
    ctx = torch.multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    result = queue.get(timeout=600)
    for p in procs:
        p.join(60)
    return result


def run_tp1(args: argparse.Namespace, threads: int) -> dict:
    torch.set_num_threads(threads)
    with LLM(model_config(args.quick), max_batch_size=args.batch, page_size=64 << 10) as llm:
        decode_rate(llm, args.batch, args.prompt_len, 8)
        return decode_rate(llm, args.batch, args.prompt_len, args.max_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller model and fewer tokens")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--out", default=None, help="directory for the JSON (default: benchmarks/results)")
    args = p.parse_args()
    args.max_tokens = args.max_tokens or (32 if args.quick else 128)
    runs = {"tp1_1thread": run_tp1(args, 1), f"tp1_{WORLD}threads": run_tp1(args, WORLD), "tp2_1thread_each": run_tp2(args)}
    print_table(["run", "decode tok/s", "ms/step", "steps"],
                [(k, r["tokens_per_s"], r["ms_per_step"], r["decode_steps"]) for k, r in runs.items()])
    cfg = model_config(args.quick)
    save("tp_host", {"environment": environment("cpu"), "cpus": os.cpu_count(),
                     "model": dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                                   kv_heads=cfg.num_key_value_heads, intermediate=cfg.intermediate_size,
                                   vocab=cfg.vocab_size, dtype="float32"),
                     "batch": args.batch, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "runs": runs}, out=args.out)


if __name__ == "__main__":
    main()
