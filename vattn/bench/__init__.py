"""`vattn bench NAME [options]`: the page-size experiments and the paper's comparisons as commands.

Every benchmark is one module of this package with the same shape:

    NAME: str                 # the command name
    HELP: str                 # one line for `vattn bench --help`
    NEEDS_GPU: bool           # True: prints that it needs a GPU and exits 0 without CUDA (unless --device cpu)
    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> dict        # a JSON-able result (use _common.progress for bars);
                                                     # a non-empty result["failures"] makes the command exit 1
    def table(result: dict) -> tuple[list[str], list[list]]   # headers, rows
    def plot(result: dict) -> matplotlib.figure.Figure | None

`main` does the rest once for all of them: parses, prints the table, records the environment
(device, versions, commit, date) and writes `<name>_<device>.json` and `.png` to
`benchmarks/results/` (or `--out DIR`).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Sequence

# command name -> module under vattn.bench (imported only when that benchmark runs)
BENCHMARKS: dict[str, str] = {
    "fragmentation": "fragmentation",
    "alloc": "alloc",
    "overlap": "overlap",
    "kernel": "kernel",
    "throughput": "throughput",
    "gpu": "gpu",
    "offload": "offload",
    "peers": "peers",
    "paper": "paper",
    "spec": "spec",
}


# every benchmark name a saved payload can carry -> its module: the commands, and the part of
# `vattn bench gpu` that is not a command of its own (gpu.py and benchmarks/gpu_summary.py use this)
MODULES: dict[str, str] = {**BENCHMARKS, "e2e": "_e2e"}


def module(name: str) -> ModuleType:
    """The module of benchmark `name` (a command or a part of `vattn bench gpu`)."""
    return importlib.import_module(f"vattn.bench.{MODULES[name]}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vattn bench", description="vattn's benchmarks: each prints a table and "
                                "writes JSON (device, versions, commit, date) and a PNG to benchmarks/results/.")
    sub = p.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name in BENCHMARKS:
        mod = module(name)
        b = sub.add_parser(name, help=mod.HELP, description=(mod.__doc__ or mod.HELP).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(b)
        b.add_argument("--out", default=None, metavar="DIR",
                       help="write the JSON and PNG here (default: benchmarks/results/)")
        b.add_argument("--no-plot", action="store_true", help="write the JSON only")
    return p


def device_tag(device: str) -> str:
    """The file-name suffix of a device: host for the CPU, cuda for any GPU."""
    return "cuda" if str(device).startswith("cuda") else "host"


def used_device(mod: ModuleType, args: argparse.Namespace, result: dict | None = None) -> str:
    """The device a benchmark ran on: what its result records, else `args.device` after `run`
    (overlap and throughput pick cuda there when `--device` is not given), else its default."""
    device = (result or {}).get("device") if isinstance(result, dict) else None
    return str(device or getattr(args, "device", None) or ("cuda" if getattr(mod, "NEEDS_GPU", False) else "cpu"))


def needs_gpu_here(mod: ModuleType, device: str) -> bool:
    """True when `mod` needs a GPU for `device` and this machine has none (the caller skips)."""
    if not (getattr(mod, "NEEDS_GPU", False) and device.startswith("cuda")):  # `--device cpu`: a harness check
        return False
    import torch

    return not torch.cuda.is_available()


def module_args(mod: ModuleType, argv: Sequence[str], out: str | None = None) -> argparse.Namespace:
    """Parse `argv` with `mod`'s own arguments (the gpu run drives other modules this way)."""
    p = argparse.ArgumentParser(prog=f"vattn bench {mod.NAME}")
    mod.add_arguments(p)
    args = p.parse_args(list(argv))
    args.out, args.no_plot = out, False
    return args


def execute(mod: ModuleType, name: str, args: argparse.Namespace) -> dict:
    """Run one benchmark module: run, print its table, save JSON (+ PNG); returns the saved payload."""
    from . import _common

    result = mod.run(args)
    device = used_device(mod, args, result)
    headers, rows = mod.table(result)
    _common.print_table(headers, rows)
    fig = None if args.no_plot else mod.plot(result)
    config = {k: v for k, v in vars(args).items() if k not in ("bench", "out", "no_plot")}
    payload = {"benchmark": name, "environment": _common.environment(device), "config": config, "result": result}
    file_name = result.get("file_name", name) if isinstance(result, dict) else name  # a mode's own file
    payload["path"] = str(_common.save(f"{file_name}_{device_tag(device)}", payload, fig, out=args.out))
    if fig is not None:
        import matplotlib.pyplot as plt

        plt.close(fig)
    return payload


def main(argv: Sequence[str] | None = None) -> int:
    """Run one benchmark; 0 on success (also when a GPU benchmark skips for want of a GPU), 1 when
    its result lists `failures` (checks that failed, parts of `vattn bench gpu` that failed)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    mod = module(args.bench)
    if needs_gpu_here(mod, used_device(mod, args)):
        print(f"vattn bench {args.bench}: needs a CUDA GPU and none is available here; nothing to do.")
        return 0
    payload = execute(mod, args.bench, args)
    return 1 if payload["result"].get("failures") else 0
