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
import logging
import mmap
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from vattn.errors import InvalidConfigError, InvalidRequestError

logger = logging.getLogger("vattn.budget")

DIR_ENV = "VATTN_BUDGET_DIR"  # where the tables live (default /dev/shm): tests, or hosts without it
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
              "participants", "label"],
    "formats": ["<i8"] * 10 + ["<f8", "<i8", "<i8", "<f8", "<i8", "<f8", "<f8", "<i8", "S128"],
    "itemsize": 512})  # room for later fields
_HEADER_BYTES = 4096
_SIZE = _HEADER_BYTES + MAX_MEMBERS * ROW.itemsize
_BOOKS = 0  # the byte whose fcntl lock guards the books
_LIVE = 1 << 20  # byte _LIVE + i: held by row i's process while it lives (beyond the file: locks need no data)


# ------------------------------------------------------------------- where ----
def device_key(device: Any = None) -> str:
    """The budget's key for `device` (None: the current CUDA device if there is one, else
    the host): "host", or "cuda-<UUID>" (the same GPU has the same key in every process,
    whatever CUDA_VISIBLE_DEVICES numbers it), or "cuda<index>" where no UUID is known."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cpu":
        return "host"
    if dev.type != "cuda":
        raise InvalidConfigError(f"a shared budget is per GPU or per host; device {device!r} is neither")
    index = dev.index
    try:
        if index is None:
            index = torch.cuda.current_device()
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
    except Exception:  # no CUDA here (the fake driver in tests): the index names it
        uuid = ""
    uuid = re.sub(r"[^A-Za-z0-9_.-]", "", uuid)
    return f"cuda-{uuid}" if uuid else f"cuda{index or 0}"


def budget_dir() -> Path:
    """The directory of the budgets' tables: $VATTN_BUDGET_DIR, else /dev/shm (shared
    memory), else the temporary directory."""
    d = os.environ.get(DIR_ENV)
    if d:
        return Path(d)
    return Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else \
        Path(os.environ.get("TMPDIR", "/tmp"))


def table_path(name: str, key: str) -> Path:
    return budget_dir() / f"{PREFIX}{name}@{key}"


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidConfigError(f"a shared budget's name is 1-64 letters, digits, '_', '.' or '-', starting with a "
                                 f"letter or digit; got {name!r}")
    return name


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
    def locked(self) -> Iterator[Table]:
        with self.tlock:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, _BOOKS)
            try:
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
        raise InvalidConfigError(f"{self.path} is not a budget table of this vattn version ({magic!r}, version "
                                 f"{int(self.header['version'])}); stop the processes using it, or use another "
                                 "budget name")

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
        """Books locked: clear this process's row i and let go of its liveness lock."""
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


def claim(path: Path, name: str, key: str, limit: int | None, member_limit: int | None, label: str,
          nonce: int) -> tuple[Table, int]:
    """Open (or create) the table and take a row for this process. Returns (table, row)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, _BOOKS)
            st = os.fstat(fd)
            if st.st_nlink == 0:  # the last member removed it after we opened it: open the new one
                os.close(fd)
                continue
            if st.st_size < _SIZE:
                os.ftruncate(fd, _SIZE)
            t = Table(path, fd)
        except BaseException:
            os.close(fd)
            raise
        try:
            row = t.claim_row(name, key, limit, member_limit, label, nonce)
        except BaseException:
            t.close()
            raise
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, _BOOKS)
        return t, row


@contextlib.contextmanager
def open_locked(path: Path) -> Iterator[Table | None]:
    """The table at `path`, locked, through a descriptor opened for the call (None: no such
    budget). Not for a table this process's member has open: closing a second descriptor of
    the file would drop the member's fcntl locks (`readers.reading` sees to that)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX, 1, _BOOKS)
        st = os.fstat(fd)
        if st.st_nlink == 0 or st.st_size < _SIZE:  # its last member removed it, or it is being created
            yield None
            return
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
    """This member's wake-up socket (None where there are no abstract sockets: it polls)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(wake_address(os.getpid(), nonce))
    except OSError:  # no abstract sockets here: the responder polls
        sock.close()
        return None
    sock.setblocking(False)
    return sock


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
