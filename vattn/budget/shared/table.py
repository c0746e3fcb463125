"""The table of one shared budget, a file in /dev/shm: its layout, its locks, the members'
rows and the books kept in them.

Every member maps the file and writes its own row under the books' lock (`Table.locked`);
a member's liveness lock is held by its process while it lives (`Table.alive`). Where the
file lives and the checks it passes before it is opened are in `directory`, the wake-ups in
`wake`; the mechanism as a whole is described in `vattn.budget.shared`.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat as stat_mod
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from vattn.budget.shared.directory import Place, file_problem, open_checked, unlink_if_same, unsafe_table
from vattn.errors import DamagedTableError, InvalidConfigError, InvalidRequestError, UnsafeTableError

logger = logging.getLogger("vattn.budget")

POLL_S = 0.1  # a responder's period: heartbeat, cached bytes, member limit, dead members
ANSWER_S = 1.0  # the longest an asker waits for the others to give back
MAX_MEMBERS = 64
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

    def cached_by_others(self, exclude: int) -> int:
        """The cached bytes the live members but row `exclude` last published."""
        r = self.rows
        return sum(int(r["cached"][j]) for j in self.live() if j != exclude)

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
    link, and written or grown only once it passed the checks (`directory.open_checked`); a table
    this call created is removed again if joining fails."""
    settle = time.monotonic() + 1.0
    while True:
        created = False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, where.mode)
            created = True
        except FileExistsError:
            try:
                fd = open_checked(path, where)
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
            problem = file_problem(st, where)
            if problem is not None and not created and _settling(st, settle):
                os.close(fd)
                time.sleep(0.001)
                continue
            if problem is not None:
                raise unsafe_table(path, problem, st, where)
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
    fd = open_checked(path, where)
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
