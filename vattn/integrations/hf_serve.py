"""`vattn serve`: `transformers serve` (OpenAI-compatible, continuous batching) on vattn
memory, for a local checkpoint, under a contract no request can break.

transformers builds the app (its routes, tokenization, generation and streaming); vattn
holds it to this contract (the README's "vattn serve" states it):

- **Refused, 400** (an OpenAI error body that says why and what the limit is), alone: an
  empty prompt; a prompt longer than one request can ever hold (`Room`: the cache's
  blocks, or fewer under `--memory-limit`, counted as transformers counts them); a prompt whose
  `max_tokens` would not fit with it (without `max_tokens`, generation stops where the
  room ends: finish_reason "length"); `n` not an int in [1, MAX_N]. A request that fits
  but not now waits in transformers' scheduler.
- **The batching loop restarts** if it dies anyway: the requests it had fail (transformers'
  5xx), a warning says so, and the next request (or `/health`) gets a new loop and cache.
- **`n` choices**: n requests of the batch, merged into one answer (streamed: their chunks
  interleaved, each with its choice index).
- **Every event stream ends with `data: [DONE]`** (transformers' end with their last chunk).
- **SIGTERM (or SIGINT) drains**: new requests get 503 with Retry-After; open ones finish
  within `shutdown_timeout` (30 s); then those still open end (a stream with an error
  event and [DONE], a request not yet answered with 503); the process exits 0. A second
  signal stops at once.
- **`GET /v1/models`** lists the served model (transformers' listing scans the hub cache:
  500 on an offline machine, 5.17-5.23).

Hooks, the same on every supported release (5.17-5.24 share this serving code): transformers'
`Serve` is built with its start held back and with our `GenerationState` (restarts; hands
out our `CBGenerateManager`, which checks each request before it is queued); our routes
replace four of its own; `_Gate` (ASGI) wraps the app, and a uvicorn server whose first
signal drains (`_server_class`) runs it.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import importlib.util
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from vattn.budget import Budget
from vattn.errors import InvalidConfigError
from vattn.integrations import hf_cb

logger = logging.getLogger("vattn.serve")

SERVING_PACKAGES = ("fastapi", "uvicorn", "openai", "pydantic", "typer")
DEFAULT_MAX_BATCH_TOKENS = 8192  # transformers 5.18-5.24's own default (see serve)
SHUTDOWN_TIMEOUT_S = 30.0  # how long SIGTERM lets open requests finish
MAX_N = 128  # choices one request may ask for (OpenAI's bound): each is a request of the batch
CACHE_WAIT_S = 120.0  # how long a new batching loop may take to build its cache before a request goes unchecked
DONE = b"data: [DONE]\n\n"
_PROBE = "vattn-serve-probe"  # a request id no request has: asks transformers' allocators what a request needs


# ------------------------------------------------------------ the contract ----
class Refusal(Exception):
    """A request `vattn serve` answers itself with a 4xx (`status`) and an OpenAI error body."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def _error(message: str, kind: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class _Asked:
    """What the client of the request being handled gave (read where transformers' handler
    calls the generation manager): the `max_tokens` values, and the prompt's field."""

    max_tokens: frozenset = frozenset()
    prompt_param: str = "prompt"


_asked: contextvars.ContextVar[_Asked] = contextvars.ContextVar("vattn_serve_asked", default=_Asked())


@dataclass(frozen=True)
class Room:
    """What one request can ever hold in a continuous-batching cache: `blocks(p, m)`, the
    pool blocks transformers takes for a prompt of p tokens and m new ones (its own count),
    against `capacity`, the blocks one request can ever have, bounded by `bound`."""

    blocks: Callable[[int, int], int]
    capacity: int
    bound: str
    hint: str

    @staticmethod
    def of(cache: Any) -> Room:
        """The room of `cache` (a live transformers `PagedAttentionCache`): its blocks, or
        what its vattn pool's limit can ever back (the trash blocks aside) when fewer."""
        sectors = hasattr(cache, "cache_allocators")
        total = cache.num_sectors if sectors else cache.num_blocks
        blocks = _request_blocks(cache)
        pool = getattr(cache, "vattn_pool", None)
        if pool is not None and (backable := pool.max_blocks() - hf_cb.TRASH_SECTORS) < total:
            bound = "the memory budget" if pool.limit is None else f"the memory limit ({pool.limit} bytes of KV pages)"
            return Room(blocks, backable, bound, " (or raise --memory-limit)")
        return Room(blocks, total, "the KV cache", " (or raise --num-blocks)")

    def fits(self, prompt: int, new: int) -> bool:
        return self.blocks(prompt, new) <= self.capacity

    def max_prompt(self) -> int | None:
        """The longest prompt that fits with one new token (None: any)."""
        return _largest(lambda p: self.fits(p, 1), 1) if self.fits(1, 1) else 0

    def max_new(self, prompt: int) -> int | None:
        """The most new tokens that fit after a prompt that fits (None: any number)."""
        return _largest(lambda m: self.fits(prompt, m), 1)


def _request_blocks(cache: Any) -> Callable[[int, int], int]:
    """(p, m) -> the pool blocks transformers takes for a request of a p-token prompt and m
    new tokens (it stores p + m - 1 of them: the last one is never fed back)."""
    allocators = getattr(cache, "cache_allocators", None)
    if allocators is not None:  # 5.18+: blocks for the tokens stored, whole sectors per attention group
        groups = list(allocators.values())
        return lambda p, m: sum(-(-a.needs_new_blocks(_PROBE, 0, p + m - 1) // a.blocks_per_sector) for a in groups)
    # 5.17: its scheduler takes (p + 1) // block_size + 1 blocks for a prompt of p tokens (in chunks too), then one
    # more each time the stored tokens fill them
    bs = cache.block_size
    return lambda p, m: cache.blocks_needed(max((p + 1) // bs + 1, -(-(p + m - 1) // bs)), 0)


def _largest(ok: Callable[[int], bool], low: int) -> int | None:
    """The largest x >= low with ok(x), for ok true at `low` and false from some x on
    (None: true as far as 2**40)."""
    high = 2 * low
    while ok(high):
        low, high = high, 2 * high
        if high > 1 << 40:
            return None
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if ok(mid) else (low, mid)
    return low


def admit(num_prompt_tokens: int, gen_config: Any, room: Room | None, asked: _Asked) -> None:
    """Refuse (Refusal) a request that can never run, alone and before it is queued: an
    empty prompt, a prompt longer than the room holds, or a prompt with a `max_tokens` the
    client asked for that the room cannot hold with it. Without `max_tokens` (transformers'
    default, 1024 or more), generation stops where the room ends."""
    p = num_prompt_tokens
    if p == 0:
        raise Refusal("the prompt is empty (0 tokens): a request needs at least one prompt token",
                      param=asked.prompt_param, code="empty_prompt")
    if room is None:
        return
    longest = room.max_prompt()
    if longest is not None and p > longest:
        raise Refusal(f"the prompt is {p} tokens, and {room.bound} holds at most {longest} prompt tokens of one "
                      f"request: shorten the prompt{room.hint}", param=asked.prompt_param,
                      code="context_length_exceeded")
    most, want = room.max_new(p), gen_config.max_new_tokens
    if most is None or (want is not None and want <= most):
        return
    if want in asked.max_tokens:
        raise Refusal(f"the prompt is {p} tokens and max_tokens is {want}, and {room.bound} leaves room for at most "
                      f"max_tokens={most} after this prompt: lower max_tokens or shorten the prompt{room.hint}",
                      param="max_tokens", code="context_length_exceeded")
    gen_config.max_new_tokens = most


# --------------------------------------------------- transformers' classes ----
@functools.cache
def _classes() -> Any:
    """Subclasses of transformers' serving classes (built once transformers is importable)."""
    from transformers.cli.serve import Serve
    from transformers.cli.serving import utils

    class Manager(utils.CBGenerateManager):
        """transformers' continuous-batching manager of the server: every request is checked
        (`admit`) before it is queued; a new loop's cache is waited for, so that even the
        first request is checked; `stop` is a hard stop (nothing may keep the process up)."""

        def init_cb(self, model: Any, gen_config: Any) -> None:
            new = self._cb is None
            super().init_cb(model, gen_config)
            deadline = time.monotonic() + CACHE_WAIT_S
            while new and self._cb.batch_processor is None and self._cb.is_running() and time.monotonic() < deadline:
                time.sleep(0.002)  # the loop's thread builds the cache (virtual memory: quick)

        def room(self) -> Room | None:
            cache = getattr(getattr(self._cb, "batch_processor", None), "cache", None)
            return Room.of(cache) if cache is not None else None

        def generate_streaming(self, model: Any, processor: Any, inputs: Any, gen_config: Any, *args: Any,
                               **kwargs: Any) -> Any:
            admit(len(inputs["input_ids"]), gen_config, self.room(), _asked.get())
            return super().generate_streaming(model, processor, inputs, gen_config, *args, **kwargs)

        async def generate_non_streaming(self, model: Any, processor: Any, inputs: Any, gen_config: Any, *args: Any,
                                         **kwargs: Any) -> Any:
            admit(len(inputs["input_ids"]), gen_config, self.room(), _asked.get())
            return await super().generate_non_streaming(model, processor, inputs, gen_config, *args, **kwargs)

        def stop(self) -> None:
            if self._cb is not None:
                self._cb.stop(block=True, timeout=5, hard_stop=True)

    class State(utils.GenerationState):
        """transformers' generation state of the server: hands out `Manager`s, and replaces
        one whose loop died (a warning says so) instead of answering 503 for good."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.num_restarts = 0
            self._vattn_lock = threading.Lock()

        def get_manager(self, model_id: str, use_cb: bool = False) -> Any:
            if use_cb:
                with self._vattn_lock:
                    self._replace_dead()
                    if self._cb_manager is None:  # ours, which transformers' get_manager then hands out
                        self._cb_manager, self._cb_model_id = Manager(cb_config=self._cb_config), model_id
            return super().get_manager(model_id, use_cb=use_cb)

        def is_cb_alive(self) -> bool:
            with self._vattn_lock:
                self._replace_dead()
            return super().is_cb_alive()

        def _replace_dead(self) -> None:
            manager = self._cb_manager
            if manager is None or manager.is_alive():
                return
            self.num_restarts += 1
            logger.warning("vattn serve: the continuous-batching loop died (%s); restarting it: the next request gets "
                           "a new loop and cache (restart %d)", manager._cb.background_thread_status.fatal_error,
                           self.num_restarts)
            try:
                manager.stop()
            except Exception:  # noqa: BLE001 - a dead loop that will not stop cleanly is still replaced
                logger.warning("vattn serve: stopping the dead loop failed", exc_info=True)
            self._cb_manager = None

    class Server(Serve):
        """transformers' `Serve`, whose start is held back until vattn has wrapped its app."""

        vattn_ready = False

        def start_server(self) -> None:
            if self.vattn_ready:
                super().start_server()

    return Server, State, utils


def _build(model: str, shutdown_timeout: float, **kw: Any) -> Any:
    """transformers' `Serve` with our generation state, routes, gate and uvicorn server."""
    import uvicorn

    Server, State, utils = _classes()
    with hf_cb._lock:  # one build at a time: transformers' Serve looks GenerationState up in its module
        saved, utils.GenerationState = utils.GenerationState, State
        try:
            srv = Server(force_model=model, continuous_batching=True, non_blocking=True, **kw)
        finally:
            utils.GenerationState = saved
    app = srv.server.config.app
    _replace_routes(app, srv)
    srv.gate = _Gate(app, shutdown_timeout)
    config = uvicorn.Config(srv.gate, host=kw["host"], port=kw["port"], log_level="info", timeout_graceful_shutdown=5)
    srv.server = _server_class()(config, srv.gate)
    srv.vattn_ready = True
    return srv


# ------------------------------------------------------------------ routes ----
def _replace_routes(app: Any, srv: Any) -> None:
    """Our `/v1/models` (the served model), `/v1/completions` and `/v1/chat/completions`
    (`n`, and what the client asked for, around transformers' handlers) and a handler
    that answers a `Refusal`."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    started = int(time.time())
    force_model = srv._model_manager.force_model

    def list_models() -> Any:
        return JSONResponse({"object": "list", "data": [
            {"id": force_model, "object": "model", "created": started, "owned_by": "vattn"}]})

    def answering(handler: Any, prompt_param: str, limits: tuple[str, ...]) -> Callable:
        async def endpoint(request: Any, body: Any) -> Any:
            n = _choices(body)
            given = (body.get(k) for k in limits)
            token = _asked.set(_Asked(frozenset(v for v in given if isinstance(v, int) and not isinstance(v, bool)),
                                      prompt_param))
            try:
                return await _answer(handler, body, request.state.request_id, n)
            finally:
                _asked.reset(token)

        endpoint.__annotations__ = {"request": Request, "body": dict}  # FastAPI reads them (this module's are strings)
        return endpoint

    ours = {("/v1/models", "GET"), ("/v1/models", "OPTIONS"), ("/v1/completions", "POST"),
            ("/v1/chat/completions", "POST")}
    app.router.routes[:] = [r for r in app.router.routes
                            if not {(getattr(r, "path", None), m) for m in getattr(r, "methods", None) or ()} & ours]
    app.add_api_route("/v1/models", list_models, methods=["GET", "OPTIONS"])
    app.add_api_route("/v1/completions", answering(srv._completion_handler, "prompt", ("max_tokens",)),
                      methods=["POST"])
    app.add_api_route("/v1/chat/completions", answering(srv._chat_handler, "messages",
                                                        ("max_tokens", "max_completion_tokens")), methods=["POST"])

    async def refused(_request: Any, e: Refusal) -> Any:
        return JSONResponse(_error(str(e), "invalid_request_error", e.param, e.code), status_code=e.status)

    app.add_exception_handler(Refusal, refused)


def _choices(body: dict) -> int:
    """The `n` of a request (taken out of the body: transformers ignores it), 1 by default."""
    n = body.pop("n", None)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise Refusal(f"n must be an int in [1, {MAX_N}] (choices of one request), got {n!r}", param="n",
                      code="invalid_value")
    return n


async def _answer(handler: Any, body: dict, request_id: str, n: int) -> Any:
    """transformers' handler, once, or n times as n requests of the batch merged into one
    answer whose choice i is request i's (streamed: their chunks interleaved)."""
    if n == 1:
        return await handler.handle_request(body, request_id)
    answers = await _gather([handler.handle_request(dict(body), f"{request_id}-{i}") for i in range(n)])
    if body.get("stream"):
        from fastapi.responses import StreamingResponse

        return StreamingResponse(_interleave([a.body_iterator for a in answers], request_id),
                                 media_type="text/event-stream")
    from fastapi.responses import JSONResponse

    parts = [json.loads(a.body) for a in answers]
    merged = dict(parts[0], id=request_id, choices=[dict(p["choices"][0], index=i) for i, p in enumerate(parts)])
    if "usage" in merged:
        prompt, new = merged["usage"]["prompt_tokens"], sum(p["usage"]["completion_tokens"] for p in parts)
        merged["usage"] = dict(merged["usage"], completion_tokens=new, total_tokens=prompt + new)
    return JSONResponse(merged)


async def _gather(calls: list[Awaitable]) -> list:
    """All of `calls`; if one raises, the others are cancelled and it is raised."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


async def _interleave(streams: list, request_id: str) -> Any:
    """The events of n event streams as they come, choice i's chunks with index i."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: Any) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while (item := await queue.get())[1] is not None:
                yield _reindexed(item[1], item[0], request_id)
    finally:
        for t in tasks:
            t.cancel()


def _reindexed(chunk: str | bytes, index: int, request_id: str) -> str:
    """An SSE chunk (one or more `data:` events) with its choices' index set and the merged id."""
    text = chunk.decode() if isinstance(chunk, bytes) else chunk
    events = []
    for event in text.split("\n\n"):
        if event.startswith("data: "):
            try:
                data = json.loads(event[6:])
            except json.JSONDecodeError:  # transformers' error event is not always JSON: passed on as it is
                data = None
            if isinstance(data, dict) and isinstance(data.get("choices"), list):
                data["id"] = request_id
                for choice in data["choices"]:
                    choice["index"] = index
                event = "data: " + json.dumps(data, separators=(",", ":"))
        events.append(event)
    return "\n\n".join(events)


# ------------------------------------------------------------ the gate ----
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


# ------------------------------------------------------------------- serve ----
def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, memory_limit: int | None = None,
          page_size: int | None = None, idle_trim_s: float | None = None, device: str = "auto",
          num_blocks: int | None = None, block_size: int | None = None, max_batch_tokens: int | None = None,
          log_level: str = "warning", shutdown_timeout: float = SHUTDOWN_TIMEOUT_S, non_blocking: bool = False,
          budget: Budget | str | None = None, budget_limit: int | None = None) -> Any:
    """`transformers serve` with continuous batching on vattn memory, for a local checkpoint
    (offline), under the contract of the module docstring: the OpenAI-compatible
    `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`. Blocks until the
    server stops (SIGTERM drains for `shutdown_timeout` seconds), unless `non_blocking`:
    then it returns transformers' `Serve` object, with the `ElasticCB` handle as `.vattn`
    and the gate as `.gate` (`kill_server()` stops it). The memory limit is in bytes of KV
    pages; `idle_trim_s` is the idle policy (see `hf_cb.enable`); `num_blocks` and
    `block_size` (tokens) size transformers' (virtual) cache. Requests that fit but not
    now wait in transformers' scheduler. `budget`: a `vattn.Budget`, or the name of a budget
    shared with the other servers of this GPU or host (`vattn.Budget.shared(budget,
    budget_limit)`; `vattn top` shows them)."""
    missing = [m for m in SERVING_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise InvalidConfigError(f"vattn serve runs `transformers serve`, which needs {', '.join(missing)}: "
                                 "pip install 'transformers[serving]'")
    if not os.path.isdir(model) or not os.path.isfile(os.path.join(model, "config.json")):
        raise InvalidConfigError(f"--model must be a local checkpoint directory with a config.json, got {model!r}")
    if isinstance(shutdown_timeout, bool) or not isinstance(shutdown_timeout, (int, float)) \
            or not 0 <= shutdown_timeout < math.inf:
        raise InvalidConfigError(f"shutdown_timeout must be a finite number of seconds >= 0, got {shutdown_timeout!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local checkpoint: never reach the Hub
    if max_batch_tokens is None and num_blocks is not None and hf_cb.design() == "blocks":
        # transformers 5.17, given num_blocks alone, sizes max_batch_tokens (its attention mask and IO
        # buffers, M x (num_blocks * block_size + M)) to fill the device's free memory: 21 GB of a 23 GB
        # host in tests/integrations/test_serve.py, memory vattn's cache is there to leave free. 5.18-5.24 take
        # 8192 when it is not given: so does 5.17 here.
        max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS
    if isinstance(budget, str):  # one budget for the servers of this GPU (or host), named
        budget = Budget.shared(budget, budget_limit, device=None if device == "auto" else device,
                               label=os.path.basename(os.path.abspath(model)))
    handle = hf_cb.enable_all(memory_limit=memory_limit, budget=budget, page_size=page_size, idle_trim_s=idle_trim_s)
    try:
        server = _build(os.path.abspath(model), shutdown_timeout, host=host, port=port, device=device,
                        cb_num_blocks=num_blocks, cb_block_size=block_size, cb_max_batch_tokens=max_batch_tokens,
                        log_level=log_level)
    except BaseException:
        hf_cb.disable_all()
        raise
    server.vattn = handle
    if non_blocking:
        server.start_server()
        return server
    try:
        server.server.run()
    finally:
        server._generation_state.shutdown()  # a hard stop of the batching loop: nothing keeps the process up
        hf_cb.disable_all()
    return server


def main(argv: list[str] | None = None) -> None:
    """`vattn serve --model DIR [--port N] [--memory-limit BYTES] [--shutdown-timeout S] ...`."""
    import argparse

    ap = argparse.ArgumentParser(prog="vattn serve", description=serve.__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local checkpoint directory (config, weights, tokenizer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--memory-limit", type=int, default=None, help="bytes of KV pages (default: no limit)")
    ap.add_argument("--page-size", type=int, default=None, help="vattn page bytes (default: the backend's)")
    ap.add_argument("--idle-trim-s", type=float, default=None,
                    help="give the KV memory back after this many idle seconds (default, or negative: never by itself)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-blocks", type=int, default=None, help="transformers' cache size in blocks (virtual)")
    ap.add_argument("--block-size", type=int, default=None, help="tokens per cache block")
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                    help="seconds SIGTERM lets open requests finish before it ends them (default: 30)")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--budget", default=None, metavar="NAME",
                    help="share KV memory with the other servers of this GPU or host in the budget NAME "
                    "(vattn top shows it)")
    ap.add_argument("--budget-limit", type=int, default=None,
                    help="bytes: the budget's limit when this server creates it (default: none)")
    a = ap.parse_args(argv)
    serve(a.model, host=a.host, port=a.port, memory_limit=a.memory_limit, page_size=a.page_size,
          idle_trim_s=a.idle_trim_s, device=a.device, num_blocks=a.num_blocks, block_size=a.block_size,
          max_batch_tokens=a.max_batch_tokens, log_level=a.log_level, shutdown_timeout=a.shutdown_timeout,
          budget=a.budget, budget_limit=a.budget_limit)


__all__ = ["MAX_N", "SHUTDOWN_TIMEOUT_S", "Refusal", "Room", "admit", "serve", "main"]


if __name__ == "__main__":
    main()
