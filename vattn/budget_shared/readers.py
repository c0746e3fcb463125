"""Reading and steering shared budgets from any process, member or not: the tables
`vattn top` and `vattn budget` show, and their limits changed at run time."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Iterator

from vattn.budget_shared.member import registry_locked
from vattn.budget_shared.table import (
    ANSWER_S, PREFIX, Table, budget_dir, check_name, open_locked, wake_members)
from vattn.checks import byte_limit
from vattn.errors import InvalidRequestError


@contextlib.contextmanager
def reading(path: Path) -> Iterator[Table | None]:
    """The locked table at `path` (None: no such budget), for readers that may not be
    members: this process's own open table if it is one (closing a second descriptor of the
    file would drop the member's fcntl locks), else a descriptor opened for the call."""
    with registry_locked() as members:
        m = members.get(path)
        if m is not None:
            with m._table.locked() as t:
                yield t
            return
        with open_locked(path) as t:
            yield t


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
        with reading(path) as t:
            if t is None:
                continue
            t.reap()
            if not t.live():
                with contextlib.suppress(OSError):
                    os.unlink(path)
                continue
            out.append(_describe(t))
    return out


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
        devices = ", ".join(b["device"] for b in found)
        raise InvalidRequestError(f"budget {name!r} exists on several devices ({devices}); say which with --device")
    path = Path(found[0]["path"])
    with reading(path) as t:
        if t is None:
            raise InvalidRequestError(f"budget {name!r} ended meanwhile")
        wake = t.set_limit(limit, pid)
    wake_members(wake)
    return next(b for b in list_budgets(name) if b["path"] == str(path))
