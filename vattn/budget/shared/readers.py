"""Reading and steering shared budgets from any process, member or not: the tables
`vattn top` and `vattn budget` show, and their limits changed at run time.

Readers trust no file: what is in the directory of tables under a table's name but is not
one this user may join (a directory, a FIFO, a link, garbage, another user's table) is
skipped and named (`Skipped`), never opened blindly, and never stops the others being
listed."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from vattn.budget.shared.member import registry_locked
from vattn.budget.shared.directory import PREFIX, Place, budget_dir, check_name, place, unlink_if_same
from vattn.budget.shared.table import ANSWER_S, Table, open_locked
from vattn.budget.shared.wake import wake_members
from vattn.checks import MAX_BYTES, byte_limit
from vattn.errors import InvalidRequestError, UnsafeTableError, VattnError


class Skipped(NamedTuple):
    """A file named like a table that was not read, and why (one line of `vattn top`)."""

    path: str
    why: str

    def line(self) -> str:
        return f"skipped: {self.path}, {self.why}"


class Survey(NamedTuple):
    """The budgets of this machine a reader could read (as `list_budgets` gives them), and
    the files it skipped."""

    budgets: list[dict[str, Any]]
    skipped: list[Skipped]


@contextlib.contextmanager
def reading(path: Path, where: Place | None = None) -> Iterator[Table | None]:
    """The locked table at `path` (None: no such budget), for readers that may not be
    members: this process's own open table if it is one (closing a second descriptor of the
    file would drop the member's fcntl locks), else a descriptor opened for the call, once
    the file passed the checks of a table of `where` (default: the checked `budget_dir`).
    Raises `UnsafeTableError` / `InvalidConfigError` for a file that is not a table."""
    with registry_locked() as members:
        m = members.get(path)
        if m is not None:
            with m._table.locked() as t:
                yield t
            return
        where = where if where is not None else place(create=False)
        if where is None:  # no directory of tables yet: no budget
            yield None
            return
        with open_locked(path, where) as t:
            yield t


# ----------------------------------------------------------------- readers ----
def survey(name: str | None = None) -> Survey:
    """Every budget with live members in this user's directory of tables (or those called
    `name`), as `list_budgets` gives them, and what was skipped: never raises for a file
    it finds there, nor for a directory it cannot use (skipped too)."""
    d = budget_dir()
    try:
        where = place(create=False)
    except VattnError as e:
        return Survey([], [Skipped(str(d), str(e))])
    if where is None:
        return Survey([], [])
    try:
        names = sorted(e.name for e in os.scandir(where.dir))
    except OSError as e:
        return Survey([], [Skipped(str(where.dir), f"cannot list it ({e.strerror})")])
    prefix = PREFIX if name is None else f"{PREFIX}{name}@"
    out, skipped = [], []
    for entry in names:
        if not entry.startswith(prefix) or "@" not in entry[len(PREFIX):]:
            continue
        path = where.dir / entry
        try:
            with reading(path, where) as t:
                if t is None:
                    continue
                t.reap()
                if not t.live():
                    unlink_if_same(path, t.fd)
                    continue
                out.append(_describe(t))
        except UnsafeTableError as e:
            skipped.append(Skipped(str(path), e.why))
        except (VattnError, OSError, ValueError, UnicodeError) as e:
            skipped.append(Skipped(str(path), _short(e, path)))
    return Survey(out, skipped)


def list_budgets(name: str | None = None) -> list[dict[str, Any]]:
    """Every budget with live members on this machine (or those called `name`), as plain
    data: name, device, limit, used, members (pid, label, mapped = bytes taken, cached,
    used = mapped - cached, host and disk = what its offload tiers hold, limit, refusals, asks, gave, last give-back, heartbeat age).
    Dead members are cleared on the way; a table with none left is removed. Files that
    are not tables are left out (`survey` names them)."""
    return survey(name).budgets


def _short(e: BaseException, path: Path) -> str:
    """An error as the why of a skipped file: without the path, which the line names."""
    text = str(e) if not isinstance(e, OSError) or not e.strerror else e.strerror
    return text.replace(f"{path} ", "", 1).replace(str(path), "it") or type(e).__name__


def _describe(t: Table) -> dict[str, Any]:
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
            "host": int(r["host"][i]), "disk": int(r["disk"][i]),
            "participants": int(r["participants"][i]), "heartbeat_s": round(now - float(r["heartbeat"][i]), 3),
            "unresponsive": pending and now - float(r["ask_time"][i]) > ANSWER_S,
        })
    return {"name": t.header["name"].item().decode(errors="replace"),
            "device": t.header["device"].item().decode(errors="replace"),
            "path": str(t.path), "limit": t.limit, "used": t.used(), "members": members}


def set_limit(name: str, limit: int | None, *, pid: int | None = None, device: str | None = None) -> dict[str, Any]:
    """Change budget `name`'s limit (or member `pid`'s) from any process, as `vattn budget
    set-limit` does. `device`: the budget's device key (`list_budgets`) when the name
    exists on several devices. Returns the budget as `list_budgets` shows it."""
    name, limit = check_name(name), byte_limit(limit, "limit", high=MAX_BYTES)
    seen = survey(name)
    found = [b for b in seen.budgets if device is None or b["device"] == device]
    if not found:
        why = "".join(f"; {s.line()}" for s in seen.skipped)
        raise InvalidRequestError(f"no budget {name!r}{'' if device is None else ' on ' + device} has live members "
                                  f"on this machine (tables in {budget_dir()}){why}")
    if len(found) > 1:
        devices = ", ".join(b["device"] for b in found)
        raise InvalidRequestError(f"budget {name!r} exists on several devices ({devices}); say which with --device")
    path = Path(found[0]["path"])
    with reading(path) as t:
        if t is None:
            raise InvalidRequestError(f"budget {name!r} ended meanwhile")
        wake = t.set_limit(limit, pid)
    wake_members(wake)
    return next(b for b in list_budgets(name) if b["path"] == str(path))
