"""Everything that needs a GPU, in one run: the kernel, alloc (CUDA), overlap (CUDA) and
end-to-end benchmarks, each writing its own `<name>_cuda.json` and `.png` into `--out`.

Parts, in order (a part that fails is recorded and the run goes on; `--budget-s` is shared:
a part starts only while time is left; kernel gets 35 %, overlap 40 % and e2e 80 % of what
is left when they start as their own budget, after which they start no new case):
- `kernel`: `vattn bench kernel` (attention on the vattn cache vs contiguous, and paged or
  gathered blocks);
- `alloc`: `vattn bench alloc --device cuda` (step latency vs pages, bandwidth, VMM calls);
- `overlap`: `vattn bench overlap --device cuda --modes sync background premapped`;
- `e2e`: end-to-end decode throughput, `vattn.LLM` vs transformers' `generate` and
  `generate_batch` (vattn/bench/_e2e.py).
`bash benchmarks/gpu_suite.sh OUTDIR` runs this after the GPU tests.

    vattn bench gpu [--quick] [--out DIR] [--budget-s 400] [--parts kernel e2e]
"""
from __future__ import annotations

import argparse
import time
import traceback
from types import ModuleType
from typing import Any

NAME = "gpu"
HELP = "every GPU benchmark in one run (kernel, alloc and overlap on CUDA, end-to-end), into --out"
NEEDS_GPU = True

PARTS = ("kernel", "alloc", "overlap", "e2e")  # their modules: vattn.bench.MODULES (e2e is _e2e.py)
BUDGET_SHARE = {"kernel": 0.35, "overlap": 0.4, "e2e": 0.8}  # parts with their own --budget-s: this share of the time left


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="the GPU (default: cuda)")
    p.add_argument("--quick", action="store_true", help="each part's quick setting (the GPU suite)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS), help="which parts (default: all)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for all parts together (default: no limit)")


def _argv(mod: ModuleType, part: str, args: argparse.Namespace, left: float | None) -> list[str]:
    """The part's command line: the device, --quick when it takes it, and what is left of the budget."""
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    options = {o for a in p._actions for o in a.option_strings}
    argv = ["--device", args.device] if "--device" in options else []
    if args.quick and "--quick" in options:
        argv.append("--quick")
    if part == "overlap" and "--modes" in options:  # the paper's claim: background as fast as all pages premapped
        argv += ["--modes", "sync", "background", "premapped"]
    if left is not None and part in BUDGET_SHARE and "--budget-s" in options:
        argv += ["--budget-s", f"{max(10.0, BUDGET_SHARE[part] * left):.0f}"]  # it starts no new case after that
    return argv


def run(args: argparse.Namespace) -> dict[str, Any]:
    from . import execute, module, module_args
    from ._common import progress

    start = time.perf_counter()
    parts: list[dict[str, Any]] = []
    for part in progress(args.parts, desc="gpu", unit="part"):
        left = None if args.budget_s is None else args.budget_s - (time.perf_counter() - start)
        if left is not None and left < 20:
            parts.append(dict(part=part, status="skipped", note="the time budget is spent"))
            continue
        mod = module(part)
        argv = _argv(mod, part, args, left)
        t0 = time.perf_counter()
        print(f"\n===== vattn bench gpu: {part} {' '.join(argv)}", flush=True)
        try:
            payload = execute(mod, part, module_args(mod, argv, out=args.out))
            failures = payload["result"].get("failures") or []
            parts.append(dict(part=part, status="failed" if failures else "passed", argv=argv,
                              seconds=time.perf_counter() - t0, file=payload["path"],
                              note="; ".join(map(str, failures))[:300]))
        except Exception as e:  # record it and go on with the next part
            traceback.print_exc()
            parts.append(dict(part=part, status="failed", argv=argv, seconds=time.perf_counter() - t0,
                              note=f"{type(e).__name__}: {e}"[:300]))
    failed = [p["part"] for p in parts if p["status"] == "failed"]
    return dict(parts=parts, seconds=time.perf_counter() - start, failures=failed)


def table(result: dict[str, Any]) -> tuple[list[str], list[list]]:
    """One row per part: status, seconds, the file it wrote, a note."""
    return (["part", "status", "seconds", "file", "note"],
            [[p["part"], p["status"], p.get("seconds", 0.0), p.get("file", "-"), p.get("note", "")]
             for p in result["parts"]])


def plot(result: dict[str, Any]) -> None:
    """None: each part writes its own plot."""
    return None
