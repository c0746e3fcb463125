"""Whether and how an SGLang KV pool uses vattn memory: `KVSettings` (from the `VATTN_SGLANG*`
environment), the pools that keep SGLang's own memory, and the SGLang releases the patch knows."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from vattn.budget import Budget
from vattn.errors import InvalidConfigError
from vattn.integrations import _env

SUPPORTED_VERSIONS = ("0.5.22", "0.5.23")

logger = logging.getLogger("vattn.sglang")


@dataclass(frozen=True)
class KVSettings:
    """How a KV pool uses vattn memory. `memory_limit`: bytes of mapped pages (None: the
    reservation and the device bound it). `page_size`: vattn page bytes (None: the
    backend's). `idle_trim_s`: full idleness before `on_idle` gives memory back, by the
    integrations' idle-trim rule (`vattn.integrations._env`: None, or a negative number,
    never). `zero_new_pages`: clear pages mapped with new memory (`ElasticPool(zero_new=)`;
    chunk 0 is cleared whatever this says). `budget`: a `vattn.Budget`
    shared with other pools of this process, or with other processes of this GPU
    (`from_env`: `VATTN_BUDGET=NAME`, `vattn.Budget.shared` on the current GPU)."""

    memory_limit: int | None = None
    page_size: int | None = None
    idle_trim_s: float | None = 2.0
    zero_new_pages: bool = True
    budget: Budget | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "idle_trim_s", _env.idle_delay(self.idle_trim_s, "idle_trim_s"))

    @staticmethod
    def from_env(env: Any = None) -> KVSettings:
        env = os.environ if env is None else env
        nbytes = "an integer number of bytes"
        limit = _env.number("VATTN_SGLANG_MEMORY_LIMIT", int, None, low=0, env=env, what=nbytes)
        page = _env.number("VATTN_SGLANG_PAGE_SIZE", int, None, low=1, env=env, what=nbytes)
        trim = _env.idle_trim_s("VATTN_SGLANG_IDLE_TRIM_S", 2.0, env=env)
        return KVSettings(memory_limit=limit, page_size=page, idle_trim_s=trim,
                          zero_new_pages=_env.flag("VATTN_SGLANG_ZERO", env), budget=_env.budget(env))


def enabled(env: Any = None) -> bool:
    """False when `VATTN_SGLANG=0` (the patched SGLang then uses its own memory)."""
    return _env.flag("VATTN_SGLANG", env)


_said: set[str] = set()


def _say_once(msg: str) -> None:
    if msg not in _said:
        _said.add(msg)
        logger.warning(msg)


def kv_settings(*, draft: bool = False, disaggregation: Any = None, settings: KVSettings | None = None
                ) -> KVSettings | None:
    """The configurator's call for a plain MHA pool: the settings, or None (with the
    reason logged once) when this pool keeps SGLang's own memory."""
    if not enabled():
        return None
    why = None
    if draft:
        why = "a speculative draft worker's pool is indexed by its target's allocator"
    elif str(getattr(disaggregation, "value", disaggregation) or "null").lower() != "null":
        why = f"PD disaggregation ({disaggregation}) registers the whole KV buffer with its transfer engine"
    if why is not None:
        _say_once(f"vattn: this KV pool keeps SGLang's own memory: {why}")
        return None
    return settings if settings is not None else KVSettings.from_env()


def check_sglang(version: str) -> None:
    """Raise InvalidConfigError unless `version` is one the patch was written against."""
    if version not in SUPPORTED_VERSIONS:
        raise InvalidConfigError(f"vattn's SGLang patch is for SGLang {', '.join(SUPPORTED_VERSIONS)}; "
                                 f"this is {version}")
