"""Other projects' clients against `vattn serve` (issue 36, "Clients as the bar"): vLLM's
benchmark client, guidellm, and Prometheus reading vLLM's Grafana queries.

Starts `vattn serve` (vattn's engine, the default) on a tiny seeded Llama with a character
tokenizer written to a temporary directory (`char_checkpoint`; nothing downloads), on
127.0.0.1, then runs, each client from a virtual environment of its own (they pin other
torch / transformers releases than vattn's):

- `vllm bench serve` (vLLM 0.33.0's client, `python -m vllm.entrypoints.cli.main`), random
  dataset, `--backend openai` (/v1/completions, with vLLM's sampling fields) and
  `--backend openai-chat` (/v1/chat/completions, greedy); the bar: 0 failed requests;
- `guidellm run` (0.8.1): two constant rates and a short sweep, synthetic prompts; the bar:
  0 errored requests (requests still in flight when a strategy's time is up are
  "incomplete": guidellm cancels them, and counts them apart);
- Debian's `prometheus` scraping /metrics every second while a small load runs, then every
  query of vLLM's example Grafana dashboard (`benchmarks/data/vllm_grafana_queries.txt`,
  `vllm:` renamed `vattn:`, `$model_name` the served name, `$__rate_interval` 30s) through
  its HTTP API; the bar: at least 14 of the 16 panels' queries return data (a finite value).

A client whose environment is missing is skipped, saying how to make it (`--setup NAME`
makes it: the exact pip / apt-get commands are in `SETUP`). Writes
benchmarks/results/peer_clients_cpu.json and prints a table; exits 1 below the bar (and on
any ERROR line in the server's log). `tests/integrations/test_serve_peer_clients.py` (slow)
runs it with --quick.

    OMP_NUM_THREADS=1 python benchmarks/peer_clients.py [--clients vllm,guidellm,prometheus]
        [--num-prompts 100] [--quick] [--setup vllm|guidellm|prometheus]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import environment, free_port, print_table, save, wait_healthy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny"  # the served name
QUERIES = REPO / "benchmarks" / "data" / "vllm_grafana_queries.txt"  # a copy of ../shared/data/'s
VLLM_VENV = Path(os.environ.get("VATTN_VLLM_CLIENT_VENV", "/tmp/venv-vllm"))
GUIDELLM_VENV = Path(os.environ.get("VATTN_GUIDELLM_VENV", "/tmp/venv-guidellm"))
PROMETHEUS = os.environ.get("VATTN_PROMETHEUS", "prometheus")

# How each client's environment is made (`--setup NAME`). vLLM's wheel goes in with --no-deps
# beside the modules its client imports (found by trying); torch 2.13.0 first, a CPU build, and
# xgrammar with --no-deps too: it requires torch, and pip would fetch vLLM's CUDA torch (GBs).
_VLLM_CLIENT_DEPS = ("numpy packaging regex pyyaml huggingface_hub pydantic cbor2 psutil pyzmq transformers<5.21 "
                     "aiohttp requests openai-harmony openai msgspec cloudpickle pillow pybase64 cachetools uvloop "
                     "py-cpuinfo fastapi prometheus_client partial_json_parser uvicorn watchfiles orjson "
                     "apache-tvm-ffi einops").split()
_VLLM_PIP = [str(VLLM_VENV / "bin" / "python"), "-m", "pip", "install"]
_GUIDELLM_PIP = [str(GUIDELLM_VENV / "bin" / "python"), "-m", "pip", "install"]
SETUP: dict[str, list[list[str]]] = {
    "vllm": [[sys.executable, "-m", "venv", str(VLLM_VENV)], [*_VLLM_PIP, "torch==2.13.0"],
             [*_VLLM_PIP, "--no-deps", "vllm==0.33.0", "xgrammar==0.2.8", "llguidance"],
             [*_VLLM_PIP, *_VLLM_CLIENT_DEPS]],
    "guidellm": [[sys.executable, "-m", "venv", str(GUIDELLM_VENV)],
                 [*_GUIDELLM_PIP, "torch==2.13.0"],  # first: else guidellm's torch requirement pulls a CUDA build
                 [*_GUIDELLM_PIP, "guidellm==0.8.1"]],
    "prometheus": [["apt-get", "update"], ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]],
}


def setup(name: str) -> None:
    """Make client `name`'s environment (the commands of `SETUP[name]`)."""
    for cmd in SETUP[name]:
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))


def missing(name: str) -> str | None:
    """Why client `name` cannot run here (None: it can)."""
    how = f"make it with: python benchmarks/peer_clients.py --setup {name}"
    if name == "vllm" and not (VLLM_VENV / "bin" / "python").exists():
        return f"no vLLM client venv at {VLLM_VENV} (VATTN_VLLM_CLIENT_VENV); {how}"
    if name == "guidellm" and not (GUIDELLM_VENV / "bin" / "guidellm").exists():
        return f"no guidellm venv at {GUIDELLM_VENV} (VATTN_GUIDELLM_VENV); {how}"
    if name == "prometheus" and shutil.which(PROMETHEUS) is None:
        return f"no `prometheus` binary (VATTN_PROMETHEUS); {how} (Debian's package)"
    if name in ("vllm", "guidellm"):  # default venvs under /tmp: run only what this user made
        from vattn.checks import not_own

        exe = VLLM_VENV / "bin" / "python" if name == "vllm" else GUIDELLM_VENV / "bin" / "guidellm"
        if (why := not_own(str(exe))) is not None:
            return f"the {name} venv is not one to run: {why}; {how}"
    return None


# ------------------------------------------------------------------- server ----
def start_server(ckpt: str, log: Path, max_num_seqs: int) -> tuple[subprocess.Popen, int, list[str]]:
    port = free_port()
    cmd = [sys.executable, "-m", "vattn", "serve", "--model", ckpt, "--port", str(port), "--device", "cpu",
           "--served-model-name", MODEL, "--max-model-len", "512", "--max-num-seqs", str(max_num_seqs),
           "--page-size", "4096", "--log-level", "warning"]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=REPO)
    wait_healthy(proc, port, log, "vattn serve")
    return proc, port, cmd


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def client_env(venv: Path) -> dict[str, str]:
    """A client's environment: its venv, no vattn on the path, nothing from a hub."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return dict(env, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VIRTUAL_ENV=str(venv),
                PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", NO_COLOR="1")


def version(venv: Path, dist: str) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "?"


def _run(cmd: list[str], env: dict, log: Path, timeout: float, cwd: Path) -> int:
    with log.open("w") as f:
        try:
            return subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  timeout=timeout, cwd=cwd).returncode
        except subprocess.TimeoutExpired:
            return 124


# ------------------------------------------------------------- vLLM's client ----
VLLM_RUNS = {  # name: the backend and what else it sends
    "openai": ["--backend", "openai", "--endpoint", "/v1/completions", "--temperature", "0.8", "--top-p", "0.95",
               "--top-k", "20", "--min-p", "0.01", "--repetition-penalty", "1.1", "--frequency-penalty", "0.1",
               "--presence-penalty", "0.1"],
    "openai-chat": ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--temperature", "0"],
}


def run_vllm(port: int, ckpt: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    rows = []
    for name, extra in VLLM_RUNS.items():
        out = tmp / f"vllm-{name}.json"
        cmd = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.cli.main", "bench", "serve", *extra,
               "--base-url", f"http://127.0.0.1:{port}", "--model", MODEL, "--tokenizer", ckpt,
               "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
               str(args.output_len), "--num-prompts", str(args.num_prompts), "--max-concurrency",
               str(args.concurrency), "--ignore-eos", "--seed", "0", "--disable-tqdm", "--save-result",
               "--result-dir", str(tmp), "--result-filename", out.name]
        log = tmp / f"vllm-{name}.log"
        rc = _run(cmd, client_env(VLLM_VENV), log, args.client_timeout, tmp)
        row: dict[str, Any] = {"client": "vllm bench serve", "run": f"--backend {name}", "rc": rc,
                               "command": " ".join(cmd[1:])}
        if out.exists():
            r = json.loads(out.read_text())
            row.update(ok=r["completed"], failed=r["failed"], output_tok_s=r["output_throughput"],
                       ttft_p50_ms=r["median_ttft_ms"], itl_p50_ms=r["median_itl_ms"],
                       output_tokens=r["total_output_tokens"], errors=sorted({e for e in r.get("errors", []) if e}),
                       warnings=[line for line in log.read_text(errors="replace").splitlines()  # but the default's
                                 if line.startswith("WARNING:") and "temperature==0" not in line])
        else:
            row.update(ok=0, failed=args.num_prompts, error=_tail(log))
        rows.append(row)
    return rows


# ------------------------------------------------------------------ guidellm ----
def guidellm_runs(quick: bool) -> dict[str, tuple[str, int]]:
    """name: (--profile, seconds per strategy)."""
    s = 3 if quick else 5
    return {"constant@2": ("kind=constant,rate=2", s), "constant@8": ("kind=constant,rate=8", s),
            "sweep": (f"kind=sweep,sweep_size={3 if quick else 4}", s)}


def run_guidellm(port: int, ckpt: str, args: argparse.Namespace, tmp: Path) -> list[dict]:
    rows = []
    for name, (profile, seconds) in guidellm_runs(args.quick).items():
        out = tmp / f"guidellm-{name.replace('@', '-')}.json"
        cmd = [str(GUIDELLM_VENV / "bin" / "guidellm"), "run",
               "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model={MODEL}",
               "--tokenizer", f"kind=huggingface_auto,model={ckpt}", "--profile", profile,
               "--constraint", f"kind=max_duration,seconds={seconds}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
               "--output", f"kind=json,path={out}", "--disable-console-interactive"]
        log = tmp / f"guidellm-{name}.log"
        rc = _run(cmd, client_env(GUIDELLM_VENV), log, args.client_timeout, tmp)
        row: dict[str, Any] = {"client": "guidellm run", "run": name, "rc": rc, "command": " ".join(cmd[1:])}
        if out.exists():
            benches = json.loads(out.read_text())["benchmarks"]
            totals = [b["metrics"]["request_totals"] for b in benches]
            tok_s = [b["metrics"]["output_tokens_per_second"]["successful"]["mean"] for b in benches]
            ttft = [b["metrics"]["time_to_first_token_ms"]["successful"]["median"] for b in benches]
            row.update(ok=sum(t["successful"] for t in totals), failed=sum(t["errored"] for t in totals),
                       incomplete=sum(t["incomplete"] for t in totals), strategies=len(benches),
                       output_tok_s=max(tok_s), ttft_p50_ms=min(ttft))
        else:
            row.update(ok=0, failed=None, error=_tail(log))
        rows.append(row)
    return rows


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


# ---------------------------------------------------------------- Prometheus ----
def grafana_queries(model: str = MODEL, rate_interval: str = "30s") -> list[tuple[str, str]]:
    """(panel, PromQL) of vLLM's example dashboard, renamed for vattn: the 16 panels' queries,
    then the template variable's (`model_name`)."""
    rows = [line.split("\t", 1) for line in QUERIES.read_text().splitlines() if "\t" in line and line[0] != "#"]
    return [(panel, q.replace("vllm:", "vattn:").replace("$model_name", model)
             .replace("$__rate_interval", rate_interval)) for panel, q in rows]


def _get_json(url: str, timeout: float = 10) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


def small_load(port: int, seconds: float, max_requests: int, threads: int = 4) -> dict[str, int]:
    """Completions and chats (streamed and not, some cut by a stop token) from `threads`
    threads for `seconds` s, at most `max_requests`."""
    counts = {"ok": 0, "failed": 0}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def one(i: int) -> None:
        if i % 2:
            path, body = "/v1/completions", {"prompt": f"request {i}: the pages of a cache", "max_tokens": 8 + i % 9}
        else:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"hello {i}"}],
                                                  "max_tokens": 8 + i % 7}
        body |= {"model": MODEL, "stream": i % 3 == 0, "ignore_eos": i % 4 != 0}
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                r.read()
                ok = r.status == 200
        except OSError:
            ok = False
        with lock:
            counts["ok" if ok else "failed"] += 1

    def worker(k: int) -> None:
        i = k
        while time.monotonic() < deadline and i < max_requests:
            one(i)
            i += threads

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return counts


def _has_data(result: list[dict]) -> bool:
    """A query's vector has a finite value (Grafana draws it)."""
    for series in result:
        try:
            if math.isfinite(float(series["value"][1])):
                return True
        except (KeyError, ValueError, TypeError):
            pass
    return False


def run_prometheus(port: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    prom_port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      f"  - job_name: vattn\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n")
    cmd = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"]
    log = tmp / "prometheus.log"
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, cwd=tmp)
    api = f"http://127.0.0.1:{prom_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                targets = _get_json(api + "/api/v1/targets")["data"]["activeTargets"]
                if targets and targets[0]["health"] == "up":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"prometheus did not scrape the server; its log: {log}\n{_tail(log)}")
            time.sleep(0.5)
        load = small_load(port, args.prom_load_s, args.num_prompts)
        time.sleep(3)  # two more scrapes after the last request
        rows = []
        for panel, query in grafana_queries(rate_interval=args.rate_interval):
            answer = _get_json(api + "/api/v1/query?" + urllib.parse.urlencode({"query": query}))
            result = answer.get("data", {}).get("result", [])
            rows.append({"panel": panel, "query": query, "status": answer.get("status"), "series": len(result),
                         "data": _has_data(result), "values": [s["value"][1] for s in result][:4]})
        version_line = subprocess.run([PROMETHEUS, "--version"], capture_output=True, text=True).stdout
        panels = [r for r in rows if not r["panel"].startswith("(")]
        return {"version": version_line.split("\n")[0], "scrape_interval": "1s", "rate_interval": args.rate_interval,
                "load": load, "queries": rows, "with_data": sum(r["data"] for r in panels), "of": len(panels),
                "command": " ".join(cmd)}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


# --------------------------------------------------------------------- main ----
def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", default="vllm,guidellm,prometheus")
    p.add_argument("--num-prompts", type=int, default=100, help="vllm bench's requests a run (and the load's cap)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prom-load-s", type=float, default=15.0, help="seconds of load while Prometheus scrapes")
    p.add_argument("--rate-interval", default="30s", help="$__rate_interval")
    p.add_argument("--client-timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="fewer requests and shorter runs")
    p.add_argument("--out", default=None, help="folder of the result (default benchmarks/results)")
    p.add_argument("--setup", choices=sorted(SETUP), help="make that client's environment, then exit")
    args = p.parse_args(argv)
    if args.setup:
        setup(args.setup)
        return {}
    if args.quick:
        args.num_prompts, args.output_len, args.prom_load_s = min(args.num_prompts, 30), min(args.output_len, 16), 8.0
    from vattn.bench._models import char_checkpoint

    clients = [c for c in args.clients.split(",") if c]
    skipped = {c: why for c in clients if (why := missing(c))}
    result: dict[str, Any] = {"environment": environment("cpu"), "skipped": skipped, "runs": [], "prometheus": None}
    with tempfile.TemporaryDirectory(prefix="vattn-peers-") as d:
        tmp = Path(d)
        ckpt = char_checkpoint(tmp / "ckpt")
        proc, port, cmd = start_server(ckpt, tmp / "server.log", args.concurrency * 2)
        result["server"] = " ".join(["vattn", *cmd[3:]])
        try:
            if "vllm" in clients and "vllm" not in skipped:
                result["versions"] = {"vllm": version(VLLM_VENV, "vllm")}
                result["runs"] += run_vllm(port, ckpt, args, tmp)
            if "guidellm" in clients and "guidellm" not in skipped:
                result.setdefault("versions", {})["guidellm"] = version(GUIDELLM_VENV, "guidellm")
                result["runs"] += run_guidellm(port, ckpt, args, tmp)
            if "prometheus" in clients and "prometheus" not in skipped:
                result["prometheus"] = run_prometheus(port, args, tmp)
        finally:
            stop(proc)
            lines = (tmp / "server.log").read_text(errors="replace").splitlines()
            errors = [i for i, line in enumerate(lines) if re.search(r"\bERROR\b", line)]
            result["server_log_errors"] = len(errors)  # the first one's traceback, whole:
            result["server_log_first_error"] = lines[errors[0]:errors[0] + 120] if errors else []
    report(result)
    save("peer_clients_cpu", result, out=args.out)
    return result


def report(result: dict[str, Any]) -> None:
    rows = [[r["client"], r["run"], r.get("ok"), r.get("failed"), r.get("incomplete", ""),
             f"{r['output_tok_s']:.0f}" if r.get("output_tok_s") else "-",
             f"{r['ttft_p50_ms']:.1f}" if r.get("ttft_p50_ms") else "-"] for r in result["runs"]]
    if rows:
        print_table(["client", "run", "ok", "failed", "incomplete", "output tok/s", "TTFT p50 ms"], rows)
    prom = result.get("prometheus")
    if prom:
        print_table(["panel", "data", "query"], [[q["panel"], "yes" if q["data"] else "NO", q["query"][:90]]
                                                 for q in prom["queries"]])
        print(f"Prometheus ({prom['version']}): {prom['with_data']} of {prom['of']} panels' queries return data")
    for name, why in result["skipped"].items():
        print(f"skipped {name}: {why}")
    if result.get("server_log_errors"):
        print(f"the server logged {result['server_log_errors']} ERROR lines; the first:",
              *result["server_log_first_error"], sep="\n  ")


def failures(result: dict[str, Any]) -> list[str]:
    """What misses the bar: failed or errored requests, a client that did not finish,
    fewer than 14 of 16 queries with data, ERROR lines in the server's log."""
    out = [f"{r['client']} {r['run']}: {r.get('failed')} failed, rc {r['rc']}" for r in result["runs"]
           if r.get("failed") != 0 or r["rc"] != 0 or not r.get("ok")]
    prom = result.get("prometheus")
    if prom and prom["with_data"] < 14:
        out.append(f"prometheus: {prom['with_data']} of {prom['of']} queries with data")
    if result.get("server_log_errors"):
        out.append(f"the server logged {result['server_log_errors']} ERROR lines")
    return out


if __name__ == "__main__":
    result = main()
    bad = failures(result) if result else []  # nothing to judge after --setup
    if bad:
        sys.exit("below the bar: " + "; ".join(bad))
