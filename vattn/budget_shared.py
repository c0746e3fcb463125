"""`SharedBudget`: one physical-memory budget shared by the processes of a machine.

`vattn.Budget.shared(name, limit)` joins the budget `name` of one device (a GPU, keyed by
its UUID, or the host) and returns a `Budget` that several processes draw from: `vattn
serve` servers, vLLM's and SGLang's schedulers, engines and caches of your own. It follows
the in-process `Budget`'s participant protocol (`vattn.budget`), so caches and pools use
it unchanged.

```
 /dev/shm/vattn-budget-NAME@DEVICE   (36 KiB, memory-mapped by every member)
 [ header: limit ][ row 0: pid, taken, cached, limit, asks ... ][ row 1 ] ... [ row 63 ]
   byte 0 lock: the books (fcntl, a few microseconds a take or a give)
   byte LIVE + i lock: held by row i's process for as long as it lives
```

- **No daemon.** The books are the file; each member writes its own row under the books'
  lock. The kernel drops a dead process's fcntl locks, so the books are never left
  locked, and a member whose liveness lock can be taken is dead: any member (every
  `POLL_S`, and before refusing a take) or `vattn top` clears its row, and its bytes go
  back to the budget. The process's pages went with it (its memfd, its CUDA context).
  Pid reuse is harmless: liveness is the lock, never the pid.
- **Give-back.** A member short of bytes asks its own other participants first (as the
  in-process budget does), then writes asks into the rows of the others (those with the
  most cached bytes first) and wakes them (an abstract Unix datagram socket; polling every
  `POLL_S` otherwise). Each member runs a responder thread that answers even when its
  process is idle: it calls its participants' `reclaim` (free slots, pre-mapped tails,
  idle pins, cached pool pages) and marks the ask done. The asker waits until the room is
  there, every ask is answered, or `ANSWER_S`; a member that leaves an ask unanswered
  that long is not waited for again until it answers (a stopped or stuck process costs
  others one wait, not one per step).
- **Limits.** The budget's limit bounds the sum of the members' bytes; a member limit
  (`member_limit=`, `vattn budget set-limit NAME BYTES --pid PID`) bounds one process's.
  Lowering either asks the members to give back cached bytes over it now; bytes under
  live data stay until freed, and takes are refused meanwhile.
- **One member per process and budget.** `Budget.shared` called again in the same
  process returns the same member (its participants are that process's caches and
  pools). A forked child must call `Budget.shared` itself. Members must share /dev/shm
  (containers: mount the same one); files are readable by their owner only.

The bytes are what the members *took*: a cache takes before it creates pages and gives
after they are released, so the physical memory of all members together never exceeds
the limit (the vLLM integration is the exception: its scheduler counts, and its workers
unmap what it gave back with their next step or idle call, within about `POLL_S`).
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from vattn.budget import Budget, BudgetStats, _check_nbytes
from vattn.checks import byte_limit
from vattn.errors import ClosedError, InvalidConfigError, InvalidRequestError

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
class _Ask:
    row: int
    nonce: int
    seq: int
    gave: int  # the row's `gave` when asked
    wait: bool  # False: the row left an ask unanswered past ANSWER_S; asked, not waited for


class _Table:
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
    def locked(self) -> Iterator[_Table]:
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

    def post(self, i: int, nbytes: int, now: float) -> _Ask:
        """Ask row i to give back `nbytes` of cached memory."""
        r = self.rows
        stuck = int(r["ask_seq"][i]) > int(r["done_seq"][i]) and now - float(r["ask_time"][i]) > ANSWER_S
        if int(r["ask_seq"][i]) == int(r["done_seq"][i]):
            r["ask_time"][i] = now
        r["ask_seq"][i] += 1
        # the largest pending ask, not their sum: an asker that asks again each step would
        # otherwise have it give back many times what it needs
        r["ask_bytes"][i] = max(int(r["ask_bytes"][i]), nbytes)
        return _Ask(i, int(r["nonce"][i]), int(r["ask_seq"][i]), int(r["gave"][i]), not stuck)

    def ask(self, short: int, exclude: int | None = None) -> list[_Ask]:
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

    def answered(self, a: _Ask) -> bool:
        r = self.rows
        return int(r["state"][a.row]) != 1 or int(r["nonce"][a.row]) != a.nonce or int(r["done_seq"][a.row]) >= a.seq

    def given(self, asks: list[_Ask]) -> int:
        r = self.rows
        return sum(max(0, int(r["gave"][a.row]) - a.gave) for a in asks if int(r["nonce"][a.row]) == a.nonce)


_registry_lock = threading.Lock()
_members: dict[Path, SharedBudget] = {}  # this process's members, by table path


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[_Table | None]:
    """The locked table at `path` (None: no such budget), for readers that may not be
    members: this process's own open table if it is one (closing a second descriptor of the
    file would drop the member's fcntl locks), else a descriptor opened for the call."""
    with _registry_lock:
        m = _members.get(path)
        if m is not None:
            with m._table.locked() as t:
                yield t
            return
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
            t = _Table(path, fd)
            try:
                _check_header(t, path)
                yield t
            finally:
                t.close()
                fd = -1
        finally:
            if fd >= 0:
                os.close(fd)


def _check_header(t: _Table, path: Path) -> bool:
    """True for a vattn budget table, False for a new (zeroed) file; raises for anything else."""
    magic = bytes(t.header["magic"])
    if magic == _MAGIC and int(t.header["version"]) == _VERSION:
        return True
    if not magic.strip(b"\0"):
        return False
    raise InvalidConfigError(f"{path} is not a budget table of this vattn version ({magic!r}, version "
                             f"{int(t.header['version'])}); stop the processes using it, or use another budget name")


def _claim(path: Path, name: str, key: str, limit: int | None, member_limit: int | None, label: str,
           nonce: int) -> tuple[_Table, int]:
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
            t = _Table(path, fd)
        except BaseException:
            os.close(fd)
            raise
        try:
            row = _claim_row(t, name, key, limit, member_limit, label, nonce)
        except BaseException:
            t.close()
            raise
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, _BOOKS)
        return t, row


def _claim_row(t: _Table, name: str, key: str, limit: int | None, member_limit: int | None, label: str,
               nonce: int) -> int:
    """Books locked: the first free row, its liveness lock taken; a budget with no live
    member is created anew with `limit`."""
    now = time.time()
    fresh = not _check_header(t, t.path)
    if not fresh:
        t.reap()
        fresh = not t.live()
    if fresh:  # a new budget, or one whose members all ended
        t.rows[:] = np.zeros((), ROW)
        t.header["magic"], t.header["version"] = _MAGIC, _VERSION
        t.header["limit"] = -1 if limit is None else limit
        t.header["created"], t.header["name"], t.header["device"] = now, name.encode(), key.encode()
    elif limit is not None and t.limit is None:  # a member that set none leaves it to the first that does
        t.header["limit"] = limit
    elif limit is not None and limit != t.limit:
        logger.warning("vattn: budget %s exists with limit %s; joined with it (limit=%d was not used; change it "
                       "with `vattn budget set-limit %s BYTES`)", name, t.limit, limit, name)
    for i in range(MAX_MEMBERS):
        if int(t.rows["state"][i]) == 1:
            continue
        try:
            fcntl.lockf(t.fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _LIVE + i)
        except OSError:
            continue  # a process is still letting go of it
        t.rows[i] = np.zeros((), ROW)
        for field, value in (("pid", os.getpid()), ("nonce", nonce), ("limit", -1 if member_limit is None else
                             member_limit), ("heartbeat", now), ("joined", now), ("label", label.encode()[:127])):
            t.rows[field][i] = value
        t.rows["state"][i] = 1
        t.mine.add(nonce)
        return i
    raise InvalidConfigError(f"budget {name!r} has {MAX_MEMBERS} members, the most one budget takes")


def _wake_address(pid: int, nonce: int) -> str:
    return f"\0vattn-budget-{pid}-{nonce:x}"  # abstract: no file, gone with the process


_sender: socket.socket | None = None
_sender_lock = threading.Lock()


def _wake(pids_nonces: list[tuple[int, int]]) -> None:
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
                _sender.sendto(b"!", _wake_address(pid, nonce))
            except OSError:  # gone, its queue full, or another network namespace
                pass


@dataclass(frozen=True)
class SharedBudgetStats(BudgetStats):
    """`BudgetStats` of a shared budget as this process sees it: `limit` is what its
    takes are compared against now (the budget's limit, lowered to what the member limit
    leaves while the others hold what they hold), `used` the bytes of all members;
    `budget_limit` and `member_limit` bound what this process could ever have."""

    budget_limit: int | None = None
    member_limit: int | None = None
    member_used: int = 0
    num_members: int = 0


# ------------------------------------------------------------------ member ----
class SharedBudget(Budget):
    """A `Budget` shared by the processes of a machine; get one with `vattn.Budget.shared`.

    ```
    budget = vattn.Budget.shared("gpu0", 40 << 30)     # join (or create with this limit)
    cache = vattn.KVCache(..., budget=budget)           # as with vattn.Budget
    budget.stats()                                      # limit, used by all members
    budget.set_limit(32 << 30)                          # the whole budget's
    budget.set_member_limit(8 << 30)                    # this process's
    ```
    """

    def __init__(self, name: str, key: str, path: Path, table: _Table, row: int, nonce: int,
                 sock: socket.socket | None) -> None:
        """Internal: use `vattn.Budget.shared`."""
        super().__init__(None)
        self.name, self.device_key, self.path = name, key, path
        self._table, self._row, self._nonce, self._sock = table, row, nonce, sock
        self._pid = os.getpid()
        self._closed = False
        self._stop = threading.Event()
        self._last_warning = -1e9
        self._responder = threading.Thread(target=self._respond_loop, name=f"vattn-budget-{name}", daemon=True)

    # ---------------------------------------------------------------- taking ----
    def try_take(self, nbytes: int) -> bool:
        """Take `nbytes` if the budget's limit (all members) and this member's limit allow."""
        n = _check_nbytes(nbytes)
        if not self._usable():
            return False
        with self._table.locked() as t:
            r, i = t.rows, self._row
            mine, ml, lim = int(r["taken"][i]), int(r["limit"][i]), t.limit
            ok = ml < 0 or mine + n <= ml
            if ok and lim is not None and t.used() + n > lim:
                ok = t.reap() > 0 and t.used() + n <= lim  # a dead member's bytes may be back
            if not ok:
                r["refusals"][i] += 1
                return False
            r["taken"][i] = mine + n
            r["peak"][i] = max(int(r["peak"][i]), mine + n)
            return True

    def give(self, nbytes: int) -> None:
        """Give back `nbytes` taken earlier (by this process)."""
        n = _check_nbytes(nbytes)
        if self._closed or self._pid != os.getpid():
            return  # left the budget (exiting), or a forked child's copy: nothing of it is counted
        with self._table.locked() as t:
            mine = int(t.rows["taken"][self._row])
            if n > mine:
                raise InvalidRequestError(f"give({n}) is more than the {mine} bytes this process took from budget "
                                          f"{self.name!r}")
            t.rows["taken"][self._row] = mine - n

    # ----------------------------------------------------------------- limits ----
    @property
    def limit(self) -> int | None:
        """What this process's takes are compared against, in bytes of all members (None:
        no limit): the budget's limit, lowered to what this member's limit leaves."""
        return self.stats().limit

    @property
    def budget_limit(self) -> int | None:
        with self._table.locked() as t:
            return t.limit

    @property
    def member_limit(self) -> int | None:
        with self._table.locked() as t:
            v = int(t.rows["limit"][self._row])
        return None if v < 0 else v

    def set_limit(self, limit: int | None) -> None:
        """Change the whole budget's limit at run time (None: none), for every member.
        Members over it are asked to give back cached bytes now; takes are refused until
        the used bytes are under it."""
        limit = byte_limit(limit)
        self._check_process()
        with self._table.locked() as t:
            wake = _set_limit(t, limit, None)
        _wake(wake)

    def set_member_limit(self, limit: int | None) -> None:
        """Change this process's own limit (None: none); cached bytes over it go back now."""
        limit = byte_limit(limit)
        self._check_process()
        with self._table.locked() as t:
            wake = _set_limit(t, limit, os.getpid())
        _wake(wake)

    @property
    def used(self) -> int:
        """Bytes taken by all members."""
        with self._table.locked() as t:
            return t.used()

    def available(self) -> int | None:
        s = self.stats()
        return None if s.limit is None else max(0, s.limit - s.used)

    def stats(self) -> SharedBudgetStats:
        with self._table.locked() as t:
            r, i = t.rows, self._row
            live = t.live()
            used, mine, ml, lim = t.used(), int(r["taken"][i]), int(r["limit"][i]), t.limit
            parts = sum(int(r["participants"][j]) for j in live if j != i)
        with self._lock:
            parts += len(self._participants)
        eff = lim
        if ml >= 0:  # used + n <= eff  <=>  within the budget's limit and mine + n <= ml
            eff = used - mine + ml if lim is None else min(lim, used - mine + ml)
        return SharedBudgetStats(eff, used, parts, lim, None if ml < 0 else ml, mine, len(live))

    # ------------------------------------------------------------ give-back ----
    def reclaim(self, nbytes: int, requester: int | None = None) -> int:
        """Ask for cached pages until `nbytes` fit: this process's other participants first,
        then the other members (waiting up to `ANSWER_S` for their answers). Returns the
        bytes given back. Call it without holding any lock of your own."""
        n = _check_nbytes(nbytes)
        if not self._usable():
            return 0
        freed = 0
        with self._lock:
            local = [cb for t, (cb, _) in self._participants.items() if t != requester]
        for cb in local:
            short = self._short(n)
            if short <= 0:
                return freed
            try:
                freed += max(0, int(cb(short)))
            except Exception:
                pass
        with self._table.locked() as t:
            r, i = t.rows, self._row
            ml, lim = int(r["limit"][i]), t.limit
            if lim is None or (ml >= 0 and int(r["taken"][i]) + n > ml):
                return freed  # the others' bytes cannot help: no budget limit, or this member's own binds
            short = t.used() + n - lim
            asks = t.ask(short, exclude=i) if short > 0 else []
            wake = [(int(r["pid"][a.row]), a.nonce) for a in asks]
        _wake(wake)
        waiting = [a for a in asks if a.wait]
        deadline, delay = time.monotonic() + ANSWER_S, 0.0005
        while waiting and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(2 * delay, 0.01)
            with self._table.locked() as t:
                if t.used() + n <= lim:
                    break
                waiting = [a for a in waiting if not t.answered(a)]
        with self._table.locked() as t:
            return freed + t.given(asks)

    def _short(self, n: int) -> int:
        """Bytes missing for a take of `n` now (0: it fits)."""
        s = self.stats()
        return 0 if s.limit is None else max(0, s.used + n - s.limit)

    def reclaimable(self, requester: int | None = None) -> int:
        """Bytes the others could give back now that would help this process: its other
        participants' `cached()` and the other members' cached bytes (as they last
        published them), none of those when this member's own limit is what binds."""
        local = super().reclaimable(requester)
        with self._table.locked() as t:
            r, i = t.rows, self._row
            remote = sum(int(r["cached"][j]) for j in t.live() if j != i)
            used, mine, ml, lim = t.used(), int(r["taken"][i]), int(r["limit"][i]), t.limit
        if ml >= 0:  # beyond the member's room, others giving back does not help
            remote = 0 if lim is None else min(remote, max(0, (ml - mine) - (lim - used)))
        return local + remote

    # --------------------------------------------------------------- members ----
    def register(self, reclaim: Any = None, cached: Any = None) -> int:
        self._check_process()
        token = super().register(reclaim, cached)
        self._publish()
        return token

    def unregister(self, token: int) -> None:
        super().unregister(token)
        if not self._closed and self._pid == os.getpid():
            self._publish()

    def _publish(self) -> None:
        """Write this process's participant count and cached bytes into its row."""
        cached = self._local_cached()
        with self._lock:
            parts = len(self._participants)
        with self._table.locked() as t:
            t.rows["participants"][self._row] = parts
            t.rows["cached"][self._row] = cached
            t.rows["heartbeat"][self._row] = time.time()

    def _local_cached(self) -> int:
        return super().reclaimable(None)

    # -------------------------------------------------------------- responder ----
    def _respond_loop(self) -> None:
        """Answer asks, enforce the member limit, publish cached bytes, clear dead members:
        every POLL_S, and at once when woken."""
        while not self._stop.is_set():
            try:
                if self._sock is not None:
                    if select.select([self._sock], [], [], POLL_S)[0]:
                        for _ in range(64):  # the wake-ups so far (bounded: askers may keep sending)
                            self._sock.recv(16)
                else:
                    self._stop.wait(POLL_S)
            except (BlockingIOError, InterruptedError):
                pass
            except (OSError, ValueError):  # the socket was closed (leaving)
                if self._stop.is_set():
                    return
                self._stop.wait(POLL_S)
            if self._stop.is_set():
                return
            try:
                self._respond()
            except Exception:  # never let the responder die: say so (once a minute) and go on
                if time.monotonic() - self._last_warning > 60:
                    self._last_warning = time.monotonic()
                    logger.warning("vattn: budget %s: the responder failed", self.name, exc_info=True)

    def _respond(self) -> None:
        cached = self._local_cached()
        with self._lock:
            parts = len(self._participants)
        with self._table.locked() as t:
            r, i = t.rows, self._row
            r["heartbeat"][i], r["cached"][i], r["participants"][i] = time.time(), cached, parts
            seq, want = int(r["ask_seq"][i]), int(r["ask_bytes"][i])
            r["ask_bytes"][i] = 0
            ml = int(r["limit"][i])
            if ml >= 0:
                want = max(want, int(r["taken"][i]) - ml)
            t.reap()
        freed = 0
        if want > 0:
            with self._lock:
                local = [cb for cb, _ in self._participants.values()]
            for cb in local:
                if freed >= want:
                    break
                try:
                    freed += max(0, int(cb(want - freed)))
                except Exception:
                    pass
        cached = self._local_cached() if freed else cached
        with self._table.locked() as t:
            r, i = t.rows, self._row
            r["cached"][i] = cached
            if freed:
                r["gave"][i] += freed
                r["last_give_time"][i], r["last_give_bytes"][i] = time.time(), freed
            if seq > int(r["done_seq"][i]):
                r["done_seq"][i] = seq
                r["ask_time"][i] = time.time() if int(r["ask_seq"][i]) > seq else 0.0

    # ---------------------------------------------------------------- leaving ----
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Leave the budget (idempotent). Close the caches and pools on it first."""
        if self._closed or self._pid != os.getpid():
            return
        with self._lock:
            if self._participants:
                raise InvalidRequestError(f"{len(self._participants)} caches or pools of this process still use "
                                          f"budget {self.name!r}; close them first")
        self._leave()

    def _leave(self) -> None:
        with _registry_lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            if self._sock is not None:
                self._sock.close()
            t = self._table
            with t.locked():
                t.rows[self._row] = np.zeros((), ROW)
                t.mine.discard(self._nonce)
                fcntl.lockf(t.fd, fcntl.LOCK_UN, 1, _LIVE + self._row)
                t.reap()
                if not t.live():  # the last member: the budget ends with it
                    with contextlib.suppress(OSError):
                        os.unlink(t.path)
            if _members.get(self.path) is self:
                del _members[self.path]
        if self._responder.is_alive() and self._responder is not threading.current_thread():
            self._responder.join(timeout=2 * POLL_S)
        if not self._responder.is_alive():
            t.close()  # else the responder may still read it: the process is ending anyway

    def _usable(self) -> bool:
        self._check_process()
        return not self._closed

    def _check_process(self) -> None:
        if self._pid != os.getpid():
            raise ClosedError(f"budget {self.name!r} was joined by process {self._pid}; this forked child "
                              f"(pid {os.getpid()}) must call vattn.Budget.shared itself")

    def __repr__(self) -> str:
        if self._closed:
            return f"SharedBudget({self.name!r}, {self.device_key}, closed)"
        s = self.stats()
        return (f"SharedBudget({self.name!r}, {self.device_key}, limit={s.budget_limit}, used={s.used}, "
                f"members={s.num_members}, this process={s.member_used})")


def join(name: str, limit: int | None = None, *, device: Any = None, member_limit: int | None = None,
         label: str | None = None) -> SharedBudget:
    """`vattn.Budget.shared`: see there."""
    name = check_name(name)
    limit, member_limit = byte_limit(limit), byte_limit(member_limit)
    if label is not None and not isinstance(label, str):
        raise InvalidConfigError(f"label must be a str or None, got {label!r}")
    key = device_key(device)
    path = table_path(name, key)
    label = label if label is not None else _default_label()
    with _registry_lock:
        m = _members.get(path)
        if m is None or m.closed:
            nonce = secrets.randbits(62) + 1
            sock = _listen(nonce)
            try:
                table, row = _claim(path, name, key, limit, member_limit, label, nonce)
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            m = SharedBudget(name, key, path, table, row, nonce, sock)
            _members[path] = m
            m._responder.start()
            _register_exit()
            return m
    with m._table.locked() as t:  # already a member: the same one, with these settings
        t.rows["label"][m._row] = label.encode()[:127]
        if member_limit is not None:
            t.rows["limit"][m._row] = member_limit
        if limit is not None and t.limit is None:
            t.header["limit"] = limit
        elif limit is not None and limit != t.limit:
            logger.warning("vattn: budget %s exists with limit %s; joined with it (limit=%d was not used)",
                           name, t.limit, limit)
    return m


def _listen(nonce: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(_wake_address(os.getpid(), nonce))
    except OSError:  # no abstract sockets here: the responder polls
        sock.close()
        return None
    sock.setblocking(False)
    return sock


def _default_label() -> str:
    """The command, short: `python -m vattn serve` shows as "vattn serve"."""
    argv = [a for a in sys.argv[:3] if a] or ["python"]
    head = Path(argv[0])
    argv[0] = head.parent.name if head.name == "__main__.py" else head.name
    return " ".join(argv)[:127]


def _set_limit(t: _Table, limit: int | None, pid: int | None) -> list[tuple[int, int]]:
    """Books locked: set the budget's limit (pid None) or one member's, and ask for the
    cached bytes over it. Returns the members to wake."""
    r = t.rows
    if pid is None:
        t.header["limit"] = -1 if limit is None else limit
        over = 0 if limit is None else t.used() - limit
        return [(int(r["pid"][a.row]), a.nonce) for a in (t.ask(over) if over > 0 else [])]
    rows = [i for i in t.live() if int(r["pid"][i]) == pid]
    if not rows:
        pids = ", ".join(str(int(r["pid"][i])) for i in t.live()) or "none"
        raise InvalidRequestError(f"process {pid} is not a member of budget {t.path.name} (members: {pids})")
    for i in rows:
        r["limit"][i] = -1 if limit is None else limit
    return [(pid, int(r["nonce"][i])) for i in rows]  # its responder gives back what is over


_exit_registered = False


def _register_exit() -> None:
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_leave_all)
        os.register_at_fork(after_in_child=_after_fork)


def _leave_all() -> None:
    """At exit: leave every budget (caches still open may give after this: ignored)."""
    global _sender
    for m in list(_members.values()):
        with contextlib.suppress(Exception):
            m._leave()
    with _sender_lock:
        if _sender is not None:
            _sender.close()
            _sender = None


def _after_fork() -> None:
    """In a forked child: no membership (the locks stayed with the parent)."""
    global _registry_lock, _sender, _sender_lock
    _registry_lock, _sender_lock = threading.Lock(), threading.Lock()
    _members.clear()
    _sender = None


# ----------------------------------------------------------------- readers ----
def list_budgets(name: str | None = None) -> list[dict[str, Any]]:
    """Every budget with live members on this machine (or those called `name`), as plain
    data: name, device, limit, used, members (pid, label, mapped = bytes taken, cached,
    used = mapped - cached, limit, refusals, asks, gave, last give-back, heartbeat age).
    Dead members are cleared on the way; a table with none left is removed."""
    out = []
    d = budget_dir()
    paths = sorted(d.glob(f"{PREFIX}{name if name is not None else '*'}@*")) if d.is_dir() else []
    for path in paths:
        with _reading(path) as t:
            if t is None:
                continue
            t.reap()
            if not t.live():
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            out.append(_describe(t))
    return out


def _describe(t: _Table) -> dict[str, Any]:
    now, r = time.time(), t.rows
    members = []
    for i in t.live():
        taken, cached = int(r["taken"][i]), int(r["cached"][i])
        pending = int(r["ask_seq"][i]) > int(r["done_seq"][i])
        last = float(r["last_give_time"][i])
        members.append({
            "pid": int(r["pid"][i]), "label": bytes(r["label"][i]).decode(errors="replace"),
            "mapped": taken, "cached": min(cached, taken), "used": max(0, taken - cached),
            "peak": int(r["peak"][i]), "limit": None if int(r["limit"][i]) < 0 else int(r["limit"][i]),
            "refusals": int(r["refusals"][i]), "asks": int(r["ask_seq"][i]), "gave": int(r["gave"][i]),
            "last_give_back_s": None if last == 0 else round(now - last, 3),
            "last_give_back_bytes": int(r["last_give_bytes"][i]),
            "participants": int(r["participants"][i]), "heartbeat_s": round(now - float(r["heartbeat"][i]), 3),
            "unresponsive": pending and now - float(r["ask_time"][i]) > ANSWER_S,
        })
    return {"name": t.header["name"].item().decode(), "device": t.header["device"].item().decode(),
            "path": str(t.path), "limit": t.limit, "used": t.used(), "members": members}


def set_limit(name: str, limit: int | None, *, pid: int | None = None, device: str | None = None) -> dict[str, Any]:
    """Change budget `name`'s limit (or member `pid`'s) from any process, as `vattn budget
    set-limit` does. `device`: the budget's device key (`list_budgets`) when the name
    exists on several devices. Returns the budget as `list_budgets` shows it."""
    name, limit = check_name(name), byte_limit(limit)
    found = [b for b in list_budgets(name) if device is None or b["device"] == device]
    if not found:
        raise InvalidRequestError(f"no budget {name!r}{'' if device is None else ' on ' + device} has live members "
                                  f"on this machine (tables in {budget_dir()})")
    if len(found) > 1:
        raise InvalidRequestError(f"budget {name!r} exists on several devices ({', '.join(b['device'] for b in found)}); "
                                  "say which with --device")
    path = Path(found[0]["path"])
    with _reading(path) as t:
        if t is None:
            raise InvalidRequestError(f"budget {name!r} ended meanwhile")
        wake = _set_limit(t, limit, pid)
    _wake(wake)
    return next(b for b in list_budgets(name) if b["path"] == str(path))


__all__ = ["SharedBudget", "SharedBudgetStats", "device_key", "join", "list_budgets", "set_limit", "budget_dir"]
