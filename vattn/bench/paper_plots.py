"""The plots of `vattn bench paper`: each figure drawn with the paper's axes from its result
(one function per figure, `plot_figure` picks it), and a figure as an image for the one-PNG
grid (`--one-png`)."""
from __future__ import annotations

import io
from typing import Any, Callable

from .paper_common import PAPER


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ok(res: dict[str, Any]) -> list[dict]:
    return [r for r in res["rows"] if "error" not in r]


def _engine_label(res: dict[str, Any], system: str) -> str:
    return "vattn.LLM" if system == "vattn" else res["paged_engine"]


def _prefill(n: int, res: dict[str, Any]) -> Any:
    """Figs. 2 and 6: prefill attention latency / tokens/s against the context."""
    rows = _ok(res)
    fig, ax = _plt().subplots(figsize=(7, 4.5))
    xs = [r["context"] for r in rows]
    if n == 2:
        ax.plot(xs, [r["virtual_us"] / 1e3 for r in rows], "o-", label="vattn (virtual cache)")
        ax.plot(xs, [r["contiguous_us"] / 1e3 for r in rows], "^:", label="contiguous tensor")
        ax.plot(xs, [r["paged16_us"] / 1e3 for r in rows], "s--", label=res["paged_labels"][16])
        ax.set(ylabel="prefill attention latency, one layer (ms)")
    else:
        ax.plot(xs, [r["virtual_tok_s"] for r in rows], "o-", label="vattn (virtual cache)")
        ax.plot(xs, [r["paged_tok_s"] for r in rows], "s--", label=res["paged_labels"][16])
        ax.set(ylabel="prefill tokens/s (one layer's attention)")
    ax.set(xscale="log", xlabel="context (tokens)")
    return fig


def _fig3(n: int, res: dict[str, Any]) -> Any:
    """Decode attention latency against the batch, per block size."""
    rows = _ok(res)
    fig, ax = _plt().subplots(figsize=(7, 4.5))
    xs = [r["batch"] for r in rows]
    ax.plot(xs, [r["virtual_us"] for r in rows], "o-", color="k", label="vattn (virtual cache)")
    for bs in res["blocks"]:
        ax.plot(xs, [r[f"paged{bs}_us"] for r in rows], "s--", label=res["paged_labels"][bs])
    ax.set(xscale="log", yscale="log", xlabel=f"batch (x {rows[0]['context'] if rows else '?'} tokens)",
           ylabel="decode attention latency, one layer (us)")
    return fig


def _fig4(n: int, res: dict[str, Any]) -> Any:
    """Decode tokens/s and the bandwidth it needs (left); the bandwidth `step` gives (right)."""
    fig, (a1, a2) = _plt().subplots(1, 2, figsize=(12, 4.5))
    rows = res["rows"]
    xs = [r["batch"] for r in rows]
    a1.plot(xs, [r["decode_tok_s"] for r in rows], "o-", label="decode tokens/s")
    a1b = a1.twinx()
    a1b.plot(xs, [r["needed_MBps"] for r in rows], "s--", color="tab:red", label="allocation needed (MB/s)")
    a1.set(xscale="log", xlabel="batch (900-token requests)", ylabel="decode tokens/s")
    a1b.set(ylabel="allocation bandwidth needed (MB/s)")
    a1.legend(loc="upper left", fontsize=7)
    a1b.legend(loc="lower right", fontsize=7)
    av = res["available"]
    a2.bar([f"{a['page_KiB']} KiB" for a in av], [a["GBps"] * 1e3 for a in av], label="vattn step (sync) MB/s")
    a2.axhline(res["peak_needed_MBps"], color="tab:red", ls="--", label="peak need (left)")
    a2.set(yscale="log", xlabel="page size", ylabel="MB/s", title="allocation bandwidth available vs needed")
    a2.legend(fontsize=7)
    return fig


def _fig7(n: int, res: dict[str, Any]) -> Any:
    """Decode tokens/s against the batch (each engine's decode iterations timed), and the ratio."""
    fig, ax = _plt().subplots(figsize=(7, 4.5))
    rows = res["rows"]
    xs = [r["batch"] for r in rows]
    for s in res["systems"]:
        ax.plot(xs, [r[f"{s}_decode_tok_s"] for r in rows], "o-", label=_engine_label(res, s))
    ax.set(xscale="log", yscale="log", xlabel=f"batch (context {rows[0]['context']} tokens)",
           ylabel="decode tokens/s (median over decode iterations)")
    ax.set_xticks(xs, [str(x) for x in xs])
    if "hf_cb" in res["systems"]:
        for x, r in zip(xs, rows):
            ax.annotate(f"{r['vattn_over_paged']:.2f}x", (x, r["vattn_decode_tok_s"]), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize=7)
    return fig


def _fig8(n: int, res: dict[str, Any]) -> Any:
    """Requests per minute per context, one bar per engine."""
    fig, ax = _plt().subplots(figsize=(7, 4.5))
    rows = res["rows"]
    w = 0.8 / len(res["systems"])
    for i, s in enumerate(res["systems"]):
        ax.bar([j + (i - (len(res["systems"]) - 1) / 2) * w for j in range(len(rows))],
               [r[f"{s}_requests_per_min"] for r in rows], w, label=_engine_label(res, s))
    ax.set_xticks(range(len(rows)), [f"{r['context'] // 1024}K" for r in rows])
    ax.set(xlabel="context (arXiv prompts scaled to it)", ylabel="requests per minute")
    return fig


def _fig9(n: int, res: dict[str, Any]) -> Any:
    """The request latency CDF per engine and rate."""
    fig, ax = _plt().subplots(figsize=(7, 4.5))
    for r in res["rows"]:
        lat = sorted(x for x in r["latencies_s"] if x == x)
        ax.plot(lat, [(i + 1) / len(lat) for i in range(len(lat))], "-" if r["system"] == "vattn" else "--",
                label=f"{'vattn.LLM' if r['system'] == 'vattn' else 'paged engine'} at {r['rate_req_s']:.2f} req/s")
    ax.set(xlabel="request latency (s)", ylabel="CDF")
    return fig


def _fig11(n: int, res: dict[str, Any]) -> Any:
    """Iteration latency series per page size, synchronous against overlapped mapping."""
    configs = list(dict.fromkeys((r["layout"], r["page_KiB"]) for r in res["rows"]))
    fig, axes = _plt().subplots(len(configs), 1, figsize=(10, 2.6 * len(configs)), squeeze=False)
    for ax, (layout, page) in zip(axes[:, 0], configs):
        rs = [r for r in res["rows"] if r["layout"] == layout and r["page_KiB"] == page]
        for b in rs[0]["boundary_iterations"]:
            ax.axvline(b, color="0.85", lw=3, zorder=0)
        for r in rs:
            ax.plot(r["series_ms"], lw=0.9, color="tab:red" if r["mode"] == "sync" else "tab:blue",
                    label=f"{'synchronous' if r['mode'] == 'sync' else 'overlapped'}: at boundaries "
                          f"{r['boundary_mean_ms']:.1f} ms, p99 {r['p99_ms']:.1f}")
        ax.set(ylabel="iteration (ms)", title=f"{layout} {page} KiB pages (effective {rs[0]['effective_page_KiB']} "
               f"KiB, {rs[0]['tokens_per_page']} tokens/page), batch {rs[0]['batch']}")
        ax.legend(fontsize=7)
    axes[-1, 0].set(xlabel="decode iteration (grey: page boundaries)")
    return fig


# figure -> its plot; the ones with several axes set their own legends
PLOTS: dict[int, Callable[[int, dict[str, Any]], Any]] = {2: _prefill, 3: _fig3, 4: _fig4, 6: _prefill, 7: _fig7,
                                                           8: _fig8, 9: _fig9, 11: _fig11}


def plot_figure(n: int, res: dict[str, Any], device: str) -> Any:
    """The paper's figure `n` from its result."""
    fig = PLOTS[n](n, res)
    title = f"Fig. {n} ({device}): {PAPER[n][0]}"
    if n in (4, 11):
        fig.suptitle(title, fontsize=9)
    else:
        ax = fig.axes[0]
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    return fig


def as_image(fig: Any) -> Any:
    """The figure rendered (an RGBA array), closed."""
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=80)
    _plt().close(fig)
    buf.seek(0)
    return _plt().imread(buf)


def close(fig: Any) -> None:
    _plt().close(fig)


def grid(images: list[tuple[str, Any]]) -> Any:
    """Every figure's image in one grid of two columns."""
    plt = _plt()
    cols = min(2, len(images))
    rows = -(-len(images) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 5 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for ax, (n, img) in zip(axes.flat, images):
        ax.imshow(img)
    return fig
