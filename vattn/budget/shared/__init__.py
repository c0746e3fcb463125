"""One physical-memory budget shared by the processes of a machine (`SharedBudget`).

`vattn.Budget.shared(name, limit)` joins the budget `name` of one device (a GPU, keyed by
its UUID, or the host) and returns a `Budget` that several processes draw from: `vattn
serve` servers, vLLM's and SGLang's schedulers, engines and caches of your own. It follows
the in-process `Budget`'s participant protocol (`vattn.budget`), so caches and pools use
it unchanged.

```
 /dev/shm/vattn-UID/vattn-budget-NAME@DEVICE   (36 KiB, memory-mapped by every member)
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
  (containers: mount the same one).
- **Who may join.** The processes of one user: the tables are in the user's own directory
  (`/dev/shm/vattn-UID`, 0700), created `O_EXCL | O_NOFOLLOW` with mode 0600, and every open
  checks the file through its descriptor (a regular file, the caller's, that mode) before it
  grows or writes anything. Users share a budget only in a directory an operator made for a
  group on purpose (`VATTN_BUDGET_DIR`, mode 2770: tables 0660 of that group). Readers skip
  (and name) what is not a table. docs/budget.md has the threat model.

The bytes are what the members *took*: a cache takes before it creates pages and gives
after they are released, so the physical memory of all members together never exceeds
the limit (the vLLM integration is the exception: its scheduler counts, and its workers
unmap what it gave back with their next step or idle call, within about `POLL_S`).

The package, by job: `directory` (where the tables live, who may join, the checks a file passes
before it is opened, a device's key), `table` (the file in /dev/shm: layout, locks, rows,
the books), `wake` (the wake-up sockets), `member` (this process's `SharedBudget`: its lease
on the budget and its responder thread), `readers` (`list_budgets` and `set_limit` for
`vattn top` / `vattn budget`, from any process).
"""
from __future__ import annotations

from vattn.budget.shared.member import SharedBudget, SharedBudgetStats, join
from vattn.budget.shared.directory import (  # noqa: F401 - PREFIX, check_name: re-exported
    DIR_ENV, PREFIX, Place, budget_dir, check_name, device_key, place, table_path)
from vattn.budget.shared.readers import Skipped, Survey, list_budgets, reading, set_limit, survey
from vattn.budget.shared.table import ANSWER_S, MAX_MEMBERS, POLL_S  # noqa: F401 - MAX_MEMBERS: re-exported
from vattn.errors import DamagedTableError, UnsafeTableError

_reading = reading  # the name the tests have used

__all__ = ["ANSWER_S", "DIR_ENV", "POLL_S", "DamagedTableError", "Place", "SharedBudget", "SharedBudgetStats",
           "Skipped", "Survey", "UnsafeTableError", "budget_dir", "device_key", "join", "list_budgets", "place",
           "reading", "set_limit", "survey", "table_path"]
