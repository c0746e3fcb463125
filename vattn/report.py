"""Tables and percentiles for what vattn prints: the benchmarks, the demos, the CLI, the GPU
suite's summary. Written once here, in plain Python (no torch), so a script that only
formats results imports it without the engine.

    text_table(["mode", "p99 ms"], [["sync", 1.25]])       mode | p99 ms
                                                           -----+-------
                                                           sync | 1.25
    markdown_table(...)                                    | mode | p99 ms |  ...
    key_value_table([("wall time", "1.20 s")], title=...)  a title, a rule, `key | value` rows, a rule
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence


# ------------------------------------------------------------------------- tables ----
def cell(x: Any) -> str:
    """One table cell: floats to 4 significant digits, booleans as yes/NO (a failed check
    stands out), None and NaN as '-' (the benchmarks' own mark for a missing value)."""
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: left-aligned columns split by ' | ', a '-+-' rule under the headers."""
    cells = [[cell(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(headers, widths)), "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table (cells as `cell` writes them)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def key_value_table(rows: Sequence[tuple[str, str]], title: str | None = None) -> str:
    """Figures one per line, `key | value` with the keys padded to one width, between two
    rules as wide as the widest line; the title, when given, above the first rule."""
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 3 + max(len(v) for _, v in rows))
    head = [title] if title is not None else []
    return "\n".join(head + [rule] + [f"{k:<{width}} | {v}" for k, v in rows] + [rule])


# -------------------------------------------------------------------- percentiles ----
def percentile(xs: Sequence[float], q: float, *, interpolate: bool = True) -> float:
    """The q-th percentile (0 <= q <= 100) of `xs`; NaN when `xs` is empty.

    interpolate=True: linear between the two nearest ranks (numpy's default). False: a
    sample, the one at sorted index floor(n * q / 100), i.e. the smallest with more than
    q % of the samples at or below it (the benchmarks' p50 / p99: a latency that happened).
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not in [0, 100]")
    return _of_sorted(sorted(xs), q, interpolate)


def _of_sorted(s: Sequence[float], q: float, interpolate: bool) -> float:
    if not s:
        return float("nan")
    if not interpolate:
        return s[min(len(s) - 1, int(len(s) * q / 100))]
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latency_stats(xs: Sequence[float]) -> dict[str, float]:
    """n, mean, p50, p99 and max of latencies (in the unit given); p50 and p99 are samples
    (`percentile(..., interpolate=False)`). Empty: n 0 and NaN for the rest."""
    s = sorted(xs)
    if not s:
        return dict(n=0, mean=float("nan"), p50=float("nan"), p99=float("nan"), max=float("nan"))
    return dict(n=len(s), mean=statistics.fmean(s), p50=_of_sorted(s, 50, False), p99=_of_sorted(s, 99, False),
                max=s[-1])
