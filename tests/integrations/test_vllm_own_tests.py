"""vLLM's own `tests/v1/core` with vattn's plugin on and off, for every supported release
(slow: `python -m pytest -m slow tests/integrations/test_vllm_own_tests.py`; the table of
counts: `python -m tests.integrations.test_vllm_own_tests`).

Each test file runs in a process of its own on the release's *unpatched* wheel (CPU,
`VLLM_TARGET_DEVICE=cpu`, `--noconftest`): once stock, and once at each page size of `PAGES`
with the plugin installed in-process the way vLLM's `load_general_plugins` would
(`VATTN_VLLM=1`; 64 KiB pages, smaller than blocks of several layers, and 2 MiB, the default
and CUDA's granularity, where a layer-outer cache needs the most blocks to fill a page), under the
harness of `test_vllm_patch.PLUGIN` (tensor-less test configurations get a one-region
geometry and a host `WorkerKV`, every block handed out is checked mapped, the books after
each test). A process that dies (a segfault) is named with the test it was running, and the
file runs again without that test. The check fails on any crash with vattn, and on any
test that passes stock and not with vattn unless it is on `BY_DESIGN` (with the reason).

Where the files come from (each release skipped with the reason when one is missing):
- vLLM: the release's wheel (`test_vllm_patch._wheel`: `VATTN_VLLM_WHEEL`, the cache dir
  `VATTN_CACHE_DIR` or ~/.cache/vattn, else `pip download`); its pure-Python dependencies
  in a target dir beside it (`test_vllm_patch._deps`);
- its tests: `VATTN_VLLM_TESTS_<version with _>` (a directory holding `tests/v1/core`, e.g.
  a copy of the release's sdist's), else the sdist (`VATTN_VLLM_SDIST_<version with _>`, or
  `vllm-<version>.tar.gz` in the cache dir);
- the model configs some tests read: `VATTN_VLLM_HF_HOME` (a Hugging Face cache holding their
  `config.json`), with `HF_HUB_OFFLINE=1`; without it those tests fail stock and with vattn
  alike (no network here), which this check does not count against vattn.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import zipfile
from pathlib import Path
from typing import Sequence

import pytest

from tests.conftest import REPO
from tests.integrations import own_tests
from tests.integrations import test_vllm_patch as tvp
from tests.integrations.own_tests import Report, version_var
from vattn.integrations import plugins

pytestmark = pytest.mark.slow

CORE = "tests/v1/core"
PAGES = {"64 KiB": 64 << 10, "2 MiB": 2 << 20}  # 64 KiB found the segfault; 2 MiB is what users run

# Tests that fail with vattn by design, with why. A test id, or a test function (every parameter).
_QUEUE = ("reads vLLM's free_block_queue (its count, head or order): under vattn it holds only the "
          "free blocks that must stay mapped (prefix-cached, watched); the others are the elastic pool's")
_ALIGN = ("vattn's align_num_blocks rounds num_blocks down so that every layer's blocks start on a page (a "
          "multiple of lcm(page, stride) / stride: 186 -> 176 blocks of 4 KiB a layer at 64 KiB pages); the test "
          "expects vLLM's own count")
_QUEUE_TESTS = {
    "tests/v1/core/test_prefix_caching.py::test_prefill": _QUEUE,
    "tests/v1/core/test_prefix_caching.py::test_prefill_plp": _QUEUE,
    "tests/v1/core/test_prefix_caching.py::test_evict": _QUEUE,
    "tests/v1/core/test_prefix_caching.py::test_prefill_not_enough_free_blocks_with_computed_blocks": _QUEUE,
    "tests/v1/core/test_prefix_caching.py::test_swa_free_split_keeps_cached_tail_ahead_of_scratch": _QUEUE,
    "tests/v1/core/test_prefix_caching.py::test_cache_hit_local_and_external": _QUEUE,
    "tests/v1/core/test_prefix_caching.py::test_cache_hit_local_and_external_three_groups": _QUEUE,
    "tests/v1/core/test_prefix_caching.py::test_cache_hit_local_and_external_three_groups_preempt_and_reallocate":
        _QUEUE,
    "tests/v1/core/test_prefix_caching.py::test_cache_hit_local_and_external_two_groups_preempt_and_reallocate":
        _QUEUE,
    "tests/v1/core/test_scheduler.py::test_memory_leak": _QUEUE + " (it compares the queue's count before and "
                                                          "after, as a leak check)",
}
BY_DESIGN = {  # page size -> test -> why
    "64 KiB": {
        **_QUEUE_TESTS,
        "tests/v1/core/test_contiguous_kv_packing.py::TestDensePacking::test_layer_outer_pads_only_unaligned_pages":
            _ALIGN,
        "tests/v1/core/test_kv_cache_planning.py::test_get_kv_cache_config_one_worker": _ALIGN,
        "tests/v1/core/test_kv_cache_planning.py::test_get_kv_cache_configs_multiple_workers": _ALIGN,
        "tests/v1/core/test_kv_cache_planning.py::test_get_kv_cache_configs_pp_sharding": _ALIGN,
    },
    # At 2 MiB the rounding cases pass: their caches (10 to 186 blocks) hold fewer blocks than one
    # whole-page run a layer, so the count stays vLLM's and vattn does not back them (start refuses)
    "2 MiB": {
        **_QUEUE_TESTS,
    },
}

ENV_STOCK = {"VATTN_VLLM": "0"}
ENV_VATTN = {"VATTN_VLLM": "1", "VATTN_TEST_PLUGIN": "1"}  # and VATTN_VLLM_PAGE_SIZE, one of PAGES
# what vLLM's tests import beyond the patch scenario's dependencies (test_vllm_patch.DEPS)
EXTRA_DEPS = ["httpx", "httpcore", "h11", "anyio", "sniffio", "idna", "anthropic", "openai", "distro", "jiter",
              "docstring-parser", "watchfiles", "orjson"]


def by_design(test_id: str, page: str = "64 KiB") -> str | None:
    """Why `test_id` fails with vattn at `page` (a key of `PAGES`) by design, or None."""
    return own_tests.why_by_design(BY_DESIGN[page], test_id)


# ------------------------------------------------------------------- the files ----
def vllm_tree(version: str, root: Path) -> Path:
    """`root` holding the release's `vllm/` (the wheel's Python files), its `tests/` (v1/core and
    what they import) and its pyproject.toml (pytest's settings). pytest.skip when missing."""
    with zipfile.ZipFile(tvp._wheel(version)) as z:
        z.extractall(root, [n for n in z.namelist() if n.startswith("vllm/") and not n.endswith(".so")])
    given = os.environ.get(version_var("VATTN_VLLM_TESTS", version))
    if given:
        src = Path(given)
        if not (src / CORE).is_dir():
            pytest.skip(f"{version_var('VATTN_VLLM_TESTS', version)}={given} holds no {CORE}")
        subprocess.run(["cp", "-r", str(src / "tests"), str(root)], check=True)
        if (src / "pyproject.toml").is_file():
            subprocess.run(["cp", str(src / "pyproject.toml"), str(root)], check=True)
        return root
    with tarfile.open(tvp._sdist(version)) as t:  # skips with the variables to set when there is none
        members = [m for m in t.getmembers() if re.match(r"[^/]+/(tests/|pyproject\.toml$)", m.name)]
        for m in members:
            m.name = m.name.split("/", 1)[1]
        t.extractall(root, members, filter="data")
    return root


def deps() -> Path:
    """vLLM's pure-Python dependencies (test_vllm_patch's and what its tests import), in a
    target dir of their own (never the venv)."""
    target = tvp._deps()
    stamp = target / ".tests-complete"
    if not stamp.exists():
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                            *EXTRA_DEPS], capture_output=True, text=True, timeout=1800)
        if r.returncode:
            pytest.skip(f"cannot install what vLLM's tests import into {target}: {r.stderr[-300:]}")
        stamp.touch()
    return target


def _env(root: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_VLLM")}
    env.update(PYTHONPATH=os.pathsep.join([str(root), str(REPO), str(deps())]), VLLM_TARGET_DEVICE="cpu",
               HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **extra)
    if os.environ.get("VATTN_VLLM_HF_HOME"):
        env["HF_HOME"] = os.environ["VATTN_VLLM_HF_HOME"]
    return env


# ---------------------------------------------------------------- a release ----
def run_release(version: str, root: Path, pages: Sequence[str] = tuple(PAGES)) -> dict[str, Report]:
    """Every test file of `tests/v1/core`, each in its own process: once stock, once with
    vattn at each page size of `pages` (keys of `PAGES`); a `Report` for each page size
    (its `version` reads "0.33.0 at 2 MiB pages")."""
    vllm_tree(version, root)
    files = sorted(str(p.relative_to(root)) for p in (root / CORE).rglob("test_*.py"))
    (root / "vattn_vllm_plugin.py").write_text(textwrap.dedent(tvp.PLUGIN))  # the harness (-p vattn_vllm_plugin)
    stock = {f: own_tests.run_file(root, f, _env(root, ENV_STOCK)) for f in files}  # the same at every page size
    reports = {}
    for page in pages:
        env = _env(root, {**ENV_VATTN, "VATTN_VLLM_PAGE_SIZE": str(PAGES[page])})
        vattn = {f: own_tests.run_file(root, f, env, ["vattn_vllm_plugin"]) for f in files}
        reports[page] = Report(f"{version} at {page} pages", stock, vattn, BY_DESIGN[page])
    return reports


@pytest.mark.parametrize("version", plugins.releases("vllm"))
def test_vllm_own_core_tests_pass_with_vattn_as_stock(version, tmp_path):
    for rep in run_release(version, tmp_path).values():
        own_tests.verdict(rep, "vLLM")


HEADER = ["release", "page size", "tests", "pass stock", "pass with vattn", "fail only with vattn",
          "of them by design", "crashes with vattn", "files that do not import here"]


def main(versions: Sequence[str]) -> list[Report]:
    """The table for docs/vllm.md: every release in a directory of its own, at every page size;
    prints each report's lines, each verdict (a failed one does not stop the others) and the table."""
    from vattn.report import markdown_table

    reports = []
    for v in versions:
        with tempfile.TemporaryDirectory() as d:
            reports += run_release(v, Path(d)).values()
    rows = []
    for rep in reports:
        print("\n".join(rep.lines()))
        try:
            rep.check("vLLM")
            print(f"{rep.version}: the check passes")
        except AssertionError as e:
            print(f"{rep.version}: THE CHECK FAILS: {e}")
        version, page = rep.version.split(" at ")
        rows.append([version, page.removesuffix(" pages"), *rep.row()[1:]])
    print(markdown_table(HEADER, rows))
    return reports


if __name__ == "__main__":  # python -m tests.integrations.test_vllm_own_tests [VERSION...]
    main(sys.argv[1:] or plugins.releases("vllm"))
