"""Several servers, one memory: two `vattn serve` servers with alternating bursts, on one
shared budget (`--budget NAME`) against two static halves of the same total
(`--memory-limit total/2` each).

Two tiny Llamas (character-level tokenizers, other weights), each behind its own `vattn
serve` process, on the host backend (`--device cpu`, the default) or one GPU (`--device
cuda`: both servers on GPU 0, their KV pages 2 MiB VMM pages; the shared budget is keyed by
the GPU's UUID). Bursts alternate: A gets `--requests` streaming chat
requests at once, then, after `--gap-s`, B does, and so on for `--cycles`. No idle trim
by default (`--idle-trim-s`): memory moves only when a server asks for it. With static
halves a burst can use half the memory however long the other server idles; on the
shared budget the bursting server asks the idle one, whose budget responder gives back
its free pages and the blocks transformers keeps for prefix sharing. Reports per server and
mode: requests served, time to first token (p50, p99), request latency, each burst's
makespan, peak KV memory; the physical KV memory of each server over time (the plot: on
the host read from each process's vattn memfd; on a GPU each process's device memory from
NVML, less what it held before its first burst: weights, CUDA context and torch's cache
besides the KV pages). Greedy answers of the two modes must be equal.
Writes multi_server_<device>.json and .png (benchmarks/results/, or $VATTN_BENCH_OUT).

    OMP_NUM_THREADS=1 python benchmarks/multi_server.py [--device cuda] [--requests 16] [--cycles 4] [--quick]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import signal
import string
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _common import environment, free_port, latency_stats, print_table, save, wait_healthy  # noqa: E402

from vattn.vmem.host import process_page_bytes  # noqa: E402  (a server's KV memory, from /proc)

MB = 1 << 20


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    return 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * 4  # K and V, fp32


class GpuMemory:
    """Device memory of processes from NVML (nvidia-ml-py, in the GPU image): what
    `nvidia-smi --query-compute-apps` shows, read in-process every sample."""

    def __init__(self) -> None:
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def __call__(self, pid: int) -> int:
        try:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except self.nvml.NVMLError:
            return 0
        return sum(p.usedGpuMemory or 0 for p in procs if p.pid == pid)


def memory_reader(device: str) -> Any:
    """pid -> bytes: a server's KV memory on the host (its memfd), or its device memory."""
    return process_page_bytes if device == "cpu" else GpuMemory()


def launch_server(ckpt: str, mode: str, args: argparse.Namespace, budget_dir: str, log: Path) -> tuple[Any, int]:
    """Start one `vattn serve` process (not waited for: `start_servers` waits for both)."""
    port = free_port()
    memory = ["--budget", "bench", "--budget-limit", str(args.total_bytes)] if mode == "shared" else \
        ["--memory-limit", str(args.total_bytes // 2)]
    cmd = [sys.executable, "-m", "vattn", "serve", "--engine", "transformers", "--model", ckpt, "--port", str(port),
           "--device", args.device,
           "--num-blocks", str(args.num_blocks), "--block-size", str(args.block_tokens), "--page-size",
           str(args.page_size), "--idle-trim-s", str(args.idle_trim_s), *memory]
    env = dict(os.environ, OMP_NUM_THREADS="1", VATTN_BUDGET_DIR=budget_dir,
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, port


def start_servers(ckpts: dict[str, str], mode: str, args: argparse.Namespace, budget_dir: str,
                  tmp: Path) -> dict[str, tuple[Any, int]]:
    """Both servers started together (each imports torch and transformers: seconds), then waited for."""
    servers: dict[str, tuple[Any, int]] = {}
    try:
        for n, c in ckpts.items():
            servers[n] = launch_server(c, mode, args, budget_dir, tmp / f"{mode}-{n}.log")
        for n, (proc, port) in servers.items():
            wait_healthy(proc, port, tmp / f"{mode}-{n}.log")
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict[str, tuple[Any, int]]) -> None:
    for proc, _ in servers.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc, _ in servers.values():
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ask(client: Any, ckpt: str, prompt: str, max_tokens: int, t0: float) -> dict[str, Any]:
    """One streaming chat request: its text, time to first token and latency (seconds)."""
    start = time.monotonic()
    first, text = None, []
    try:
        stream = client.chat.completions.create(model=ckpt, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True)
        for chunk in stream:
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta:
                first = first if first is not None else time.monotonic()
                text.append(delta)
    except Exception as e:  # counted as not served
        return {"ok": False, "error": repr(e), "start": start - t0}
    end = time.monotonic()
    return {"ok": True, "text": "".join(text), "ttft": (first or end) - start, "latency": end - start,
            "start": start - t0, "end": end - t0}


def run_mode(mode: str, ckpts: dict[str, str], prompts: dict[str, list[list[str]]], args: argparse.Namespace,
             tmp: Path) -> dict[str, Any]:
    import openai

    budget_dir = str(tmp / f"budgets-{mode}")
    servers = start_servers(ckpts, mode, args, budget_dir, tmp)
    try:
        clients = {n: openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300,
                                    max_retries=0) for n, (_, port) in servers.items()}
        read = memory_reader(args.device)
        for n in ckpts:  # builds each server's cache (its first request), not measured
            ask(clients[n], ckpts[n], "warm up", 2, time.monotonic())
        time.sleep(0.5)
        # on a GPU a process holds weights, its CUDA context and torch's cache besides the KV pages:
        # count what it holds over its level now (after the warm-up built its cache, before any burst)
        base = [read(p.pid) - (args.trash_bytes if args.device != "cpu" else 0) for p, _ in servers.values()] \
            if args.device != "cpu" else [0, 0]
        samples: list[tuple[float, int, int]] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.wait(0.02):
                samples.append((time.monotonic() - t0, *(max(0, read(p.pid) - b)
                                                         for (p, _), b in zip(servers.values(), base))))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        results: dict[str, list[dict]] = {n: [] for n in ckpts}
        bursts = []
        with concurrent.futures.ThreadPoolExecutor(args.requests) as ex:
            for cycle in range(args.cycles):
                for n in ckpts:
                    b0 = time.monotonic() - t0
                    futures = [ex.submit(ask, clients[n], ckpts[n], p, args.max_tokens, t0)
                               for p in prompts[n][cycle]]
                    got = [f.result() for f in futures]
                    results[n] += got
                    bursts.append({"server": n, "cycle": cycle, "start": b0, "end": time.monotonic() - t0,
                                   "served": sum(r["ok"] for r in got)})
                    print(f"  {mode:6} cycle {cycle} {n}: {bursts[-1]['served']}/{len(got)} served in "
                          f"{bursts[-1]['end'] - b0:.2f} s", flush=True)
                    time.sleep(args.gap_s)
        stop.set()
        sampler.join()
    finally:
        stop_servers(servers)
    out: dict[str, Any] = {"bursts": bursts, "samples": samples}
    for i, n in enumerate(ckpts):
        ok = [r for r in results[n] if r["ok"]]
        out[n] = {"sent": len(results[n]), "served": len(ok),
                  "ttft_s": latency_stats([r["ttft"] for r in ok]),
                  "latency_s": latency_stats([r["latency"] for r in ok]),
                  "burst_s": latency_stats([b["end"] - b["start"] for b in bursts if b["server"] == n]),
                  "peak_MiB": max(s[1 + i] for s in samples) / MB,
                  "texts": [r.get("text") for r in results[n]],
                  "errors": [r["error"] for r in results[n] if not r["ok"]][:5]}
    out["peak_sum_MiB"] = max(s[1] + s[2] for s in samples) / MB
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where both servers run (cuda: GPU 0, 2 MiB pages)")
    ap.add_argument("--requests", type=int, default=16, help="requests of each burst")
    ap.add_argument("--cycles", type=int, default=4, help="bursts at A then at B, this many times")
    ap.add_argument("--prompt-chars", type=int, nargs=2, default=(40, 80), help="prompt length range (tokens)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens each request generates")
    ap.add_argument("--total-mib", type=float, default=None,
                    help="KV memory for the two servers together (a burst needs about 10 MiB at once); "
                         "default 8 on the host, 16 on a GPU (its trash sectors take a 2 MiB page a server)")
    ap.add_argument("--gap-s", type=float, default=1.5, help="idle seconds after each burst")
    ap.add_argument("--idle-trim-s", type=float, default=-1, help="each server's idle policy (default: never)")
    ap.add_argument("--hidden", type=int, default=None, help="default 128 on the host, 1024 on a GPU")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=None, help="default 4 on the host, 8 on a GPU")
    ap.add_argument("--kv-heads", type=int, default=None, help="default 4 on the host, 8 on a GPU")
    ap.add_argument("--groups", type=int, default=None,
                    help="on a GPU: the total in page groups (a group: one 2 MiB page of each of the 2 x layers KV "
                         "buffers) instead of --total-mib; default 6 (--quick 4)")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="8 requests a burst, one cycle")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    # On a GPU a page is 2 MiB of each KV buffer: the host's model (hidden 128) would fit a whole
    # burst in one page group, so the GPU's has 4 KiB of each buffer a token (hidden 1024, 8 KV
    # heads, fp32): a group holds 512 tokens, 32 blocks, and a burst (16 requests of 136-176
    # tokens, about 160 blocks) needs 5 groups: more than a static half of 6, less than the whole.
    for name, host, gpu in (("hidden", 128, 1024), ("heads", 4, 8), ("kv_heads", 4, 8)):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else host)
    if args.total_mib is None:
        args.total_mib = 16.0 if cuda else 8.0
    if args.quick:
        args.requests, args.cycles, args.total_mib = 8, 1, args.total_mib / 2
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    block_bytes = kv_bytes_per_token(args) * args.block_tokens
    # transformers' sector is one block; a page holds one (the host) or 2 MiB of them (a GPU)
    args.page_size = 2 * MB if cuda else block_bytes
    args.num_blocks = int(args.total_mib * MB) // block_bytes  # virtual: each server may map the whole total
    args.trash_bytes = -(-2 * block_bytes // args.page_size) * args.page_size  # a cache's two trash sectors' pages
    args.total_bytes = args.num_blocks * block_bytes + 2 * args.trash_bytes
    if cuda:  # whole page groups, half of them each in the static mode
        group_bytes = args.page_size * 2 * args.layers
        groups = args.groups or (4 if args.quick else 6)
        if groups % 2:
            raise SystemExit(f"--groups {groups}: an even number, so that each static half is whole groups")
        args.total_bytes = groups * group_bytes
        args.num_blocks = args.total_bytes // block_bytes
        args.total_mib = args.total_bytes / MB

    from vattn.bench._models import char_checkpoint

    rng = random.Random(0)
    letters = string.ascii_letters + string.digits + " "
    prompts = {n: [["".join(rng.choice(letters) for _ in range(rng.randint(*args.prompt_chars)))
                    for _ in range(args.requests)] for _ in range(args.cycles)] for n in ("A", "B")}
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpts = {n: char_checkpoint(tmp / n, seed=seed, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                    num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                    num_key_value_heads=args.kv_heads, max_position_embeddings=1024)
                 for n, seed in (("A", 0), ("B", 1))}
        for mode in ("static", "shared"):
            runs[mode] = run_mode(mode, ckpts, prompts, args, tmp)
    same = all(runs["static"][n]["texts"] == runs["shared"][n]["texts"] for n in ("A", "B"))
    rows = []
    for mode, r in runs.items():
        for n in ("A", "B"):
            s = r[n]
            rows.append([mode, n, f"{s['served']}/{s['sent']}", s["ttft_s"]["p50"], s["ttft_s"]["p99"],
                         s["latency_s"]["p50"], s["latency_s"]["p99"], s["burst_s"]["mean"], s["peak_MiB"]])
    print(f"\n{args.cycles} cycles of {args.requests}-request bursts at A then B; {args.total_bytes / MB:.1f} MiB of "
          f"KV memory in all (one budget, or {args.total_bytes / 2 / MB:.1f} MiB each); same greedy answers: {same}")
    print_table(["mode", "server", "served", "TTFT p50 s", "TTFT p99 s", "latency p50 s", "latency p99 s",
                 "burst s (mean)", "peak MiB"], rows)
    ratios = {f"{n}_{k}_shared_over_static": runs["shared"][n][m][q] / runs["static"][n][m][q]
              for n in ("A", "B") for k, m, q in (("ttft_p50", "ttft_s", "p50"), ("ttft_p99", "ttft_s", "p99"),
                                                  ("burst_s", "burst_s", "mean"))}
    print(ratios)
    print(f"peak of A + B: static {runs['static']['peak_sum_MiB']:.2f} MiB, shared {runs['shared']['peak_sum_MiB']:.2f} "
          f"MiB (limit {args.total_bytes / MB:.2f} MiB)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True, sharey=True)
    for ax, mode in zip(axes, ("static", "shared")):
        t, a, b = zip(*runs[mode]["samples"])
        ax.stackplot(t, [x / MB for x in a], [x / MB for x in b], labels=["server A", "server B"], alpha=0.8)
        ax.axhline(args.total_bytes / MB, color="k", ls="--", lw=1, label="total")
        if mode == "static":
            ax.axhline(args.total_bytes / 2 / MB, color="grey", ls=":", lw=1, label="each half")
        for burst in runs[mode]["bursts"]:
            ax.axvspan(burst["start"], burst["end"], color="C0" if burst["server"] == "A" else "C1", alpha=0.08)
        s = runs[mode]
        ax.set(ylabel="KV memory (MiB)", title=f"{mode}: TTFT p50/p99 A {s['A']['ttft_s']['p50']:.2f}/"
               f"{s['A']['ttft_s']['p99']:.2f} s, B {s['B']['ttft_s']['p50']:.2f}/{s['B']['ttft_s']['p99']:.2f} s")
        ax.legend(loc="upper right")
    axes[-1].set_xlabel("seconds (shaded: the bursts)")
    payload = {
        "environment": environment(args.device),
        "args": vars(args),
        "same_greedy_answers": same,
        "ratios": ratios,
        "modes": {m: {"peak_sum_MiB": r["peak_sum_MiB"], "bursts": r["bursts"],
                      **{n: {k: v for k, v in r[n].items() if k != "texts"} for n in ("A", "B")}}
                  for m, r in runs.items()},
        "memory_over_time": {m: r["samples"][::5] for m, r in runs.items()},
    }
    save(f"multi_server_{args.device}", payload, fig)
    if not same:
        raise SystemExit("the two modes answered differently")


if __name__ == "__main__":
    main()
