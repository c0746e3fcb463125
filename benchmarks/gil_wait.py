"""What a host page map costs a thread while another thread runs Python: the GIL's hand-back.

A server's batching thread maps a prefill's pages while its event loop thread streams answers.
A C call that lets go of the GIL must win it back afterwards; when the other thread took it
meanwhile, that wait lasts up to the interpreter's switch interval (5 ms). vattn's host calls
keep the GIL for batches of up to 64 system calls (`cext/vattn_ext.c`, GIL_HOLD_CALLS). This
times map + unmap of one page group of 4 buffers (a 2-layer model's K and V) beside a thread
spinning in Python, for this checkout and, with `--before DIR`, another one built in place,
alternating runs:

    OMP_NUM_THREADS=1 python benchmarks/gil_wait.py [--before DIR] [--runs 3] [--calls 2000] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from _common import environment, print_table, save

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, threading, time
from array import array
from vattn.vmem.host import HostBackend
calls, page, nbuf = int(sys.argv[1]), 64 << 10, 4
be = HostBackend()
rng = be.reserve(page * 64 * nbuf, page)
bases = array("Q", [rng.addr + b * page * 64 for b in range(nbuf)])
group = be.create(1, nbuf, page)
stop = False
def spin():
    x = 0
    while not stop:
        x += 1
t = threading.Thread(target=spin)
t.start()
lat = []
for i in range(calls):
    offs = array("Q", [(i % 60) * page])
    t0 = time.perf_counter()
    be.map(bases, offs, group, page)
    be.unmap(bases, offs, page)
    lat.append(time.perf_counter() - t0)
stop = True
t.join()
print(json.dumps(lat))
"""


def run(src: Path, calls: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHILD, str(calls)], env=env, cwd=src, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def summary(lat: list[float]) -> dict:
    s = sorted(lat)
    return dict(p50_us=statistics.median(s) * 1e6, p99_us=s[int(0.99 * len(s))] * 1e6,
                mean_us=statistics.mean(s) * 1e6, max_ms=s[-1] * 1e3, over_1ms=sum(x > 1e-3 for x in s), calls=len(s))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=None, metavar="DIR", help="another checkout (its extension built in place)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    checkouts = {"this": REPO, **({"before": Path(args.before).resolve()} if args.before else {})}
    results: dict[str, list[dict]] = {k: [] for k in checkouts}
    for _ in range(args.runs):
        for name, src in checkouts.items():
            results[name].append(summary(run(src, args.calls)))
    rows = [[name, i, f"{r['p50_us']:.0f}", f"{r['p99_us']:.0f}", f"{r['mean_us']:.0f}", f"{r['max_ms']:.1f}",
             f"{r['over_1ms']} of {r['calls']}"] for name, rs in results.items() for i, r in enumerate(rs)]
    print_table(["checkout", "run", "p50 us", "p99 us", "mean us", "max ms", "over 1 ms"], rows)
    save("gil_wait_host", dict(environment("cpu"), args=vars(args), load_average=os.getloadavg()[0], results=results),
         plot(results), out=args.out)


def plot(results: dict[str, list[dict]]) -> Any:
    """p50, mean and p99 of each checkout's runs (log scale); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    stats = ("p50_us", "mean_us", "p99_us")
    width = 0.8 / len(results)
    for j, (name, rs) in enumerate(results.items()):
        xs = [k + (j - (len(results) - 1) / 2) * width for k in range(len(stats))]
        ax.bar(xs, [statistics.median(r[x] for r in rs) for x in stats], width, label=name)
    ax.set_xticks(range(len(stats)), [x.replace("_us", "") for x in stats])
    ax.set_yscale("log")
    ax.set_ylabel("map + unmap of a page, us (median of runs)")
    ax.set_title("a host page map beside a thread running Python", fontsize=9)
    ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    main()
