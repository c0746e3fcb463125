"""vattn.integrations.plugins: a release's patch installed in memory as the engine's
plugin (no engine needed: a small engine-like package is written to a temporary dir).
`tests/integrations/test_plugins_releases.py` (slow) does the same on the real vLLM and SGLang wheels."""
from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from vattn.integrations import plugins
from vattn.integrations.plugins import hunks
from vattn.integrations.plugins.releases import FINGERPRINTS

POOL = '''\
from dataclasses import dataclass


class Base:
    def __init__(self, n):
        self.n = n


class Pool(Base):
    def __init__(self, n):
        super().__init__(n)
        self.free = list(range(n))

    def count(self):
        n = len(self.free)
        n = n + 0
        n = n * 1
        return n

    def take(self, k):
        k = int(k)
        k = max(k, 0)
        k = min(k, 1 << 30)
        k = k + 0
        if k > len(self.free):
            return None
        out = self.free[:k]
        del self.free[:k]
        return out


def size(pool):
    return len(pool.free)


@dataclass
class Output:
    step: int = 0
'''
USER = '''\
from eng.pool import size


def report(pool):
    return size(pool)
'''
VERSION = '__version__ = "1.0.0"\n'
HOOKS = '''\
calls = []


def took(pool, out):
    calls.append(("took", out))
    return out


def size_hook(pool):
    return -1
'''


def _diff(root: Path, rel: str, new: str) -> str:
    (root / "b").mkdir(exist_ok=True)
    old = root / "eng" / rel
    tmp = root / "b" / rel.replace("/", "_")
    tmp.write_text(new)
    r = subprocess.run(["diff", "-u", "--label", f"a/eng/{rel}", "--label", f"b/eng/{rel}", str(old), str(tmp)],
                       capture_output=True, text=True)
    return r.stdout


@pytest.fixture
def eng(tmp_path, monkeypatch):
    """The package `eng` (pool.py, user.py, version.py) on sys.path, a hook module
    `vattn_eng_hooks`, and the patch that calls it."""
    (tmp_path / "eng").mkdir()
    (tmp_path / "eng" / "__init__.py").write_text("")
    (tmp_path / "eng" / "pool.py").write_text(POOL)
    (tmp_path / "eng" / "user.py").write_text(USER)
    (tmp_path / "eng" / "version.py").write_text(VERSION)
    new = POOL.replace("from dataclasses import dataclass\n",
                       "from dataclasses import dataclass\nfrom vattn.integrations import _env as vattn_env\n")
    new = new.replace("        self.free = list(range(n))\n",
                      "        self.free = list(range(n))\n        self.hooked = vattn_env.flag('X_NEVER_SET')\n")
    new = new.replace("        del self.free[:k]\n        return out\n",
                      "        del self.free[:k]\n        return tuple(out)  # hooked\n")
    new = new.replace("    step: int = 0\n", "    step: int = 0\n\n    extra: object | None = None\n")
    patch = "the eng patch\n\n" + _diff(tmp_path, "pool.py", new)
    (tmp_path / "eng-1.0.0.patch").write_text(patch)
    monkeypatch.syspath_prepend(str(tmp_path))
    for m in [m for m in sys.modules if m == "eng" or m.startswith("eng.")]:
        del sys.modules[m]
    import eng.pool
    import eng.user  # noqa: F401  (imports `size` by name before the hooks go in)
    monkeypatch.setitem(FINGERPRINTS, "eng", {"1.0.0": hunks.fingerprints(patch, tmp_path)})
    monkeypatch.setitem(plugins.SWITCH, "eng", "VATTN_ENG")
    monkeypatch.setitem(plugins.VERSION_MODULE, "eng", "eng.version")
    monkeypatch.setattr(plugins, "patch_file", lambda e, v: tmp_path / f"{e}-{v}.patch")
    yield tmp_path
    plugins.uninstall("eng")
    for m in [m for m in sys.modules if m == "eng" or m.startswith("eng.")]:
        del sys.modules[m]


def test_the_plan_places_each_hunk_in_its_function(eng):
    planned = hunks.plan((eng / "eng-1.0.0.patch").read_text())
    got = {(h.kind, h.name) for h in planned}
    assert got == {("import", "eng.pool:<imports>"), ("function", "eng.pool:Pool.__init__"),
                   ("function", "eng.pool:Pool.take"), ("attribute", "eng.pool:Output")}


def test_install_hooks_in_place_and_uninstall_restores(eng, monkeypatch):
    import eng.pool as pool
    old_take, old_init = pool.Pool.take, pool.Pool.__init__
    assert plugins.install("eng").status == "installed"
    p = pool.Pool(4)  # zero-argument super() works in the hooked __init__
    assert p.n == 4 and p.hooked is True
    assert p.take(2) == (0, 1) and p.take(9) is None
    assert pool.Output().extra is None and pool.Output(3).step == 3
    assert plugins.install("eng").status == "installed"  # once per process
    plugins.uninstall("eng")
    assert pool.Pool.take is old_take and pool.Pool.__init__ is old_init
    assert not hasattr(pool.Output, "extra") and not hasattr(pool, "vattn_env")
    assert pool.Pool(3).take(1) == [0]


def test_tracebacks_show_the_hooked_lines(eng):
    import traceback

    import eng.pool as pool
    plugins.install("eng")
    try:
        pool.Pool.take(None, 1)
    except AttributeError:
        tb = traceback.format_exc()
    assert "vattn-patched" in tb and "if k > len(self.free):" in tb


def test_a_module_function_is_rebound_where_it_was_imported(eng, monkeypatch):
    """A hunk in a module function: modules that imported it by name see the new one."""
    import eng.pool as pool
    import eng.user as user
    new = POOL.replace("def size(pool):\n    return len(pool.free)\n", "def size(pool):\n    return -len(pool.free)\n")
    patch = "p\n\n" + _diff(eng, "pool.py", new)
    planned = hunks.plan(patch)
    done = hunks.install(planned)
    try:
        assert user.report(pool.Pool(3)) == -3 and pool.size(pool.Pool(2)) == -2
    finally:
        hunks.uninstall(done)
    assert user.report(pool.Pool(3)) == 3


def test_a_changed_function_is_refused_and_nothing_installed(eng):
    """Another body for a hooked function: the fingerprint differs; the engine stays stock."""
    import eng.pool as pool
    src = (eng / "eng" / "pool.py").read_text()
    (eng / "eng" / "pool.py").write_text(src.replace("        self.n = n\n", "        self.n = n  # local edit\n"))
    assert plugins.install("eng").status == "installed"  # Base.__init__ is not hooked: no matter
    plugins.uninstall("eng")
    (eng / "eng" / "pool.py").write_text(src.replace("k = int(k)\n", "k = int(k) + 0\n"))
    with pytest.warns(RuntimeWarning, match=r"eng\.pool:Pool\.take is not the function .* fingerprint"):
        st = plugins.install("eng")
    assert st.status == "refused" and "Reinstall eng==1.0.0" in st.reason
    assert not hasattr(pool.Output, "extra") and not hasattr(pool, "vattn_env")


def test_a_hooked_module_that_does_not_import_is_refused_and_nothing_stays(eng, monkeypatch):
    """A module of the patch that raises on import (a dependency missing in this
    environment): refused with the error, and the hooks installed before it taken out."""
    import eng.pool as pool
    (eng / "eng" / "broken.py").write_text("import a_module_that_is_not_there\n\n\ndef f():\n    return 1\n")
    broken = _diff(eng, "broken.py", "import a_module_that_is_not_there\n\n\ndef f():\n    return 2\n")
    patch = (eng / "eng-1.0.0.patch").read_text() + broken
    (eng / "eng-1.0.0.patch").write_text(patch)
    monkeypatch.setitem(FINGERPRINTS, "eng", {"1.0.0": hunks.fingerprints(patch, eng)})
    old_take = pool.Pool.take
    with pytest.warns(RuntimeWarning, match="ModuleNotFoundError: No module named 'a_module_that_is_not_there'"):
        st = plugins.install("eng")
    assert st.status == "refused" and not st.hooks
    assert pool.Pool.take is old_take and not hasattr(pool.Output, "extra") and not hasattr(pool, "vattn_env")


def test_an_unknown_release_is_refused_loudly(eng, caplog):
    (eng / "eng" / "version.py").write_text('__version__ = "1.1.0"\n')
    importlib.reload(importlib.import_module("eng.version"))
    with pytest.warns(RuntimeWarning, match=r"no hooks for eng 1\.1\.0; it knows 1\.0\.0"):
        st = plugins.install("eng")
    assert st.status == "refused"
    assert any(r.levelname == "ERROR" and "runs stock" in r.message for r in caplog.records)


def test_a_hunk_that_does_not_fit_is_refused(eng):
    patch = (eng / "eng-1.0.0.patch").read_text().replace("-        return out\n", "-        return outs\n")
    with pytest.raises(hunks.HookError, match="expected '        return outs'"):
        hunks.plan(patch)


def test_an_engine_patched_on_disk_is_left_as_it_is(eng):
    r = subprocess.run(["patch", "-p1", "-s", "-i", str(eng / "eng-1.0.0.patch")], cwd=eng, capture_output=True,
                       text=True)
    if r.returncode:
        pytest.skip(f"no `patch` program: {r.stderr}")
    st = plugins.install("eng")
    assert st.status == "patched on disk" and not st.hooks


def test_the_switch_is_off_unless_set_on(eng, monkeypatch):
    import eng.pool as pool
    for value in (None, "", "0", "no", "OFF", " false "):
        if value is None:
            monkeypatch.delenv("VATTN_ENG", raising=False)
        else:
            monkeypatch.setenv("VATTN_ENG", value)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert plugins._load("eng") is None
        assert not hasattr(pool.Output, "extra")
    for value in ("1", "yes", " On ", "TRUE"):
        monkeypatch.setenv("VATTN_ENG", value)
        assert plugins._load("eng").status == "installed" and hasattr(pool.Output, "extra")
        plugins.uninstall("eng")


def test_a_switch_that_means_neither_is_refused_in_the_log_not_raised(eng, monkeypatch, caplog):
    import eng.pool as pool
    monkeypatch.setenv("VATTN_ENG", "maybe")
    with pytest.warns(RuntimeWarning, match=r"VATTN_ENG must be one of 1, true, yes, on .* got 'maybe'"):
        st = plugins._load("eng")
    assert st.status == "refused" and not hasattr(pool.Output, "extra")
    assert any(r.levelname == "ERROR" and "runs stock" in r.message for r in caplog.records)


def test_an_engine_that_is_not_installed_is_refused_in_the_log_not_raised(eng, monkeypatch, caplog):
    # VATTN_VLLM=1 where vLLM is missing: load_vllm raised ModuleNotFoundError
    monkeypatch.setitem(plugins.VERSION_MODULE, "eng", "eng_that_is_not_installed.version")
    monkeypatch.setenv("VATTN_ENG", "1")
    with pytest.warns(RuntimeWarning, match="eng is not installed here .*ModuleNotFoundError"):
        st = plugins._load("eng")
    assert st.status == "refused" and "unset VATTN_ENG" in st.reason
    assert any(r.levelname == "ERROR" and "not installed" in r.message for r in caplog.records)


def test_load_vllm_and_sglang_without_the_engines_log_and_return(monkeypatch):
    code = textwrap.dedent("""
        import sys, warnings
        sys.modules["vllm"] = sys.modules["sglang"] = None  # not installed, whatever this venv holds
        warnings.simplefilter("ignore")
        from vattn.integrations import plugins
        plugins.load_vllm(); plugins.load_sglang()
        print(plugins._state["vllm"].status, plugins._state["sglang"].status)
    """)
    env = {**__import__("os").environ, "VATTN_VLLM": "1", "VATTN_SGLANG": "yes"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["refused", "refused"]
    assert "vllm is not installed here" in r.stderr and "sglang is not installed here" in r.stderr


def test_a_lazy_module_that_fails_on_getattr_does_not_stop_the_hooks(eng):
    """transformers' lazy modules import on attribute access; without torchvision its image
    processors raise ModuleNotFoundError there, which made the whole plugin refuse."""
    import types

    class Lazy(types.ModuleType):
        def __getattr__(self, name):
            raise ModuleNotFoundError("No module named 'torchvision'")

    sys.modules["a_lazy_module"] = Lazy("a_lazy_module")
    sys.modules["not_a_module"] = object()  # anything may sit in sys.modules
    try:
        import eng.pool as pool
        import eng.user as user
        new = POOL.replace("def size(pool):\n    return len(pool.free)\n", "def size(pool):\n    return -len(pool.free)\n")
        done = hunks.install(hunks.plan("p\n\n" + _diff(eng, "pool.py", new)))
        try:
            assert user.report(pool.Pool(3)) == -3  # still rebound where it was imported by name
        finally:
            hunks.uninstall(done)
    finally:
        del sys.modules["a_lazy_module"], sys.modules["not_a_module"]


def test_private_names_are_refused():
    tree = hunks.ast.parse(textwrap.dedent("""
        def f(self):
            return self.__secret
    """))
    with pytest.raises(hunks.HookError, match="private names"):
        hunks._compile_function(tree.body[0], "<x>")


def test_entry_points_and_shipped_patches():
    """The engines find vattn by entry point; each listed release has its patch shipped."""
    from importlib.metadata import entry_points
    assert [e.value for e in entry_points(group="vllm.general_plugins") if e.name == "vattn"] == [
        "vattn.integrations.plugins:load_vllm"]
    assert [e.value for e in entry_points(group="sglang.srt.plugins") if e.name == "vattn"] == [
        "vattn.integrations.plugins:load_sglang"]
    for engine in ("vllm", "sglang"):
        assert len(plugins.releases(engine)) == 2
        for v in plugins.releases(engine):
            text = plugins.patch_file(engine, v).read_text()
            assert {h.path for h in hunks.parse(text)} and f"{engine}" in text
            assert Path(plugins.patch_file(engine, v)).resolve().parent.name == "patches"


@pytest.mark.parametrize("raw, default, expected", [
    (None, True, True), ("", False, False), ("  ", True, True),
    ("1", False, True), ("True", False, True), ("YES", False, True), ("on", False, True),
    ("0", True, False), ("false", True, False), ("No", True, False), (" OFF ", True, False),
])
def test_one_switch_parser_for_every_integration(raw, default, expected):
    from vattn.integrations import _env
    env = {} if raw is None else {"X": raw}
    assert _env.switch("X", default, env) is expected
    if raw is not None and raw.strip():
        assert _env.flag("X", env) is _env.opted_in("X", env) is expected  # set: the default plays no part


@pytest.mark.parametrize("raw", ["2", "enable", "y", "nope"])
def test_a_switch_value_that_means_neither_is_an_error_that_names_the_values(raw, monkeypatch):
    import vattn
    from vattn.integrations import _env, vllm as vv
    with pytest.raises(vattn.InvalidConfigError, match=r"X must be one of 1, true, yes, on \(on\) or 0, false, no, off"):
        _env.switch("X", True, {"X": raw})
    monkeypatch.setenv("VATTN_VLLM", raw)  # a patched vLLM: refused at start, with the same message
    with pytest.raises(vattn.InvalidConfigError, match="VATTN_VLLM must be one of"):
        vv.enabled()
