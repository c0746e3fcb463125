"""tests/integrations/test_hf_cb.py and tests/integrations/test_serve.py on every transformers
release `hf_cb` supports.

The installed release runs as it is; every other one is installed once (pip, `--target` a
cache directory: the environment's own transformers is left alone) with whatever of its
requirements the environment does not satisfy, and put first on PYTHONPATH. The two test
modules run in a subprocess: the greedy-equality tests (Llama, Qwen2, sliding-window
Mistral), the memory, limit and budget tests, `vattn serve` over HTTP (answers equal to
`generate`, memory rising under a burst and falling back when idle, and its contract:
refusals at each release's own block count, restarts, `n`, `[DONE]`, draining on SIGTERM),
and a test that checks the version it ran on. None may be skipped (the `gpu` tests, which
need a CUDA GPU, are left out: the GPU suite runs them).
Marked `slow` (downloads, about a minute a release):
`python -m pytest -m slow tests/integrations/test_hf_cb_versions.py`.
The cache directory is $VATTN_TRANSFORMERS_CACHE or ~/.cache/vattn/transformers.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

hf_cb = pytest.importorskip("vattn.integrations.hf_cb")
pytest.importorskip("transformers")
from packaging.requirements import Requirement  # noqa: E402

from tests.conftest import REPO  # noqa: E402

# The exact release each supported major.minor was verified with
TESTED = {"5.17": "5.17.0", "5.18": "5.18.0", "5.19": "5.19.0", "5.20": "5.20.2", "5.21": "5.21.1",
          "5.22": "5.22.2", "5.23": "5.23.0", "5.24": "5.24.0"}


def install(version: str) -> Path:
    """transformers==version in its own directory, plus the requirements this environment misses."""
    root = Path(os.environ.get("VATTN_TRANSFORMERS_CACHE", Path.home() / ".cache" / "vattn" / "transformers"))
    target = root / version
    done = target / ".complete"
    if done.exists():
        return target
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(target)]
    subprocess.run([*pip, "--no-deps", f"transformers=={version}"], check=True, timeout=600)
    info = next(target.glob(f"transformers-{version}.dist-info"))
    missing = []
    for line in (info / "METADATA").read_text().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            missing.append(str(req))
    if missing:  # with their own requirements, into the same directory
        subprocess.run([*pip, "--upgrade", *missing], check=True, timeout=600)
    done.touch()
    return target


def test_every_supported_version_has_a_tested_release():
    assert set(hf_cb.SUPPORTED_VERSIONS) <= set(TESTED)
    assert {"5.17", "5.24"} <= set(hf_cb.SUPPORTED_VERSIONS)


def test_extras_ask_for_the_verified_releases():
    """pip never picks a transformers vattn has not verified: every extra that pulls it asks
    for `hf_cb.verified_requirement()` (which follows `hf_cb.DESIGNS`)."""
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pulls = {extra: req for extra, reqs in extras.items() for req in map(Requirement, reqs) if req.name == "transformers"}
    assert set(pulls) == {"hf", "serve", "test"}
    want = Requirement(hf_cb.verified_requirement()).specifier
    assert {extra: req.specifier for extra, req in pulls.items()} == dict.fromkeys(pulls, want)


@pytest.mark.slow
@pytest.mark.parametrize("minor", hf_cb.SUPPORTED_VERSIONS)
def test_hf_cb_tests_pass_on(minor):
    version = TESTED[minor]
    path = [] if metadata.version("transformers") == version else [str(install(version))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, str(REPO)]), VATTN_EXPECT_TRANSFORMERS=version,
               OMP_NUM_THREADS="1")
    # gpu tests deselected: without a GPU they would be skipped, and here none may
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu",
                          "tests/integrations/test_hf_cb.py", "tests/integrations/test_serve.py",
                          "tests/integrations/test_serve_clients.py"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary) and "skipped" not in summary and "failed" not in summary, summary


@pytest.mark.slow
@pytest.mark.parametrize("minor", hf_cb.SUPPORTED_VERSIONS)
def test_engine_model_families_pass_on(minor):
    """vattn's engine reads transformers' modules of the newer layer kinds (the latent's cache
    call and `expand_kv`, sinks, chunked attention): its family tests on each release."""
    version = TESTED[minor]
    path = [] if metadata.version("transformers") == version else [str(install(version))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, str(REPO)]), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu",
                          "tests/engine/test_new_kinds.py", "tests/engine/test_model_support.py"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    assert re.search(r"\b\d+ passed\b", out.strip().splitlines()[-1]), out[-2000:]
