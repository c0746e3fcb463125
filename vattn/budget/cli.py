"""`vattn top` and `vattn budget set-limit`: the shared budgets of this machine, live, and
their limits changed at run time (see `vattn.budget.shared`)."""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from fractions import Fraction
from typing import Any, Sequence

from vattn.budget.shared import Skipped, budget_dir, set_limit, survey
from vattn.checks import MAX_BYTES

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int | None:
    """`12345`, `64M`, `64MiB`, `1.5G` (binary units, exact: no float rounding) or `none`
    (no limit); at most `MAX_BYTES` (what a budget's table holds)."""
    t = text.strip().lower()
    if t in ("none", "off", "unlimited"):
        return None
    m = re.fullmatch(r"(\d{1,30}(?:\.\d{1,30})?)\s*([kmgt]?)(?:i?b)?", t)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected bytes (e.g. 1073741824, 512M, 1.5GiB) or 'none', got {text!r}")
    n = int(Fraction(m.group(1)) * _UNITS[m.group(2)])
    if n > MAX_BYTES:
        raise argparse.ArgumentTypeError(f"{text!r} is {n} bytes; a budget's limit is at most {MAX_BYTES} bytes "
                                         f"({human(MAX_BYTES)}), or 'none'")
    return n


def human(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20),
                       ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_budgets(budgets: list[dict[str, Any]], skipped: Sequence[Skipped] = ()) -> str:
    """The text `vattn top` prints: one block per budget, one line per member, then one
    line per file skipped ("skipped: PATH, why")."""
    lines = [s.line() for s in skipped]
    if not budgets:
        return "\n".join([f"no shared budgets with live members on this machine (tables in {budget_dir()})", *lines])
    blocks = []
    for b in budgets:
        share = "" if not b["limit"] else f" ({100 * b['used'] / b['limit']:.0f} %)"
        head = (f"budget {b['name']} on {b['device']}: limit {human(b['limit'])}, used {human(b['used'])}{share}, "
                f"{len(b['members'])} member{'s' * (len(b['members']) != 1)}")
        rows = [("PID", "NAME", "MAPPED", "USED", "CACHED", "HOST", "DISK", "LIMIT", "REFUSALS", "LAST GIVE-BACK",
                 "STATE")]
        for m in b["members"]:
            last = "-" if m["last_give_back_s"] is None else \
                f"{m['last_give_back_s']:.1f} s ago, {human(m['last_give_back_bytes'])}"
            state = "unresponsive" if m["unresponsive"] else \
                (f"silent {m['heartbeat_s']:.0f} s" if m["heartbeat_s"] > 5 else "ok")
            rows.append((str(m["pid"]), m["label"][:24], human(m["mapped"]), human(m["used"]), human(m["cached"]),
                         human(m["host"]), human(m["disk"]), human(m["limit"]), str(m["refusals"]), last, state))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        table = ["  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        blocks.append("\n".join([head, *table]))
    return "\n\n".join(blocks) + "".join(f"\n{line}" for line in lines)


def top_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="vattn top", description="The members of each shared memory budget on this "
                                "machine, live: process, name, bytes mapped (taken from the budget), used, cached "
                                "(what it would give back), what its offload tiers hold in host memory and on disk "
                                "(not the budget's), its limit, refused takes, its last give-back.")
    p.add_argument("--name", default=None, help="only the budget of this name")
    p.add_argument("--json", action="store_true", help='print once as JSON and exit: {"budgets": [...], '
                   '"skipped": [{"path": ..., "why": ...}]} (files named like tables that are not ones this user '
                   'may read)')
    p.add_argument("--once", action="store_true", help="print once and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default: 1)")
    a = p.parse_args(argv)
    if a.json:
        seen = survey(a.name)
        print(json.dumps({"budgets": seen.budgets, "skipped": [s._asdict() for s in seen.skipped]}, indent=2))
        return 0
    if a.once:
        print(format_budgets(*survey(a.name)))
        return 0
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            text = format_budgets(*survey(a.name))
            print(f"{clear}{time.strftime('%H:%M:%S')}  vattn top (every {a.interval:g} s, Ctrl-C quits)\n{text}\n",
                  flush=True)
            time.sleep(max(0.05, a.interval))
    except KeyboardInterrupt:
        return 0


def budget_main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="vattn budget", description="Shared memory budgets (vattn.Budget.shared).")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("set-limit", help="change a budget's limit, or one member's, at run time",
                       description="Change the limit of budget NAME (all members together), or with --pid the "
                       "limit of one member process. Members over it give back their cached bytes now; bytes "
                       "under live data go back as requests finish, and new takes are refused meanwhile.")
    s.add_argument("name")
    s.add_argument("bytes", type=parse_bytes, help="e.g. 8589934592, 8G, 512MiB, or none")
    s.add_argument("--pid", type=int, default=None, help="the member process whose own limit this is")
    s.add_argument("--device", default=None, help="the budget's device (host, cuda-<UUID>) when NAME is on several")
    a = p.parse_args(argv)
    b = set_limit(a.name, a.bytes, pid=a.pid, device=a.device)
    who = f"member {a.pid} of budget {a.name}" if a.pid is not None else f"budget {a.name}"
    print(f"{who} on {b['device']}: limit {human(a.bytes)}")
    print(format_budgets([b]))
    return 0


__all__ = ["budget_main", "format_budgets", "human", "parse_bytes", "top_main"]
