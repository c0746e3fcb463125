"""Argument checks shared by the configs and calls of the cache and of the engine.
Plain Python, no torch.

An "int" is anything that is an integer without loss: a Python int, a numpy integer, or a
0-d integer tensor / array (`operator.index` accepts them). Bools are not ints here.
"""
from __future__ import annotations

import math
import numbers
import operator
from typing import Any

# torch.Generator.manual_seed / torch.manual_seed accept exactly this range.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def is_int(value: Any) -> bool:
    """Whether `value` is an integer scalar (not a bool, not a float, not a 1-element list)."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        return False
    if getattr(value, "ndim", 0) != 0:  # torch accepts 1-element tensors as an index; we do not
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def as_int(value: Any, name: str, error: type[Exception], *, low: int | None = None,
           high: int | None = None, what: str | None = None) -> int:
    """`value` as a Python int in [low, high], or `error` naming `name` and the range."""
    if not is_int(value) or not ((low is None or operator.index(value) >= low)
                                 and (high is None or operator.index(value) <= high)):
        raise error(f"{name} must be {what or _int_range(low, high)}, got {value!r}")
    return operator.index(value)


def as_float(value: Any, name: str, error: type[Exception], *, what: str) -> float:
    """`value` as a finite Python float (ints, numpy numbers and 0-d tensors too), or `error`."""
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")):
        raise error(f"{name} must be {what}, got {value!r}")
    if is_int(value):
        try:
            x = float(operator.index(value))
        except OverflowError:  # an int past any float (10**400)
            raise error(f"{name} must be {what}, got {value!r}") from None
    elif isinstance(value, numbers.Real):
        x = float(value)
    elif getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d float tensor / array
        x = value.item()
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise error(f"{name} must be {what}, got {value!r}")
        x = float(x)
    else:
        raise error(f"{name} must be {what}, got {value!r}")
    if not math.isfinite(x):
        raise error(f"{name} must be {what}, got {value!r}")
    return x


def _int_range(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"an int in [{low}, {high}]"
    if low == 1:
        return "a positive int"
    if low is not None:
        return f"an int >= {low}"
    if high is not None:
        return f"an int <= {high}"
    return "an int"
