"""The settings of the server integrations (vLLM, SGLang, transformers' continuous
batching), read alike: environment variables, the one on/off rule (`switch`), the one
idle-trim rule, and the shared budget (`VATTN_BUDGET=NAME`, `VATTN_BUDGET_LIMIT=BYTES`:
`budget`).

On/off (`VATTN_VLLM`, `VATTN_SGLANG`, `VATTN_SGLANG_ZERO`): 1, true, yes, on are on; 0,
false, no, off are off (any case); unset or empty is the switch's default (the plugins: off;
a patched engine: on); anything else is an error that names these values.

Idle trim (`VATTN_VLLM_IDLE_TRIM_S`, `VATTN_SGLANG_IDLE_TRIM_S`, `KVSettings.idle_trim_s`,
`hf_cb.enable(idle_trim_s=)`, `vattn serve --idle-trim-s`): the seconds of idleness after
which memory goes back, 0 at once. None means never; so does a negative number (the way
an environment variable says it), infinity and more than a timer can wait. Unset or empty
variables take the integration's default; NaN and anything not a number are errors. The
rule and the policy itself (`IdleTrim`) are `vattn.idle`'s, the same for the engine."""
from __future__ import annotations

import math
import os
from typing import Any, Callable

from vattn.errors import InvalidConfigError
from vattn.idle import delay_seconds

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off")


def switch(name: str, default: bool, env: Any = None) -> bool:
    """An on/off environment variable, read one way by every integration: 1, true, yes, on
    (any case, spaces around ignored) mean on; 0, false, no, off mean off; unset or empty
    mean `default`; anything else is an InvalidConfigError that names the accepted values."""
    env = os.environ if env is None else env
    raw = (env.get(name) or "").strip().lower()
    if not raw:
        return default
    if raw in ON:
        return True
    if raw in OFF:
        return False
    raise InvalidConfigError(f"{name} must be one of {', '.join(ON)} (on) or {', '.join(OFF)} (off), "
                             f"got {env.get(name)!r}")


def flag(name: str, env: Any = None) -> bool:
    """A switch that is on unless set off (`switch(name, True)`): the patched engines' and
    the integrations' own switches (`VATTN_VLLM=0` runs a patched vLLM stock)."""
    return switch(name, True, env)


def opted_in(name: str, env: Any = None) -> bool:
    """A switch that is off unless set on (`switch(name, False)`): the plugins' opt-in."""
    return switch(name, False, env)


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


def idle_delay(value: Any, name: str = "idle_trim_s") -> float | None:
    """`value` by the idle-trim rule (`vattn.idle.delay_seconds`): seconds >= 0, or None for
    never (None, a negative number, infinity, more than a timer can wait)."""
    return delay_seconds(value, name, negative_means_never=True)


def idle_trim_s(name: str, default: float | None, env: Any = None) -> float | None:
    """The environment variable `name` by the idle-trim rule (unset or empty: `default`)."""
    return idle_delay(number(name, float, default, env=env, what="a number of seconds"), name)


def budget(env: Any = None, device: Any = None) -> Any:
    """`VATTN_BUDGET=NAME`: the memory budget NAME shared by the processes of this GPU (or
    host), joined (`vattn.Budget.shared(NAME, VATTN_BUDGET_LIMIT, device=device)`: the
    limit is used when this process creates it, or when it has none); None when unset."""
    env = os.environ if env is None else env
    name = (env.get("VATTN_BUDGET") or "").strip()
    if not name:
        return None
    from vattn.budget import Budget

    limit = number("VATTN_BUDGET_LIMIT", int, None, low=0, env=env, what="an integer number of bytes")
    return Budget.shared(name, limit, device=device)
