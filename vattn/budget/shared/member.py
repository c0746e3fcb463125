"""This process's membership of a shared budget (`SharedBudget`): taking and giving bytes,
the limits, asking the others to give back, the responder thread that answers their asks,
joining and leaving."""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import select
import secrets
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from vattn.budget.base import BudgetBase, BudgetStats
from vattn.budget.shared.directory import Place, check_name, device_key, place, unlink_if_same
from vattn.budget.shared.table import ANSWER_S, POLL_S, Table, claim
from vattn.budget.shared.wake import close_sender, drain, forget_sender, listen, wake_members
from vattn.checks import MAX_BYTES, byte_count, byte_limit
from vattn.errors import ClosedError, DamagedTableError, InvalidConfigError, InvalidRequestError

logger = logging.getLogger("vattn.budget")

ASK_SHARE = 8  # a short member asks the others for at least 1/8 of the budget's limit (of what they cache)
LEAVE_WAIT_S = 2.0  # the longest giving back or leaving waits for a stuck process's lock on the books

_registry_lock = threading.Lock()
_members: dict[Path, SharedBudget] = {}  # this process's members, by table path


@contextlib.contextmanager
def registry_locked() -> Iterator[dict[Path, SharedBudget]]:
    """This process's members by table path, with the registry's lock held: no member joins
    or leaves meanwhile."""
    with _registry_lock:
        yield _members


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
class SharedBudget(BudgetBase):
    """A `Budget` shared by the processes of a machine; get one with `vattn.Budget.shared`.

    ```
    budget = vattn.Budget.shared("gpu0", 40 << 30)     # join (or create with this limit)
    cache = vattn.KVCache(..., budget=budget)           # as with vattn.Budget
    budget.stats()                                      # limit, used by all members
    budget.set_limit(32 << 30)                          # the whole budget's
    budget.set_member_limit(8 << 30)                    # this process's
    ```
    """

    def __init__(self, name: str, key: str, where: Place, path: Path, table: Table, row: int, nonce: int,
                 sock: socket.socket | None) -> None:
        """Internal: use `vattn.Budget.shared`."""
        super().__init__(None)
        self.name, self.device_key, self.path, self.where = name, key, path, where
        self._table, self._row, self._nonce, self._sock = table, row, nonce, sock
        self._pid = os.getpid()
        self._closed = False
        # this process's bytes, kept here too: the row is written from it, so a row another
        # process damaged cannot make `give` (and so closing a cache) fail
        self._taken = 0
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._last_warning = -1e9
        self._responder = threading.Thread(target=self._respond_loop, name=f"vattn-budget-{name}", daemon=True)

    # ---------------------------------------------------------------- taking ----
    def try_take(self, nbytes: int) -> bool:
        """Take `nbytes` if the budget's limit (all members) and this member's limit allow.
        `DamagedTableError` when another process took or cleared this member's row."""
        n = byte_count(nbytes, high=MAX_BYTES)
        if not self._usable():
            return False
        with self._table.locked() as t:
            self._check_row(t)
            r, i = t.rows, self._row
            mine, ml, lim = self._taken, int(r["limit"][i]), t.limit
            ok = mine + n <= MAX_BYTES and (ml < 0 or mine + n <= ml)
            if ok and lim is not None and t.used() + n > lim:
                ok = t.reap() > 0 and t.used() + n <= lim  # a dead member's bytes may be back
            if not ok:
                r["refusals"][i] += 1
                return False
            self._taken = mine + n
            r["taken"][i] = self._taken
            r["peak"][i] = max(int(r["peak"][i]), self._taken)
            return True

    def give(self, nbytes: int) -> None:
        """Give back `nbytes` taken earlier (by this process). A table another process
        damaged does not stop it: what could not be written is logged (and written with
        this member's next take or give)."""
        n = byte_count(nbytes)
        if self._closed or self._pid != os.getpid():
            return  # left the budget (exiting), or a forked child's copy: nothing of it is counted
        given = False
        try:
            with self._table.locked(wait_s=LEAVE_WAIT_S) as t:
                self._give_locally(n)
                given = True
                if t.owns(self._row, self._nonce):
                    t.rows["taken"][self._row] = self._taken
                else:
                    self._warn("row", f"vattn: budget {self.name}: this process's row of {self.path} was cleared or "
                               "taken by another process; what it gives back is not written there")
        except (DamagedTableError, OSError) as e:
            if not given:
                with self._table.tlock:
                    self._give_locally(n)
            self._warn("give", f"vattn: budget {self.name}: could not write a give-back into {self.path} ({e})")

    def _give_locally(self, n: int) -> None:
        """The table's thread lock held: take `n` off this process's own count."""
        if n > self._taken:
            raise InvalidRequestError(f"give({n}) is more than the {self._taken} bytes this process took from "
                                      f"budget {self.name!r}")
        self._taken -= n

    def _check_row(self, t: Table) -> None:
        if not t.owns(self._row, self._nonce):
            raise DamagedTableError(f"budget {self.name!r}: this process's row of {self.path} was cleared or taken by "
                                    "another process; close the caches on the budget and join it again")

    def _warn(self, kind: str, message: str) -> None:
        """Log `message` (the first of each kind only: a damaged table says so once)."""
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("%s", message)

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
        limit = byte_limit(limit, "limit", high=MAX_BYTES)
        self._check_process()
        with self._table.locked() as t:
            wake = t.set_limit(limit, None)
        wake_members(wake)

    def set_member_limit(self, limit: int | None) -> None:
        """Change this process's own limit (None: none); cached bytes over it go back now."""
        limit = byte_limit(limit, "member_limit", high=MAX_BYTES)
        self._check_process()
        with self._table.locked() as t:
            self._check_row(t)
            wake = t.set_limit(limit, os.getpid())
        wake_members(wake)

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
            used, mine, ml, lim = t.used(), self._taken, int(r["limit"][i]), t.limit
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
        n = byte_count(nbytes)
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
            if lim is None or (ml >= 0 and self._taken + n > ml):
                return freed  # the others' bytes cannot help: no budget limit, or this member's own binds
            short = t.used() + n - lim
            if short > 0:
                # A member short once is short again at its next steps (a burst), and every
                # ask is a round trip to the others' responder threads: ask for a share of
                # the budget at once (of what they have cached), and wait only for `short`.
                short = max(short, min(lim // ASK_SHARE, t.cached_by_others(i)))
            asks = t.ask(short, exclude=i) if short > 0 else []
            wake = [(int(r["pid"][a.row]), a.nonce) for a in asks]
        wake_members(wake)
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
            remote = t.cached_by_others(i)
            used, mine, ml, lim = t.used(), self._taken, int(r["limit"][i]), t.limit
        if ml >= 0:  # beyond the member's room, others giving back does not help
            remote = 0 if lim is None else min(remote, max(0, (ml - mine) - (lim - used)))
        return local + remote

    # --------------------------------------------------------------- members ----
    def register(self, reclaim: Any = None, cached: Any = None) -> int:
        self._check_process()
        if self._closed:
            raise ClosedError(f"budget {self.name!r} was left (closed); join it again with vattn.Budget.shared")
        token = super().register(reclaim, cached)
        try:
            self._publish()
        except BaseException:
            super().unregister(token)
            raise
        return token

    def unregister(self, token: int) -> None:
        """Leave as a participant (idempotent); never fails for a damaged table (logged)."""
        super().unregister(token)
        if not self._closed and self._pid == os.getpid():
            try:
                self._publish(wait_s=LEAVE_WAIT_S)
            except (DamagedTableError, OSError) as e:
                self._warn("publish", f"vattn: budget {self.name}: could not write into {self.path} ({e})")

    def _publish(self, wait_s: float | None = None) -> None:
        """Write this process's participant count, cached bytes and tiers into its row."""
        cached, (host, disk) = self._local_cached(), self.tier_bytes()
        with self._lock:
            parts = len(self._participants)
        with self._table.locked(wait_s) as t:
            self._check_row(t)
            r, i = t.rows, self._row
            r["participants"][i], r["cached"][i], r["host"][i], r["disk"][i] = parts, cached, host, disk
            r["heartbeat"][i] = time.time()

    def _local_cached(self) -> int:
        return super().reclaimable(None)

    # -------------------------------------------------------------- responder ----
    def _respond_loop(self) -> None:
        """Answer asks, enforce the member limit, publish cached bytes, clear dead members:
        every POLL_S, and at once when woken."""
        last = time.monotonic()
        while not self._stop.is_set():
            woken = True  # a wake-up of one who may join, or the poll's time
            try:
                if self._sock is not None:
                    if select.select([self._sock], [], [], POLL_S)[0]:
                        woken = drain(self._sock, self.where)  # only those who may join wake it
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
            if not woken and time.monotonic() - last < POLL_S:
                continue  # a stranger's wake-up: the next poll is soon enough
            last = time.monotonic()
            try:
                self._respond()
            except DamagedTableError as e:  # another process changed the table: said once, no traceback
                self._warn("respond", f"vattn: budget {self.name}: the responder cannot answer ({e})")
            except Exception:  # never let the responder die: say so (once a minute) and go on
                if time.monotonic() - self._last_warning > 60:
                    self._last_warning = time.monotonic()
                    logger.warning("vattn: budget %s: the responder failed", self.name, exc_info=True)

    def _respond(self) -> None:
        cached, (host, disk) = self._local_cached(), self.tier_bytes()
        with self._lock:
            parts = len(self._participants)
        with self._table.locked() as t:
            self._check_row(t)
            r, i = t.rows, self._row
            r["heartbeat"][i], r["cached"][i], r["participants"][i] = time.time(), cached, parts
            r["host"][i], r["disk"][i] = host, disk
            seq, want = int(r["ask_seq"][i]), int(r["ask_bytes"][i])
            r["ask_bytes"][i] = 0
            ml = int(r["limit"][i])
            if ml >= 0:
                want = max(want, self._taken - ml)
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
            self._check_row(t)
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
        """Leave the budget (idempotent). Close the caches and pools on it first. Leaving
        works whatever another process did to the table: what could not be done there is
        logged, and the kernel drops this process's locks on it."""
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
                with contextlib.suppress(OSError):
                    self._sock.close()
            t = self._table
            try:
                with t.locked(wait_s=LEAVE_WAIT_S):
                    t.release_row(self._row, self._nonce)
                    t.reap()
                    if not t.live():  # the last member: the budget ends with it
                        unlink_if_same(t.path, t.fd)
            except Exception as e:  # its row is cleared by the others once this process's locks are gone
                logger.warning("vattn: budget %s: could not clear this process's row of %s (%s); it goes when this "
                               "process closes the table", self.name, self.path, e)
            if _members.get(self.path) is self:
                del _members[self.path]
        if self._responder.is_alive() and self._responder is not threading.current_thread():
            self._responder.join(timeout=2 * POLL_S)
        if not self._responder.is_alive():
            try:  # the locks on the file go with the descriptor
                t.close()
            except Exception as e:
                logger.warning("vattn: budget %s: could not close %s (%s)", self.name, self.path, e)

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
        try:
            s = self.stats()
        except Exception as e:  # a damaged table, a forked child
            return f"SharedBudget({self.name!r}, {self.device_key}, unreadable: {e})"
        return (f"SharedBudget({self.name!r}, {self.device_key}, limit={s.budget_limit}, used={s.used}, "
                f"members={s.num_members}, this process={s.member_used})")


def join(name: str, limit: int | None = None, *, device: Any = None, member_limit: int | None = None,
         label: str | None = None) -> SharedBudget:
    """`vattn.Budget.shared`: see there. Every argument is checked before the table is
    touched: a join that fails leaves no file and no row behind."""
    name = check_name(name)
    limit = byte_limit(limit, "limit", high=MAX_BYTES)
    member_limit = byte_limit(member_limit, "member_limit", high=MAX_BYTES)
    if label is not None and not isinstance(label, str):
        raise InvalidConfigError(f"label must be a str or None, got {label!r}")
    key = device_key(device)
    label = _table_label(label if label is not None else _default_label())
    where = place(create=True)
    path = where.path(name, key)
    with _registry_lock:
        m = _members.get(path)
        if m is None or m.closed:
            nonce = secrets.randbits(62) + 1
            sock = listen(nonce)
            try:
                table, row = claim(where, path, name, key, limit, member_limit, label, nonce)
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
            m = SharedBudget(name, key, where, path, table, row, nonce, sock)
            _members[path] = m
            try:
                m._responder.start()
            except BaseException:  # no thread to be had: leave as if it never joined
                del _members[path]
                m._closed = True
                _abandon(table, row, nonce, sock)
                raise
            _register_exit()
            return m
    with m._table.locked() as t:  # already a member: the same one, with these settings
        m._check_row(t)
        t.rows["label"][m._row] = label.encode()[:127]
        if member_limit is not None:
            t.rows["limit"][m._row] = member_limit
        if limit is not None and t.limit is None:
            t.header["limit"] = limit
        elif limit is not None and limit != t.limit:
            logger.warning("vattn: budget %s exists with limit %s; joined with it (limit=%d was not used)",
                           name, t.limit, limit)
    return m


def _abandon(table: Table, row: int, nonce: int, sock: socket.socket | None) -> None:
    """Undo a join that failed after its row was taken: the row, the table if it has no
    other member, the descriptor and the socket."""
    with contextlib.suppress(Exception):
        with table.locked(wait_s=LEAVE_WAIT_S):
            table.release_row(row, nonce)
            if not table.live():
                unlink_if_same(table.path, table.fd)
    with contextlib.suppress(Exception):
        table.close()
    if sock is not None:
        sock.close()


def _table_label(label: str) -> str:
    """`label` as the table holds it (UTF-8): a character UTF-8 cannot hold, such as the lone
    surrogate sys.argv has for a byte that is not UTF-8, shows as its escape ("caf\\udce9")."""
    return label.encode("utf-8", "backslashreplace").decode("utf-8")


def _default_label() -> str:
    """The command, short: `python -m vattn serve` shows as "vattn serve"."""
    argv = [a for a in sys.argv[:3] if a] or ["python"]
    head = Path(argv[0])
    argv[0] = head.parent.name if head.name == "__main__.py" else head.name
    return " ".join(argv)[:127]


_exit_registered = False


def _register_exit() -> None:
    global _exit_registered
    if not _exit_registered:
        _exit_registered = True
        atexit.register(_leave_all)
        os.register_at_fork(after_in_child=_after_fork)


def _leave_all() -> None:
    """At exit: leave every budget (caches still open may give after this: ignored)."""
    for m in list(_members.values()):
        with contextlib.suppress(Exception):
            m._leave()
    close_sender()


def _after_fork() -> None:
    """In a forked child: no membership (the locks stayed with the parent)."""
    global _registry_lock
    _registry_lock = threading.Lock()
    _members.clear()
    forget_sender()
