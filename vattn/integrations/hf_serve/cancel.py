"""A request whose client went away, in transformers' batching loop.

A stream the client cuts (a close, FIN, or a reset, RST) ends its handler's event stream;
transformers' handler then cancels its request (`CBStreamer.cancel` -> `cancel_request`), and
at its next step the loop drops it and frees its blocks (`Scheduler.clear_cancelled_requests`).
What the loop misses (transformers 5.24; `install` adds it to the scheduler of each loop):

- **Its hold on new requests outlives the requests it waits for.** When the cache is full, the
  loop offloads running requests to make room (`offload_requests`: CPU offload or a soft
  reset, the request queued again) and sets `scheduler.block_new_requests`: no waiting request
  is admitted until a running one *finishes* (`update_batch` lifts the hold). A running request
  that is cancelled frees its blocks as well, but lifts nothing. Once every running request was
  cancelled (clients that cut their streams while the cache was full), no request can finish
  any more: the loop idles at 0 CPU with `running=0, waiting=N` for good, and every request
  after waits forever. Here a cancelled running request lifts the hold as a finished one does,
  and a hold with no running request left (nothing could lift it) is lifted before scheduling.

```
cache full -> offload, hold on | running requests cancelled (cut streams) -> blocks freed
  transformers: hold stays on, running=0: no request ever scheduled again (the wedge)
  here:         hold lifted with the cancel (or at the next schedule): waiting ones run
```

- **A cancelled request is logged once, at INFO** (one line naming it; not an error).
"""
from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger("vattn.serve")


def install(scheduler: Any) -> None:
    """Make `scheduler` (the transformers `Scheduler` of a running batching loop) lift its hold
    on new requests when a running request is cancelled or none is left, and log each cancelled
    request (idempotent)."""
    if not getattr(type(scheduler), "_vattn_cancels", False):
        scheduler.__class__ = _lifting(type(scheduler))


@functools.cache
def _lifting(cls: type) -> type:
    """transformers' scheduler class `cls` whose hold on new requests (`block_new_requests`) ends
    with the running requests it waits for, cancelled or finished."""

    class Lifting(cls):  # type: ignore[misc, valid-type]
        _vattn_cancels = True

        def clear_cancelled_requests(self, *args: Any, **kwargs: Any) -> Any:
            running = set(self.active_requests)
            cancelled = super().clear_cancelled_requests(*args, **kwargs)
            for state in cancelled:
                was_running = state.request_id in running
                if was_running:  # its blocks are free now, as a finished request's: the hold has done its job
                    self.block_new_requests = False
                logger.info("vattn serve: request %s cancelled (its client went away) while %s; its blocks are "
                            "free", state.request_id, "running" if was_running else "waiting")
            return cancelled

        def schedule_batch(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "block_new_requests", False) and not self.active_requests:
                self.block_new_requests = False  # no running request is left to finish and lift it
            return super().schedule_batch(*args, **kwargs)

    Lifting.__name__, Lifting.__qualname__ = cls.__name__, cls.__qualname__
    return Lifting
