"""Shared by the benchmark tests."""
import pytest


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Benchmarks print no progress and plot without a display."""
    monkeypatch.setenv("VATTN_BENCH_QUIET", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
