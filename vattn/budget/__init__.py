"""`Budget`: one physical-memory budget that several caches (several models) draw from.

Bytes are the unit; the participants' protocol (register, try_take, reclaim, give) and the
rules that keep it deadlock-free are in `vattn.budget.base`.

The books live in `vattn.budget.base` (`BudgetBase`), which the members of a budget shared by
processes (`vattn.budget.shared`) build on as well; `Budget` adds `Budget.shared`, and every
budget is a `Budget` (`isinstance(Budget.shared(...), Budget)`), so `vattn.budget.shared` never
imports this module back.

The package, by job: this module (`Budget`, the public class), `base` (`BudgetBase`: the books
of one process and the participants' protocol), `shared/` (one budget shared by the processes
of a GPU or host: `Budget.shared`), `cli` (`vattn top`, `vattn budget set-limit`).
"""
from __future__ import annotations

from typing import Any

from vattn.budget.base import BudgetBase, BudgetStats, Cached, Reclaim


class Budget(BudgetBase):
    """A thread-safe physical-memory budget in bytes, shared by several pools.

    ```
    budget = vattn.Budget(8 << 30)
    a = vattn.ElasticPool(..., budget=budget)   # model A
    b = vattn.ElasticPool(..., budget=budget)   # model B: takes what A gives back
    budget.set_limit(4 << 30)                   # lower at run time: new pages are refused
    ```
    `limit=None` means no limit of its own (the device still has one). Lowering the
    limit below what is taken refuses new takes until enough is given back; it does
    not take memory away by itself (call `reclaim`, or the pools' `trim`).
    """

    @classmethod
    def shared(cls, name: str, limit: int | None = None, *, device: Any = None, member_limit: int | None = None,
               label: str | None = None) -> Budget:
        """Join the budget `name` shared by the processes of this machine, creating it with
        `limit` bytes if it has no member (a budget ends with its last member; an existing
        budget keeps its limit, unless it has none: then `limit` becomes it). One budget
        per GPU (`device`: "cuda[:N]"; keyed by the GPU's UUID) or per host ("cpu"); None:
        the current GPU if there is one, else the host. `member_limit`: bytes this process
        may take at most. `label`: the name `vattn top` shows (default: the command).
        Pass it wherever a `Budget` goes (`KVCache(budget=)`, `ElasticPool`, `LLM`);
        `vattn.budget.shared` explains the mechanism. Calling it again in the same process
        returns the same member. Only processes of the same user join (the tables are in
        /dev/shm/vattn-UID), or of a group in a directory shared on purpose
        (`VATTN_BUDGET_DIR`, mode 2770): docs/budget.md, "Who may join". Byte values are at
        most 2**63 - 1 (`InvalidConfigError` past it); `device` must exist."""
        # imported on use: a process-local budget never loads the table machinery (sockets, /dev/shm)
        from vattn.budget.shared import join

        return join(name, limit, device=device, member_limit=member_limit, label=label)

    @classmethod
    def __subclasshook__(cls, sub: type) -> bool:
        """Every budget is a `Budget`: a shared budget's member (`SharedBudget`) is built on
        `BudgetBase` too, without importing this module (no import circle)."""
        # the MRO, not issubclass: BudgetBase's own check asks its subclasses (this hook) again
        if cls is Budget and BudgetBase in getattr(sub, "__mro__", ()):
            return True
        return NotImplemented


__all__ = ["Budget", "BudgetStats", "Cached", "Reclaim"]
