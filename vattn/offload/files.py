"""The disk tier's files on a shared host: whose directories and files vattn trusts, and how
it opens a file it did not just make (see docs/shared-pages.md, "Threat model").

```
offload_dir            yours, writable by no one else (0700)   or a group's on purpose (2770)
  vattn-kv-<identity>/   made by vattn: 0700                     2770 (the directory's group)
    3f/                  made by vattn: 0700                     2770
      3f09...c1.3.kv     O_EXCL, 0600, yours                     0660, of the group
```
- **Directories.** `offload_dir` (followed once, if a link, to its real path) must be a
  directory owned by this process's user (or root) that no other user can write: not
  writable by everyone, and writable by its group only with the set-group-ID bit (an
  operator's directory shared with a group on purpose, mode 2770, the caller in that group).
  The directories vattn makes under it are checked the same way (owned by the user, or of the
  shared group). Anything else is an `UnsafeOffloadDirError` at start, naming the path, its
  owner and mode, and what to do.
- **Files.** Created with `O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600 (0660 shared), renamed into
  place. Opened with `O_NOFOLLOW | O_NONBLOCK` (a link is not followed, a FIFO does not block),
  then checked through the descriptor (`fstat`) before a byte is read: a regular file, one
  link, of this user (of the group, shared), writable by no one else, and exactly the size its
  name's layout says (a planted 3 GiB file is never read). Anything else is a miss, and
  removed.
- **Warnings** about files are rate-limited (`Warnings`): one line per kind of failure at most
  every `WARN_EVERY_S`, with the count of those not logged since.
"""
from __future__ import annotations

import errno
import logging
import os
import secrets
import stat as stat_mod
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from vattn.checks import group_text, not_regular, stat_text, user_text
from vattn.errors import UnsafeOffloadDirError

WARN_EVERY_S = 10.0  # one warning line per kind of failure at most this often
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Place:
    """A checked `offload_dir` (`root`, its real path) and who may write in it: this user
    alone (`gid` None) or the members of group `gid` (a directory shared on purpose)."""

    root: str
    gid: int | None = None

    @property
    def file_mode(self) -> int:
        return 0o600 if self.gid is None else 0o660

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.gid is None else 0o2770

    def who(self) -> str:
        return f"you ({user_text(os.geteuid())})" if self.gid is None else f"group {group_text(self.gid)}"


def place(path: str) -> Place:
    """`path` as the disk tier's directory, checked (created 0700 when missing). Raises
    `UnsafeOffloadDirError` when another user could write in it; OSError when it cannot be
    made or looked at."""
    try:
        os.stat(path)
    except FileNotFoundError:
        os.makedirs(path, mode=0o700, exist_ok=True)
    root = os.path.realpath(path)  # a link the user gave is followed once, here; never after
    st = os.lstat(root)
    uid, mode = os.geteuid(), stat_mod.S_IMODE(st.st_mode)
    why = None
    if not stat_mod.S_ISDIR(st.st_mode):
        why = "not a directory"
    elif st.st_uid not in (uid, 0):
        why = f"owned by {user_text(st.st_uid)}, not by you ({user_text(uid)})"
    elif mode & stat_mod.S_IWOTH:
        why = "writable by every user (anyone could plant blocks in it)"
    elif mode & stat_mod.S_IWGRP and not mode & stat_mod.S_ISGID:
        why = (f"writable by its group {group_text(st.st_gid)} without the set-group-ID bit: chmod 2770 to share "
               "offloaded blocks with that group on purpose, or chmod 0700")
    elif mode & stat_mod.S_IWGRP and uid != 0 and st.st_gid not in (os.getegid(), *os.getgroups()):
        why = f"shared with group {group_text(st.st_gid)}, which you are not in"
    if why is not None:
        raise unsafe(path, root, why, st)
    return Place(root, st.st_gid if mode & stat_mod.S_IWGRP else None)


def make_dir(where: Place, path: str) -> None:
    """Make directory `path` under `where` (if missing) with its mode, and check it: a
    directory, not a link, of this user (of the group, shared), writable by no one else.
    Raises `UnsafeOffloadDirError`, or OSError when it cannot be made."""
    try:
        os.mkdir(path, where.dir_mode)
        if where.gid is not None:
            os.chmod(path, where.dir_mode)  # (the umask took the group's bits)
    except FileExistsError:
        pass
    st = os.lstat(path)
    why = dir_problem(where, st)
    if why is not None:
        raise unsafe(path, path, why, st)


def dir_problem(where: Place, st: os.stat_result) -> str | None:
    """Why a directory under `where` (its `lstat`) is not one vattn made there (None: it may be)."""
    if stat_mod.S_ISLNK(st.st_mode):
        return "a symbolic link, not a directory"
    if not stat_mod.S_ISDIR(st.st_mode):
        return "not a directory"
    mode = stat_mod.S_IMODE(st.st_mode)
    if mode & stat_mod.S_IWOTH:
        return "writable by every user"
    if where.gid is None:
        if st.st_uid != os.geteuid():
            return f"owned by {user_text(st.st_uid)}, not by you"
        if mode & stat_mod.S_IWGRP:
            return f"writable by its group {group_text(st.st_gid)}"
    elif st.st_gid != where.gid:
        return f"of group {group_text(st.st_gid)}, not the shared directory's ({group_text(where.gid)})"
    return None


def file_problem(where: Place, st: os.stat_result, size: int) -> str | None:
    """Why the file `st` is not a block file of `where` of `size` bytes (None: it may be one)."""
    kind = not_regular(st)
    if kind is not None:
        return kind
    mode = stat_mod.S_IMODE(st.st_mode)
    if where.gid is None and st.st_uid != os.geteuid():
        return f"owned by {user_text(st.st_uid)}, not by you"
    if where.gid is not None and st.st_gid != where.gid:
        return f"of group {group_text(st.st_gid)}, not the shared directory's"
    if mode & (stat_mod.S_IWOTH | (stat_mod.S_IWGRP if where.gid is None else 0)):
        return f"mode {mode:04o}: writable by others"
    if st.st_nlink != 1:
        return f"a file with {st.st_nlink} links"
    if st.st_size != size:
        return f"{st.st_size} bytes, not the {size} its layout has"
    return None


def read_block(where: Place, path: str, size: int) -> tuple[bytearray | None, str | None]:
    """The `size` bytes of the block file at `path`, opened without trusting it (see the
    module docstring): (data, None); (None, None) when there is no such file; (None, why)
    when it is not a block file of `where` (it is then removed, if it is still the file
    looked at). Raises OSError for an I/O error."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symbolic link (O_NOFOLLOW), removed (unlink never follows one)
            unlink(path)
            return None, "a symbolic link"
        raise
    try:
        st = os.fstat(fd)
        why = file_problem(where, st, size)
        if why is None:
            data = bytearray(size)
            view, got = memoryview(data), 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    break
                got += n
            if got == size:
                return data, None
            why = f"cut short ({got} of {size} bytes) while read"
        unlink_if_same(path, fd)
        return None, why
    finally:
        os.close(fd)


def write_file(path: str, parts: Sequence[Any], mode: int = 0o600) -> None:
    """Write `parts` (bytes-like) to `path` atomically: a new temporary file in its directory
    (`O_EXCL | O_NOFOLLOW`, `mode`), renamed into place (a reader sees the whole file or
    none). Raises OSError; leaves no temporary file behind."""
    d = os.path.dirname(path)
    tmp = os.path.join(d, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, CREATE_FLAGS, mode)
    try:
        try:
            if mode & 0o070:
                os.fchmod(fd, mode)  # (the umask took the group's bits)
            for part in parts:
                view = memoryview(part).cast("B")
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        unlink(tmp)
        raise


def unlink_if_same(path: str, fd: int) -> None:
    """Remove `path` if it is still the file open as `fd` (not one put there since)."""
    try:
        st, now = os.fstat(fd), os.lstat(path)
        if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
            os.unlink(path)
    except OSError:
        pass


def listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class Warnings:
    """Warnings rate-limited per kind: at most one line every `every_s` seconds for each
    kind, with the count of those held back since (a read-only disk fails every write: one
    line, not dozens a second). Thread-safe."""

    def __init__(self, logger: logging.Logger, every_s: float = WARN_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.every_s, self.clock = logger, every_s, clock
        self._last: dict[str, tuple[float, int]] = {}  # kind -> (when last logged, held back since)
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str) -> bool:
        """Log `message` unless a warning of `kind` was logged less than `every_s` ago (then
        it is counted, and the next line of that kind says how many). True when logged."""
        with self._lock:
            now = self.clock()
            last, held = self._last.get(kind, (None, 0))
            if last is not None and now - last < self.every_s:
                self._last[kind] = (last, held + 1)
                return False
            self._last[kind] = (now, 0)
        more = f" ({held} more like it in the last {now - last:.0f} s)" if held else ""
        self.logger.warning("vattn: %s%s", message, more)
        return True


def unsafe(given: str, path: str, why: str, st: os.stat_result) -> UnsafeOffloadDirError:
    shown = given if given == path else f"{given} (-> {path})"
    return UnsafeOffloadDirError(
        f"offload_dir {shown} ({stat_text(st)}) is {why}; another user could put blocks there that this engine "
        "would serve as its own. Use a directory of yours (mkdir -m 0700), or one an operator shares with a group "
        "on purpose (mode 2770, set-group-ID: see docs/shared-pages.md)", path=path, why=why, st=st)


__all__ = ["Place", "Warnings", "dir_problem", "file_problem", "listdir", "make_dir", "place", "read_block", "unlink",
           "unsafe", "write_file"]
