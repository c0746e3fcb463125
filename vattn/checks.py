"""Argument checks shared by every config (the cache's, the elastic pool's, the engine's,
the budget's) and by the calls of the cache and of the engine. Plain Python, no torch.

An "int" is anything that is an integer without loss: a Python int, a numpy integer, or a
0-d integer tensor / array (`operator.index` accepts them). Bools are not ints here.
"""
from __future__ import annotations

import math
import os
import numbers
import operator
import re
from typing import Any, Sequence

from vattn.errors import InvalidConfigError, InvalidRequestError

# torch.Generator.manual_seed / torch.manual_seed accept exactly this range.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1
# The most bytes a shared budget's table holds in one field (signed 64-bit): its limits and takes.
MAX_BYTES = (1 << 63) - 1
# A page larger than this is never sane (and a page larger than a slot wastes memory for
# nothing: see `vattn.config.Geometry.check_page_size`).
MAX_PAGE_SIZE = 1 << 30


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


# ------------------------------------------------------------------ configs ----
# Each raises InvalidConfigError naming the field, what it must be, and what it got.
def positive(value: Any, name: str, *, optional: bool = False) -> int | None:
    """A positive int (None too when `optional`)."""
    if optional and value is None:
        return None
    return as_int(value, name, InvalidConfigError, low=1, what="a positive int" + (" or None" if optional else ""))


def byte_limit(value: Any, name: str = "limit", *, high: int | None = None) -> int | None:
    """A memory limit: an int number of bytes >= 0 (at most `high`), or None (no limit)."""
    if value is None:
        return None
    what = ">= 0 bytes or None" if high is None else f"an int of bytes in [0, {high}] or None"
    return as_int(value, name, InvalidConfigError, low=0, high=high, what=what)


def byte_count(value: Any, name: str = "nbytes", *, high: int | None = None,
               error: type[Exception] = InvalidRequestError) -> int:
    """A number of bytes a call takes or gives: an int >= 0 (at most `high`), else `error`
    naming `name` and the range."""
    return as_int(value, name, error, low=0, high=high)


def flag(value: Any, name: str) -> bool:
    """True or False (not 1, not "yes")."""
    if not isinstance(value, bool):
        raise InvalidConfigError(f"{name} must be True or False, got {value!r}")
    return value


def one_of(value: Any, name: str, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise InvalidConfigError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def page_size(value: Any) -> int | None:
    """A page size in bytes, at most MAX_PAGE_SIZE, or None (the backend's)."""
    if value is None:
        return None
    size = positive(value, "page_size")
    if size > MAX_PAGE_SIZE:
        raise InvalidConfigError(f"page_size={size} is over {MAX_PAGE_SIZE >> 20} MiB; use a page of 4 KiB to 2 MiB "
                                 "(the default is the backend's)")
    return size


def device(value: Any, *, optional: bool = False) -> str | None:
    """A device a backend runs on: 'cpu' (the host backend) or 'cuda[:N]', given as a string
    or a torch.device; returned as a string (None too when `optional`). Parsed here without
    torch: the books import this module."""
    if optional and value is None:
        return None
    if hasattr(value, "type") and hasattr(value, "index") and not isinstance(value, str):  # a torch.device
        value = str(value)
    if not isinstance(value, str):
        raise InvalidConfigError(f"device must be a string like 'cpu' or 'cuda:0', got {value!r}")
    m = _DEVICE.fullmatch(value)
    if m is None:
        raise InvalidConfigError(f"device must be 'cpu' (host backend) or 'cuda[:N]', got {value!r}")
    if m[1] == "cpu" and m[2] is not None and int(m[2]) != 0:
        raise InvalidConfigError(f"the host has one memory: use device='cpu', not {value!r}")
    return value


_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")

# ------------------------------------------------------------- owners of files ----
def user_text(uid: int) -> str:
    """`uid 0 (root)`, or `uid N` for a uid with no name: how an error names an owner."""
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def group_text(gid: int) -> str:
    """`0 (root)`, or `N` for a gid with no name."""
    import grp

    try:
        return f"{gid} ({grp.getgrgid(gid).gr_name})"
    except KeyError:
        return str(gid)


def stat_text(st: Any) -> str:
    """A file's owner, group and mode as an error names them (the budget's tables, the offload
    tier's directories): `owner uid 0 (root), group 0 (root), mode 0700`."""
    import stat as stat_mod

    return f"owner {user_text(st.st_uid)}, group {group_text(st.st_gid)}, mode {stat_mod.S_IMODE(st.st_mode):04o}"


def not_regular(st: Any) -> str | None:
    """What a file `st` (`os.stat_result`) is when it is no regular file ("a symbolic link", "a
    FIFO", ...: what a planted file that must not be read is named as), None for a regular file."""
    import stat as stat_mod

    m = st.st_mode
    for test, what in ((stat_mod.S_ISLNK, "a symbolic link"), (stat_mod.S_ISDIR, "a directory"),
                       (stat_mod.S_ISFIFO, "a FIFO"), (stat_mod.S_ISSOCK, "a socket"),
                       (stat_mod.S_ISCHR, "a device"), (stat_mod.S_ISBLK, "a device")):
        if test(m):
            return what
    return None if stat_mod.S_ISREG(m) else "not a regular file"


def not_own(path: str, *, within: str = "/tmp") -> str | None:
    """Why `path` (an interpreter a benchmark or test would run by default, e.g. a venv under
    /tmp) might be another user's plant, or None: inside the shared folder `within`, the path
    itself (a venv's `python` is a link: its owner counts) and every directory above it up to
    `within` must be this user's, none writable by group or others. A path outside `within` is
    not checked. Returns what is wrong, with its owner and mode."""
    import stat as stat_mod

    p = os.path.abspath(path)
    stop = os.path.abspath(within)
    if os.path.commonpath([p, stop]) != stop:
        return None  # not in the shared folder: a path the user named, theirs to vouch for
    first = True  # (a link's own mode is always 0777: only its owner says who made it)
    while p not in (stop, os.path.dirname(p)):
        try:
            st = os.lstat(p)
        except OSError as e:
            return f"{p}: {e.strerror}"
        if st.st_uid != os.getuid():
            return f"{p} is not yours ({stat_text(st)})"
        if not (first and stat_mod.S_ISLNK(st.st_mode)) and stat_mod.S_IMODE(st.st_mode) & 0o022:
            return f"{p} is writable by others ({stat_text(st)})"
        first = False
        p = os.path.dirname(p)
    return None
