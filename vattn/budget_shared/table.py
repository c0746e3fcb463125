"""The table of one shared budget, a file in /dev/shm: its layout, its locks, the members'
rows, the books kept in them, and the wake-ups that tell a member to read its row.

Every member maps the file and writes its own row under the books' lock (`Table.locked`);
a member's liveness lock is held by its process while it lives (`Table.alive`). The
mechanism as a whole is described in `vattn.budget_shared`.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import grp
import logging
import mmap
import os
import pwd
import re
import socket
import stat as stat_mod
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from vattn import checks
from vattn.checks import group_text, not_regular, stat_text, user_text
from vattn.errors import DamagedTableError, InvalidConfigError, InvalidRequestError, UnsafeTableError

logger = logging.getLogger("vattn.budget")

DIR_ENV = "VATTN_BUDGET_DIR"  # where the tables live (default /dev/shm/vattn-UID); a group's directory
SHM = Path("/dev/shm")  # the parent of each user's own directory of tables
POLL_S = 0.1  # a responder's period: heartbeat, cached bytes, member limit, dead members
ANSWER_S = 1.0  # the longest an asker waits for the others to give back
MAX_MEMBERS = 64
PREFIX = "vattn-budget-"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_MAGIC, _VERSION = b"VATTNBDG", 1

HEADER = np.dtype([("magic", "S8"), ("version", "<i8"), ("limit", "<i8"), ("created", "<f8"),
                   ("name", "S64"), ("device", "S128")])
ROW = np.dtype({  # one member; -1 is "none" for limits; times are time.time()
    "names": ["state", "pid", "nonce", "taken", "peak", "cached", "limit", "refusals", "ask_seq", "ask_bytes",
              "ask_time", "done_seq", "gave", "last_give_time", "last_give_bytes", "heartbeat", "joined",
              "participants", "label", "host", "disk"],  # host, disk: what its offload tiers hold (0 in older rows)
    "formats": ["<i8"] * 10 + ["<f8", "<i8", "<i8", "<f8", "<i8", "<f8", "<f8", "<i8", "S128", "<i8", "<i8"],
    "itemsize": 512})  # room for later fields
_HEADER_BYTES = 4096
_SIZE = _HEADER_BYTES + MAX_MEMBERS * ROW.itemsize
_BOOKS = 0  # the byte whose fcntl lock guards the books
_LIVE = 1 << 20  # byte _LIVE + i: held by row i's process while it lives (beyond the file: locks need no data)


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


def _file_problem(st: os.stat_result, where: Place) -> str | None:
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


def _unsafe(path: Path, why: str, st: os.stat_result | None, where: Place) -> UnsafeTableError:
    what = "" if st is None else f" ({stat_text(st)})"
    return UnsafeTableError(f"{path}{what} is {why}; vattn joins only a table made for {where.who()}: remove it if "
                            "you do not know it, or use another budget name", path=path, why=why, st=st)


def _open_checked(path: Path, where: Place) -> int | None:
    """A descriptor of the file at `path` once it passed the checks of a table of `where`
    (None: no such file): looked at before it is opened (never a FIFO or a device opened,
    never a link followed) and again through the descriptor. Raises `UnsafeTableError`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    problem = _file_problem(st, where)
    if problem is not None:
        raise _unsafe(path, problem, st, where)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:  # replaced meanwhile (ELOOP: a link now), or not ours to open
        raise _unsafe(path, f"not openable ({e.strerror})", None, where) from None
    st = os.fstat(fd)
    problem = _file_problem(st, where)
    if problem is not None:
        os.close(fd)
        raise _unsafe(path, problem, st, where)
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


# ------------------------------------------------------------------- books ----
@dataclass
class Ask:
    row: int
    nonce: int
    seq: int
    gave: int  # the row's `gave` when asked
    wait: bool  # False: the row left an ask unanswered past ANSWER_S; asked, not waited for


class Table:
    """The mapped file of one budget, opened by this process. Every read or write of the
    books is inside `locked()` (a thread lock, then the file's fcntl lock)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd
        self.mm = mmap.mmap(fd, _SIZE)
        self.header = np.ndarray((), HEADER, buffer=self.mm, offset=0)
        self.rows = np.ndarray((MAX_MEMBERS,), ROW, buffer=self.mm, offset=_HEADER_BYTES)
        self.tlock = threading.Lock()
        self.mine: set[int] = set()  # nonces of this process's rows (never probed, never reaped)

    @contextlib.contextmanager
    def locked(self, wait_s: float | None = None) -> Iterator[Table]:
        """The books, locked (waiting at most `wait_s` for another process to let go of them,
        else `DamagedTableError`; None: as long as it takes). `DamagedTableError` too where
        the file was cut short (reading the mapping past its end would kill the process
        with SIGBUS)."""
        with self.tlock:
            lock_books(self.fd, self.path, wait_s)
            try:
                if os.fstat(self.fd).st_size < _SIZE:
                    raise DamagedTableError(f"the budget table {self.path} was cut short by another process; close "
                                            "the caches on the budget and join it again")
                yield self
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, _BOOKS)

    def close(self) -> None:
        """Unmap and close (this process's fcntl locks on the file go with the fd)."""
        del self.header, self.rows  # numpy views pin the mmap
        self.mm.close()
        os.close(self.fd)

    # -------------------------------------------------------- the locked books ----
    @property
    def limit(self) -> int | None:
        v = int(self.header["limit"])
        return None if v < 0 else v

    def owns(self, i: int, nonce: int) -> bool:
        """Whether row i is still the member `nonce`'s (not cleared or taken over by another)."""
        return int(self.rows["state"][i]) == 1 and int(self.rows["nonce"][i]) == nonce

    def live(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.rows["state"] == 1)]

    def used(self) -> int:
        return int(self.rows["taken"][self.rows["state"] == 1].sum())

    def alive(self, i: int) -> bool:
        """Whether row i's process lives: its liveness lock cannot be taken."""
        if int(self.rows["nonce"][i]) in self.mine:
            return True
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _LIVE + i)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EAGAIN):
                return True
            raise
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, _LIVE + i)
        return False

    def reap(self) -> int:
        """Clear the rows of dead members (their bytes go back). Returns how many."""
        dead = [i for i in self.live() if not self.alive(i)]
        for i in dead:
            pid, taken = int(self.rows["pid"][i]), int(self.rows["taken"][i])
            self.rows[i] = np.zeros((), ROW)
            logger.info("vattn: budget %s: member pid %d is gone; its %d bytes are back", self.path.name, pid, taken)
        return len(dead)

    def post(self, i: int, nbytes: int, now: float) -> Ask:
        """Ask row i to give back `nbytes` of cached memory."""
        r = self.rows
        stuck = int(r["ask_seq"][i]) > int(r["done_seq"][i]) and now - float(r["ask_time"][i]) > ANSWER_S
        if int(r["ask_seq"][i]) == int(r["done_seq"][i]):
            r["ask_time"][i] = now
        r["ask_seq"][i] += 1
        # the largest pending ask, not their sum: an asker that asks again each step would
        # otherwise have it give back many times what it needs
        r["ask_bytes"][i] = max(int(r["ask_bytes"][i]), nbytes)
        return Ask(i, int(r["nonce"][i]), int(r["ask_seq"][i]), int(r["gave"][i]), not stuck)

    def ask(self, short: int, exclude: int | None = None) -> list[Ask]:
        """Ask the other members for `short` bytes: those with the most cached bytes first,
        each for what it has; everyone for the rest when their cached bytes fall short."""
        r, now = self.rows, time.time()
        others = sorted((i for i in self.live() if i != exclude), key=lambda i: -int(r["cached"][i]))
        asks, left = [], short
        for i in others:
            c = int(r["cached"][i])
            if left <= 0 or c <= 0:
                break
            asks.append(self.post(i, min(c, left), now))
            left -= min(c, left)
        if left > 0:  # the published figures are up to POLL_S old
            asked = {a.row for a in asks}
            asks += [self.post(i, left, now) for i in others if i not in asked]
        return asks

    def answered(self, a: Ask) -> bool:
        r = self.rows
        return int(r["state"][a.row]) != 1 or int(r["nonce"][a.row]) != a.nonce or int(r["done_seq"][a.row]) >= a.seq

    def given(self, asks: list[Ask]) -> int:
        r = self.rows
        return sum(max(0, int(r["gave"][a.row]) - a.gave) for a in asks if int(r["nonce"][a.row]) == a.nonce)

    # ------------------------------------------------- joining, leaving, limits ----
    def check_header(self) -> bool:
        """True for a vattn budget table, False for a new (zeroed) file; raises for anything else."""
        magic = bytes(self.header["magic"])
        if magic == _MAGIC and int(self.header["version"]) == _VERSION:
            return True
        if not magic.strip(b"\0"):
            return False
        raise InvalidConfigError(f"{self.path} is not a budget table of this vattn version ({magic[:8]!r}, version "
                                 f"{int(self.header['version'])}); stop the processes using it and remove it, or use "
                                 "another budget name")

    def claim_row(self, name: str, key: str, limit: int | None, member_limit: int | None, label: str,
                  nonce: int) -> int:
        """Books locked: the first free row, its liveness lock taken; a budget with no live
        member is created anew with `limit`."""
        now = time.time()
        fresh = not self.check_header()
        if not fresh:
            self.reap()
            fresh = not self.live()
        if fresh:  # a new budget, or one whose members all ended
            self.rows[:] = np.zeros((), ROW)
            self.header["magic"], self.header["version"] = _MAGIC, _VERSION
            self.header["limit"] = -1 if limit is None else limit
            self.header["created"], self.header["name"], self.header["device"] = now, name.encode(), key.encode()
        elif limit is not None and self.limit is None:  # a member that set none leaves it to the first that does
            self.header["limit"] = limit
        elif limit is not None and limit != self.limit:
            logger.warning("vattn: budget %s exists with limit %s; joined with it (limit=%d was not used; change it "
                           "with `vattn budget set-limit %s BYTES`)", name, self.limit, limit, name)
        for i in range(MAX_MEMBERS):
            if int(self.rows["state"][i]) == 1:
                continue
            try:
                fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _LIVE + i)
            except OSError:
                continue  # a process is still letting go of it
            self.rows[i] = np.zeros((), ROW)
            for field, value in (("pid", os.getpid()), ("nonce", nonce), ("limit", -1 if member_limit is None else
                                 member_limit), ("heartbeat", now), ("joined", now), ("label", label.encode()[:127])):
                self.rows[field][i] = value
            self.rows["state"][i] = 1
            self.mine.add(nonce)
            return i
        raise InvalidConfigError(f"budget {name!r} has {MAX_MEMBERS} members, the most one budget takes")

    def release_row(self, i: int, nonce: int) -> None:
        """Books locked: clear this process's row i (if it is still its own) and let go of
        its liveness lock."""
        if self.owns(i, nonce):
            self.rows[i] = np.zeros((), ROW)
        self.mine.discard(nonce)
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, _LIVE + i)

    def set_limit(self, limit: int | None, pid: int | None) -> list[tuple[int, int]]:
        """Books locked: set the budget's limit (pid None) or one member's, and ask for the
        cached bytes over it. Returns the members to wake."""
        r = self.rows
        if pid is None:
            self.header["limit"] = -1 if limit is None else limit
            over = 0 if limit is None else self.used() - limit
            return [(int(r["pid"][a.row]), a.nonce) for a in (self.ask(over) if over > 0 else [])]
        rows = [i for i in self.live() if int(r["pid"][i]) == pid]
        if not rows:
            pids = ", ".join(str(int(r["pid"][i])) for i in self.live()) or "none"
            raise InvalidRequestError(f"process {pid} is not a member of budget {self.path.name} (members: {pids})")
        for i in rows:
            r["limit"][i] = -1 if limit is None else limit
        return [(pid, int(r["nonce"][i])) for i in rows]  # its responder gives back what is over


def lock_books(fd: int, path: Path, wait_s: float | None) -> None:
    """Take the books' lock of the table open as `fd`: as long as it takes (`wait_s` None),
    else at most `wait_s` seconds, then `DamagedTableError`."""
    if wait_s is None:
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, _BOOKS)
        return
    deadline, delay = time.monotonic() + wait_s, 0.0005
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _BOOKS)
            return
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                raise
        if time.monotonic() > deadline:
            raise DamagedTableError(f"the books of {path} stayed locked for {wait_s:g} s (a member stopped while "
                                    "holding them?)")
        time.sleep(delay)
        delay = min(2 * delay, 0.01)


def claim(where: Place, path: Path, name: str, key: str, limit: int | None, member_limit: int | None, label: str,
          nonce: int) -> tuple[Table, int]:
    """Open (or create) the table at `path` in `where` and take a row for this process.
    Returns (table, row). A file is created only where none is (`O_EXCL`), never through a
    link, and written or grown only once it passed the checks (`_open_checked`); a table
    this call created is removed again if joining fails."""
    settle = time.monotonic() + 1.0
    while True:
        created = False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, where.mode)
            created = True
        except FileExistsError:
            try:
                fd = _open_checked(path, where)
            except UnsafeTableError as e:
                if not _settling(e.st, settle):
                    raise
                time.sleep(0.001)  # its creator is setting its mode (after the umask): look again
                continue
            if fd is None:  # removed meanwhile: create it
                continue
        except OSError as e:
            raise InvalidConfigError(f"cannot create the budget table {path}: {e.strerror}; check {where.dir}") \
                from None
        try:
            if created:
                os.fchmod(fd, where.mode)  # whatever the umask
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, _BOOKS)
            st = os.fstat(fd)
            if st.st_nlink == 0:  # the last member removed it after we opened it: open the new one
                os.close(fd)
                continue
            problem = _file_problem(st, where)
            if problem is not None and not created and _settling(st, settle):
                os.close(fd)
                time.sleep(0.001)
                continue
            if problem is not None:
                raise _unsafe(path, problem, st, where)
            if st.st_size == 0:  # new (or its creator died before it grew it)
                os.ftruncate(fd, _SIZE)
            elif st.st_size != _SIZE:
                raise InvalidConfigError(f"{path} ({st.st_size} bytes) is not a budget table; remove it if no vattn "
                                         "process uses it, or use another budget name")
            t = Table(path, fd)
        except BaseException:
            if created:
                unlink_if_same(path, fd)
            os.close(fd)
            raise
        try:
            row = t.claim_row(name, key, limit, member_limit, label, nonce)
        except BaseException:
            if created:
                unlink_if_same(path, fd)
            t.close()
            raise
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, _BOOKS)
        return t, row


def _settling(st: os.stat_result | None, until: float) -> bool:
    """Whether a file that failed the checks may be a table its creator has not given its
    mode yet (an empty regular file, for a moment)."""
    return st is not None and stat_mod.S_ISREG(st.st_mode) and st.st_size == 0 and time.monotonic() < until


@contextlib.contextmanager
def open_locked(path: Path, where: Place, wait_s: float = 2.0) -> Iterator[Table | None]:
    """The table at `path`, checked and locked, through a descriptor opened for the call
    (None: no such budget). Not for a table this process's member has open: closing a
    second descriptor of the file would drop the member's fcntl locks (`readers.reading`
    sees to that). `UnsafeTableError` for a file that is not a table of `where`,
    `InvalidConfigError` for one that is not a table at all, `DamagedTableError` when its
    books stayed locked `wait_s` (a reader does not hang on a stuck member)."""
    fd = _open_checked(path, where)
    if fd is None:
        yield None
        return
    try:
        lock_books(fd, path, wait_s)
        st = os.fstat(fd)
        if st.st_nlink == 0 or st.st_size == 0:  # its last member removed it, or it is being created
            yield None
            return
        if st.st_size != _SIZE:
            raise InvalidConfigError(f"{path} ({st.st_size} bytes) is not a budget table")
        t = Table(path, fd)
        try:
            t.check_header()
            yield t
        finally:
            t.close()
            fd = -1
    finally:
        if fd >= 0:
            os.close(fd)


# ----------------------------------------------------------------- wake-ups ----
def wake_address(pid: int, nonce: int) -> str:
    return f"\0vattn-budget-{pid}-{nonce:x}"  # abstract: no file, gone with the process


_sender: socket.socket | None = None
_sender_lock = threading.Lock()


def wake_members(pids_nonces: list[tuple[int, int]]) -> None:
    """Wake the responders of these members now (best effort: they poll anyway)."""
    global _sender
    if not pids_nonces:
        return
    with _sender_lock:
        if _sender is None:
            _sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            _sender.setblocking(False)
        for pid, nonce in pids_nonces:
            try:
                _sender.sendto(b"!", wake_address(pid, nonce))
            except OSError:  # gone, its queue full, or another network namespace
                pass


def listen(nonce: int) -> socket.socket | None:
    """This member's wake-up socket (None where there are no abstract sockets: it polls).
    Any local process can send to an abstract socket: the kernel tells who sent each
    wake-up (SO_PASSCRED), and `drain` drops those of processes that may not join."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(wake_address(os.getpid(), nonce))
    except OSError:  # no abstract sockets here: the responder polls
        sock.close()
        return None
    with contextlib.suppress(AttributeError, OSError):  # Linux; elsewhere every wake-up counts
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.setblocking(False)
    return sock


_UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid


def drain(sock: socket.socket, where: Place) -> bool:
    """Read the wake-ups waiting (64 at most: askers may keep sending). True when one came
    from a process that may join the budget (a sender the kernel does not name counts)."""
    woken = False
    for _ in range(64):
        try:
            _, ancillary, _, _ = sock.recvmsg(16, socket.CMSG_SPACE(_UCRED.size))
        except (BlockingIOError, InterruptedError):
            break
        uid = None
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == getattr(socket, "SCM_CREDENTIALS", -1) and \
                    len(data) >= _UCRED.size:
                uid = _UCRED.unpack_from(data)[1]
        woken = woken or uid is None or where.trusts(uid)
    return woken


def close_sender() -> None:
    """At exit: close the socket `wake_members` sends from."""
    global _sender
    with _sender_lock:
        if _sender is not None:
            _sender.close()
            _sender = None


def forget_sender() -> None:
    """In a forked child: the parent's sending socket and its lock are not the child's."""
    global _sender, _sender_lock
    _sender, _sender_lock = None, threading.Lock()
