"""The GPU suite's bookkeeping: one results.json and one summary.md in OUTDIR.

After every step, `gpu_suite.sh` calls this to record the step's status and to fold the
JSON files the step wrote into OUTDIR/results.json (the files are then removed, so OUTDIR
stays a handful of files), and summary.md is written again from results.json.
Plain Python (no torch) except `--env`.

    python benchmarks/gpu_summary.py OUTDIR --step NAME --status passed --seconds 12 --timeout 90 [--note TEXT]
    python benchmarks/gpu_summary.py OUTDIR --env cuda      # record the environment (imports torch)
    python benchmarks/gpu_summary.py OUTDIR                 # merge and rewrite summary.md only
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

RESULTS, SUMMARY = "results.json", "summary.md"


def load(out: Path) -> dict[str, Any]:
    path = out / RESULTS
    if path.exists():
        try:
            return json.loads(path.read_text())
        except ValueError:
            (out / (RESULTS + ".bad")).write_text(path.read_text())
    return {"suite": {"steps": []}}


def merge(out: Path, results: dict[str, Any]) -> list[str]:
    """Fold every other *.json of OUTDIR into results[stem] and delete the file."""
    merged = []
    for path in sorted(out.glob("*.json")):
        if path.name == RESULTS:
            continue
        try:
            results[path.stem] = json.loads(path.read_text())
        except ValueError as e:
            results[path.stem] = {"error": f"unreadable JSON: {e}"}
        path.unlink()
        merged.append(path.stem)
    return merged


def write(out: Path, results: dict[str, Any]) -> None:
    tmp = out / (RESULTS + ".tmp")
    tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
    tmp.replace(out / RESULTS)
    (out / SUMMARY).write_text(summary(results))


# ------------------------------------------------------------------------ markdown ----
def _fmt(x: Any) -> str:
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.4g}"
    if x is None:
        return "-"
    return str(x)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _env(results: dict[str, Any]) -> str:
    env = results.get("suite", {}).get("env") or {}
    if not env:
        for v in results.values():
            if isinstance(v, dict) and isinstance(v.get("env"), dict):
                env = v["env"]
                break
    keys = ["device", "gpu_memory_GiB", "compute_capability", "driver", "cuda", "torch", "transformers", "python",
            "kernel", "vattn", "commit", "date"]
    return ", ".join(f"{k} {env[k]}" for k in keys if env.get(k) not in (None, ""))


def _steps(results: dict[str, Any]) -> str:
    steps = results.get("suite", {}).get("steps", [])
    if not steps:
        return "(no steps recorded)"
    return table(["step", "status", "seconds", "timeout", "note"],
                 [[s["name"], s["status"].upper() if s["status"] in ("failed", "timeout") else s["status"],
                   s.get("seconds"), s.get("timeout"), s.get("note", "")] for s in steps])


def _vmm(d: dict) -> str:
    parts = [table(["driver", "page MiB", "create us", "map us", "set access us", "unmap us", "release us"],
                   [[r["driver"], r["page_MiB"], r["create"], r["map"], r["set_access"], r["unmap"], r["release"]]
                    for r in d.get("per_call", [])]),
             "", "step() allocation bandwidth:", "",
             table(["driver", "layout", "page MiB", "groups", "GB/s", "us/group"],
                   [[r["driver"], r["layout"], r["page_MiB"], r["groups"], r["GBps"], r["us_per_group"]]
                    for r in d.get("step_bandwidth", [])])]
    return "\n".join(parts)


def _alloc(d: dict) -> str:
    return "\n".join([
        table(["layout", "page KiB", "buffers", "map us", "unmap us", "1 call/buffer us", "GB/s"],
              [[r["layout"], r["page_KiB"], r["buffers"], r["map_us"], r["unmap_us"], r["map_per_buffer_calls_us"],
                r["map_GBps"]] for r in d.get("map", [])]),
        "", "step() in a decode loop:", "",
        table(["mode", "mean us", "p50 us", "p99 us", "max us", "groups mapped in step", "mean / on-demand"],
              [[r["mode"], r["step_us_mean"], r["step_us_p50"], r["step_us_p99"], r["step_us_max"],
                r["groups_mapped_in_step"], r["mean_vs_on_demand"]] for r in d.get("step", [])])])


def _kernels(d: dict) -> str:
    rows = d.get("rows", [])
    ok = [r for r in rows if "error" not in r]
    parts = [f"kernel: {d.get('kernel')}", "",
             table(["layout", "phase", "B", "T", "virtual us", "contiguous us", "strided us", "virtual/contiguous",
                    "equal", "vs SDPA"],
                   [[r["layout"], r["phase"], r["batch"], r["context"], r.get("virtual_us"), r.get("contiguous_us"),
                     r.get("strided_us"), r.get("virtual_vs_contiguous"), r.get("equal_to_contiguous"),
                     r.get("max_abs_diff_vs_sdpa")] for r in ok])]
    summ = d.get("summary")
    for k, v in (summ.items() if isinstance(summ, dict) else [("summary", summ)]):
        parts.append(f"- {k}: {v}")
    parts += [f"- ERROR {r['layout']} {r.get('phase')} B={r['batch']} T={r['context']}: {r['error']}"
              for r in rows if "error" in r]
    parts += [f"- CHECK FAILED {r['layout']} {r['phase']} B={r['batch']} T={r['context']}: {r['check_failed']}"
              for r in rows if "check_failed" in r]
    parts += [f"- skipped {s}" for s in d.get("skipped", [])]
    return "\n".join(parts)


def _overlap(d: dict) -> str:
    m = d.get("model", {})
    a = d.get("args", {})
    runs = d.get("runs", [])
    kernel = runs[0]["kernel"] if runs else "?"
    parts = [f"{m.get('layers')} layers x hidden {m.get('hidden')} ({(m.get('parameters') or 0) / 1e9:.2f} B params), "
             f"batch {a.get('batch')}, {a.get('layout')}, {a.get('iters')} timed decode iterations x {a.get('repeats')}, "
             f"attention kernel {kernel}", "",
             table(["mode", "mean ms", "p50 ms", "p99 ms", "max ms", "iterations mapping"],
                   [[k, v["mean_ms"], v["p50_ms"], v["p99_ms"], v["max_ms"], v["iterations_with_mapping"]]
                    for k, v in d.get("by_mode", {}).items()])]
    for k, v in d.get("ratios", {}).items():
        parts.append(f"- {k}: {_fmt(v)}")
    r = d.get("ratios", {}).get("background/premapped mean")
    if r is not None:
        parts.append(f"- background within 2% of premapped (mean): {_fmt(r <= 1.02)}")
    parts += [f"- ERROR {e}" for e in d.get("errors", [])]
    return "\n".join(parts)


def _e2e(d: dict) -> str:
    a = d.get("args", {})
    rows, notes = [], []
    for r in d.get("results", []):
        for system, s in r.get("systems", {}).items():
            agree = r.get(f"{system}_vs_hf_generate", {})
            rows.append([r["model"], r["batch"], system, s.get("decode_tok_s"), s.get("decode_tok_s_in_run"),
                         s.get("total_tok_s"),
                         s.get("peak_reserved_GiB"), s.get("peak_mapped_GiB"), agree.get("token_match"),
                         agree.get("prefix_match")])
        lg = r.get("first_token_logits_vattn_vs_hf")
        if lg:
            notes.append(f"- {r['model']} B={r['batch']}: first-token logits max abs diff {_fmt(lg['max_abs_diff'])} "
                         f"(max |logit| {_fmt(lg['logits_abs_max'])}), argmax equal {_fmt(lg['argmax_equal'])}")
        v = r.get("systems", {}).get("vattn", {})
        if v.get("after_finish"):
            f = v["after_finish"]
            c = v.get("after_close") or {}
            notes.append(f"- {r['model']} B={r['batch']}: after finish {_fmt(f['mapped_MiB'])} MiB mapped, "
                         f"{_fmt(f['used_MiB'])} MiB used, {_fmt(f['cached_MiB'])} MiB cached (deferred reclamation)"
                         + (f"; close() freed {_fmt(c['gpu_free_rose_MiB'])} of {_fmt(c['created_MiB'])} MiB created: "
                            f"pages returned {_fmt(c['pages_returned'])}" if c else ""))
        for system, e in r.get("errors", {}).items():
            notes.append(f"- ERROR {r['model']} B={r.get('batch')} {system}: {e}")
    models = ", ".join(f"{k}: {v['layers']} layers, {v['parameters'] / 1e9:.2f} B params"
                       for k, v in d.get("models", {}).items())
    return "\n".join([f"prompt {a.get('prompt_len')} tokens, {a.get('max_tokens')} new tokens, greedy, "
                      f"{d.get('dtype', '?')}, vattn layout {a.get('layout')}; {models}", "",
                      table(["model", "B", "system", "decode tok/s", "in-run decode tok/s", "total tok/s",
                             "peak reserved GiB",
                             "vattn mapped GiB", "token match vs generate", "prefix match"], rows)]
                     + notes + [f"- skipped {s}" for s in d.get("skipped", [])])


FORMATTERS: list[tuple[str, str, Callable[[dict], str]]] = [
    ("vmm_latency_cuda", "CUDA VMM call latency (vmm_latency.py)", _vmm),
    ("alloc_latency_cuda", "Page-group map and step latency on CUDA (alloc_latency.py)", _alloc),
    ("gpu_kernels", "FlashAttention on the vattn cache vs a contiguous tensor (gpu_kernels.py)", _kernels),
    ("gpu_overlap", "Hidden allocation latency in a decode loop (gpu_overlap.py)", _overlap),
    ("gpu_e2e", "End-to-end decode throughput vs transformers (gpu_e2e.py)", _e2e),
    ("alloc_latency_host", "Host allocator latency (alloc_latency.py)", _alloc),
    ("gpu_kernels_cpu_check", "CPU check of gpu_kernels.py (host backend; timings meaningless)", _kernels),
    ("gpu_overlap_cpu_check", "CPU check of gpu_overlap.py (host backend; timings meaningless)", _overlap),
    ("gpu_e2e_cpu_check", "CPU check of gpu_e2e.py (host backend; timings meaningless)", _e2e),
]


def summary(results: dict[str, Any]) -> str:
    steps = results.get("suite", {}).get("steps", [])
    failed = [s["name"] for s in steps if s["status"] in ("failed", "timeout")]
    skipped = [s["name"] for s in steps if s["status"] == "skipped"]
    if failed:
        head = f"FAILED: {', '.join(failed)}"
    elif not steps:
        head = "no steps yet"
    else:
        head = "ALL PASSED" if not skipped else f"every step that ran passed; skipped: {', '.join(skipped)}"
    parts = ["# vattn GPU suite", "", f"**{head}**", "", _env(results), "", "## Steps", "", _steps(results)]
    for name, title, fmt in FORMATTERS:
        if name in results:
            try:
                body = fmt(results[name])
            except Exception as e:  # a summary must never break the suite
                body = f"(could not summarise: {type(e).__name__}: {e}; see results.json)"
            parts += ["", f"## {title}", "", body]
    return "\n".join(parts) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--step")
    ap.add_argument("--status", choices=["passed", "failed", "skipped", "timeout"])
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--timeout", type=float)
    ap.add_argument("--note", default="")
    ap.add_argument("--env", default=None, help="record the environment for this device (imports torch)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = load(out)
    results.setdefault("suite", {}).setdefault("steps", [])
    if args.env:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from _common import environment

        results["suite"]["env"] = environment(args.env)
    merged = merge(out, results)
    if args.step:
        results["suite"]["steps"].append(dict(name=args.step, status=args.status, seconds=args.seconds,
                                              timeout=args.timeout, note=args.note, results=merged))
    write(out, results)


if __name__ == "__main__":
    main()
