"""The vAttention paper's (ASPLOS'25) eight experiments, one command each, with the paper's axes.

    vattn bench paper [--figure 2 3 4 6 7 8 9 11] [--device cpu|cuda] [--quick]

Each figure reuses the measurement of an existing benchmark and writes its own JSON
(environment: device, versions, commit, date) and PNG, `paper_fig<N>_<host|cuda>`, to
benchmarks/results/ (or `--out`); `paper_<host|cuda>.json` indexes them (`--one-png`: the
figures' results in that one JSON and every plot in one PNG, for the GPU suite's few files).

The figures live by job: `paper_kernels` (2, 3, 6), `paper_alloc` (4, 11), `paper_engines`
(7, 8, 9), their plots in `paper_plots`, what they share in `paper_common`; this module is the
command.

| fig | what | measured with |
|---|---|---|
| 2 | prefill attention latency, paged vs non-paged, Llama-3-8B heads, 1K-32K tokens | `kernel.run_case` |
| 3 | a paged decode kernel at blocks of 16/32/64/128 tokens, batch 1-16 x 16K | `kernel.run_case` |
| 4 | decode tokens/s and the allocation bandwidth it needs, batch 1-300, 900-token requests; the bandwidth vattn's `step` provides per page size (64 KiB-2 MiB) | `paper_engines.decode_vattn`, `alloc.bench_new_pages` |
| 6 | single-request prefill throughput (one layer's attention), 2K-192K tokens, paged vs vAttention | `kernel.run_case` |
| 7 | decode tokens/s against batch 1-32 at 16K context: vattn.LLM vs a paged engine, each decode iteration timed inside one run | `paper_engines.decode_vattn`, `decode_hf_cb` |
| 8 | offline arXiv trace at 64K-192K context: requests per minute | `throughput.run_vattn`, `run_hf_cb` |
| 9 | online arXiv trace at two request rates: latency CDF | the engines stepped under Poisson arrivals |
| 11 | decode iteration latency, synchronous vs overlapped allocation, per page size | `overlap.run` |

On the host (no GPU) every figure runs, scaled down where the paper's sizes cannot run on a
few CPUs: each result's `scaled` says the paper's value and the one used. Kernel figures on the
host: PyTorch SDPA on the contiguous / virtual cache; the "paged" baseline there is the block
table gathered into a contiguous copy, then SDPA: NOT a paged kernel ("gather+SDPA (no paged
kernel on the host)"). On CUDA they use the paged kernel `vattn bench kernel` uses
(FlashAttention 4's `page_table` mode when installed, else torch's or flash-attn's block-table
FlashAttention, else the gather, labelled so). The paged engine of figures 7-9 is transformers'
continuous batching (its paged cache, `generate_batch`'s manager), not vLLM. Page sizes under
2 MiB need the host backend or, on the stock CUDA driver, fused page groups (a 2 MiB page holding
every layer's tokens: as many tokens as a 2 MiB / layers per-layer page).
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch

import vattn

from . import _common
from .paper_alloc import fig4, fig11
from .paper_common import FIGURES, HOST_PAGED, PAPER, hf_cb_problem, is_cuda
from .paper_engines import fig7, fig8, fig9
from .paper_kernels import fig2, fig3, fig6
from .paper_plots import as_image, close, grid, plot_figure

NAME = "paper"
HELP = "the vAttention paper's eight experiments (Figs. 2, 3, 4, 6, 7, 8, 9, 11), one JSON + PNG each"
NEEDS_GPU = False

RUNNERS: dict[int, Callable[[argparse.Namespace, dict], dict]] = {2: fig2, 3: fig3, 4: fig4, 6: fig6, 7: fig7,
                                                                   8: fig8, 9: fig9, 11: fig11}
__all__ = ["FIGURES", "HOST_PAGED", "PAPER", "RUNNERS", "add_arguments", "hf_cb_problem", "plot", "run", "table"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--figure", type=int, nargs="+", default=list(FIGURES), choices=FIGURES,
                   help="the paper's figures to run (default: all eight)")
    p.add_argument("--device", default="cpu", help="cpu (host backend, default) or cuda")
    p.add_argument("--quick", action="store_true", help="CI-size runs (the GPU suite)")
    p.add_argument("--no-paged-engine", action="store_true",
                   help="figures 7-9: vattn.LLM only (leave out transformers' continuous batching)")
    p.add_argument("--one-png", action="store_true",
                   help="write the figures' results into paper_<device>.json and every plot into one PNG "
                   "(the GPU suite's few files) instead of a JSON + PNG per figure")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if is_cuda(args) and not torch.cuda.is_available():
        raise vattn.InvalidConfigError("vattn bench paper --device cuda needs a CUDA GPU and none is available "
                                       "here; run it on the host with --device cpu")
    from . import device_tag

    tag = device_tag(args.device)
    figures: dict[str, Any] = {}
    failures: list[str] = []
    for n in sorted(set(args.figure)):
        scaled: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            res = RUNNERS[n](args, scaled)
        except vattn.InvalidConfigError:
            raise
        except Exception as e:  # record it, go on with the next figure
            import traceback

            traceback.print_exc()
            failures.append(f"fig {n}: {type(e).__name__}: {e}")
            continue
        res.update(figure=n, paper_experiment=PAPER[n][0], paper_headline=PAPER[n][1], scaled=scaled,
                   device=args.device, seconds=time.perf_counter() - t0)
        failures += [f"fig {n}: {f}" for f in res.get("failures", [])]
        print(f"\nFig. {n}: {res['headline']}" + (f"  [scaled: {', '.join(scaled)}]" if scaled else ""), flush=True)
        fig = None if args.no_plot else plot_figure(n, res, args.device)
        entry = dict(headline=res["headline"], paper_headline=PAPER[n][1], scaled=scaled, seconds=res["seconds"])
        if args.one_png:
            entry["result"] = res
            entry["image"] = None if fig is None else as_image(fig)
        else:
            payload = {"benchmark": f"paper_fig{n}", "environment": _common.environment(args.device),
                       "config": {k: v for k, v in vars(args).items() if k not in ("bench", "out", "no_plot")},
                       "result": res}
            entry["file"] = _common.save(f"paper_fig{n}_{tag}", payload, fig, out=args.out).name  # beside the index
            if fig is not None:
                close(fig)
        figures[str(n)] = entry
    return dict(file_name="paper", device=args.device, figures=figures, failures=failures)


def table(result: dict[str, Any]) -> tuple[list[str], list[list]]:
    rows = []
    for n, e in result["figures"].items():
        sc = "; ".join(f"{k}: {v['paper']} -> {v['used']}" for k, v in e["scaled"].items())
        rows.append([f"Fig. {n}", e["headline"], sc or "-"])
    for f in result["failures"]:
        print(f"FAILED {f}")
    return ["figure", "measured", "scaled (paper -> here)"], rows


def plot(result: dict[str, Any]) -> Any:
    """With --one-png: every figure's plot in one grid (else the figures wrote their own PNGs)."""
    images = [(n, e.pop("image")) for n, e in result["figures"].items() if e.get("image") is not None]
    for e in result["figures"].values():
        e.pop("image", None)
    if not images:
        return None
    return grid(images)
