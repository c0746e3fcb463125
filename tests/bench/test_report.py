"""vattn.report: the tables and percentiles every printed report uses, and the GPU suite's
summary script that formats with it without torch."""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from vattn.report import cell, key_value_table, latency_stats, markdown_table, percentile, text_table

ROWS = [["sync", 1.23456, 3, True], ["background", float("nan"), None, False]]


def test_cell():
    assert [cell(x) for x in (0.000123456, 12345.6, 7, "x", True, False, None, float("nan"))] == \
        ["0.0001235", "1.235e+04", "7", "x", "yes", "NO", "-", "-"]


def test_text_table():
    assert text_table(["mode", "ms", "n", "ok"], ROWS).splitlines() == [
        "mode       | ms    | n | ok ",
        "-----------+-------+---+----",
        "sync       | 1.235 | 3 | yes",
        "background | -     | - | NO ",
    ]
    assert text_table(["a", "bb"], []) == "a | bb\n--+---"  # no rows: the headers alone


def test_markdown_table():
    assert markdown_table(["mode", "ms", "n", "ok"], ROWS) == (
        "| mode | ms | n | ok |\n|---|---|---|---|\n| sync | 1.235 | 3 | yes |\n| background | - | - | NO |")


def test_key_value_table():
    rows = [("wall time", "1.20 s"), ("preemptions", "0")]
    rule = "-" * 20  # the widest line: 11 + len(" | ") + 6
    assert key_value_table(rows).splitlines() == [rule, "wall time   | 1.20 s", "preemptions | 0", rule]
    assert key_value_table(rows, title="demo").splitlines() == ["demo", rule, "wall time   | 1.20 s", "preemptions | 0",
                                                                 rule]


def test_percentile_interpolates_like_numpy():
    rng = random.Random(0)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 25, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_percentile_as_a_sample():
    xs = list(range(100, 0, -1))  # 1..100, unsorted
    assert percentile(xs, 50, interpolate=False) == 51  # index 50 of the sorted samples
    assert percentile(xs, 99, interpolate=False) == 100
    assert percentile(xs, 100, interpolate=False) == 100
    assert percentile(xs, 0, interpolate=False) == 1
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([1.0, 2.0, 3.0, 4.0], 50, interpolate=False) == 3.0
    assert math.isnan(percentile([], 50)) and math.isnan(percentile([], 50, interpolate=False))
    with pytest.raises(ValueError, match="not in"):
        percentile([1.0], 101)


def test_latency_stats():
    st = latency_stats([4.0, 1.0, 3.0, 2.0])
    assert st == dict(n=4, mean=2.5, p50=3.0, p99=4.0, max=4.0)
    empty = latency_stats([])
    assert empty["n"] == 0 and all(math.isnan(empty[k]) for k in ("mean", "p50", "p99", "max"))


def test_gpu_summary_records_a_step_without_torch(tmp_path):
    """benchmarks/gpu_summary.py formats with vattn.report and imports no torch to record a step."""
    code = ("import sys, runpy; sys.modules['torch'] = None; "
            f"sys.argv = ['gpu_summary.py', {str(tmp_path)!r}, '--step', 'kernel', '--status', 'failed', "
            "'--seconds', '12.5', '--timeout', '90', '--note', 'exit 1']; "
            f"runpy.run_path({str(REPO / 'benchmarks' / 'gpu_summary.py')!r}, run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert "**FAILED: kernel**" in summary
    assert "| step | status | seconds | timeout | note |\n|---|---|---|---|---|\n| kernel | FAILED | 12.5 | 90 | exit 1 |" \
        in summary
    assert json.loads((tmp_path / "results.json").read_text())["suite"]["steps"][0]["name"] == "kernel"
