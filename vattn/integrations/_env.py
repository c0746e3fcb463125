"""The environment variables of the server integrations (vLLM, SGLang), read alike."""
from __future__ import annotations

import math
import os
from typing import Any, Callable

from vattn.errors import InvalidConfigError

OFF = ("0", "false", "no", "off")


def flag(name: str, env: Any = None) -> bool:
    """An on/off switch that is on unless set to 0, false, no or off."""
    env = os.environ if env is None else env
    return env.get(name, "1").strip().lower() not in OFF


def number(name: str, cast: Callable[[str], Any], default: Any, *, low: Any = None, env: Any = None,
           what: str = "a number") -> Any:
    """`name` as `cast` (int: decimal, or 0x/0o/0b), `default` when unset or empty;
    InvalidConfigError when it is not a number, not finite (floats) or below `low`."""
    env = os.environ if env is None else env
    raw = (env.get(name) or "").strip()
    if not raw:
        return default
    try:
        n = int(raw, 0) if cast is int else cast(raw)
    except ValueError:
        raise InvalidConfigError(f"{name} must be {what}, got {raw!r}") from None
    if isinstance(n, float) and math.isnan(n):
        raise InvalidConfigError(f"{name} must be {what}, got {raw!r}")
    if low is not None and n < low:
        raise InvalidConfigError(f"{name} must be >= {low}, got {n}")
    return n


def idle_trim_s(name: str, default: float, env: Any = None) -> float | None:
    """Seconds of idleness before memory goes back; None (a negative value): never."""
    s = number(name, float, default, env=env, what="a number of seconds")
    return None if s < 0 else s
