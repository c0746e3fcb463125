"""`EngineLoop`: one thread steps a `vattn.LLM`; the event loop adds and aborts requests
without ever waiting for it.

```
event loop (asyncio)                     loop thread
  add(ids, params, sink) --inbox-->        drain inbox: llm.add_request / abort_request
  abort(handle)          --inbox-->        llm.step()  (while work exists; else sleep on `wake`)
  sink.put_nowait(...)   <--call_soon_threadsafe-- at most one call pending: the outbox's flush
```
The inbox is a `queue.SimpleQueue` and `wake` a `threading.Event`: the event loop only
puts and sets. Only the loop thread calls the engine (the engine's `TurnLock` would let
another thread in between steps; one caller keeps the order of adds and aborts plain).
Outputs are cumulative (`RequestOutput` carries every token so far), so a sink that reads
late loses nothing. Per step, per request that got a token: one tuple and the metrics' few
observations (`vattn.serve.metrics.ServeMetrics.on_step`); nothing else in Python.

Hand-over (issue 36, the streamed path's cost): a step's outputs go to an outbox; the loop
thread schedules one `call_soon_threadsafe` (a write to the event loop's self-pipe, a wake-up)
only when no flush is pending already. An event loop that fell behind (it shares the GIL with
this thread) takes several steps' outputs in one wake-up, and each stream sends them as one
event (`_Run._next_batch`), instead of a wake-up, a task switch and an HTTP write per request per
step it then has to catch up on. The loop thread never waits for the event loop.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from vattn.engine.sampling_params import SamplingParams
from vattn.engine.sequence import RequestOutput

logger = logging.getLogger("vattn.serve")


@dataclass(eq=False)
class Handle:
    """One engine request of a client request: what the event loop knows of it. Outputs
    (or an exception from add_request) go to `sink` as (tag, RequestOutput | Exception)."""

    tag: int
    sink: asyncio.Queue
    request_id: int | None = None  # the engine's, set by the loop thread
    # the loop thread's bookkeeping for metrics: tokens seen, time of the last token
    num_tokens: int = 0
    last_token_time: float | None = None
    prefill_s: float = 0.0  # how long the step that gave its first token took
    final_only: bool = False  # only its final output goes to `sink` (a non-streamed answer: no wake-up a step)
    posted_tokens: int = 0  # tokens (all its samples) in the last output posted to `sink` (--stream-interval)


class EngineLoop:
    """Drives `llm` from one thread (`start`, `close`). `add` and `abort` are called from the
    event loop `loop` and never block; `call` runs a function on the loop thread between
    steps (figures for /metrics) and returns an awaitable of its result."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop,
                 on_step: Callable[[list[tuple[Handle, RequestOutput]], float, float], None] | None = None,
                 stream_interval: int = 1) -> None:
        self.llm = llm
        self.loop = loop
        # vLLM's --stream-interval: a streamed request's output is posted once it has this many
        # tokens more than the last one posted (its first token and its end: at once); 1: every step
        self.stream_interval = stream_interval
        self.on_step = on_step  # (outputs with their handles, step start, step end): metrics, on the loop thread
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._handles: dict[int, Handle] = {}  # engine request id -> handle (loop thread only)
        # (handle, output | exception) not yet handed to the event loop, and whether a flush of it
        # is scheduled there; `_outbox_lock` keeps the two consistent between the threads
        self._outbox: list[tuple[Handle, Any]] = []
        self._flush_pending = False
        self._outbox_lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="vattn-serve-engine", daemon=True)
        self.num_steps = 0
        self.failure: BaseException | None = None  # what ended the loop thread, if it ended by itself

    # ------------------------------------------------------------ event loop side ----
    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def add(self, tag: int, token_ids: list[int], params: SamplingParams, sink: asyncio.Queue,
            final_only: bool = False) -> Handle:
        """Queue a request for the engine (returns at once). `final_only`: post only its final
        output (or an error), not one a step."""
        handle = Handle(tag, sink, final_only=final_only)
        self._inbox.put(("add", handle, token_ids, params))
        self._wake.set()
        return handle

    def abort(self, handle: Handle) -> None:
        """Stop a request (a client went away): its slot and pages are freed at the next turn."""
        self._inbox.put(("abort", handle))
        self._wake.set()

    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """`fn()` run on the loop thread between steps; an awaitable of its result."""
        future = self.loop.create_future()
        self._inbox.put(("call", fn, future))
        self._wake.set()
        return future

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop thread (requests still running are dropped) and close the engine."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.llm.close()

    # ----------------------------------------------------------- loop thread side ----
    def _run(self) -> None:
        llm = self.llm
        try:
            while not self._stopping:
                self._drain_inbox()
                if not llm.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                start = time.perf_counter()
                try:
                    outputs = llm.step()
                except Exception:  # noqa: BLE001 - a bug of one iteration must not end the server
                    logger.exception("vattn serve: an engine step failed; its requests fail, serving goes on")
                    self._fail_all(RuntimeError("the engine failed while running this request; retry"))
                    continue
                self.num_steps += 1
                if outputs:
                    self._deliver(outputs, start, time.perf_counter())
        except BaseException as e:  # noqa: BLE001 - the loop is gone: every open request must hear it
            self.failure = e
            logger.exception("vattn serve: the engine loop died; /health answers 503 from now on")
            self._fail_all(RuntimeError(f"the engine loop died ({type(e).__name__}: {e}); the server must restart"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            kind = item[0]
            if kind == "add":
                _, handle, ids, params = item
                try:
                    handle.request_id = self.llm.add_request(ids, params)
                except Exception as e:  # noqa: BLE001 - reported to its client (400), the loop goes on
                    self._post([(handle, e)])
                    continue
                self._handles[handle.request_id] = handle
            elif kind == "abort":
                handle = item[1]
                if handle.request_id is not None and handle.request_id in self._handles:
                    self.llm.abort_request(handle.request_id)  # its final output comes with the next step
            else:
                _, fn, future = item
                try:
                    result, error = fn(), None
                except Exception as e:  # noqa: BLE001
                    result, error = None, e
                self.loop.call_soon_threadsafe(_resolve, future, result, error)

    def _deliver(self, outputs: list[RequestOutput], start: float, end: float) -> None:
        pairs = []
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is None:
                continue
            if out.finished:
                del self._handles[out.request_id]
            pairs.append((handle, out))
        if self.on_step is not None:
            try:
                self.on_step(pairs, start, end)
            except Exception:  # noqa: BLE001 - figures must never stop serving
                logger.warning("vattn serve: recording metrics failed", exc_info=True)
        interval = self.stream_interval
        if interval <= 1:
            self._post([p for p in pairs if p[1].finished or not p[0].final_only])
        else:
            self._post([p for p in pairs if p[1].finished or (not p[0].final_only and _due(p[0], p[1], interval))])

    def _post(self, pairs: list[tuple[Handle, Any]]) -> None:
        """Hand outputs to the event loop: into the outbox, and one wake-up unless one is
        pending already (its flush takes these too)."""
        if not pairs:
            return
        with self._outbox_lock:
            self._outbox.extend(pairs)
            if self._flush_pending:
                return
            self._flush_pending = True
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the event loop is closed: the server is going down
            pass

    def _flush(self) -> None:
        """(event loop) Every output posted since the last flush, to its sink, in order."""
        with self._outbox_lock:
            pairs, self._outbox = self._outbox, []
            self._flush_pending = False
        _put_all(pairs)

    def _fail_all(self, error: Exception) -> None:
        handles = list(self._handles.values())
        self._handles.clear()
        try:
            self.llm.abort_request([h.request_id for h in handles if h.request_id is not None])
        except Exception:  # noqa: BLE001
            logger.warning("vattn serve: aborting the failed requests failed", exc_info=True)
        self._post([(h, error) for h in handles])


def _due(handle: Handle, out: RequestOutput, interval: int) -> bool:
    """Whether a streamed request's output is posted this step (`stream_interval` > 1): its
    first tokens, or `interval` tokens more than it last posted (outputs are cumulative: the
    stream sends what it skipped with the next)."""
    num = sum(len(o.token_ids) for o in out.outputs)
    if handle.posted_tokens and num - handle.posted_tokens < interval:
        return False
    handle.posted_tokens = num
    return True


def _put_all(pairs: list[tuple[Handle, Any]]) -> None:
    for handle, item in pairs:
        handle.sink.put_nowait((handle.tag, item))


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
