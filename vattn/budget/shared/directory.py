"""Where the tables of shared budgets live and who may join them: the directory (this
user's own, or one an operator shares with a group on purpose), the checks a file passes
before it is opened as a table, and a budget's key per device. The mechanism as a whole is
described in `vattn.budget.shared`."""
from __future__ import annotations

import contextlib
import functools
import grp
import os
import pwd
import re
import stat as stat_mod
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vattn import checks
from vattn.checks import group_text, not_regular, stat_text, user_text
from vattn.errors import InvalidConfigError, UnsafeTableError

DIR_ENV = "VATTN_BUDGET_DIR"  # where the tables live (default /dev/shm/vattn-UID); a group's directory
SHM = Path("/dev/shm")  # the parent of each user's own directory of tables
PREFIX = "vattn-budget-"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


# ------------------------------------------------------------------- where ----
def device_key(device: Any = None) -> str:
    """The budget's key for `device` (None: the current CUDA device if there is one, else
    the host): "host", or "cuda-<UUID>" (the same GPU has the same key in every process,
    whatever CUDA_VISIBLE_DEVICES numbers it), or "cuda<index>" where no UUID is known.
    A GPU must exist here: "cuda:3" on a host without it is an `InvalidConfigError`."""
    import torch

    device = checks.device(device, optional=True)  # 'cpu' or 'cuda[:N]' (a torch.device too), else refused
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu":
        return "host"
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise InvalidConfigError(f"device {device!r}: torch sees no CUDA device on this host; use device='cpu' for "
                                 "the host's budget, or join where the GPU is")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index >= count:
        raise InvalidConfigError(f"device {device!r}: this host has {count} CUDA device{'s' * (count != 1)} "
                                 f"(cuda:0 to cuda:{count - 1})")
    try:
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    except Exception:  # a driver that does not say: the index names it
        uuid = ""
    uuid = re.sub(r"[^A-Za-z0-9_.-]", "", uuid)
    return f"cuda-{uuid}" if uuid else f"cuda{index}"


def budget_dir() -> Path:
    """The directory of the budgets' tables: $VATTN_BUDGET_DIR, else this user's own
    directory in shared memory, /dev/shm/vattn-UID (the temporary directory's where there
    is no /dev/shm). Not checked here: `place` checks it."""
    d = os.environ.get(DIR_ENV)
    if d:
        return Path(d)
    base = SHM if SHM.is_dir() and os.access(SHM, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())
    return base / f"vattn-{os.geteuid()}"


def table_path(name: str, key: str) -> Path:
    return budget_dir() / f"{PREFIX}{name}@{key}"


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidConfigError(f"a shared budget's name is 1-64 letters, digits, '_', '.' or '-', starting with a "
                                 f"letter or digit; got {name!r}")
    return name


# ------------------------------------------------------------ who may join ----
@dataclass(frozen=True)
class Place:
    """A checked directory of tables, and who may join the tables in it: the caller's user
    alone (`gid` None: tables owned by the caller, mode 0600), or the members of group
    `gid` (a directory the operator made for it, mode 2770: tables of that group, 0660)."""

    dir: Path
    gid: int | None

    @property
    def mode(self) -> int:
        return 0o600 if self.gid is None else 0o660

    def path(self, name: str, key: str) -> Path:
        return self.dir / f"{PREFIX}{name}@{key}"

    def trusts(self, uid: int) -> bool:
        """Whether a process of user `uid` may join (and so wake) this place's members."""
        return uid in (0, os.geteuid()) or (self.gid is not None and _in_group(uid, self.gid))

    def who(self) -> str:
        return f"you ({user_text(os.geteuid())})" if self.gid is None else f"group {group_text(self.gid)}"


def place(*, create: bool) -> Place | None:
    """The directory of the tables (`budget_dir`), checked: this user's and writable by no
    one else, or shared on purpose with a group (mode 2770, the caller in that group). The
    default directory is created 0700 when `create` (else None when it is missing). Raises
    `InvalidConfigError` naming the directory, its owner and mode, and what to do."""
    d = budget_dir()
    explicit = bool(os.environ.get(DIR_ENV))
    stat = os.stat if explicit else os.lstat  # the default one is in a world-writable directory: no links
    try:
        st = stat(d)
    except FileNotFoundError:
        if not create:
            return None
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            st = stat(d)
        except OSError as e:
            raise InvalidConfigError(f"cannot create the budget directory {d}: {e.strerror}; set {DIR_ENV} to a "
                                     "directory of yours") from None
    except OSError as e:
        raise InvalidConfigError(f"cannot use the budget directory {d}: {e.strerror}") from None
    return _check_dir(d, st, explicit)


def _check_dir(d: Path, st: os.stat_result, explicit: bool) -> Place:
    uid, mode = os.geteuid(), stat_mod.S_IMODE(st.st_mode)
    fix = f"set {DIR_ENV} to a directory of yours (mode 0700), or remove {d} if you do not know it" if not explicit \
        else "use a directory of yours (mode 0700), or one an operator shares with a group (mode 2770)"
    why = None
    if stat_mod.S_ISLNK(st.st_mode):
        why = "a symbolic link, not a directory"
    elif not stat_mod.S_ISDIR(st.st_mode):
        why = "not a directory"
    elif st.st_uid != uid and not (explicit and st.st_uid == 0):
        why = f"owned by {user_text(st.st_uid)}, not by you ({user_text(uid)})"
    elif mode & stat_mod.S_IWOTH:
        why = "writable by every user (anyone could plant files in it)"
    elif mode & stat_mod.S_IWGRP and not (explicit and mode & stat_mod.S_ISGID):
        why = ("writable by its group without the set-group-ID bit: chmod 2770 to share budgets with group "
               f"{group_text(st.st_gid)} on purpose, or chmod 0700") if explicit else "writable by its group"
    elif mode & stat_mod.S_IWGRP and uid != 0 and st.st_gid not in (os.getegid(), *os.getgroups()):
        why = f"shared with group {group_text(st.st_gid)}, which you are not in"
    if why is not None:
        raise InvalidConfigError(f"the budget directory {d} ({stat_text(st)}) is {why}; {fix}")
    return Place(d, st.st_gid if mode & stat_mod.S_IWGRP else None)


def file_problem(st: os.stat_result, where: Place) -> str | None:
    """Why the file `st` is not a table of `where` (None: it may be one)."""
    kind = not_regular(st)
    if kind is not None:
        return kind if kind == "not a regular file" else f"{kind}, not a budget table"
    mode = stat_mod.S_IMODE(st.st_mode)
    if where.gid is None and st.st_uid != os.geteuid():
        return f"owned by {user_text(st.st_uid)}, not by you"
    if where.gid is not None and st.st_gid != where.gid:
        return f"of group {group_text(st.st_gid)}, not the directory's ({group_text(where.gid)})"
    if mode != where.mode:
        return f"mode {mode:04o}, not {where.mode:04o}"
    if st.st_nlink != 1:
        return f"a file with {st.st_nlink} links (a hard link)"
    return None


def unsafe_table(path: Path, why: str, st: os.stat_result | None, where: Place) -> UnsafeTableError:
    what = "" if st is None else f" ({stat_text(st)})"
    return UnsafeTableError(f"{path}{what} is {why}; vattn joins only a table made for {where.who()}: remove it if "
                            "you do not know it, or use another budget name", path=path, why=why, st=st)


def open_checked(path: Path, where: Place) -> int | None:
    """A descriptor of the file at `path` once it passed the checks of a table of `where`
    (None: no such file): looked at before it is opened (never a FIFO or a device opened,
    never a link followed) and again through the descriptor. Raises `UnsafeTableError`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    problem = file_problem(st, where)
    if problem is not None:
        raise unsafe_table(path, problem, st, where)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:  # replaced meanwhile (ELOOP: a link now), or not ours to open
        raise unsafe_table(path, f"not openable ({e.strerror})", None, where) from None
    st = os.fstat(fd)
    problem = file_problem(st, where)
    if problem is not None:
        os.close(fd)
        raise unsafe_table(path, problem, st, where)
    return fd


def unlink_if_same(path: Path, fd: int) -> None:
    """Remove `path` if it is still the file open as `fd` (not one put there since)."""
    with contextlib.suppress(OSError):
        st, now = os.fstat(fd), os.lstat(path)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            os.unlink(path)


@functools.lru_cache(maxsize=64)
def _in_group(uid: int, gid: int) -> bool:
    try:
        user = pwd.getpwuid(uid)
        return user.pw_gid == gid or user.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False
