"""`vattn serve`'s lifecycle: the outermost ASGI layer (`_Gate`: a body larger than
`--max-body-bytes` is refused with 413 before it is read, by its Content-Length; every event
stream ends with [DONE]; SIGTERM drains, then ends what is still open) and the uvicorn server
that drains on its first signal."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
from typing import Any, Awaitable, Callable

from vattn.integrations.hf_serve.contract import _error

logger = logging.getLogger("vattn.serve")

DONE = b"data: [DONE]\n\n"
MAX_BODY_BYTES = 4 << 20  # default --max-body-bytes: about a million tokens of text, past any cache of the tests
DRAIN_BYTES = 64 << 20  # of a body refused with 413, read and dropped so that the client can read the answer
DRAIN_IDLE_S = 2.0  # ... while it comes: a pause this long ends the reading (a length was sent, and no body)


class _Gate:
    """The outermost ASGI layer. A request body of more than `max_body_bytes` gets 413 (by
    its Content-Length, before it is read; a chunked one once that much came). Every event
    stream ends with `data: [DONE]`. Once draining (`deadline` set: SIGTERM), new requests get
    503 with Retry-After; at the deadline (`expire`) the open ones end: 503 if their answer
    had not started, else a final error event and [DONE]."""

    def __init__(self, app: Any, shutdown_timeout: float, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.shutdown_timeout = shutdown_timeout
        self.max_body_bytes = max_body_bytes
        self.on_refused: Callable[[str], None] | None = None  # told the code of each request the gate refuses
        self.open: set[_Exchange] = set()  # requests being answered
        self.deadline: float | None = None  # time.monotonic() by which draining ends; None while serving
        self.expired = False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":  # lifespan: transformers' app starts and stops its model manager
            return await self.app(scope, receive, send)
        if self.deadline is not None:
            retry = max(1, math.ceil(self.deadline - time.monotonic()))
            return await _send_json(send, 503, _error(
                f"vattn serve is shutting down: it finishes the requests it has (at most {retry} s more) and takes no "
                "new ones; retry on another server or once it is back", "server_shutting_down", code=503),
                [(b"retry-after", str(retry).encode())])
        receive = await self._bounded(scope, receive, send)
        if receive is None:
            return
        exchange = _Exchange(send)
        # vattn serve's event streams send their body's parts here directly (`app._EventStream`):
        # starlette's wrappers of `send` between here and the route only watch for the answer's start
        scope["vattn.send"] = exchange.send
        self.open.add(exchange)
        try:
            await exchange.run(self.app(scope, exchange.watching(receive), exchange.send))
        finally:
            self.open.discard(exchange)

    async def _bounded(self, scope: dict, receive: Callable, send: Callable) -> Callable | None:
        """`receive`, or a replay of the whole body read here when it came without a length
        (chunked); None once 413 was sent (the body is larger than `max_body_bytes`)."""
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) <= self.max_body_bytes:
                return receive  # uvicorn reads exactly Content-Length bytes (and refuses a malformed one)
            await self._too_large(receive, send, f"is {int(length)} bytes")
            return None
        if b"chunked" not in headers.get(b"transfer-encoding", b""):
            return receive
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return receive
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                await self._too_large(receive, send, f"is more than {self.max_body_bytes} bytes", more)
                return None
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> dict:
            return replay.pop() if replay else await receive()

        return replayed

    async def _too_large(self, receive: Callable, send: Callable, size: str, more: bool = True) -> None:
        """413 at once, by the length the client gave or the bytes that came: the whole answer
        is sent before any more of the body is read (a client that sends a Content-Length and
        then nothing, or waits for `100 Continue`, has it at once). Then what the client still
        sends of the body is read and dropped (`_drain`) before the connection closes, so that a
        client that sends its whole body before it reads gets this answer, not a reset."""
        if self.on_refused is not None:
            self.on_refused("request_too_large")
        data = json.dumps(_error(
            f"the request body {size}, more than this server takes (--max-body-bytes {self.max_body_bytes}): send a "
            "shorter prompt, or start vattn serve with a larger --max-body-bytes", "invalid_request_error",
            code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
            (b"connection", b"close")]})  # the body left unread ends the connection
        await send({"type": "http.response.body", "body": data, "more_body": more})  # all of it: the client has it
        if more:
            await _drain(receive)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    def drain(self) -> None:
        """Take no new requests; the open ones have `shutdown_timeout` seconds. (Safe in a signal handler.)"""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.shutdown_timeout

    def expire(self) -> None:
        """End every open request now (the grace period is over)."""
        self.expired = True
        for exchange in list(self.open):
            exchange.expire()


class _Exchange:
    """One request through the gate: its answer (a task, so that it can be ended), what of it
    was sent, and whether its client went away before the answer started (`gone`: the answer
    is cancelled, and with it the request in the batch; a streamed answer has started, and
    starlette watches its client from then on)."""

    def __init__(self, send: Callable) -> None:
        self._send = send
        self.task: asyncio.Future | None = None
        self.started = self.streaming = self.done = self.expired = self.gone = False
        self._watch: asyncio.Future | None = None

    def watching(self, receive: Callable) -> Callable:
        """`receive` for the app: once the app has the whole body, the client is watched
        until the answer starts (`_watch_client`)."""
        async def received() -> dict:
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False) \
                    and self._watch is None and not self.started:
                self._watch = asyncio.ensure_future(self._watch_client(receive))
            return message

        return received

    async def _watch_client(self, receive: Callable) -> None:
        """Cancel the answer if the client goes away before it starts (a non-streamed request
        ran on to its end, up to its whole room, for nobody)."""
        while not self.started:
            if (await receive())["type"] == "http.disconnect":
                if not self.started and self.task is not None:
                    self.gone = True
                    self.task.cancel()
                return

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            if self._watch is not None:  # the app watches its client from now on (a stream), or is done
                self._watch.cancel()
            content_type = dict(message.get("headers") or ()).get(b"content-type", b"")
            self.streaming = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.done = True
            if self.streaming:
                message = dict(message, body=message.get("body", b"") + DONE)
        await self._send(message)

    async def run(self, answer: Awaitable) -> None:
        self.task = asyncio.ensure_future(answer)
        try:
            await self.task
        except asyncio.CancelledError:
            if self.gone:  # its client went away: no one to answer (the batch logs the cancel)
                return
            if not self.expired:  # cancelled from outside (uvicorn): not ours to answer
                raise
            await self._end("vattn serve shut down before this request finished (its --shutdown-timeout ran out); "
                            "retry on another server or once it is back")
        except Exception:
            if not self.started or self.done:  # nothing sent yet: uvicorn answers 500
                raise
            logger.exception("vattn serve: an answer failed after it started")
            await self._end("vattn serve failed while answering this request; retry")
        finally:
            if self._watch is not None:
                self._watch.cancel()

    def expire(self) -> None:
        self.expired = True
        if self.task is not None:
            self.task.cancel()

    async def _end(self, message: str) -> None:
        if not self.started:
            await _send_json(self._send, 503, _error(message, "server_shutting_down", code=503))
        elif not self.done:
            self.done = True
            tail = b""
            if self.streaming:
                tail = b"data: " + json.dumps(_error(message, "server_shutting_down", code=503)).encode() + b"\n\n" + DONE
            await self._send({"type": "http.response.body", "body": tail, "more_body": False})


async def _drain(receive: Callable) -> None:
    """Read and drop what the client sends of a refused body: up to DRAIN_BYTES, until it is
    all there, the client goes away, or nothing came for DRAIN_IDLE_S."""
    drained, more = 0, True
    while more and drained < DRAIN_BYTES:
        try:
            message = await asyncio.wait_for(receive(), DRAIN_IDLE_S)
        except asyncio.TimeoutError:
            return
        drained += len(message.get("body", b""))
        more = message["type"] == "http.request" and message.get("more_body", False)


async def _send_json(send: Callable, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": data})


@functools.cache
def _server_class() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server whose first SIGTERM or SIGINT drains through the gate (the
        signal is not raised again at exit: the process exits 0); a second one stops at once."""

        def __init__(self, config: Any, gate: _Gate) -> None:
            super().__init__(config)
            self.gate = gate
            self._logged_drain = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.gate.deadline is None and not self.should_exit:
                self.gate.drain()
            else:
                super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            gate = self.gate
            if gate.deadline is not None and not self.should_exit:
                if not self._logged_drain:  # here, not in the signal handler
                    self._logged_drain = True
                    logger.warning("vattn serve: draining: %d open requests get %.0f s to finish; new ones get 503",
                                   len(gate.open), gate.shutdown_timeout)
                now = time.monotonic()
                if not gate.open:
                    self.should_exit = True
                elif now >= gate.deadline and not gate.expired:
                    logger.warning("vattn serve: --shutdown-timeout ran out: ending %d open requests", len(gate.open))
                    gate.expire()
                elif now >= gate.deadline + 5:  # an end that could not be sent: uvicorn's shutdown cancels it
                    self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer
