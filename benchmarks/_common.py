"""Shared by the benchmarks: environment facts, a printed table, JSON + PNG output."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Sequence

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def environment(device: str) -> dict[str, Any]:
    """Device, versions, commit and date, stored with every result."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.cuda.get_device_name(torch.device(device))
    else:
        dev = f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"
    import vattn

    return {
        "device": dev, "device_kind": device, "python": platform.python_version(), "torch": torch.__version__,
        "vattn": vattn.__version__, "kernel": platform.release(), "commit": commit,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    cells = [[f"{c:.4g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("-+-".join("-" * w for w in widths))
    for r in cells:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths)))


def save(name: str, payload: dict[str, Any], fig: Any = None) -> Path:
    """Write results/<name>.json (and <name>.png when a matplotlib figure is given)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    if fig is not None:
        fig.tight_layout()
        fig.savefig(RESULTS / f"{name}.png", dpi=120)
    print(f"wrote {path}" + (f" and {name}.png" if fig is not None else ""))
    return path
