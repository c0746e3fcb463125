"""Everything that needs a GPU, in one run: the kernel, alloc (CUDA), overlap (CUDA) and
end-to-end benchmarks, each writing its own `<name>_cuda.json` and `.png` into `--out`.

Parts, in order (a part that fails is recorded and the run goes on; `--budget-s` is shared:
a part starts only while time is left; kernel gets 35 %, overlap 40 % and e2e 80 % of what
is left when they start as their own budget, after which they start no new case):
- `kernel`: `vattn bench kernel` (attention on the vattn cache vs contiguous, and paged or
  gathered blocks);
- `alloc`: `vattn bench alloc --device cuda` (step latency vs pages, bandwidth, VMM calls);
- `overlap`: `vattn bench overlap --device cuda --modes sync background background-next premapped`;
- `e2e`: end-to-end decode throughput, `vattn.LLM` (CUDA graphs, eager: `--compare-eager`, and
  compiled under CUDA graphs: `--compile`, on CUDA) vs transformers' `generate` and
  `generate_batch`, the engine's time outside the forward (`--engine-overhead`: the GPU idle
  between decode forwards) with asynchronous scheduling (the default on CUDA) and without
  (`--compare-async`: system `vattn_sync`), and each decode step against its bandwidth bound
  (vattn/bench/_e2e.py).
Each part runs in a process of its own (unless `--in-process`): a CUDA error poisons the
process's context for good, and a crash or a hang would take every later part with it; so
a part that crashes, or outlives its hard limit (with `--budget-s`: its share of the time
left plus a margin, see PART_LIMIT), is recorded as failed or timeout, and the next part
starts in a fresh process with all of the GPU's memory.
`bash benchmarks/gpu_suite.sh OUTDIR` runs this after the GPU tests.

    vattn bench gpu [--quick] [--out DIR] [--budget-s 400] [--parts kernel e2e] [--in-process]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

NAME = "gpu"
HELP = "every GPU benchmark in one run (kernel, alloc and overlap on CUDA, end-to-end), into --out"
NEEDS_GPU = True

PARTS = ("kernel", "alloc", "overlap", "e2e")  # their modules: vattn.bench.MODULES (e2e is _e2e.py)
BUDGET_SHARE = {"kernel": 0.35, "overlap": 0.4, "e2e": 0.8}  # parts with their own --budget-s: this share of the time left
# The hard limit of a part's process with --budget-s: share x the time left + seconds, and never past
# the time left. Past it the process is killed and the next part starts.
PART_LIMIT = {"kernel": (0.35, 60.0), "alloc": (0.25, 40.0), "overlap": (0.4, 45.0), "e2e": (1.0, 0.0)}
HANDOFF_ENV = "VATTN_GPU_PART_HANDOFF"  # the child writes the path of the JSON it saved (or its error) there
THREADS_ENV = "VATTN_GPU_PART_THREADS"  # torch's intra-op threads in the parent, for the child


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda", help="the GPU (default: cuda)")
    p.add_argument("--quick", action="store_true", help="each part's quick setting (the GPU suite)")
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS), help="which parts (default: all)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for all parts together (default: no limit)")
    p.add_argument("--in-process", action="store_true",
                   help="run the parts in this process (default: each in a process of its own)")


def _argv(mod: ModuleType, part: str, args: argparse.Namespace, left: float | None) -> list[str]:
    """The part's command line: the device, --quick when it takes it, and what is left of the budget."""
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    options = {o for a in p._actions for o in a.option_strings}
    argv = ["--device", args.device] if "--device" in options else []
    if args.quick and "--quick" in options:
        argv.append("--quick")
    if part == "overlap" and "--modes" in options:  # the paper's claim: background as fast as all pages premapped
        argv += ["--modes", "sync", "background", "background-next", "premapped", "--repeats", "3"]
    if part == "e2e":  # CUDA graphs against the eager engine, and compiled; the engine's time outside the forward,
        argv += ["--compare-eager", "--engine-overhead", "--compare-async"]  # scheduling asynchronously and not
        if args.device.startswith("cuda"):  # (the CPU run checks the harness: compiling a model takes minutes there)
            argv.append("--compile")
    if left is not None and part in BUDGET_SHARE and "--budget-s" in options:
        argv += ["--budget-s", f"{max(10.0, BUDGET_SHARE[part] * left):.0f}"]  # it starts no new case after that
    return argv


def part_limit(part: str, left: float | None) -> float | None:
    """Seconds the part's process may run (None: no limit, without --budget-s)."""
    if left is None:
        return None
    share, extra = PART_LIMIT[part]
    return max(20.0, min(left - 5.0, share * left + extra))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from . import module
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
        if getattr(args, "in_process", False):
            rec = _run_in_process(mod, part, argv, args.out)
            _release_gpu(args.device)
        else:
            rec = _run_in_child(part, argv, args.out, part_limit(part, left))
        parts.append(dict(part=part, argv=argv, seconds=time.perf_counter() - t0, **rec))
        print(f"===== vattn bench gpu: {part} {rec['status']} in {time.perf_counter() - t0:.0f} s"
              + (f": {rec['note']}" if rec.get("note") else ""), flush=True)
    failed = [p["part"] for p in parts if p["status"] in ("failed", "timeout")]
    return dict(parts=parts, seconds=time.perf_counter() - start, failures=failed)


def _outcome(payload: dict[str, Any], path: str) -> dict[str, Any]:
    failures = payload["result"].get("failures") or []
    return dict(status="failed" if failures else "passed", file=path, note="; ".join(map(str, failures))[:300])


def _run_in_process(mod: ModuleType, part: str, argv: list[str], out: str | None) -> dict[str, Any]:
    from . import execute, module_args

    try:
        payload = execute(mod, part, module_args(mod, argv, out=out))
        return _outcome(payload, payload["path"])
    except Exception as e:  # record it and go on with the next part
        traceback.print_exc()
        return dict(status="failed", note=f"{type(e).__name__}: {e}"[:300])


def _release_gpu(device: str) -> None:
    """What one part leaves in torch's caching allocator goes back before the next (in-process)."""
    import gc

    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _run_in_child(part: str, argv: list[str], out: str | None, limit: float | None) -> dict[str, Any]:
    """Run one part in a fresh Python (its output goes where ours goes); wait at most `limit` s."""
    import json
    import subprocess
    import tempfile

    import vattn

    fd, handoff = tempfile.mkstemp(prefix=f"vattn-gpu-{part}-", suffix=".txt")
    os.close(fd)
    env = dict(os.environ)
    root = str(Path(vattn.__file__).resolve().parents[1])  # the child imports this same vattn
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env[HANDOFF_ENV] = handoff
    if "torch" in sys.modules:  # the child computes with as many threads as we would (set_num_threads too)
        env[THREADS_ENV] = str(sys.modules["torch"].get_num_threads())
    code = "import sys; from vattn.bench.gpu import _child; sys.exit(_child(sys.argv[1:]))"
    cmd = [sys.executable, "-c", code, part, out or "", *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)  # same process group: an outer timeout kills it too
    try:
        try:
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return dict(status="timeout", note=f"killed after its limit of {limit:.0f} s")
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        said = Path(handoff).read_text().strip()
    finally:
        Path(handoff).unlink(missing_ok=True)
    if said.startswith("ERROR\t"):
        return dict(status="failed", note=said[len("ERROR\t"):][:300])
    if rc == 0 and said:
        try:
            return _outcome(json.loads(Path(said).read_text()), said)
        except (OSError, ValueError, KeyError) as e:
            return dict(status="failed", note=f"its JSON {said} cannot be read: {e}"[:300])
    why = f"killed by signal {-rc} (a crash?)" if rc < 0 else f"exit code {rc}"
    return dict(status="failed", note=f"its process ended without a result: {why}; see its output above")


def _child(argv: list[str]) -> int:
    """A part in its own process: `PART OUT ARGV...` (OUT '' for the default)."""
    from . import execute, module, module_args

    part, out, rest = argv[0], argv[1] or None, argv[2:]
    handoff = os.environ.get(HANDOFF_ENV)
    if os.environ.get(THREADS_ENV, "").isdigit():
        import torch

        torch.set_num_threads(max(1, int(os.environ[THREADS_ENV])))
    try:
        mod = module(part)
        payload = execute(mod, part, module_args(mod, rest, out=out))
    except Exception as e:
        traceback.print_exc()
        if handoff:
            Path(handoff).write_text(f"ERROR\t{type(e).__name__}: {e}".replace("\n", " "))
        return 1
    if handoff:
        Path(handoff).write_text(payload["path"])
    return 0


def table(result: dict[str, Any]) -> tuple[list[str], list[list]]:
    """One row per part: status, seconds, the file it wrote, a note."""
    return (["part", "status", "seconds", "file", "note"],
            [[p["part"], p["status"], p.get("seconds", 0.0), p.get("file", "-"), p.get("note", "")]
             for p in result["parts"]])


def plot(result: dict[str, Any]) -> None:
    """None: each part writes its own plot."""
    return None
