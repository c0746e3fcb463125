"""`BudgetBase`: the books of one physical-memory budget that several caches (several models)
draw from.

Bytes are the unit. A participant (an `ElasticPool`, later the slot API's allocator)
follows one protocol:

```
token = budget.register(reclaim, cached)   # reclaim(nbytes) -> bytes it gave back (may be 0);
                                           # cached() -> bytes it could give back now
...
if budget.try_take(n):                # before creating n bytes of physical pages
    create pages                      # on failure: budget.give(n)
else:                                 # short: drop your own lock first, then
    budget.reclaim(n, requester=token)   # ask the others to give back cached pages
    retry try_take once               # still short: a scheduling miss, not an error
...
release pages; budget.give(n)         # after the pages are really gone
budget.unregister(token)              # at close, after giving everything back
```
A cache with offload tiers also says what they hold (`register_tiers(fn)`, `fn() -> (host
bytes, disk bytes)`): not the budget's memory, shown beside it (`tier_bytes`, `vattn top`).

Rules that keep it deadlock-free: the budget never holds its lock while it calls a
participant's `reclaim`, and a participant never holds its own lock while it calls
`budget.reclaim` (it may hold it around `try_take`/`give`, which only take the
budget's lock for a few instructions). A `reclaim` callback takes its own lock, gives
back pages no live data is in (waiting for the device first), calls `give`, and
returns how many bytes it gave. It must not raise; it may give back more or less
than asked.

`BudgetBase` holds those books for one process; `vattn.Budget` (`vattn.budget`) is the public
class, and the members of a budget shared by processes (`vattn.budget.shared`) build on it too.
"""
from __future__ import annotations

import itertools
import threading
from abc import ABCMeta
from dataclasses import dataclass
from typing import Callable

from vattn.checks import byte_count, byte_limit
from vattn.errors import InvalidConfigError, InvalidRequestError

Reclaim = Callable[[int], int]
Cached = Callable[[], int]
Tiers = Callable[[], "tuple[int, int]"]


@dataclass(frozen=True)
class BudgetStats:
    """Bytes taken from the budget and its limit (None: no limit)."""

    limit: int | None
    used: int
    num_participants: int

    @property
    def available(self) -> int | None:
        return None if self.limit is None else max(0, self.limit - self.used)


class BudgetBase(metaclass=ABCMeta):  # ABCMeta: `vattn.Budget` counts every budget as one (its __subclasshook__)
    """The books of a thread-safe physical-memory budget in bytes (limit, bytes taken, participants).
    Use `vattn.Budget`; `vattn.budget.shared.SharedBudget` builds on it too."""

    def __init__(self, limit: int | None = None) -> None:
        self._lock = threading.Lock()
        self._limit = byte_limit(limit)
        self._used = 0
        self._participants: dict[int, tuple[Reclaim, Cached]] = {}
        self._tiers: dict[int, Tiers] = {}  # what the participants' offload tiers hold (register_tiers)
        self._ids = itertools.count(1)

    # ------------------------------------------------------------------ taking ----
    def try_take(self, nbytes: int) -> bool:
        """Take `nbytes` if the limit allows; True when taken, False (nothing taken) otherwise."""
        n = byte_count(nbytes)
        with self._lock:
            if self._limit is not None and self._used + n > self._limit:
                return False
            self._used += n
            return True

    def give(self, nbytes: int) -> None:
        """Give back `nbytes` taken earlier."""
        n = byte_count(nbytes)
        with self._lock:
            if n > self._used:
                raise InvalidRequestError(f"give({n}) is more than the {self._used} bytes taken from this budget")
            self._used -= n

    # ------------------------------------------------------------------ limit ----
    @property
    def limit(self) -> int | None:
        return self._limit

    def set_limit(self, limit: int | None) -> None:
        """Change the limit at run time (None: no limit). Takes above it are refused from now on."""
        limit = byte_limit(limit)
        with self._lock:
            self._limit = limit

    @property
    def used(self) -> int:
        return self._used

    def available(self) -> int | None:
        """Bytes that may still be taken now (None: no limit)."""
        with self._lock:
            return None if self._limit is None else max(0, self._limit - self._used)

    def stats(self) -> BudgetStats:
        with self._lock:
            return BudgetStats(self._limit, self._used, len(self._participants))

    # ------------------------------------------------------------ participants ----
    def register(self, reclaim: Reclaim | None = None, cached: Cached | None = None) -> int:
        """Join the budget; `reclaim(nbytes) -> bytes given back` lets others ask for cached
        pages when they are short, and `cached() -> bytes` says how much `reclaim` could give
        now (it is called without locks: an estimate is fine). Returns the participant's token."""
        for name, cb in (("reclaim", reclaim), ("cached", cached)):
            if cb is not None and not callable(cb):
                raise InvalidConfigError(f"{name} must be callable or None, got {cb!r}")
        with self._lock:
            token = next(self._ids)
            self._participants[token] = (reclaim or _nothing, cached or _none_cached)
            return token

    def register_tiers(self, tiers: Tiers) -> int:
        """Say what an offload tier holds: `tiers() -> (host bytes, disk bytes)` (called
        without locks, from any thread: an estimate is fine). Not memory of this budget;
        `tier_bytes` and `vattn top` show it beside it. Returns a token for `unregister`."""
        if not callable(tiers):
            raise InvalidConfigError(f"tiers must be callable, got {tiers!r}")
        with self._lock:
            token = next(self._ids)
            self._tiers[token] = tiers
            return token

    def tier_bytes(self) -> tuple[int, int]:
        """(host bytes, disk bytes) the registered offload tiers hold now."""
        with self._lock:
            fns = list(self._tiers.values())
        host = disk = 0
        for fn in fns:
            try:
                h, d = fn()
                host, disk = host + max(0, int(h)), disk + max(0, int(d))
            except Exception:  # a tier that cannot say (closing) holds nothing to show
                pass
        return host, disk

    def unregister(self, token: int) -> None:
        """Leave the budget (idempotent). Give back what you took first."""
        with self._lock:
            self._participants.pop(token, None)
            self._tiers.pop(token, None)

    def reclaim(self, nbytes: int, requester: int | None = None) -> int:
        """Ask the other participants to give back cached pages until `nbytes` are free
        under the limit (or everyone was asked). Returns the bytes they gave back. Call it
        without holding any lock of your own."""
        n = byte_count(nbytes)
        with self._lock:
            others = [cb for t, (cb, _) in self._participants.items() if t != requester]
        freed = 0
        for cb in others:  # no budget lock held: the callbacks take their own locks and call give()
            with self._lock:
                room = None if self._limit is None else self._limit - self._used  # negative over the limit
            if room is not None and room >= n:
                break
            want = n if room is None else n - room
            try:
                freed += max(0, int(cb(want)))
            except Exception:  # a participant that cannot give back just does not
                pass
        return freed

    def reclaimable(self, requester: int | None = None) -> int:
        """Bytes the other participants say they could give back now (their `cached()`)."""
        with self._lock:
            others = [cached for t, (_, cached) in self._participants.items() if t != requester]
        total = 0
        for cached in others:
            try:
                total += max(0, int(cached()))
            except Exception:
                pass
        return total

    def __repr__(self) -> str:
        s = self.stats()
        return f"Budget(limit={s.limit}, used={s.used}, participants={s.num_participants})"


def _nothing(nbytes: int) -> int:
    return 0


def _none_cached() -> int:
    return 0


__all__ = ["BudgetBase", "BudgetStats", "Cached", "Reclaim", "Tiers"]
