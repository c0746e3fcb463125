"""The GPU suite's bookkeeping: one results.json and one summary.md in OUTDIR.

After every step, `gpu_suite.sh` calls this to record the step's status and to fold the
JSON files the step wrote into OUTDIR/results.json (the files are then removed, so OUTDIR
stays a handful of files), and summary.md is written again from results.json.
Plain Python (no torch; `vattn.report` for the tables) except `--env` and the `vattn bench`
sections, which use each benchmark module's own `table()`.

    python benchmarks/gpu_summary.py OUTDIR --step NAME --status passed --seconds 12 --timeout 90 [--note TEXT]
    python benchmarks/gpu_summary.py OUTDIR --env cuda      # record the environment (imports torch)
    python benchmarks/gpu_summary.py OUTDIR                 # merge and rewrite summary.md only
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's vattn (its root imports no torch)
from vattn.report import markdown_table  # noqa: E402

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


def _env(results: dict[str, Any]) -> str:
    env = results.get("suite", {}).get("env") or {}
    if not env:
        for v in results.values():
            if isinstance(v, dict) and isinstance(v.get("env") or v.get("environment"), dict):
                env = v.get("env") or v["environment"]
                break
    keys = ["device", "gpu_memory_GiB", "compute_capability", "driver", "cuda", "torch", "transformers", "python",
            "kernel", "vattn", "commit", "date"]
    return ", ".join(f"{k} {env[k]}" for k in keys if env.get(k) not in (None, ""))


def _steps(results: dict[str, Any]) -> str:
    steps = results.get("suite", {}).get("steps", [])
    if not steps:
        return "(no steps recorded)"
    return markdown_table(["step", "status", "seconds", "timeout", "note"],
                          [[s["name"], s["status"].upper() if s["status"] in ("failed", "timeout") else s["status"],
                            s.get("seconds"), s.get("timeout"), s.get("note", "")] for s in steps])


# `vattn bench` payloads, summarised with each module's own table(), in this order
BENCH_ORDER = ("gpu", "kernel", "alloc", "overlap", "e2e", "throughput")


def _bench(d: dict) -> str:
    """A `vattn bench` payload (benchmark, environment, config, result) as its module's table
    and printed notes (importing the module imports torch)."""
    import contextlib
    import io

    from vattn.bench import module

    mod = module(d["benchmark"])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        headers, rows = mod.table(d["result"])
    config = ", ".join(f"{k} {v}" for k, v in d.get("config", {}).items() if v not in (None, False, []))
    notes = [line for line in buf.getvalue().splitlines() if line.strip()]
    return "\n".join([f"config: {config}", ""] + notes + ["", markdown_table(headers, rows)])


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
    benches = sorted((k for k, v in results.items() if isinstance(v, dict) and "benchmark" in v and "result" in v),
                     key=lambda k: (BENCH_ORDER.index(results[k]["benchmark"]) if results[k]["benchmark"] in BENCH_ORDER
                                    else len(BENCH_ORDER), k))
    sections = [(k, f"vattn bench {results[k]['benchmark']} ({k})", _bench) for k in benches]
    for name, title, fmt in sections:
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
        from vattn.bench._common import environment

        results["suite"]["env"] = environment(args.env)
    merged = merge(out, results)
    if args.step:
        results["suite"]["steps"].append(dict(name=args.step, status=args.status, seconds=args.seconds,
                                              timeout=args.timeout, note=args.note, results=merged))
    write(out, results)


if __name__ == "__main__":
    main()
