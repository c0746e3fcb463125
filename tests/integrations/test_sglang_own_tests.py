"""SGLang's own mem-cache unit tests with vattn's plugin on and off, for every supported
release (slow: `python -m pytest -m slow tests/integrations/test_sglang_own_tests.py`; the
table of counts: `python -m tests.integrations.test_sglang_own_tests`).

SGLang's wheel has no tests; its repository's are public code, kept out of this repository:
`VATTN_SGLANG_TESTS_<version with _>` names a folder holding SGLang's `test/...` files (how
to get the files this check was run with: `tests/integrations/sglang_peer_fetch.md`); the
release is skipped, with the variable to set, without it.

Each test file runs in a process of its own, twice, on the release's *unpatched* wheel
(`test_sglang_patch._wheel`; CPU; SGLang's package `__init__` not run, the way
`test_sglang_patch.SCRIPT_PRELUDE` imports it; what its modules import pip-installed
`--no-deps` into a directory of their own, `test_sglang_patch.sglang_deps_dir`): stock
(`VATTN_SGLANG=0`), and with the plugin installed in-process (`VATTN_SGLANG=1`, as SGLang's
`sglang.srt.plugins` entry point would) under the harness `HARNESS`, which puts the tests'
pools and allocators on vattn memory as a server's configurator would and checks every index
handed out is mapped. The runner (`own_tests`) names a process that dies with the test it
was running and runs the file again without it. The check fails on any crash with vattn,
and on any test that passes stock and not with vattn unless it is on `BY_DESIGN` (with the
reason).
"""
from __future__ import annotations

import os
import shutil
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.integrations import own_tests
from tests.integrations import test_sglang_patch as tsp
from tests.integrations.own_tests import Report, version_var
from vattn.integrations import plugins

pytestmark = pytest.mark.slow

TESTS_VAR = "VATTN_SGLANG_TESTS"

# Tests that fail with vattn by design, with why: a test id, a test function (every parameter) or a file.
_FREE_LIST = ("reads SGLang's free list itself (`free_pages`, `get_all_free_pages()`): under vattn it holds the free "
              "pages of lent chunks only; the pages of chunks not lent yet are counted by available_size() and "
              "appended to the list when an allocation needs them")
_MEM_CACHE = "test/registered/unit/mem_cache"
BY_DESIGN: dict[str, str] = {
    f"{_MEM_CACHE}/test_allocator_cpu.py::TestTokenAllocatorFree::test_no_sort_free_goes_directly_to_free_pages":
        _FREE_LIST + " (it counts 8 pages in the list after 4 of 8 were allocated and freed; vattn lent 5)",
    f"{_MEM_CACHE}/test_paged_allocator.py::TestPagedAllocatorFreeGroup::"
    "test_free_group_end_frees_whole_page_fragments":
        _FREE_LIST + " (it expects all 16 pages listed after 2 were allocated and freed; vattn lent 3)",
    f"{_MEM_CACHE}/test_token_allocator.py::TestTokenAllocator::test_releases_preserve_capacity_and_reuse_order":
        _FREE_LIST + " (it expects get_all_free_pages() to name pages 7 and 8 and the next alloc(2) to hand out 7, 8: "
                     "under vattn 8 is in a chunk not lent yet, so the freed 5 comes next; available_size() agrees)",
}

ENV_STOCK = {"VATTN_SGLANG": "0"}
HOST_PAGE = 4096  # vattn pages of one OS page: chunks of few SGLang pages, so the tests' small pools lend many
ENV_VATTN = {"VATTN_SGLANG": "1", "VATTN_SGLANG_PAGE_SIZE": str(HOST_PAGE)}
# Imported by SGLang's modules or its test utilities and never used by these tests (the
# multimodal configs; the benchmark datasets): stand-ins, as test_sglang_patch does for torchvision.
STAND_INS = ("torchvision", "datasets")

BARE = '''"""Imports SGLang's packages without running sglang/__init__.py (which loads the whole runtime)."""
import os, sys, types
_pkg = types.ModuleType("sglang")
_pkg.__path__ = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang")]
sys.modules["sglang"] = _pkg
'''

HARNESS = r'''
"""Puts SGLang's mem-cache unit tests on vattn memory, as a server with the plugin is:
- the plugin installs its hooks in this process (VATTN_SGLANG=1), as SGLang's entry point would;
- a plain MHATokenToKVPool built without vattn settings gets them (KVSettings from the
  environment: VATTN_SGLANG_PAGE_SIZE is one OS page), as the configurator's hunk gives them
  to every plain MHA pool;
- a TokenToKVPoolAllocator or PagedTokenToKVPoolAllocator is bound to its pool when vattn backs
  that pool (the configurator's `bind`); when the test gave it no real pool (None or a mock),
  vattn backs its page ids with a pool of its own (one buffer, two SGLang pages a chunk), so its
  free list is lent chunk by chunk as in a server; an allocator over a pool vattn does not back
  keeps SGLang's memory, as in a server;
- every index an allocation hands out lies in a lent, mapped chunk; after each test every page
  in the free lists of the live bound allocators does too, and each pool's books hold.
"""
import dataclasses
import mmap
import unittest.mock
import weakref

import pytest
import torch

from vattn.integrations import plugins

_st = plugins.install("sglang")
assert _st.status == "installed", (_st.status, _st.reason)
from vattn.integrations import sglang as vs  # noqa: E402
from sglang.srt.mem_cache import memory_pool as _mp  # noqa: E402
from sglang.srt.mem_cache.allocator import paged as _paged, token as _token  # noqa: E402

CHUNK_PAGES = 2  # SGLang pages a chunk of the pool vattn gives an allocator that has none
_live = weakref.WeakSet()  # allocators bound to vattn memory


def _check_mapped(kv, units, what):
    books = kv.pool._books
    for chunk in torch.unique(units // kv.chunk_pages).tolist():
        assert chunk in kv.lent, f"{what}: a page of chunk {chunk}, which is not lent"
        first, last = books.pages_of(chunk)
        assert all(books.groups[p] is not None for p in range(first, last + 1)), f"{what}: chunk {chunk} unmapped"


def _own_pool(alloc):
    """vattn memory for an allocator the test gave no real pool: its page ids' chunks."""
    ps = alloc.page_size
    if alloc.size % ps:
        return None  # SGLang's rows (size + a page) are not whole pages: vattn declines such a pool
    settings = vs.KVSettings.from_env()
    page = settings.page_size or mmap.PAGESIZE  # VATTN_SGLANG_PAGE_SIZE: the vattn page
    row = max(1, page // (CHUNK_PAGES * ps))  # bytes a token: CHUNK_PAGES SGLang pages a vattn page
    kv = vs.ElasticKV(rows=alloc.size + ps, page_size=ps, head_num=1, head_dim=row, layer_num=1,
                      dtype=torch.uint8, device="cpu", settings=dataclasses.replace(settings, page_size=page))
    kv.allocator = weakref.ref(alloc)  # what vs.bind does once it has checked the pool
    alloc.vattn = kv
    alloc.clear()  # the free list becomes chunk 0's pages
    return kv


def _back(alloc):
    pool = alloc.get_kvcache()
    if isinstance(getattr(pool, "vattn", None), vs.ElasticKV):
        vs.bind(pool, alloc)
    elif (pool is None or isinstance(pool, unittest.mock.NonCallableMock)) and str(alloc.device) == "cpu":
        _own_pool(alloc)
    if getattr(alloc, "vattn", None) is not None:
        _live.add(alloc)


def _bind_after_init(cls):
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if type(self) is cls:  # subclasses are other allocators: they keep SGLang's memory
            _back(self)

    cls.__init__ = __init__


def _checked(cls, name):
    fn = getattr(cls, name)

    def call(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        kv = getattr(self, "vattn", None)
        if kv is not None and out is not None and out.numel():
            _check_mapped(kv, out.reshape(-1).cpu() // self.page_size, f"{type(self).__name__}.{name} handed out")
        return out

    setattr(cls, name, call)


_pool_init = _mp.MHATokenToKVPool.__init__


def _pool_init_with_settings(self, *args, **kwargs):
    if kwargs.get("vattn") is None:
        kwargs["vattn"] = vs.kv_settings()
    _pool_init(self, *args, **kwargs)


_mp.MHATokenToKVPool.__init__ = _pool_init_with_settings
for _cls in (_token.TokenToKVPoolAllocator, _paged.PagedTokenToKVPoolAllocator):
    _bind_after_init(_cls)
_checked(_token.TokenToKVPoolAllocator, "alloc")
for _name in ("alloc", "alloc_extend", "alloc_decode"):
    _checked(_paged.PagedTokenToKVPoolAllocator, _name)


@pytest.fixture(autouse=True)
def _vattn_checks():
    yield
    for alloc in list(_live):
        kv = alloc.vattn
        kv.pool.check_invariants()
        free = [alloc.free_pages, getattr(alloc, "release_pages", None), *(getattr(alloc, "staged_pages", None) or [])]
        _check_mapped(kv, torch.cat([f.reshape(-1).cpu() for f in free if f is not None]), "the free list holds")
'''


# ------------------------------------------------------------------- the files ----
def sglang_tree(version: str, root: Path) -> Path:
    """`root` holding the release's `sglang/` (the unpatched wheel's Python files), SGLang's
    `test/` files from `VATTN_SGLANG_TESTS_<version>`, the two pytest plugins (`sglang_bare`,
    `vattn_sglang_plugin`) and the stand-ins (`_stand_ins/`). pytest.skip when missing."""
    var = version_var(TESTS_VAR, version)
    given = os.environ.get(var)
    if not given:
        pytest.skip(f"set {var} to a folder holding SGLang's test/ files (the wheel has none; "
                    "tests/integrations/sglang_peer_fetch.md says which and how)")
    if not (Path(given) / "test").is_dir():
        pytest.skip(f"{var}={given} holds no test/ folder")
    with zipfile.ZipFile(tsp._wheel(version)) as z:  # skips with the variable to set when there is none
        z.extractall(root, [n for n in z.namelist() if n.startswith("sglang/") and not n.endswith(".so")])
    shutil.copytree(Path(given) / "test", root / "test")
    (root / "sglang_bare.py").write_text(BARE)
    (root / "vattn_sglang_plugin.py").write_text(textwrap.dedent(HARNESS))
    for name in STAND_INS:
        (root / "_stand_ins" / name).mkdir(parents=True, exist_ok=True)
        (root / "_stand_ins" / name / "__init__.py").write_text(tsp.TORCHVISION_STAND_IN.replace("torchvision", name))
    return root


def sglang_test_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in (root / "test").rglob("test_*.py"))


def _env(root: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VATTN_SGLANG")}
    env.update(PYTHONPATH=os.pathsep.join([str(root), str(REPO), str(tsp.sglang_deps_dir()), str(root / "_stand_ins")]),
               OMP_NUM_THREADS="1", **extra)
    return env


# ---------------------------------------------------------------- a release ----
def run_release(version: str, root: Path) -> Report:
    """Every test file under `test/`, stock and with vattn, each in its own process."""
    sglang_tree(version, root)
    return own_tests.run_files(version, root, sglang_test_files(root), BY_DESIGN, _env(root, ENV_STOCK),
                               _env(root, ENV_VATTN), ["sglang_bare"], ["sglang_bare", "vattn_sglang_plugin"],
                               timeout=900)


@pytest.mark.parametrize("version", plugins.releases("sglang"))
def test_sglang_own_mem_cache_tests_pass_with_vattn_as_stock(version, tmp_path):
    own_tests.verdict(run_release(version, tmp_path), "SGLang")


if __name__ == "__main__":  # the table for docs/sglang.md: python -m tests.integrations.test_sglang_own_tests [V...]
    own_tests.main(run_release, sys.argv[1:] or plugins.releases("sglang"))
