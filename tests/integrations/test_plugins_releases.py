"""The plugins against every listed release's wheel (slow: `python -m pytest -m slow`).

For each release in `vattn.integrations.plugins.releases` (vLLM and SGLang):
- the fingerprints recorded for it are those of its wheel's functions;
- the plugin hooks exactly the functions `patch -p1` changes (derived independently: the
  defs whose source differs between the wheel and the patched copy);
- vLLM: on the *unpatched* wheel, the plugin installed in-process (as vLLM's
  `load_general_plugins` would) runs the patched-tree scenario of `test_vllm_patch.py`
  (the real `KVCacheManager` on vattn), and vLLM's own block-pool and KV-cache-manager
  tests of that release (its sdist: `VATTN_VLLM_SDIST_<version with _>` or
  `~/.cache/vattn/vllm-<version>.tar.gz`), with `VATTN_VLLM=0` and with the plugin on;
- SGLang: on the *unpatched* wheel, the plugin installed in-process (as SGLang's
  `sglang.srt.plugins` entry point would) runs vattn's SGLang checks of
  `test_sglang_patch.py` on the real classes: `MHATokenToKVPool` on vattn memory, the real
  allocators' trace, the idle invariant check and `RadixCache` under a limit (`REAL_POOL`),
  and the scheduler loop through refused pages on the real allocators, `PrefillBudget` and
  `RadixCache`, outputs equal to SGLang's own memory (`REAL_LOOP`).
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.integrations import test_sglang_patch as tsp
from tests.integrations import test_vllm_patch as tvp
from vattn.integrations import plugins
from vattn.integrations.plugins import hunks
from vattn.integrations.plugins.releases import FINGERPRINTS

pytestmark = pytest.mark.slow

CASES = [(e, v) for e in ("vllm", "sglang") for v in plugins.releases(e)]


def _wheel(engine: str, version: str) -> Path:
    return tvp._wheel(version) if engine == "vllm" else tsp._wheel(version)


@pytest.fixture(scope="module", params=CASES, ids=[f"{e}-{v}" for e, v in CASES])
def release(request, tmp_path_factory):
    """(engine, version, unpatched tree, patched tree) of a release's wheel."""
    engine, version = request.param
    wheel = _wheel(engine, version)
    root = tmp_path_factory.mktemp(f"{engine}-{version}")
    plain, patched = root / "plain", root / "patched"
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith(f"{engine}/") and not n.endswith(".so")]
        z.extractall(plain, names)
    shutil.copytree(plain, patched)
    patch = plugins.patch_file(engine, version)
    r = subprocess.run(["patch", "-p1", "-F", "0", "-i", str(patch)], cwd=patched, capture_output=True, text=True)
    assert r.returncode == 0 and "offset" not in r.stdout and "fuzz" not in r.stdout, r.stdout + r.stderr
    return engine, version, plain, patched


def test_recorded_fingerprints_are_the_wheels(release):
    engine, version, plain, _ = release
    assert hunks.fingerprints(plugins.patch_file(engine, version).read_text(), plain) == FINGERPRINTS[engine][version]


def _changed_defs(plain: Path, patched: Path, files: list[str]) -> set[str]:
    """`module:qualname` of every def (or class body) whose source the patch changed."""
    out = set()
    for f in files:
        def table(path: Path) -> dict[str, str]:
            src = path.read_text()
            tree = ast.parse(src)
            got = {}
            for q, node, _ in hunks._defs(tree):
                seg = ast.get_source_segment(src, node)
                if isinstance(node, ast.ClassDef):  # the class body without its methods
                    seg = "\n".join(ast.unparse(s) for s in node.body
                                    if not isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
                got[q] = seg
            return got
        a, b = table(plain / f), table(patched / f)
        mod = hunks._module_name(f)
        for q in b:
            if a.get(q) != b[q]:
                # an enclosing class changed only through its methods does not count
                out.add(f"{mod}:{q}")
    return out


def test_the_plugin_hooks_the_functions_the_patch_changes(release):
    engine, version, plain, patched = release
    text = plugins.patch_file(engine, version).read_text()
    files = sorted({h.path for h in hunks.parse(text)})
    hooked = {h.name for h in hunks.plan(text, plain) if h.kind != "import"}
    assert hooked == _changed_defs(plain, patched, files)


def _vllm_plain(release):
    engine, version, plain, _ = release
    if engine != "vllm":
        pytest.skip("vLLM only")
    return version, plain


INSTALL = (
    "import os; os.environ['VATTN_VLLM'] = '1'\n"
    "from vattn.integrations import plugins\n"
    "st = plugins.install('vllm'); assert st.status == 'installed', (st.status, st.reason)\n"
    "print('hooks', len(st.hooks))\n"
)


def test_vllm_plugin_runs_the_kv_cache_manager_scenario(release):
    version, plain = _vllm_plain(release)
    r = tvp._run(plain, "import vllm.v1.core.kv_cache_manager, vllm.v1.worker.utils")
    if r.returncode:
        pytest.skip(f"vLLM's modules do not import here: {r.stderr.strip().splitlines()[-1]}")
    r = tvp._run(plain, INSTALL + tvp.SCENARIO, {"VATTN_VLLM_PAGE_SIZE": str(64 << 10)})
    print(r.stdout)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-4000:]


def test_vllm_own_tests_with_the_plugin(release):
    version, plain = _vllm_plain(release)
    tvp._vllm_tests(plain, version)
    off = tvp._pytest(plain, {"VATTN_VLLM": "0"}, plugin=False)
    on = tvp._pytest(plain, {"VATTN_VLLM": "1", "VATTN_TEST_PLUGIN": "1", "VATTN_VLLM_PAGE_SIZE": str(64 << 10)},
                     plugin=True)
    passed_off = {t for t, s in off.items() if s == "PASSED"}
    passed_on = {t for t, s in on.items() if s == "PASSED"}
    print(f"vLLM {version}, plugin: VATTN_VLLM=0 {len(passed_off)}/{len(off)} passed; "
          f"VATTN_VLLM=1 {len(passed_on)}/{len(on)} passed")
    report = Path(os.environ.get("VATTN_VLLM_REPORT_DIR", plain)) / f"vllm-{version}-plugin-tests.txt"
    report.write_text("\n".join(f"{t}\toff={off.get(t)}\ton={on.get(t)}" for t in sorted(set(off) | set(on))))
    assert passed_off == set(off)
    for t in sorted(passed_off - passed_on):
        print("fails only with vattn (by design: reads vLLM's free_block_queue):", t)
        assert tvp._reads_free_queue(plain, t), f"{t} fails with vattn and does not inspect the free queue"
    assert len(passed_on) > 0.9 * len(on)


def test_sglang_plugin_runs_the_integration_checks(release, tmp_path):
    engine, version, plain, _ = release
    if engine != "sglang":
        pytest.skip("SGLang only")
    for name, script, ok in (("REAL_POOL", tsp.REAL_POOL, "REAL POOL OK"), ("REAL_LOOP", tsp.REAL_LOOP, "REAL LOOP OK")):
        d = tmp_path / name
        d.mkdir()
        r = tsp.run_script(script, plain, "plugin", d)
        print(r.stdout)
        assert r.returncode == 0 and ok in r.stdout and f"plugin: sglang {version}" in r.stdout, (
            r.stdout + r.stderr)[-4000:]
