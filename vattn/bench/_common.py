"""Shared by the benchmarks: environment facts, a printed table, a progress bar, JSON + PNG
output. Written once here; every `vattn bench` module and `benchmarks/*.py` script uses it
(tables and percentiles: `vattn.report`, re-exported here for them)."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Sequence

import torch

from vattn.report import latency_stats, text_table  # noqa: F401  (latency_stats: the benchmarks import it from here)


def _results_dir() -> Path:
    """benchmarks/results of the checkout vattn runs from, else of the working directory."""
    repo = Path(__file__).resolve().parents[2]
    if (repo / "benchmarks").is_dir() and (repo / "pyproject.toml").is_file():
        return repo / "benchmarks" / "results"
    return Path.cwd() / "benchmarks" / "results"


RESULTS = _results_dir()
TRACE = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "arxiv_summarization.csv"  # the default trace
OUT_ENV = "VATTN_BENCH_OUT"  # when set, save() writes there instead of RESULTS (the GPU suite's OUTDIR)


def environment(device: str) -> dict[str, Any]:
    """Device, versions, commit and date, stored with every result."""
    # VATTN_COMMIT first: the GPU machine's copy of the tree carries the .git of an older checkout
    commit = os.environ.get("VATTN_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    if cuda:
        dev = torch.cuda.get_device_name(torch.device(device))
    else:
        dev = f"{platform.processor() or platform.machine()} ({os.cpu_count()} CPUs)"
    import vattn

    env = {
        "device": dev, "device_kind": device, "python": platform.python_version(), "torch": torch.__version__,
        "vattn": vattn.__version__, "kernel": platform.release(), "commit": commit,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        from importlib.metadata import version

        env["transformers"] = version("transformers")
    except Exception:
        pass
    if cuda:
        props = torch.cuda.get_device_properties(torch.device(device))
        env.update(cuda=torch.version.cuda, driver=_driver_version(), gpu_memory_GiB=round(props.total_memory / 2**30, 1),
                   compute_capability=f"{props.major}.{props.minor}")
    return env


def _driver_version() -> str:
    """The NVIDIA driver version, from nvidia-smi or else the driver API (cuda-python)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        if out:
            return out.splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        from cuda.bindings import driver

        err, v = driver.cuDriverGetVersion()
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    except Exception:
        return ""


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print `vattn.report.text_table(headers, rows)`."""
    print(text_table(headers, rows))


def save(name: str, payload: dict[str, Any], fig: Any = None, out: str | os.PathLike | None = None) -> Path:
    """Write <dir>/<name>.json (and <name>.png when a matplotlib figure is given). <dir> is
    `out`, else $VATTN_BENCH_OUT, else benchmarks/results/."""
    folder = Path(out or os.environ.get(OUT_ENV) or RESULTS)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    if fig is not None:
        fig.tight_layout()
        fig.savefig(folder / f"{name}.png", dpi=120)
    print(f"wrote {path}" + (f" and {name}.png" if fig is not None else ""))
    return path


def _jsonable(x: Any) -> Any:
    """json.dumps fallback: torch dtypes/devices, paths and the like as strings."""
    return str(x)


def progress(iterable: Any = None, *, total: int | None = None, desc: str = "", unit: str = "it") -> Any:
    """A tqdm progress bar on stderr (the printed table stays clean on stdout); silent when
    VATTN_BENCH_QUIET is set (tests)."""
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True,
                disable=bool(os.environ.get("VATTN_BENCH_QUIET")))


def free_port() -> int:
    """A free TCP port of 127.0.0.1 (for a server the benchmark starts)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(proc: Any, port: int, log: Path, what: str = "server", timeout: float = 180) -> None:
    """Wait until the server process `proc` answers GET /health on `port` with 200
    (SystemExit, pointing at its `log`, if it exits or does not within `timeout` s)."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            try:
                tail = Path(log).read_text(errors="replace")[-1500:]
            except OSError:
                tail = "(no log)"
            raise SystemExit(f"the {what} exited: see {log}; its end:\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the {what} was not ready in {timeout:.0f} s: see {log}")


def sync(device: str) -> None:
    """Wait for the GPU (a no-op on the CPU), before and after a timed block."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def agreement(got: Sequence[Sequence[int]], ref: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Greedy agreement of token sequences with reference ones: the fraction of equal tokens
    (position by position) and of the common prefix, the sequences equal, and `equal` (all)."""
    eq = tot = pre = 0
    for x, y in zip(got, ref):
        tot += max(len(x), len(y))
        eq += sum(a == b for a, b in zip(x, y))
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        pre += k
    same = sum(list(x) == list(y) for x, y in zip(got, ref))
    return dict(equal=same == len(ref) and len(got) == len(ref), sequences_equal=same, sequences=len(ref),
                token_match=eq / tot if tot else 1.0, prefix_match=pre / tot if tot else 1.0)
