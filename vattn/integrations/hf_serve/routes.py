"""`vattn serve`'s routes over transformers' app: the served model's `/v1/models`, `/metrics`,
and the completion routes (the body read strictly, `n` choices: n requests of the batch
merged into one answer, the request's own limits and extensions, a long prompt tokenized off
the event loop) around transformers' handlers."""
from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid
from typing import Any, Awaitable, Callable

from vattn.integrations.hf_serve import cancel, offload
from vattn.integrations.hf_serve.contract import Refusal, _asked, _error, parse_json, read_body


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

    def answering(handler: Any, chat: bool) -> Callable:
        async def endpoint(request: Any) -> Any:
            body = parse_json(await request.body())
            n, asked = read_body(body, chat)
            request_id = _batch_id(request)
            streams: list = []
            token, noting = _asked.set(asked), cancel.opened.set(streams)
            try:
                return _closing(await offload.tokenizing_off_loop(lambda: _answer(handler, body, request_id, n)),
                                streams)
            except BaseException:  # its streams' answer will never run (a cancel, an error): their requests go
                cancel.cancel_streams(streams)
                raise
            finally:
                cancel.opened.reset(noting)
                _asked.reset(token)

        endpoint.__annotations__ = {"request": Request}  # FastAPI reads them (this module's are strings)
        return endpoint

    ours = {("/v1/models", "GET"), ("/v1/models", "OPTIONS"), ("/v1/completions", "POST"),
            ("/v1/chat/completions", "POST")}
    app.router.routes[:] = [r for r in app.router.routes
                            if not {(getattr(r, "path", None), m) for m in getattr(r, "methods", None) or ()} & ours]
    app.add_api_route("/v1/models", list_models, methods=["GET", "OPTIONS"])
    app.add_api_route("/v1/completions", answering(srv._completion_handler, chat=False), methods=["POST"])
    app.add_api_route("/v1/chat/completions", answering(srv._chat_handler, chat=True), methods=["POST"])
    app.add_api_route("/metrics", srv.metrics.endpoint, methods=["GET"])

    async def refused(_request: Any, e: Refusal) -> Any:
        srv.metrics.refused(e.code)
        return JSONResponse(_error(str(e), "invalid_request_error", e.param, e.code), status_code=e.status)

    app.add_exception_handler(Refusal, refused)


def _batch_id(request: Any) -> str:
    """The id of a request in transformers' batch (and of its answer): the one transformers'
    middleware gave it, which is the client's `X-Request-ID` when it sent one (the response
    header echoes that), then made unique with a suffix. The batch keys everything by this id:
    two requests in flight with one id (a client's retry, or two clients) killed the batching
    loop (an embedding index out of range), and a retry right after a cut was dropped with the
    cancelled request it shared its id with."""
    request_id = request.state.request_id
    if request.headers.get("x-request-id") is not None:
        request_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
    return request_id


async def _answer(handler: Any, body: dict, request_id: str, n: int) -> Any:
    """transformers' handler, once, or n times as n requests of the batch merged into one
    answer whose choice i is request i's (streamed: their chunks interleaved)."""
    from fastapi.responses import StreamingResponse

    if n == 1:
        return await handler.handle_request(body, request_id)
    answers = await _gather([handler.handle_request(dict(body), f"{request_id}-{i}") for i in range(n)])
    if body.get("stream"):
        return StreamingResponse(_interleave([a.body_iterator for a in answers], request_id),
                                 media_type="text/event-stream")
    from fastapi.responses import JSONResponse

    parts = [json.loads(a.body) for a in answers]
    merged = dict(parts[0], id=request_id, choices=[dict(p["choices"][0], index=i) for i, p in enumerate(parts)])
    if "usage" in merged:
        prompt, new = merged["usage"]["prompt_tokens"], sum(p["usage"]["completion_tokens"] for p in parts)
        merged["usage"] = dict(merged["usage"], completion_tokens=new, total_tokens=prompt + new)
    return JSONResponse(merged)


def _closing(response: Any, streams: list) -> Any:
    """`response`; a streamed one (starlette's `StreamingResponse`) that, when it ends before
    its event stream did, however it ends, closes the stream (`aclose`) and cancels the batch
    requests of `streams` (their streamers, noted while the request was handled).

    A client that cuts its stream ends the answer: starlette cancels the task that writes it.
    When the cancel lands inside the event stream (waiting for tokens), transformers' stream
    cancels its request; when it lands elsewhere (a write waiting, or before the stream even
    started), the stream was left open, cancelled only when the garbage collector finalized it
    (one never started: never): until then its request went on generating, up to its whole
    room, and kept its blocks."""
    from starlette.responses import StreamingResponse

    if isinstance(response, StreamingResponse):
        response.__class__ = _closing_class(type(response))
        response.vattn_streams = streams
    return response


@functools.cache
def _closing_class(cls: type) -> type:
    class Closing(cls):  # type: ignore[misc, valid-type]
        vattn_streams: list = []

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            ended = False
            try:
                await super().__call__(scope, receive, send)
                ended = getattr(self.body_iterator, "ag_frame", None) is None  # it ran to its end
            finally:
                if not ended:
                    aclose = getattr(self.body_iterator, "aclose", None)
                    if aclose is not None:
                        await aclose()  # one left at a yield: GeneratorExit, transformers' stream cancels
                    cancel.cancel_streams(self.vattn_streams)  # one never started, or the n streams of _interleave

    Closing.__name__, Closing.__qualname__ = cls.__name__, cls.__qualname__
    return Closing


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
