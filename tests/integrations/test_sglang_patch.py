"""`patches/sglang-<version>.patch` against the real SGLang wheel of each release the
patches are written for, 0.5.22 and 0.5.23 (slow: a 40 MB download each).

- The wheel: `VATTN_SGLANG_WHEEL_<version with _>=/path/to/sglang-<version>-*.whl`, else
  the cache directory (`VATTN_CACHE_DIR`, default `~/.cache/vattn`), else `pip download
  --no-deps --only-binary :all: sglang==<version>` into it; skipped with the reason when
  none works.
- `sglang/` is unpacked, the patch applied with `patch -p1` (no fuzz, no offset beyond
  what the file says), every patched file byte-compiled, and the patch reversed cleanly.
- SGLang's own allocator classes (`allocator/base.py`, `token.py`, `paged.py`, patched)
  are imported without SGLang's package `__init__`s and heavy dependencies: the parent
  packages are bare, and the four helpers `paged.py` imports from `sglang.srt.utils` are
  SGLang's own functions, compiled from the wheel's `utils/common.py`; the platform
  reports no Triton, so SGLang's torch paths (`alloc_extend_naive`,
  `alloc_decode_naive`) run. These real classes replay the allocation trace of
  `tests/integrations/test_sglang_integration.py` on vattn's host backend.
- SGLang's real, patched `MHATokenToKVPool` (`memory_pool.py`, which imports much of
  SGLang) is built on vattn memory in a subprocess: its import needs Triton and a few
  more of SGLang's dependencies, installed with `pip install --no-deps --target` into
  the cache (`VATTN_SGLANG_DEPS` names a ready directory instead; about 300 MB, most of
  it Triton), never into this environment; torchvision (imported by SGLang's multimodal
  configs, unused by the KV pool, and built for another torch) is a stand-in module.
  Its own `set_kv_buffer`/`get_kv_buffer` and the trace run on the host backend.
- The scheduler loop of `tests/integrations/test_sglang_engine_loop.py` on SGLang's real patched
  allocators (their decode gate `check_decode_capacity`), real `PrefillBudget` and real
  `RadixCache`, with page creation refused under load: every request finishes with the
  output on SGLang's own memory (`torch.zeros` buffers).
- `tests/integrations/test_plugins_releases.py` runs the same two scripts on the *unpatched* wheel with
  the plugin installed in the process instead (`SCRIPT_PRELUDE`'s "plugin" mode).
- `VATTN_SGLANG_OWN_TESTS`: paths of SGLang's own CPU allocator tests (from an SGLang
  checkout; the wheel has none) to run against the patched classes in the same setting.
"""
from __future__ import annotations

import ast
import functools
import importlib
import logging
import os
import py_compile
import re
import shutil
import subprocess
import sys
import types
import typing
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from vattn.integrations import sglang as vs

pytestmark = pytest.mark.slow

ROOT = REPO
PATCHES = sorted((ROOT / "patches").glob("sglang-*.patch"))
VERSIONS = [re.match(r"sglang-(.+)\.patch", p.name).group(1) for p in PATCHES]
UTILS = ("get_bool_env_var", "get_num_new_pages", "is_hip", "next_power_of_2")


def _cache_dir() -> Path:
    return Path(os.environ.get("VATTN_CACHE_DIR", Path.home() / ".cache" / "vattn"))


def _wheel(version: str) -> Path:
    given = os.environ.get(f"VATTN_SGLANG_WHEEL_{version.replace('.', '_')}")
    if given:
        if not Path(given).is_file():
            pytest.skip(f"VATTN_SGLANG_WHEEL_{version.replace('.', '_')}={given} is not a file")
        return Path(given)
    cache = _cache_dir() / "sglang"
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[-1]
    cache.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        f"sglang=={version}", "-d", str(cache)], capture_output=True, text=True, timeout=600)
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if r.returncode or not found:
        pytest.skip(f"cannot download the sglang {version} wheel: {(r.stderr or r.stdout).strip()[-300:]}")
    return found[-1]


def _patched_files(patch: Path) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(), flags=re.M)


@dataclass(frozen=True)
class Release:
    version: str
    patch: Path
    root: Path  # holds the release's sglang/, the patch applied


@pytest.fixture(scope="module", params=VERSIONS, ids=[f"sglang-{v}" for v in VERSIONS])
def tree(request, tmp_path_factory) -> Release:
    """The wheel's `sglang/` with the release's patch applied."""
    version = request.param
    patch = ROOT / "patches" / f"sglang-{version}.patch"
    if shutil.which("patch") is None:
        pytest.skip("needs the `patch` program")
    root = tmp_path_factory.mktemp(f"sglang-{version}")
    with zipfile.ZipFile(_wheel(version)) as z:
        z.extractall(root, [n for n in z.namelist() if n.startswith("sglang/")])
    r = subprocess.run(["patch", "-p1", "--no-backup-if-mismatch", "-F", "0", "-i", str(patch)],
                       cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "offset" not in r.stdout and "fuzz" not in r.stdout, r.stdout
    return Release(version, patch, root)


def test_patch_applies_compiles_and_reverses(tree):
    files = _patched_files(tree.patch)
    assert len(files) >= 8
    for f in files:
        py_compile.compile(str(tree.root / f), doraise=True)
        assert "vattn_sglang." in (tree.root / f).read_text()
    r = subprocess.run(["patch", "-p1", "-R", "--dry-run", "-i", str(tree.patch)], cwd=tree.root,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    vs.check_sglang(tree.version)


def _module_names(path: Path) -> set[str]:
    """Names bound at module level (imports, defs, assignments)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def test_names_the_hunks_use_exist_in_their_modules(tree):
    """The modules that need a GPU to import: what the added lines name is bound there."""
    needs = {"sglang/srt/mem_cache/memory_pool.py": {"vattn_sglang", "Any", "Optional"},
             "sglang/srt/mem_cache/kv_cache_configurator.py": {"vattn_sglang", "MHATokenToKVPool", "get_disagg"},
             "sglang/srt/managers/scheduler.py": {"vattn_sglang"},
             "sglang/srt/managers/scheduler_components/invariant_checker.py": {"vattn_sglang"},
             "sglang/srt/mem_cache/allocator/base.py": {"vattn_sglang"},
             "sglang/srt/mem_cache/prefill_budget.py": {"vattn_sglang"}}
    for f, names in needs.items():
        assert names <= _module_names(tree.root / f), (f, names - _module_names(tree.root / f))
    api = set(vs.__all__)
    for f in _patched_files(tree.patch):
        for call in re.findall(r"vattn_sglang\.(\w+)", (tree.root / f).read_text()):
            assert call in api, f"{f} calls vattn_sglang.{call}, which vattn.integrations.sglang does not export"


def test_every_hunk_calls_into_vattn(tree):
    """The patch carries no logic: every added line is a call into vattn_sglang, its
    import, or the plumbing of one value (kwarg, comment, a wrapped return)."""
    added = [line[1:] for line in tree.patch.read_text().splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    assert len(added) < 60
    assert sum("vattn_sglang." in a for a in added) >= 12


def _module(name: str, path: Path | None = None, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    if path is not None:
        mod.__path__ = [str(path)]
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


@pytest.fixture(scope="module")
def sglang_alloc(tree):
    """The patched `sglang.srt.mem_cache.allocator` package (token, paged), real code."""
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    for k in saved:
        del sys.modules[k]
    src = (tree.root / "sglang/srt/utils/common.py").read_text()
    funcs = [n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name in UTILS]
    assert sorted(f.name for f in funcs) == sorted(UTILS)
    utils_ns: dict = {"torch": torch, "os": os, "Optional": typing.Optional, "lru_cache": functools.lru_cache,
                      "logger": logging.getLogger("sglang"), "_warned_bool_env_var_keys": set()}
    exec(compile(ast.Module(body=funcs, type_ignores=[]), "sglang/srt/utils/common.py", "exec"), utils_ns)
    pkg = tree.root / "sglang"
    _module("sglang", pkg)
    _module("sglang.srt", pkg / "srt")
    _module("sglang.srt.mem_cache", pkg / "srt/mem_cache")
    _module("sglang.srt.mem_cache.allocator", pkg / "srt/mem_cache/allocator")
    _module("sglang.srt.utils", pkg / "srt/utils", **{n: utils_ns[n] for n in UTILS})
    caps = types.SimpleNamespace(supports_triton=False)
    _module("sglang.srt.platforms", pkg / "srt/platforms", current_platform=types.SimpleNamespace(capabilities=caps))

    def no_kernel(*a, **k):
        raise AssertionError("the Triton kernel must not run on the CPU")

    _module("sglang.kernels", pkg / "kernels")
    _module("sglang.kernels.ops", pkg / "kernels/ops")
    _module("sglang.kernels.ops.memory", pkg / "kernels/ops/memory")
    _module("sglang.kernels.ops.memory.allocator", alloc_extend_kernel=no_kernel, alloc_decode_kernel=no_kernel)
    token = importlib.import_module("sglang.srt.mem_cache.allocator.token")
    paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
    yield types.SimpleNamespace(token=token, paged=paged)
    for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
        del sys.modules[k]
    sys.modules.update(saved)


class _Adapter:
    """SGLang's call signatures (tensors, CPU copies, extend_num_tokens) for the trace."""

    def __init__(self, alloc) -> None:
        self.a = alloc
        self.page_size = alloc.page_size

    def __getattr__(self, name):
        return getattr(self.a, name)

    def alloc_extend(self, prefix_lens, seq_lens, last_loc):
        p, s, last = (torch.tensor(x, dtype=torch.int64) for x in (prefix_lens, seq_lens, last_loc))
        return self.a.alloc_extend(p, p.clone(), s, s.clone(), last, int((s - p).sum()))

    def alloc_decode(self, seq_lens, last_loc):
        s, last = torch.tensor(seq_lens, dtype=torch.int64), torch.tensor(last_loc, dtype=torch.int64)
        return self.a.alloc_decode(s, s.clone(), last)


def _make(mods, page_size: int, size: int, **settings):
    from tests.integrations.test_sglang_integration import VPAGE, MHATokenToKVPool

    settings["page_size"] = settings.pop("vpage", VPAGE)  # vattn's page (page_size is SGLang's)
    settings.setdefault("idle_trim_s", 0.0)
    pool = MHATokenToKVPool(size, page_size, vs.KVSettings(**settings))
    if page_size == 1:
        alloc = mods.token.TokenToKVPoolAllocator(size, torch.float32, "cpu", pool, False)
    else:
        alloc = mods.paged.PagedTokenToKVPoolAllocator(size, page_size, torch.float32, "cpu", pool, False)
    vs.bind(pool, alloc)
    assert alloc.vattn is pool.vattn
    return pool, alloc, pool.vattn


@pytest.mark.parametrize("page_size", [1, 16])
def test_real_allocators_replay_the_trace(sglang_alloc, page_size):
    from tests.integrations.test_sglang_integration import check_books, chunk0, mapped, replay, whole

    size = whole(page_size, 4096)
    pool, alloc, kv = _make(sglang_alloc, page_size, size)
    assert type(alloc).__module__.startswith("sglang.srt.mem_cache.allocator")
    base = mapped(kv)
    assert base == chunk0(kv) and alloc.available_size() == size
    stats = replay(pool, _Adapter(alloc), kv, seed=11)
    assert stats["admitted"] > 20 and stats["peak"] > 4 * base
    check_books(kv, alloc, [])
    kv.trim()
    assert mapped(kv) == base and alloc.available_size() == size
    alloc.clear()  # flush_cache
    assert mapped(kv) == base


@pytest.mark.parametrize("page_size", [1, 16])
def test_real_allocators_under_a_limit(sglang_alloc, page_size):
    from tests.integrations.test_sglang_integration import VPAGE, L, check_books, mapped, replay

    limit = 6 * 2 * L * VPAGE
    pool, alloc, kv = _make(sglang_alloc, page_size, 8192 // page_size * page_size, memory_limit=limit)
    stats = replay(pool, _Adapter(alloc), kv, seed=5, steps=200)
    assert stats["evicted"] + stats["retracted"] + stats["misses"] > 0 and stats["peak"] <= limit
    free = alloc.free_pages.clone()
    too_many = (alloc.available_size() // page_size + 1) * page_size
    if page_size == 1:
        assert alloc.alloc(too_many) is None
    else:
        n = too_many // page_size
        assert _Adapter(alloc).alloc_extend([0], [too_many], [-1]) is None
        assert _Adapter(alloc).alloc_decode([1] * n, [0] * n) is None
    assert torch.equal(alloc.free_pages, free) and mapped(kv) <= limit
    check_books(kv, alloc, [])


@pytest.mark.parametrize("page_size", [1, 16])
def test_real_allocators_keep_the_drain_order(sglang_alloc, page_size):
    """drain() puts the pages of the fullest chunks first; SGLang's merge_and_sort_free,
    which its alloc paths call when the free list runs short, re-sorts only with need_sort
    (PD disaggregation, where vattn keeps SGLang's memory), so the order holds."""
    from tests.integrations.test_sglang_integration import VPAGE, whole

    vpage = VPAGE if page_size == 1 else 4 * VPAGE  # at least 4 SGLang pages a chunk
    pool, alloc, kv = _make(sglang_alloc, page_size, whole(page_size, 4096), vpage=vpage)
    c = kv.chunk_pages
    assert c >= 4 and kv.num_chunks > 3 and not alloc.need_sort
    held = alloc.alloc((len(kv.valid_units(0)) + 2 * c) * page_size)  # chunks 0, 1 and 2 whole
    pages = held.view(-1, page_size)[:, 0] // page_size if page_size > 1 else held
    of = {int(u): int(u) // c for u in pages}
    one = [u for u in of if of[u] == 1]
    two = [u for u in of if of[u] == 2]
    to_tokens = (lambda us: (torch.tensor(us)[:, None] * page_size + torch.arange(page_size)).reshape(-1))
    alloc.free(to_tokens(one[:-1]))  # chunk 1: all free but one page
    alloc.free(to_tokens(two[:2]))  # chunk 2: two pages free (the fullest)
    assert kv.drain(alloc) == 0  # no chunk all free: nothing given back, the list reordered
    first = alloc.free_pages[:2].tolist()
    assert all(u // c == 2 for u in first), first
    short = len(alloc.free_pages) + 1  # more than the free list: merge_and_sort_free, then a lent chunk
    got = alloc.alloc(short * page_size)
    got = (got.view(-1, page_size)[:, 0] // page_size if page_size > 1 else got).tolist()
    assert got[:2] == first  # the fullest chunk's pages still came first


def test_sglang_own_allocator_tests(tree, sglang_alloc, tmp_path):
    """SGLang's own CPU tests of the (patched) allocators, when given (they are not in the wheel)."""
    given = [p for p in os.environ.get("VATTN_SGLANG_OWN_TESTS", "").split(os.pathsep) if p]
    if not given:
        pytest.skip("set VATTN_SGLANG_OWN_TESTS to SGLang's allocator test files (an SGLang checkout) to run them")
    _module("sglang.test", tree.root / "sglang/test")
    _module("sglang.test.ci", tree.root / "sglang/test/ci")
    _module("sglang.test.ci.ci_register", register_cpu_ci=lambda **k: None)
    # their tests mock the Triton kernels and check they are launched: take that path
    sys.modules["sglang.srt.platforms"].current_platform.capabilities.supports_triton = True
    args = [str(Path(p).resolve()) for p in given]
    try:
        assert pytest.main(["-q", "-p", "no:cacheprovider", "-o", "addopts=", *args]) == 0
    finally:
        sys.modules["sglang.srt.platforms"].current_platform.capabilities.supports_triton = False


# What `sglang.srt.mem_cache.memory_pool` needs to import on a CPU machine, beyond torch,
# numpy, transformers, pydantic, psutil, packaging and pillow (vattn's own test environment),
# then what `sglang.srt.managers.scheduler` adds (the plugin imports every module it hooks).
# The same for 0.5.22 and 0.5.23.
DEPS = ("triton==3.9.0", "orjson==3.13.0", "pybase64==1.5.1", "requests==2.34.2", "urllib3==2.8.0",
        "certifi==2026.10.18", "pyzmq==27.3.0", "ipython==9.18.1", "traitlets==5.16.1", "dill==0.4.1",
        "apache-tvm-ffi==0.1.11", "sentencepiece==0.2.3", "compressed-tensors==0.20.0", "loguru==0.7.3",
        "gguf==0.19.0", "einops==0.8.2", "partial-json-parser==0.2.1.1.post7", "msgspec==0.22.0",
        "setproctitle==1.3.8", "aiohttp==3.14.5", "multidict==7.2.1", "attrs==26.1.0", "yarl==1.25.1",
        "propcache==0.5.4", "aiohappyeyeballs==2.7.1", "aiosignal==1.4.0", "frozenlist==1.8.0")

TORCHVISION_STAND_IN = '''"""Stands in for torchvision: imported by SGLang's multimodal configs, never used here."""
import importlib.machinery, sys, types


class _Anything:
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return _Anything()
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()
    def __mro_entries__(self, bases): return (object,)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Anything()


class _Submodules:
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)
        m.__path__, m.__getattr__ = [], __getattr__
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Submodules())
__version__ = "0.0"
'''

# The scripts below run in a subprocess: argv = deps (os.pathsep-separated), stubs, the
# directory holding sglang/, and "patched" (the patch applied there) or "plugin" (the
# unpatched wheel: the plugin installs the hooks first, as SGLang's entry point would).
SCRIPT_PRELUDE = '''
import importlib, os, sys, types
deps, stubs, tree, mode = sys.argv[1:5]
sys.path[:0] = deps.split(os.pathsep) + [stubs]
pkg = types.ModuleType("sglang"); pkg.__path__ = [tree + "/sglang"]; sys.modules["sglang"] = pkg
import torch
if mode == "plugin":
    os.environ["VATTN_SGLANG"] = "1"
    from vattn.integrations import plugins
    st = plugins.install("sglang")
    assert st.status == "installed", (st.status, st.reason)
    assert "vattn_sglang" not in open(tree + "/sglang/srt/mem_cache/allocator/base.py").read()  # not patched
    print("plugin: sglang", st.version, len(st.hooks), "hooks")
else:
    assert "vattn_sglang" in open(tree + "/sglang/srt/mem_cache/allocator/base.py").read()
'''

REAL_POOL = SCRIPT_PRELUDE + '''
from vattn.integrations import sglang as vs
from tests.integrations.test_sglang_integration import check_books, chunk0, mapped, replay, whole
from tests.integrations.test_sglang_patch import _Adapter
mp = importlib.import_module("sglang.srt.mem_cache.memory_pool")
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

def pool(ps, size, settings):
    return mp.MHATokenToKVPool(size, ps, torch.float32, head_num=2, head_dim=16, layer_num=2, device="cpu",
                               enable_memory_saver=False, vattn=settings)

plain = pool(16, 1024, None)  # no settings: SGLang's own buffers, as before the patch
assert plain.vattn is None and plain.k_buffer[0].shape == (1040, 2, 16)
for ps in (1, 16):
    size = whole(ps, 4096)
    p = pool(ps, size, vs.KVSettings(page_size=4096, idle_trim_s=0))
    kv = p.vattn
    assert isinstance(kv, vs.ElasticKV) and p.k_buffer[1].shape == (size + ps, 2, 16)
    assert p.k_data_ptrs.tolist() == [b.data_ptr() for b in p.k_buffer]
    a = (TokenToKVPoolAllocator(size, torch.float32, "cpu", p, False) if ps == 1
         else PagedTokenToKVPoolAllocator(size, ps, torch.float32, "cpu", p, False))
    vs.bind(p, a)
    assert mapped(kv) == chunk0(kv) and a.available_size() == size
    locs = a.alloc(ps * 40)
    class Layer:
        layer_id, k_scale, v_scale = 1, None, None
    k = torch.randn(len(locs), 2, 16)
    p.set_kv_buffer(Layer(), locs, k, -k)  # SGLang's own write path
    kk, vv = p.get_kv_buffer(1)
    assert torch.equal(kk[locs], k) and torch.equal(vv[locs], -k)
    a.free(locs)
    stats = replay(p, _Adapter(a) if ps > 1 else a, kv, seed=ps)
    assert stats["admitted"] > 20 and stats["peak"] > 4 * chunk0(kv)
    check_books(kv, a, [])
    kv.trim()
    assert mapped(kv) == chunk0(kv) and a.available_size() == size
    print("ps", ps, stats)

# the scheduler's idle invariant (available + evictable + protected == total) under a limit:
# free pages memory cannot back now count as free, not leaked
from types import SimpleNamespace as NS
from sglang.srt.runtime_context import get_parallel
ic = importlib.import_module("sglang.srt.managers.scheduler_components.invariant_checker")
get_parallel().override_permanently(dcp_enabled=False)
checker = ic.SchedulerInvariantChecker
p = pool(16, 4096, vs.KVSettings(page_size=4096, memory_limit=6 * 4 * 4096))
a = PagedTokenToKVPoolAllocator(4096, 16, torch.float32, "cpu", p, False)
vs.bind(p, a)
a.free(a.alloc(a.available_size()))
me = NS(_check_pool_invariant=checker._check_pool_invariant, is_hybrid_swa=False, is_hybrid_ssm=False,
        tree_cache=NS(protected_size=lambda: 0), pool_stats_observer=NS(session_held_tokens=lambda: 0),
        max_total_num_tokens=4096, token_to_kv_pool_allocator=a)
leak, msg = checker._check_full_pool(me, NS(full_evictable_size=0, full_available_size=a.available_size()))
assert a.available_size() < 4096 and not leak, msg

# SGLang's radix cache and its alloc_token_slots (evict, then alloc) on a limited vattn pool:
# the tree holds memory, eviction frees it into the allocator, the alloc then fits
from array import array
from sglang.srt.mem_cache.allocation import alloc_token_slots
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
limit = 8 * 4 * 4096
p = pool(1, whole(1, 2048), vs.KVSettings(page_size=4096, memory_limit=limit, idle_trim_s=0))
a = TokenToKVPoolAllocator(whole(1, 2048), torch.float32, "cpu", p, False)
vs.bind(p, a)
tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=a, page_size=1))
for i in range(4):
    locs = alloc_token_slots(tree, 60)
    p.k_buffer[0][locs] = float(i + 1)
    tree.insert(InsertParams(key=RadixKey(array("l", [1000 * i + j for j in range(60)])), value=locs))
assert tree.evictable_size() == 240 and a.available_size() == 8 * 32 - 1 - 240
assert alloc_token_slots(tree, 100) is not None  # evicts the least recently used entries
assert tree.evictable_size() == 120 and p.vattn.stats().mapped_bytes <= limit
m = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("l", [3000 + j for j in range(60)]))))
assert m.device_prefix_len == 60
assert bool((p.k_buffer[0][tree.path_device_indices(m.last_device_node)] == 4.0).all())
print("REAL POOL OK")
'''


REAL_LOOP = SCRIPT_PRELUDE + '''
from array import array
from vattn.integrations import sglang as vs
import tests.integrations.test_sglang_engine_loop as loop
from tests.integrations.test_sglang_integration import whole
from tests.integrations.test_sglang_patch import _Adapter
mp = importlib.import_module("sglang.srt.mem_cache.memory_pool")
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.prefill_budget import PrefillBudget
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey


class Radix:
    """SGLang's RadixCache behind the loop's calls (match, lock, insert, evict)."""

    def __init__(self, alloc, ps):
        self.t = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                            page_size=ps))

    def supports_prefix_sharing(self):
        return self.t.supports_prefix_sharing()

    def supports_mamba(self):
        return False

    def evictable_size(self):
        return self.t.evictable_size()

    def evict_for_alloc(self, params):
        return self.t.evict_for_alloc(params)

    def evict(self, n):
        return self.t.evict(EvictParams(num_tokens=n))

    def match(self, tokens):
        m = self.t.match_prefix(MatchPrefixParams(key=RadixKey(array("l", tokens[:-1]))))
        if not m.device_prefix_len:
            return torch.empty(0, dtype=torch.int64), None
        return self.t.path_device_indices(m.last_device_node).to(torch.int64), m.last_device_node

    def lock(self, node):
        if node is not None:
            self.t.inc_lock_ref(node)

    def unlock(self, node):
        if node is not None:
            self.t.dec_lock_ref(node)

    def insert(self, tokens, locs):
        return self.t.insert(InsertParams(key=RadixKey(array("l", tokens)), value=locs.clone())).prefix_len

    def all_locs(self):
        out, todo = [], list(self.t.root_node.children.values())
        while todo:
            node = todo.pop()
            out.append(node.value)
            todo += list(node.children.values())
        return out


class Calls:
    @staticmethod
    def extend(alloc, prefix_lens, seq_lens, last_loc):
        return _Adapter(alloc).alloc_extend(prefix_lens, seq_lens, last_loc)

    @staticmethod
    def decode(alloc, seq_lens, last_loc):
        return _Adapter(alloc).alloc_decode(seq_lens, last_loc)


def make(ps, size, settings):
    pool = mp.MHATokenToKVPool(size, ps, torch.float32, head_num=2, head_dim=16, layer_num=2, device="cpu",
                               enable_memory_saver=False, vattn=settings)
    alloc = (TokenToKVPoolAllocator(size, torch.float32, "cpu", pool, False) if ps == 1
             else PagedTokenToKVPoolAllocator(size, ps, torch.float32, "cpu", pool, False))
    vs.bind(pool, alloc)
    return pool, alloc, loop.Scheduler(alloc, Radix(alloc, ps), pool, budget_cls=PrefillBudget, calls=Calls)


tenant = loop.Tenant()
vs.backing.make_backend = lambda device: loop.refusing_backend(tenant)  # where ElasticKV looks it up
clock = [1000.0]
vs.backing.time.monotonic = lambda: clock[0]
for ps in (1, 16):
    size = whole(ps, 2048)
    stock, errors, s0, kv0 = loop.serve(ps, size, make=make)
    assert not errors and kv0 is None and s0.stats["retracted"] == 0
    out, errors, sched, kv = loop.serve(ps, size, settings=loop.SETTINGS, tenant=tenant, block_steps=range(6, 66),
                                        clock=clock, make=make)
    assert type(sched.alloc).__module__.startswith("sglang.srt.mem_cache.allocator")
    assert not errors and out == stock, (errors, sorted(k for k in out if out[k] != stock.get(k)))
    assert tenant.refused > 0 and kv.num_refusals > 0 and not kv.refused
    assert sched.stats["no_token"] + sched.stats["retracted"] > 0, sched.stats
    print("ps", ps, "requests", len(out), sched.stats, "refused creations", tenant.refused)
print("REAL LOOP OK")
'''


def sglang_deps_dir() -> Path:
    """A directory with what SGLang's KV pool and scheduler modules import (pip
    --no-deps --target, filled once; `VATTN_SGLANG_DEPS` names a ready one)."""
    given = os.environ.get("VATTN_SGLANG_DEPS")
    deps = Path(given) if given else _cache_dir() / f"sglang-deps-py{sys.version_info.major}{sys.version_info.minor}"
    marker = deps / ".vattn-complete"
    if not marker.exists() or marker.read_text() != "\n".join(DEPS):
        if given:
            pytest.skip(f"VATTN_SGLANG_DEPS={given} is not a directory this test filled")
        deps.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target",
                            str(deps), *DEPS], capture_output=True, text=True, timeout=1200)
        if r.returncode:
            pytest.skip(f"cannot install SGLang's import dependencies: {(r.stderr or r.stdout).strip()[-300:]}")
        marker.write_text("\n".join(DEPS))
    return deps


def stubs_dir(tmp: Path) -> Path:
    (tmp / "torchvision").mkdir(exist_ok=True)
    (tmp / "torchvision" / "__init__.py").write_text(TORCHVISION_STAND_IN)
    return tmp


def run_script(text: str, root: Path, mode: str, tmp: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """One of the scripts above on the `sglang/` under `root` ("patched" or "plugin")."""
    script = tmp / "script.py"
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(script), str(sglang_deps_dir()), str(stubs_dir(tmp)), str(root), mode],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_real_mha_pool_on_vattn_memory(tree, tmp_path):
    """SGLang's patched MHATokenToKVPool: built on vattn memory (and unchanged without
    settings), its own set_kv_buffer/get_kv_buffer, the real allocators and the trace;
    the scheduler's real idle invariant check holds under a memory limit; SGLang's radix
    cache evicts into a limited vattn pool through its own alloc_token_slots."""
    r = run_script(REAL_POOL, tree.root, "patched", tmp_path)
    assert r.returncode == 0 and "REAL POOL OK" in r.stdout, (r.stdout + r.stderr)[-4000:]


def test_real_scheduler_classes_serve_through_refused_pages(tree, tmp_path):
    """The scheduler loop on SGLang's real patched allocators (their decode gate), its real
    PrefillBudget and RadixCache: page creation refused for 60 steps under load, token and
    paged allocators; no "out of memory", every output equal to SGLang's own memory's."""
    r = run_script(REAL_LOOP, tree.root, "patched", tmp_path)
    print(r.stdout)
    assert r.returncode == 0 and "REAL LOOP OK" in r.stdout, (r.stdout + r.stderr)[-4000:]
