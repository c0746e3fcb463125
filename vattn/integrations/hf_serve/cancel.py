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
- **A cancelled request's result handler stays** (`OutputRouter.result_handlers` drops a
  handler only with its request's last output, which a cancelled request never has): each cut
  stream left its handler, its streamer and the queue of text nobody read, for good. Here the
  handler goes one step after its request was dropped (an output already on its way, with
  asynchronous batching, reaches a handler that ignores it; none is left for the shared
  output queue, which nobody reads in a server).

```
cache full -> offload, hold on | running requests cancelled (cut streams) -> blocks freed
  transformers: hold stays on, running=0: no request ever scheduled again (the wedge)
  here:         hold lifted with the cancel (or at the next schedule): waiting ones run
```

A cancelled request is logged once, at INFO (one line naming it; it is no error).

The answer's side (`opened`, `cancel_streams`): the streams one HTTP request opened in the
batch are noted while it is handled, so that an answer that ends before its streams did (a
cut, a cancel before its event stream even started) cancels their requests itself.
"""
from __future__ import annotations

import contextvars
import functools
import logging
from typing import Any

logger = logging.getLogger("vattn.serve")

# The streamers (transformers' CBStreamer) of the batch requests the HTTP request being handled opened
opened: contextvars.ContextVar[list | None] = contextvars.ContextVar("vattn_serve_opened", default=None)


def note_stream(streamer: Any) -> None:
    """Note a streamer opened for the HTTP request being handled (`opened`; none: not noted)."""
    streams = opened.get()
    if streams is not None:
        streams.append(streamer)


def cancel_streams(streams: list) -> None:
    """Cancel the batch requests of `streams` (transformers' `cancel_request`: a request
    already finished or cancelled is left as it is)."""
    for streamer in streams:
        streamer.cancel()


def install(batch_processor: Any) -> None:
    """Make the scheduler of `batch_processor` (transformers' `ContinuousBatchProcessor` of a
    running loop) lift its hold on new requests when a running request is cancelled or none is
    left, drop the result handlers of cancelled requests, and log each one (idempotent)."""
    scheduler = batch_processor.scheduler
    scheduler.vattn_router = getattr(batch_processor, "output_router", None)
    scheduler.vattn_dropped = []  # request ids dropped at the last clear: their handlers go at the next
    if not getattr(type(scheduler), "_vattn_cancels", False):
        scheduler.__class__ = _lifting(type(scheduler))


def _ignore(_output: Any) -> None:
    """The handler of a cancelled request until it goes: an output still on its way is dropped."""


@functools.cache
def _lifting(cls: type) -> type:
    """transformers' scheduler class `cls` whose hold on new requests (`block_new_requests`) ends
    with the running requests it waits for, cancelled or finished, and whose cancelled requests
    leave no result handler behind."""

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
            self._drop_handlers([s.request_id for s in cancelled])
            return cancelled

        def _drop_handlers(self, dropped: list[str]) -> None:
            """Remove the handlers of the requests dropped at the last clear (a step ago: no output
            of theirs is in flight any more) and silence those of `dropped`."""
            router, gone, self.vattn_dropped = self.vattn_router, self.vattn_dropped, dropped
            if router is None or not (gone or dropped):
                return
            with router._lock:
                for request_id in gone:
                    router.result_handlers.pop(request_id, None)
                for request_id in dropped:
                    entry = router.result_handlers.get(request_id)
                    if entry is not None:
                        router.result_handlers[request_id] = (_ignore, entry[1])

        def schedule_batch(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "block_new_requests", False) and not self.active_requests:
                self.block_new_requests = False  # no running request is left to finish and lift it
            return super().schedule_batch(*args, **kwargs)

    Lifting.__name__, Lifting.__qualname__ = cls.__name__, cls.__qualname__
    return Lifting
