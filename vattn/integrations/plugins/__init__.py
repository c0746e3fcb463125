"""vattn as a plugin of vLLM and SGLang: `pip install -e <a vattn clone>`, then `VATTN_VLLM=1 vllm serve ...`
or `VATTN_SGLANG=1 python -m sglang.launch_server ...`; nothing in site-packages changes.

The engines load plugins by entry point in every process that needs them: vLLM's
`vllm.general_plugins` (the API process, EngineCore, every worker), SGLang's
`sglang.srt.plugins` (every scheduler process). vattn's entry points (`pyproject.toml`)
call `load_vllm` / `load_sglang`, which install in memory the hooks of the release's patch,
`patches/<engine>-<version>.patch` (shipped in the package): the plugin and the patch are
the same hooks, by construction (`hunks.py`).

The switch (`VATTN_VLLM`, `VATTN_SGLANG`): 1, true, yes or on (any case) installs the hooks;
unset, empty, 0, false, no or off: nothing happens, silently; any other value is refused
with an error in the log (`vattn.integrations._env.switch`, the one parser of both plugins).

Refusals (the engine then runs stock, with an error in its log):
- a switch with a value that means neither on nor off;
- the engine is not installed (`VATTN_VLLM=1` where vLLM is missing): nothing to hook;
- a release vattn has no patch for (`releases.py`: the newest two minor releases of each);
- a hooked function whose source fingerprint differs from the one recorded for the
  release (a local change, a rebuilt wheel), or a hunk that does not fit exactly;
- the engine already patched on disk with `patches/`: the plugin leaves it as it is;
- a hooked module that does not import (what was installed so far is taken out again).
The whole patch is checked before anything is installed: all hooks or none.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from importlib import import_module, resources
from pathlib import Path

from vattn.errors import InvalidConfigError
from vattn.integrations import _env
from vattn.integrations.plugins import hunks
from vattn.integrations.plugins.hunks import Hook, HookError
from vattn.integrations.plugins.releases import FINGERPRINTS

logger = logging.getLogger("vattn.plugins")

SWITCH = {"vllm": "VATTN_VLLM", "sglang": "VATTN_SGLANG"}  # the opt-in variable of each engine
VERSION_MODULE = {"vllm": "vllm.version", "sglang": "sglang.version"}


@dataclass
class State:
    """What the plugin did in this process for one engine."""

    version: str
    status: str  # "installed", "patched on disk", "refused"
    hooks: list[Hook]
    installed: hunks.Installed | None = None
    reason: str = ""


_state: dict[str, State] = {}


def releases(engine: str) -> tuple[str, ...]:
    """The releases of `engine` vattn has hooks for, oldest first."""
    return tuple(sorted(FINGERPRINTS[engine], key=lambda v: tuple(int(x) for x in v.split("."))))


def patch_file(engine: str, version: str) -> Path:
    """`patches/<engine>-<version>.patch` as shipped in the package."""
    return Path(str(resources.files("vattn.integrations.plugins") / "patches" / f"{engine}-{version}.patch"))


def engine_version(engine: str) -> str:
    return str(import_module(VERSION_MODULE[engine]).__version__)


def check(engine: str, version: str) -> list[Hook]:
    """The release's hooks, planned and compiled against the installed engine, each
    fingerprint equal to the recorded one. HookError (what differs, what to do) otherwise."""
    known = FINGERPRINTS[engine].get(version)
    if known is None:
        raise HookError(f"vattn has no hooks for {engine} {version}; it knows {', '.join(releases(engine))}. "
                        f"Install {engine}=={releases(engine)[-1]}, or a vattn release that lists {version}")
    planned = hunks.plan(patch_file(engine, version).read_text())
    got = {h.name: h.fingerprint for h in planned if h.kind != "import"}
    if set(got) != set(known):
        raise HookError(f"the {engine} {version} patch hooks {sorted(got)}, the recorded fingerprints name "
                        f"{sorted(known)}: this vattn's patch and table disagree")
    for name, fp in sorted(got.items()):
        if fp != known[name]:
            raise HookError(f"{name} is not the function the {engine} {version} hook was written for (source "
                            f"fingerprint {fp}, expected {known[name]}): a locally changed or rebuilt {engine}. "
                            f"Reinstall {engine}=={version}")
    return planned


def _patched_on_disk(engine: str, version: str) -> bool:
    """Whether the installed engine's files already carry this patch (`patch -p1`): the
    patch's `from vattn...` import lines stand in them."""
    for h in hunks.parse(patch_file(engine, version).read_text()):
        for line in h.added:
            if line.startswith("from vattn"):
                try:
                    if line in hunks._source_file(hunks._module_name(h.path)).read_text():
                        return True
                except HookError:
                    return False
    return False


def install(engine: str) -> State:
    """Install the hooks for the installed release of `engine` (once per process), or
    refuse and leave the engine stock. Returns what was done."""
    if engine in _state:
        return _state[engine]
    try:
        version = engine_version(engine)
    except ImportError as e:  # the engine is not installed here (or its version module does not import)
        return _refuse(engine, "", f"{engine} is not installed here ({type(e).__name__}: {e}); install it in this "
                                   f"environment, or unset {SWITCH[engine]}")
    try:
        if version in FINGERPRINTS[engine] and _patched_on_disk(engine, version):
            st = State(version, "patched on disk", [])
            logger.info("vattn: %s %s is patched on disk (patches/); the plugin adds nothing", engine, version)
        else:
            planned = check(engine, version)
            st = State(version, "installed", planned, hunks.install(planned))
            logger.info("vattn: %s %s on vattn memory (%d hooks)", engine, version, len(planned))
    except (HookError, ImportError) as e:  # ImportError: a hooked module does not import here
        reason = str(e) if isinstance(e, HookError) else f"a module it hooks does not import: {type(e).__name__}: {e}"
        return _refuse(engine, version, reason)
    _state[engine] = st
    return st


def _refuse(engine: str, version: str, reason: str) -> State:
    """Leave the engine stock and say why: an error in the log, and a RuntimeWarning."""
    st = State(version, "refused", [], reason=reason)
    msg = f"vattn: {engine} runs stock, on its own KV memory: {reason}"
    logger.error(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    _state[engine] = st
    return st


def uninstall(engine: str) -> None:
    """Put the engine's functions back (tests)."""
    st = _state.pop(engine, None)
    if st is not None and st.installed is not None:
        hunks.uninstall(st.installed)


def _load(engine: str) -> State | None:
    """The entry points' work: never raises (an engine's plugin loader must not fail for
    vattn); what was refused is in the log and in the returned `State`."""
    try:
        asked = _env.opted_in(SWITCH[engine])
    except InvalidConfigError as e:
        return _refuse(engine, "", str(e))
    if not asked:
        return None  # not asked for: the engine stays exactly as it is
    try:
        return install(engine)
    except Exception as e:  # not foreseen: still the engine's own memory, and the reason in the log
        return _refuse(engine, "", f"installing the hooks failed: {type(e).__name__}: {e}")


def load_vllm() -> None:
    """vLLM's `vllm.general_plugins` entry point (every vLLM process): with `VATTN_VLLM=1`,
    put the KV cache on vattn memory."""
    _load("vllm")


def load_sglang() -> None:
    """SGLang's `sglang.srt.plugins` entry point (every scheduler process): with
    `VATTN_SGLANG=1`, put the KV cache on vattn memory."""
    _load("sglang")


__all__ = ["HookError", "State", "check", "install", "load_sglang", "load_vllm", "patch_file", "releases",
           "uninstall"]
