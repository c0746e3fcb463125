"""`vattn serve`'s lifecycle: the outermost ASGI layer (`_Gate`: every event stream ends with
[DONE]; SIGTERM drains, then ends what is still open) and the uvicorn server that drains on
its first signal."""
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


class _Gate:
    """The outermost ASGI layer. Every event stream ends with `data: [DONE]`. Once draining
    (`deadline` set: SIGTERM), new requests get 503 with Retry-After; at the deadline
    (`expire`) the open ones end: 503 if their answer had not started, else a final error
    event and [DONE]."""

    def __init__(self, app: Any, shutdown_timeout: float) -> None:
        self.app = app
        self.shutdown_timeout = shutdown_timeout
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
        exchange = _Exchange(send)
        self.open.add(exchange)
        try:
            await exchange.run(self.app(scope, receive, exchange.send))
        finally:
            self.open.discard(exchange)

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
    """One request through the gate: its answer (a task, so that it can be ended) and what
    of it was sent."""

    def __init__(self, send: Callable) -> None:
        self._send = send
        self.task: asyncio.Future | None = None
        self.started = self.streaming = self.done = self.expired = False

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started = True
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
            if not self.expired:  # cancelled from outside (uvicorn): not ours to answer
                raise
            await self._end("vattn serve shut down before this request finished (its --shutdown-timeout ran out); "
                            "retry on another server or once it is back")
        except Exception:
            if not self.started or self.done:  # nothing sent yet: uvicorn answers 500
                raise
            logger.exception("vattn serve: an answer failed after it started")
            await self._end("vattn serve failed while answering this request; retry")

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
