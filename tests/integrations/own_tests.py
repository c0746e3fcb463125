"""The runner behind the standing checks of another engine's own tests with vattn's plugin
on and off (`test_vllm_own_tests.py`, `test_sglang_own_tests.py`).

Each test file runs in a process of its own, once stock and once with the plugin. A process
that dies (a segfault, a hang past the timeout) is named with the test it was running, and
the file runs again without that test. A `Report` of one release compares the two runs:
the tests that pass stock and not with vattn, each either on the engine's written
`by_design` list (with the reason) or unexplained.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

MAX_CRASHES = 10  # per file: reruns without the test that killed the process
TIMEOUT_EXIT = 124  # the exit code a file's process is named with when it ran past its timeout


def version_var(prefix: str, version: str) -> str:
    """`VATTN_X_TESTS_0_5_23` for prefix `VATTN_X_TESTS` and version `0.5.23`."""
    return f"{prefix}_{version.replace('.', '_')}"


@dataclass
class FileRun:
    """One test file in its own process (again without each test that killed it)."""

    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> PASSED, FAILED, ERROR, SKIPPED, ...
    crashes: dict[str, int] = field(default_factory=dict)  # test id (or the file) -> the process's exit code
    collect_error: str = ""  # why the file could not be collected ("" when it was)


# `-v`'s line for a test's outcome; SUBFAILED(...) when one of a unittest test's subTests failed
_OUTCOME = re.compile(r"^(\S+::\S+(?: \S+)*?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS|SUBFAILED|SUBPASSED)\b")
_FAILS_AFTER = {"ERROR": "ERROR", "SUBFAILED": "FAILED"}  # a failed teardown or subTest undoes a PASSED


def run_file(root: Path, path: str, env: dict[str, str], plugins: Sequence[str] = (), timeout: int = 1800) -> FileRun:
    """Run the test file `path` under `root` in a process of its own, with the pytest
    plugins `plugins` (module names importable from `env`'s PYTHONPATH); after a crash,
    again without the test that was running."""
    out, deselect = FileRun(), []
    for _ in range(MAX_CRASHES + 1):
        args = [sys.executable, "-m", "pytest", *(a for p in plugins for a in ("-p", p)), "-v", "-p",
                "no:cacheprovider", "--noconftest", "-rA", path]
        for t in deselect:
            args += ["--deselect", t]
        try:
            r = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
            stdout, code = r.stdout, r.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            code = TIMEOUT_EXIT
        running = None
        for line in stdout.splitlines():
            m = _OUTCOME.match(line)
            if m:  # a test's first outcome, unless a teardown or a subTest then failed
                test, outcome = m.groups()
                if outcome in _FAILS_AFTER:
                    out.outcomes[test] = _FAILS_AFTER[outcome]
                elif outcome != "SUBPASSED":
                    out.outcomes.setdefault(test, outcome)
                running = None
            elif line.startswith(path + "::"):
                running = line.split()[0]  # `-v` prints the id before the outcome: the test under way
        collect_failed = "ERROR collecting" in stdout or "error during collection" in stdout \
            or "errors during collection" in stdout
        if code in (0, 1, 5) or (code == 2 and collect_failed):  # passed, failed, nothing collected
            if collect_failed:
                out.collect_error = _collect_error(stdout)
            return out
        culprit = running or path
        out.crashes[culprit] = code
        if running is None:
            return out
        deselect.append(running)
    return out


def run_files(version: str, root: Path, files: Sequence[str], by_design: dict[str, str], stock_env: dict[str, str],
              vattn_env: dict[str, str], stock_plugins: Sequence[str] = (), vattn_plugins: Sequence[str] = (),
              timeout: int = 1800) -> Report:
    """Every file of `files`, stock and with vattn, each in its own process: the release's `Report`."""
    rep = Report(version, {}, {}, by_design)
    for f in files:
        rep.stock[f] = run_file(root, f, stock_env, stock_plugins, timeout)
        rep.vattn[f] = run_file(root, f, vattn_env, vattn_plugins, timeout)
    return rep


def _collect_error(stdout: str) -> str:
    lines = [x for x in stdout.splitlines() if x.startswith("E  ")]
    return lines[-1][1:].strip() if lines else "collection error"


def why_by_design(by_design: dict[str, str], test_id: str) -> str | None:
    """Why `test_id` fails with vattn by design (its id, its function with every parameter,
    or its whole file on the list), or None."""
    return by_design.get(test_id) or by_design.get(test_id.split("[")[0]) or by_design.get(test_id.split("::")[0])


@dataclass
class Report:
    """An engine's own tests of one release, stock and with vattn."""

    version: str
    stock: dict[str, FileRun]
    vattn: dict[str, FileRun]
    by_design: dict[str, str] = field(default_factory=dict)

    def _all(self, runs: dict[str, FileRun]) -> dict[str, str]:
        return {t: o for r in runs.values() for t, o in r.outcomes.items()}

    @property
    def tests(self) -> set[str]:
        return set(self._all(self.stock)) | set(self._all(self.vattn))

    def passed(self, which: str) -> set[str]:
        return {t for t, o in self._all(getattr(self, which)).items() if o == "PASSED"}

    def crashes(self, which: str) -> dict[str, int]:
        return {t: c for r in getattr(self, which).values() for t, c in r.crashes.items()}

    def vattn_only_failures(self) -> list[str]:
        """Tests that pass stock and not with vattn (failed, errored, crashed or never ran)."""
        return sorted(self.passed("stock") - self.passed("vattn"))

    def why(self, test_id: str) -> str | None:
        return why_by_design(self.by_design, test_id)

    def unexplained(self) -> list[str]:
        return [t for t in self.vattn_only_failures() if not self.why(t)]

    def row(self) -> list:
        fails = self.vattn_only_failures()
        return [self.version, len(self.tests), len(self.passed("stock")), len(self.passed("vattn")), len(fails),
                len(fails) - len(self.unexplained()), len(self.crashes("vattn")),
                sum(1 for r in self.stock.values() if r.collect_error)]

    def lines(self) -> list[str]:
        """What the table does not say: each failure only with vattn, each crash, each file
        that does not import here."""
        out = [f"{self.version}: fails only with vattn: {t} -- {self.why(t) or 'NOT BY DESIGN'}"
               for t in self.vattn_only_failures()]
        out += [f"{self.version}: crashed with vattn (exit {c}): {t}" for t, c in self.crashes("vattn").items()]
        out += [f"{self.version}: {f} does not import here (stock and with vattn alike): {r.collect_error}"
                for f, r in self.stock.items() if r.collect_error]
        return out

    def check(self, engine: str) -> None:
        """The standing check's verdict: no crash, every failure only with vattn by design,
        a file imports with vattn exactly when it imports stock."""
        assert self.passed("stock"), "no test passed stock: the environment is broken"
        assert not self.crashes("stock"), f"{engine}'s tests crash stock here: {self.crashes('stock')}"
        assert not self.crashes("vattn"), f"{engine}'s tests crash with vattn: {self.crashes('vattn')}"
        assert not self.unexplained(), f"fail only with vattn, not by design: {self.unexplained()}"
        for f, r_stock in self.stock.items():
            r_vattn = self.vattn.get(f, FileRun())
            assert bool(r_stock.collect_error) == bool(r_vattn.collect_error), (f, r_stock.collect_error,
                                                                                r_vattn.collect_error)


HEADER = ["release", "tests", "pass stock", "pass with vattn", "fail only with vattn", "of them by design",
          "crashes with vattn", "files that do not import here"]


def verdict(rep: Report, engine: str) -> None:
    """The standing check's test body: print what was found, then `Report.check`."""
    print(dict(zip(HEADER, rep.row())))
    print("\n".join(rep.lines()))
    rep.check(engine)


def main(run_release: Callable[[str, Path], Report], versions: Sequence[str]) -> None:
    """`python -m tests.integrations.test_<engine>_own_tests [VERSION...]`: every release in a
    directory of its own, then the lines of each report and the table for the engine's doc."""
    from vattn.report import markdown_table

    reports = []
    for v in versions:
        with tempfile.TemporaryDirectory() as d:
            reports.append(run_release(v, Path(d)))
    for rep in reports:
        for line in rep.lines():
            print(line)
    print(markdown_table(HEADER, [rep.row() for rep in reports]))
