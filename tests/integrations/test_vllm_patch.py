"""patches/vllm-<version>.patch against the real vLLM release (slow: `python -m pytest -m slow`).

What runs, each step skipped with its reason when it cannot:
1. The wheel (env `VATTN_VLLM_WHEEL`, else the cache dir `VATTN_CACHE_DIR` or
   ~/.cache/vattn, else `pip download`, about 340 MB) is unpacked (`vllm/`, Python files)
   and the patch applied with `patch -p1`, the command a user runs; every patched file
   compiles (`py_compile`), and the patch reverses cleanly.
2. With vLLM's pure-Python dependencies in a separate target dir (env
   `VATTN_VLLM_DEPS`, else `pip install --target` into the cache dir; never the venv),
   the patched scheduler side runs for real: vLLM's `KVCacheManager` (prefix caching
   on) over vattn, with the worker's patched `allocate_kv_cache` giving a host-backend
   `WorkerKV`; requests are allocated, hit the prefix cache, freed, trimmed, and
   refused under a limit.
3. vLLM's own unit tests of that release (its sdist tarball, which carries `tests/`: env
   `VATTN_VLLM_SDIST_<version with _>`, else `vllm-<version>.tar.gz` in the cache dir)
   run twice on the patched tree: with `VATTN_VLLM=0` (the
   patch must change nothing) and with vattn on (a plugin gives their tensor-less
   configurations a one-region geometry and puts a host `WorkerKV` behind every block
   pool, checking after each allocation that every block vLLM holds is mapped).
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow

PATCHES = sorted(REPO.glob("patches/vllm-*.patch"))
# pip names of what the patched scheduler modules import and the venv lacks (no torch, no CUDA)
DEPS = ["pyzmq", "urllib3", "msgspec", "cbor2", "aiohttp", "multidict", "attrs", "yarl", "propcache",
        "aiohappyeyeballs", "aiosignal", "frozenlist", "requests", "certifi", "openai-harmony", "pybase64",
        "cachetools", "cloudpickle", "uvloop", "py-cpuinfo", "prometheus-client", "xgrammar", "apache-tvm-ffi",
        "partial-json-parser", "llguidance", "einops"]
# The block pool's and KV cache manager's tests (seconds). The nixl/HiSparse ones wait for
# transfer libraries that are not installed; the scheduler's build a model config (network).
VLLM_TESTS = ["tests/v1/core/test_prefix_caching.py", "tests/v1/core/test_single_type_kv_cache_manager.py"]
VLLM_DESELECT = "not nixl and not hisparse"


def _version(patch: Path) -> str:
    return re.fullmatch(r"vllm-(.+)\.patch", patch.name).group(1)


def _cache_dir() -> Path:
    d = Path(os.environ.get("VATTN_CACHE_DIR") or Path.home() / ".cache" / "vattn")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _wheel(version: str) -> Path:
    env = os.environ.get("VATTN_VLLM_WHEEL")
    if env:
        if not Path(env).is_file():
            pytest.skip(f"VATTN_VLLM_WHEEL={env} is not a file")
        return Path(env)
    cache = _cache_dir()
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if found:
        return found[0]
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        f"vllm=={version}", "-d", str(cache)], capture_output=True, text=True, timeout=1800)
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if r.returncode or not found:
        pytest.skip(f"cannot download the vLLM {version} wheel (set VATTN_VLLM_WHEEL): {r.stderr[-300:]}")
    return found[0]


def _patched_files(patch: Path) -> list[str]:
    return [line[6:].strip() for line in patch.read_text().splitlines() if line.startswith("+++ b/")]


@pytest.fixture(scope="module", params=PATCHES, ids=lambda p: p.name)
def tree(request, tmp_path_factory):
    """The release's `vllm/` (Python files) with the patch applied as a user does."""
    patch = request.param
    if shutil.which("patch") is None:
        pytest.skip("the `patch` command is not installed")
    wheel = _wheel(_version(patch))
    root = tmp_path_factory.mktemp("vllm")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root, [n for n in z.namelist() if n.startswith("vllm/") and not n.endswith(".so")])
    r = subprocess.run(["patch", "-p1", "--forward", "-i", str(patch)], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, f"patch -p1 failed:\n{r.stdout}\n{r.stderr}"
    assert "offset" not in r.stdout and "fuzz" not in r.stdout, r.stdout  # applies exactly
    return patch, root


def test_patch_applies_compiles_and_reverses(tree):
    patch, root = tree
    files = _patched_files(patch)
    assert files and all(f.startswith("vllm/") for f in files)
    for f in files:
        src = (root / f).read_text()
        assert "vattn" in src, f
        compile(src, str(root / f), "exec")  # what py_compile does, without writing .pyc
    r = subprocess.run([sys.executable, "-m", "py_compile", *files], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["patch", "-p1", "-R", "--dry-run", "-i", str(patch)], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _deps() -> Path:
    env = os.environ.get("VATTN_VLLM_DEPS")
    if env:
        return Path(env)
    target = _cache_dir() / f"vllm-deps-py{sys.version_info.major}{sys.version_info.minor}"
    stamp = target / ".complete"
    if not stamp.exists():
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *DEPS],
                           capture_output=True, text=True, timeout=1800)
        if r.returncode:
            pytest.skip(f"cannot install vLLM's pure-Python dependencies into {target}: {r.stderr[-300:]}")
        stamp.touch()
    return target


def _run(root: Path, code: str, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(REPO), str(_deps())]), **(env or {}))
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=e, capture_output=True, text=True,
                          timeout=timeout)


def _importable(root: Path) -> None:
    r = _run(root, "import vllm.v1.core.kv_cache_manager, vllm.v1.worker.utils")
    if r.returncode:
        pytest.skip(f"the patched vLLM modules do not import here: {r.stderr.strip().splitlines()[-1]}")


SCENARIO = r'''
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import Request
from vllm.v1.worker.utils import allocate_kv_cache
from vattn.integrations import vllm as vv

BS, N, L = 16, 512, 4
spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float16)
page = spec.page_size_bytes  # K and V of one block in one layer: 8 KiB
names = [f"layers.{i}.attn" for i in range(L)]
cfg = KVCacheConfig(num_blocks=N, kv_cache_tensors=[KVCacheTensor(size=N * page * L, layers=names,
                    layer_stride=N * page, block_stride=page)], kv_cache_groups=[KVCacheGroupSpec(names, spec)])
init_none_hash(sha256)
mgr = KVCacheManager(cfg, max_model_len=4096, enable_caching=True, hash_block_size=BS, scheduler_block_size=BS)
skv = mgr.block_pool.vattn
assert skv is not None, "the patched coordinator did not attach vattn"
views = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout.LBNHC, None)  # the patched worker side
w = vv.worker_kv("cpu")
assert w is not None and views[names[0]].untyped_storage().data_ptr() == w.tensor.data_ptr()
print("views", tuple(views[names[1]].shape), "mapped at start", w.mapped_bytes)

def step():
    out = type("Out", (), {})()
    out.vattn_ops = vv.take_ops(type("S", (), {"kv_cache_manager": mgr})())
    vv.apply(out)

def request(rid, tokens):
    sp = SamplingParams(max_tokens=16)
    sp.update_from_generation_config({}, eos_token_id=100)
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(BS, sha256))

def admit(req):
    hit, n_hit, _ = mgr.get_computed_blocks(req)
    blocks = mgr.allocate_slots(req, req.num_tokens - n_hit, n_hit, hit)
    if blocks is not None:
        step()
        for b in mgr.get_block_ids(req.request_id)[0]:
            assert w.is_mapped(b), b
            w.tensor[b * page] = b % 100  # "the forward writes" (layer 0, block b)
    return blocks, n_hit

system = list(range(1, 1 + 8 * BS))  # a shared 8-block system prompt
reqs = [request(f"r{i}", system + [1000 + i] * (20 + 7 * i)) for i in range(8)]
hits = [admit(r)[1] for r in reqs]
print("prefix hits", hits)
assert hits[0] == 0 and all(h == 8 * BS for h in hits[1:]), hits
grown = w.mapped_bytes
assert grown > 4 * skv.layout.page_size, grown
for r in reqs:
    mgr.free(r)
step()
assert w.mapped_bytes == grown  # freed blocks keep their pages (cached, and the prefix cache)
again = request("again", system + [7] * 5)
assert admit(again)[1] == 8 * BS  # the prefix cache survives the free
for b in mgr.get_block_ids("again")[0][:8]:
    assert int(w.tensor[b * page]) == b % 100  # its data too
mgr.free(again)
skv.check_invariants()
given = skv.trim()
step()
print("grown", grown, "after trim", w.mapped_bytes, "given back", given)
assert w.mapped_bytes == len(w.bases) * skv.layout.page_size  # the null block's page only
# a limit: an exhausted pool is a scheduling miss, never an error
skv.set_limit(2 * len(w.bases) * skv.layout.page_size)  # 2 page groups = 16 blocks, one is null
big = request("big", list(range(5000, 5000 + 20 * BS)))
assert admit(big)[0] is None, "over the limit: allocate_slots must return None"
small = request("small", list(range(9000, 9000 + 10 * BS)))
assert admit(small)[0] is not None
assert mgr.block_pool.get_usage() > 0.6
mgr.free(small)
skv.check_invariants()
print("OK")
'''


def test_patched_vllm_kv_cache_manager_on_vattn(tree):
    patch, root = tree
    _importable(root)
    r = _run(root, SCENARIO, {"VATTN_VLLM_PAGE_SIZE": str(64 << 10)})
    print(r.stdout)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr[-4000:]


PLUGIN = r'''
"""Puts vLLM's unit tests on vattn: tensor-less test configurations get a one-region
geometry; every attached block pool gets a host WorkerKV that applies the page ops after
each allocation and checks that the blocks handed out are mapped."""
import os
import pytest
if os.environ.get("VATTN_TEST_PLUGIN") == "1":  # an unpatched tree: the plugin installs the hooks
    from vattn.integrations import plugins
    _st = plugins.install("vllm")
    assert _st.status == "installed", (_st.status, _st.reason)
from vattn.integrations import vllm as vv

BLOCK = 4096
_block_layout = vv.block_layout
_take = vv.SchedulerKV.take
_live = []

def block_layout(cfg, page=None):
    if getattr(cfg, "vattn_layout", None) is not None:  # the test worker of a scheduler: its layout
        return cfg.vattn_layout
    if not list(cfg.kv_cache_tensors):
        P = page or vv.page_size()
        return vv.BlockLayout(int(cfg.num_blocks), BLOCK, P, (0,), int(cfg.num_blocks) * BLOCK)
    return _block_layout(cfg, page)

def take(self, n):
    blocks = _take(self, n)
    w = getattr(self, "_test_worker", None)
    if w is None:
        cfg = type("C", (), {"num_blocks": self.layout.num_blocks, "kv_cache_tensors": [],
                             "vattn_layout": self.layout})()
        w = self._test_worker = vv.WorkerKV(cfg, self.layout.size, "cpu")
        w.seq = 0
        _live.append(self)
    w.apply(self.drain())
    for b in blocks:
        assert w.is_mapped(b.block_id), f"block {b.block_id} handed out unmapped"
    return blocks

vv.block_layout = vv.worker.block_layout = block_layout  # attach and WorkerKV look it up there
vv.SchedulerKV.take = take

@pytest.fixture(autouse=True)
def _vattn_checks():
    yield
    while _live:
        skv = _live.pop()
        skv.check_invariants()
        skv._test_worker.apply(skv.drain())
        skv._test_worker.close()
'''


def _sdist(version: str) -> Path:
    """The release's sdist: `VATTN_VLLM_SDIST_<version with _>`, else the cache dir's
    `vllm-<version>.tar.gz` (pip cannot download it here: it builds its metadata)."""
    var = f"VATTN_VLLM_SDIST_{version.replace('.', '_')}"
    sdist = Path(os.environ.get(var) or _cache_dir() / f"vllm-{version}.tar.gz")
    if not sdist.is_file():
        pytest.skip(f"no vLLM {version} sdist at {sdist} (set {var} to the tarball: it carries tests/)")
    return sdist


def _vllm_tests(root: Path, version: str) -> Path:
    sdist = _sdist(version)
    import tarfile
    with tarfile.open(sdist) as t:
        members = [m for m in t.getmembers() if re.match(r"[^/]+/tests/", m.name)]
        for m in members:
            m.name = m.name.split("/", 1)[1]
        t.extractall(root, members, filter="data")
    return root


def _pytest(root: Path, extra_env: dict, plugin: bool) -> dict[str, str]:
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-rA", "-k", VLLM_DESELECT, *VLLM_TESTS]
    if plugin:
        (root / "vattn_vllm_plugin.py").write_text(textwrap.dedent(PLUGIN))
        args += ["-p", "vattn_vllm_plugin"]
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(REPO), str(_deps())]), **extra_env)
    r = subprocess.run([sys.executable, *args], cwd=root, env=e, capture_output=True, text=True, timeout=3600)
    out = {}
    for line in r.stdout.splitlines():
        m = re.match(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", line)
        if m:
            out[m.group(2)] = m.group(1)
    assert out, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_vllm_unit_tests_on_the_patched_tree(tree):
    patch, root = tree
    _importable(root)
    _vllm_tests(root, _version(patch))
    off = _pytest(root, {"VATTN_VLLM": "0"}, plugin=False)
    on = _pytest(root, {"VATTN_VLLM_PAGE_SIZE": str(64 << 10)}, plugin=True)
    passed_off = {t for t, s in off.items() if s == "PASSED"}
    passed_on = {t for t, s in on.items() if s == "PASSED"}
    report = Path(os.environ.get("VATTN_VLLM_REPORT", root / "vllm-tests-report.txt"))
    report.write_text("\n".join(f"{t}\toff={off.get(t)}\ton={on.get(t)}" for t in sorted(set(off) | set(on))))
    print(f"vLLM {_version(patch)}, patched: VATTN_VLLM=0 {len(passed_off)}/{len(off)} passed; vattn on: "
          f"{len(passed_on)}/{len(on)} passed; report: {report}")
    assert passed_off == set(off), "with VATTN_VLLM=0 the patched tree must pass vLLM's tests"
    for t in sorted(passed_off - passed_on):
        reads_queue = _reads_free_queue(root, t)
        print("fails only with vattn:", t, "(reads vLLM's free_block_queue)" if reads_queue else "")
        # By design vLLM's free queue holds only the free blocks that must stay mapped; a test
        # that counts or walks it sees fewer blocks. Any other failure is a bug.
        assert reads_queue, f"{t} fails with vattn and does not inspect the free queue"
    assert len(passed_on) > 0.9 * len(on)


def _reads_free_queue(root: Path, test_id: str) -> bool:
    """Whether a test function, or a helper it calls (transitively), reads `free_block_queue`."""
    path, name = test_id.split("::")[:2]
    src = (root / path).read_text()
    funcs = dict(re.findall(r"\ndef (\w+)\((.*?)(?=\n(?:def |@|class )|\Z)", src, re.S))
    todo, seen = [name.split("[")[0]], set()
    while todo:
        f = todo.pop()
        if f in seen or f not in funcs:
            continue
        seen.add(f)
        if "free_block_queue" in funcs[f]:
            return True
        todo += [g for g in funcs if re.search(rf"\b{g}\(", funcs[f])]
    return False
