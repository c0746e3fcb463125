"""Decode tokens/s at tensor_parallel_size 1 and 2 on the host (gloo), same model, same requests.

TP 1 runs in this process (1 torch thread, then as many threads as ranks); TP 2 spawns two
ranks with torch.multiprocessing, gloo on 127.0.0.1, 1 thread each. Decode tokens/s counts the
iterations after every prompt is computed (each running request gets one token a step).
TP 2 also reports, per decode step and per rank, the engine's control round trips (tensor
collectives on its gloo group, not the model's all-reduces; a *_object collective is two)
and the wall time spent in them (a rank's wait for the other, e.g. rank 1's for rank 0's
sampling before the token broadcast, included). `--tiny`: a 1-layer 64-wide model, so that
the control messages are a large part of a step; `--tp2-only`: skip the TP 1 runs.

    OMP_NUM_THREADS=1 python benchmarks/tp.py [--quick | --tiny] [--tp2-only] [--out DIR]
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


def model_config(quick: bool, tiny: bool = False) -> LlamaConfig:
    if tiny:
        return LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaConfig(vocab_size=4096, hidden_size=256 if quick else 512, intermediate_size=768 if quick else 1536,
                       num_hidden_layers=2 if quick else 4, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=1024)


def round_trip_us(tp, n: int = 1000) -> float:
    """The cost of one control round trip with the ranks in step: a small all-gather on the
    engine's gloo group, back to back."""
    import torch.distributed as dist

    t = torch.zeros(8, dtype=torch.int64)
    out = [torch.zeros_like(t) for _ in range(WORLD)]
    for _ in range(50):
        dist.all_gather(out, t, group=tp.cpu_group)
    start = time.perf_counter()
    for _ in range(n):
        dist.all_gather(out, t, group=tp.cpu_group)
    return 1e6 * (time.perf_counter() - start) / n


def decode_rate(llm: LLM, batch: int, prompt_len: int, max_tokens: int) -> dict:
    """Run `batch` requests; time the iterations that only decode."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        llm.add_request(torch.randint(3, 4096, (prompt_len,), generator=g).tolist(), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in llm.scheduler.running + list(llm.scheduler.waiting)):
        llm.step()  # prefill
    tp = llm.tp  # TP > 1: its control collectives' count and time (`TensorParallel._collective`)
    trips0, control0 = (tp.num_control_round_trips, tp.control_seconds) if tp is not None else (0, 0.0)
    steps, tokens, t = 0, 0, time.perf_counter()
    while llm.has_unfinished():
        tokens += len(llm.scheduler.running)
        llm.step()
        steps += 1
    seconds = time.perf_counter() - t
    r = dict(decode_tokens=tokens, decode_steps=steps, seconds=seconds, tokens_per_s=tokens / seconds,
             ms_per_step=1e3 * seconds / steps)
    if tp is not None:
        r.update(control_round_trips_per_step=(tp.num_control_round_trips - trips0) / steps,
                 control_us_per_step=1e6 * (tp.control_seconds - control0) / steps)
    return r


def _rank(rank: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    with LLM(model_config(args.quick, args.tiny), tensor_parallel_size=WORLD, max_batch_size=args.batch,
             page_size=64 << 10, distributed_timeout_s=120) as llm:
        rtt = round_trip_us(llm.tp)
        decode_rate(llm, args.batch, args.prompt_len, 8)  # warm-up
        r = decode_rate(llm, args.batch, args.prompt_len, args.max_tokens)
        r["round_trip_us"] = rtt
    queue.put((rank, r))


def run_tp2(args: argparse.Namespace) -> dict:
    ctx = torch.multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in range(WORLD))
    for p in procs:
        p.join(60)
    result = results[0]  # rank 0's rate; each rank's control figures
    for key in ("control_round_trips_per_step", "control_us_per_step", "round_trip_us"):
        result[key] = [results[r].pop(key) for r in range(WORLD)]
    return result


def run_tp1(args: argparse.Namespace, threads: int) -> dict:
    torch.set_num_threads(threads)
    with LLM(model_config(args.quick, args.tiny), max_batch_size=args.batch, page_size=64 << 10) as llm:
        decode_rate(llm, args.batch, args.prompt_len, 8)
        return decode_rate(llm, args.batch, args.prompt_len, args.max_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a smaller model and fewer tokens")
    p.add_argument("--tiny", action="store_true", help="a 1-layer 64-wide model: the control messages weigh most")
    p.add_argument("--tp2-only", action="store_true", help="skip the TP 1 runs")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--out", default=None, help="directory for the JSON (default: benchmarks/results)")
    args = p.parse_args()
    args.max_tokens = args.max_tokens or (32 if args.quick else 128)
    runs = {} if args.tp2_only else {"tp1_1thread": run_tp1(args, 1), f"tp1_{WORLD}threads": run_tp1(args, WORLD)}
    runs["tp2_1thread_each"] = run_tp2(args)
    print_table(["run", "decode tok/s", "ms/step", "steps"],
                [(k, r["tokens_per_s"], r["ms_per_step"], r["decode_steps"]) for k, r in runs.items()])
    tp2 = runs["tp2_1thread_each"]
    print("TP 2 control per decode step, rank 0 / rank 1: round trips "
          + " / ".join(f"{n:g}" for n in tp2["control_round_trips_per_step"]) + ", us in them "
          + " / ".join(f"{us:.0f}" for us in tp2["control_us_per_step"]) + "; one round trip in step: "
          + " / ".join(f"{us:.0f}" for us in tp2["round_trip_us"]) + " us")
    cfg = model_config(args.quick, args.tiny)
    save("tp_host", {"environment": environment("cpu"), "cpus": os.cpu_count(),
                     "model": dict(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                                   kv_heads=cfg.num_key_value_heads, intermediate=cfg.intermediate_size,
                                   vocab=cfg.vocab_size, dtype="float32"),
                     "batch": args.batch, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "runs": runs}, out=args.out)


if __name__ == "__main__":
    main()
