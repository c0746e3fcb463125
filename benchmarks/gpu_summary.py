"""The GPU suite's bookkeeping: one results.json and one summary.md in OUTDIR.

After every step, `gpu_suite.sh` calls this to record the step's status and to fold the
JSON files the step wrote into OUTDIR/results.json (the files are then removed, so OUTDIR
stays a handful of files), and summary.md is written again from results.json.
Plain Python (no torch; `vattn.report` for the tables) except `--env` and the `vattn bench`
sections, which use each benchmark module's own `table()`.

    python benchmarks/gpu_summary.py OUTDIR --step NAME --status passed --seconds 12 --timeout 90 [--note TEXT]
    python benchmarks/gpu_summary.py OUTDIR --env cuda      # record the environment (imports torch)
    python benchmarks/gpu_summary.py OUTDIR                 # merge and rewrite summary.md only
    python benchmarks/gpu_summary.py --check-requirements DIR   # the wheels installed into DIR: is
                                                            # every Requires-Dist met where they run?
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


def _multi_server(d: dict) -> str:
    """benchmarks/multi_server.py's payload: per mode and server, served, TTFT, bursts, peak memory."""
    rows = []
    for mode, r in d["modes"].items():
        for n in ("A", "B"):
            s = r[n]
            rows.append([mode, n, f"{s['served']}/{s['sent']}", s["ttft_s"]["p50"], s["ttft_s"]["p99"],
                         s["burst_s"]["mean"], s["peak_MiB"]])
    ratios = ", ".join(f"{k} {v:.2f}" for k, v in d.get("ratios", {}).items())
    return "\n".join([f"device {d.get('environment', {}).get('device')}; same greedy answers: "
                      f"{d.get('same_greedy_answers')}", "", ratios, "",
                      markdown_table(["mode", "server", "served", "TTFT p50 s", "TTFT p99 s", "burst s", "peak MiB"],
                                     rows)])


def check_requirements(site: Path) -> int:
    """Every Requires-Dist of the distributions installed in `site` (the carried wheels), checked
    against what this Python finds (the image's packages and `site`, on its path): prints each
    problem, returns their number."""
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    problems, checked = [], 0
    for info in sorted(site.glob("*.dist-info")):
        dist = md.Distribution.at(info)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            if canonicalize_name(req.name) == "nvidia-cutlass-dsl-libs-cu12":  # the cu13 libraries are carried
                continue
            checked += 1
            try:
                have = md.version(req.name)
            except md.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} wants {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist.metadata['Name']} wants {req}: {have} is installed")
    for p in problems:
        print(f"PROBLEM: {p}")
    print(f"requirements of the wheels in {site}: {checked} checked, {len(problems)} problems")
    return len(problems)


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
    sections += [(k, f"benchmarks/multi_server.py ({k})", _multi_server) for k, v in results.items()
                 if k.startswith("multi_server") and isinstance(v, dict) and "modes" in v]
    for name, title, fmt in sections:
        try:
            body = fmt(results[name])
        except Exception as e:  # a summary must never break the suite
            body = f"(could not summarise: {type(e).__name__}: {e}; see results.json)"
        parts += ["", f"## {title}", "", body]
    return "\n".join(parts) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--check-requirements", metavar="DIR", default=None,
                    help="check the Requires-Dist of the wheels installed in DIR, then exit")
    ap.add_argument("--step")
    ap.add_argument("--status", choices=["passed", "failed", "skipped", "timeout"])
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--timeout", type=float)
    ap.add_argument("--note", default="")
    ap.add_argument("--env", default=None, help="record the environment for this device (imports torch)")
    args = ap.parse_args()
    if args.check_requirements:
        sys.exit(1 if check_requirements(Path(args.check_requirements)) else 0)
    if args.out is None:
        ap.error("OUTDIR is needed")
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
