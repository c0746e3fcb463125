"""The FastAPI app of `vattn serve --engine vattn`: OpenAI's routes over an `EngineLoop`.

`/v1/completions` and `/v1/chat/completions` (streamed as server-sent events, or not),
`/v1/models`, `/health`, `/version`, `/metrics`. Each request: the body is read as strict JSON
(`hf_serve.contract.parse_json`), checked (`vattn.serve.protocol`), tokenized (the chat
template of the checkpoint's tokenizer), one engine request per prompt is added; outputs come
back per step (cumulative) and are turned into OpenAI's shapes. A client that goes away
(a cut stream, or a closed connection while a non-streamed answer waits) has its requests
aborted: their slots and pages are freed at the engine's next turn. Errors are OpenAI error
bodies (`{"error": {"message", "type", "param", "code"}}`), never FastAPI's 422 `{"detail"}`.
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps' own escaping of a str (ensure_ascii)
from starlette.requests import ClientDisconnect

import vattn
from vattn.engine.sequence import CompletionOutput, RequestOutput
from vattn.integrations.hf_serve.contract import Refusal, parse_json
from vattn.serve.engine import Handle
from vattn.serve.protocol import GenerationRequest, Prompt, read_chat, read_completion
from vattn.serve.routes import (ServerState, add_error_handlers, check_served, error_body, info_routes, refuse,
                                unauthorized, utility_routes)

logger = logging.getLogger("vattn.serve")

LONG_PROMPT_CHARS = 16384  # a longer text is tokenized off the event loop


def build_app(state: ServerState) -> Any:
    """The FastAPI app for `state` (its engine loop started by the caller): the routes of
    `vattn.serve.routes` and the generation ones."""
    app = FastAPI(title="vattn serve", version=vattn.__version__, docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app, state)
    app.include_router(info_routes(state))
    app.include_router(utility_routes(state))
    app.include_router(_generation_routes(state))
    return app


def _generation_routes(state: ServerState) -> APIRouter:
    """`/v1/completions` and `/v1/chat/completions`: streamed as server-sent events, or not."""
    router = APIRouter()

    async def generate(request: Request, chat: bool) -> Response:
        refused = unauthorized(state, request)
        if refused is not None:
            return refused
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone before its body came (a client cancelling at once): nothing to run
            logger.info("vattn serve: a client went away before its request's body came")
            return Response(status_code=499)
        try:
            body = parse_json(raw)
            req = read_chat(body) if chat else read_completion(body)
            check_served(state, req.model)
            prompts = await _tokenize(state, req)
            params = [req.params_for(len(p.token_ids), state.max_model_len) for p in prompts]
        except Refusal as e:
            return refuse(state, e)
        run = _Run(state, req, prompts, params)
        if req.stream:
            return _EventStream(run, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        try:
            return JSONResponse(await run.whole(request))
        except Refusal as e:
            return refuse(state, e)
        except _ClientGone:
            return Response(status_code=499)

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    return router


async def _tokenize(state: ServerState, req: GenerationRequest) -> list[Prompt]:
    tok = state.tokenizer
    if req.chat:
        if not getattr(tok, "chat_template", None):
            raise Refusal("this checkpoint's tokenizer has no chat template: use /v1/completions", param="messages",
                          code="no_chat_template")
        try:
            text = tok.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template that refuses these messages (roles, order): the client's
            raise Refusal(f"the checkpoint's chat template refused these messages: {e}", param="messages",
                          code="invalid_value") from None
        texts: list[Any] = [text]
    else:
        texts = req.prompts
    size = sum(len(t) for t in texts if isinstance(t, str))
    if size > LONG_PROMPT_CHARS:
        return await asyncio.get_running_loop().run_in_executor(None, _encode_all, tok, texts, req.chat, state.vocab_size)
    return _encode_all(tok, texts, req.chat, state.vocab_size)


def _encode_all(tok: Any, texts: list[Any], chat: bool, vocab_size: int) -> list[Prompt]:
    out = []
    for t in texts:
        if isinstance(t, str):
            # a chat template writes its special tokens itself; a completion's prompt gets the tokenizer's (as LLM does)
            ids = list(tok.encode(t, add_special_tokens=not chat))
            if not ids:
                raise Refusal("the prompt tokenizes to no tokens", param="messages" if chat else "prompt",
                              code="empty_prompt")
            out.append(Prompt(ids, t))
        else:
            bad = [x for x in t if x >= vocab_size]
            if bad:
                raise Refusal(f"prompt token ids must be in [0, {vocab_size}) (the model's vocabulary), got {bad[:5]}",
                              param="prompt", code="invalid_value")
            out.append(Prompt(list(t), None))
    return out


class _ClientGone(Exception):
    pass


class _Run:
    """One client request in flight: its engine requests (one per prompt) and their outputs."""

    def __init__(self, state: ServerState, req: GenerationRequest, prompts: list[Prompt], params: list[Any]) -> None:
        self.state, self.req, self.prompts, self.params = state, req, prompts, params
        self.id = ("chatcmpl-" if req.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.sink = _Mailbox()
        self.ended = False  # the stream's last event was yielded (`_EventStream` sends it as the body's end)
        self.handles: list[Handle] = []
        self.n = params[0].n if params else 1
        self.finished: dict[int, RequestOutput] = {}

    def _start(self, final_only: bool = False) -> None:
        for tag, (p, sp) in enumerate(zip(self.prompts, self.params)):
            self.state.metrics.on_request(sp)
            self.handles.append(self.state.loop.add(tag, p.token_ids, sp, self.sink, final_only))

    def _abort_open(self) -> None:
        for tag, handle in enumerate(self.handles):
            if tag not in self.finished:
                self.state.loop.abort(handle)

    async def _next(self) -> tuple[int, RequestOutput]:
        return self._take(await self.sink.get())

    async def _next_batch(self) -> dict[int, RequestOutput]:
        """Every output queued by now (at least one), the latest of each engine request: outputs
        are cumulative, so a stream that fell behind by several steps sends one event for them."""
        batch = {}
        for got in await self.sink.take():
            tag, out = self._take(got)
            batch[tag] = out
        return batch

    def _take(self, got: tuple[int, Any]) -> tuple[int, RequestOutput]:
        tag, item = got
        if isinstance(item, Exception):
            raise Refusal(str(item), status=400 if _is_client_error(item) else 500,
                          code="invalid_request" if _is_client_error(item) else "engine_error")
        if item.finished:
            self.finished[tag] = item
        return tag, item

    # ---------------------------------------------------------------- not streamed ----
    async def whole(self, request: Any) -> dict:
        self._start(final_only=True)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            while len(self.finished) < len(self.handles):
                getter = asyncio.ensure_future(self._next())
                done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    logger.info("vattn serve: the client of %s went away; its requests are aborted", self.id)
                    raise _ClientGone
                getter.result()
        except asyncio.CancelledError:  # the gate saw the client go first (or shutdown ended the wait)
            logger.info("vattn serve: the answer to %s was cancelled (its client went away, or the server shut "
                        "down); its requests are aborted", self.id)
            raise
        finally:
            watcher.cancel()
            self._abort_open()
        outs = [self.finished[t] for t in range(len(self.handles))]
        failed = next((o for out in outs for o in out.outputs if o.finish_reason == "error"), None)
        if failed is not None:
            raise Refusal(f"the engine failed on this request: {failed.error}", status=500, code="engine_error")
        choices = []
        for tag, out in enumerate(outs):
            for o in out.outputs:
                choices.append(self._choice(tag * self.n + o.index, tag, o, whole=True))
        return {"id": self.id, "object": "chat.completion" if self.req.chat else "text_completion",
                "created": self.created, "model": self.state.name, "choices": choices, "usage": self._usage(outs)}

    def _choice(self, index: int, tag: int, o: CompletionOutput, whole: bool) -> dict:
        text = o.text or ""
        if self.req.chat:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "logprobs": self._chat_logprobs(o, 0), "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
        prefix = self._echo(tag) if self.req.echo else ""
        return {"index": index, "text": prefix + text, "logprobs": self._completion_logprobs(o, 0, 0),
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}

    def _echo(self, tag: int) -> str:
        p = self.prompts[tag]
        return p.text if p.text is not None else self.state.tokenizer.decode(p.token_ids)

    def _usage(self, outs: list[RequestOutput]) -> dict:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(len(o.token_ids) for out in outs for o in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ------------------------------------------------------------------ logprobs ----
    def _completion_logprobs(self, o: CompletionOutput, start: int, offset: int) -> dict | None:
        """OpenAI's completions shape for tokens start.. of `o` (text offsets from `offset`)."""
        if self.req.logprobs is None or o.logprobs is None:
            return None
        k = self.req.logprobs
        tokens, values, tops, offsets = [], [], [], []
        for tid, entry in zip(o.token_ids[start:], o.logprobs[start:]):
            text = self.state.token_text(tid)
            tokens.append(text)
            values.append(_finite(entry[tid].logprob))
            tops.append({self.state.token_text(t): _finite(lp.logprob)
                         for t, lp in sorted(entry.items(), key=lambda x: x[1].rank) if lp.rank <= k} if k else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, o: CompletionOutput, start: int) -> dict | None:
        if self.req.logprobs is None or o.logprobs is None:
            return None
        k = self.req.logprobs
        content = []
        for tid, entry in zip(o.token_ids[start:], o.logprobs[start:]):
            text = self.state.token_text(tid)
            top = [{"token": (s := self.state.token_text(t)), "logprob": _finite(lp.logprob), "bytes": list(s.encode())}
                   for t, lp in sorted(entry.items(), key=lambda x: x[1].rank) if lp.rank <= k]
            content.append({"token": text, "logprob": _finite(entry[tid].logprob), "bytes": list(text.encode()),
                            "top_logprobs": top})
        return {"content": content}

    # ------------------------------------------------------------------- streamed ----
    async def stream(self) -> AsyncIterator[bytes]:
        """Server-sent events; the gate (`hf_serve.gate._Gate`) ends them with `data: [DONE]`."""
        self._start()
        sent_tokens: dict[tuple[int, int], int] = {}
        sent_chars: dict[tuple[int, int], int] = {}
        done: set[tuple[int, int]] = set()
        latest: dict[int, RequestOutput] = {}
        kind = "chat.completion.chunk" if self.req.chat else "text_completion"
        head = {"id": self.id, "object": kind, "created": self.created, "model": self.state.name}
        prefix = _event(head)[:-3] + b',"choices":'  # the bytes every chunk of this stream starts with
        # a choice that neither finishes nor carries logprobs (nearly every one of a stream), as
        # json.dumps writes it, from a template: no dict and no encoder a token (issue 36)
        plain = _CHAT_CHOICE if self.req.chat else _TEXT_CHOICE
        want_logprobs = self.req.logprobs is not None
        complete = False
        try:
            first = self._opening(head)
            if first is not None:
                yield first
            while len(self.finished) < len(self.handles):
                try:
                    batch = await self._next_batch()
                except Refusal as e:
                    yield _event(error_body(str(e), "server_error" if e.status >= 500 else "invalid_request_error",
                                            code=e.code))
                    complete = True
                    return
                latest.update(batch)
                failed = next((o for out in batch.values() for o in out.outputs if o.finish_reason == "error"), None)
                if failed is not None:  # OpenAI has no finish_reason "error": an error event ends the stream
                    yield _event(error_body(f"the engine failed on this request: {failed.error}", "server_error",
                                            code="engine_error"))
                    complete = True
                    return
                choices = self._choices(batch, sent_tokens, sent_chars, done, plain, want_logprobs)
                if choices:  # the same bytes as _event({**head, "choices": choices, ["usage": ...]})
                    usage = _dumps(self._usage(list(latest.values()))) if self.req.continuous_usage else None
                    event = prefix + ("[" + ",".join(choices) + "]").encode() + (
                        b"}\n\n" if usage is None else b',"usage":' + usage + b"}\n\n")
                    if len(self.finished) == len(self.handles):
                        # the last choices: with the usage event, if asked, as one write that ends the body
                        if self.req.include_usage:
                            event += _event({**head, "choices": [],
                                             "usage": self._usage([latest[t] for t in sorted(latest)])})
                        self.ended = complete = True
                    yield event
            if self.req.include_usage and not self.ended:
                self.ended = True
                yield _event({**head, "choices": [], "usage": self._usage([latest[t] for t in sorted(latest)])})
            complete = True
        finally:
            if not complete:
                logger.info("vattn serve: the client of %s cancelled its stream; its requests are aborted", self.id)
            self._abort_open()

    def _opening(self, head: dict) -> bytes | None:
        """The stream's first event: a chat's role for every choice, or a completion's echoed
        prompts (None: neither)."""
        if self.req.chat:  # the first chunk of every choice: its role
            return _event({**head, "choices": [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for i in range(len(self.prompts) * self.n)]})
        if self.req.echo:
            return _event({**head, "choices": [
                {"index": t * self.n + i, "text": self._echo(t), "logprobs": None, "finish_reason": None,
                 "stop_reason": None} for t in range(len(self.prompts)) for i in range(self.n)]})
        return None

    def _choices(self, batch: dict[int, RequestOutput], sent_tokens: dict[tuple[int, int], int],
                 sent_chars: dict[tuple[int, int], int], done: set[tuple[int, int]], plain: str,
                 want_logprobs: bool) -> list[str]:
        """The JSON of each choice of `batch` with news since the last event (what is sent is
        noted in `sent_tokens`, `sent_chars`, and `done` once it finished); `plain`: the
        template of a choice that neither finishes nor carries logprobs (nearly every one)."""
        choices = []
        for tag, out in batch.items():
            for o in out.outputs:
                key = (tag, o.index)
                if key in done:
                    continue
                text = o.text or ""
                t0, c0 = sent_tokens.get(key, 0), sent_chars.get(key, 0)
                if len(o.token_ids) == t0 and len(text) == c0 and not o.finished:
                    continue
                index = tag * self.n + o.index
                piece = text[c0:]
                reason = o.finish_reason if o.finished else None
                sent_tokens[key], sent_chars[key] = len(o.token_ids), len(text)
                if reason is None and (not want_logprobs or o.logprobs is None):
                    choices.append(plain % (index, _json_str(piece)))
                    continue
                if self.req.chat:
                    choice = {"index": index, "delta": {"content": piece} if piece or not reason else {},
                              "logprobs": self._chat_logprobs(_tail(o, t0), 0), "finish_reason": reason}
                else:
                    choice = {"index": index, "text": piece, "logprobs": self._completion_logprobs(_tail(o, t0), 0, c0),
                              "finish_reason": reason}
                if reason is not None:
                    choice["stop_reason"] = o.stop_reason
                    done.add(key)
                choices.append(json.dumps(choice, separators=(",", ":")))
        return choices


# a streamed choice that neither finishes nor carries logprobs: `_json_str(piece)` is json.dumps(piece)
_TEXT_CHOICE = '{"index":%d,"text":%s,"logprobs":null,"finish_reason":null}'
_CHAT_CHOICE = '{"index":%d,"delta":{"content":%s},"logprobs":null,"finish_reason":null}'


class _Mailbox:
    """A run's sink: the engine loop's flush puts (tag, output | exception) in it (event loop
    thread), the run takes what came (`take`: all of it, the stream; `get`: one, the answer
    whole). One future per wait, set by the first put after it: no asyncio.Queue (its putter and
    getter bookkeeping) per output."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque = collections.deque()
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item: Any) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self.items

    async def _wait(self) -> None:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    async def get(self) -> Any:
        await self._wait()
        return self.items.popleft()

    async def take(self) -> list:
        await self._wait()
        items = list(self.items)
        self.items.clear()
        return items


class _EventStream(StreamingResponse):
    """starlette's StreamingResponse (its watch for the client going away included) of a
    `_Run`'s events, less its per-event layers (issue 36): the body's parts go straight to the
    gate's `send` (`scope["vattn.send"]`, see hf_serve.gate; starlette's own wrappers of `send`
    only look for `http.response.start`, which still goes through them), and the stream's last
    event is the body's end (one write with the gate's `data: [DONE]`, not three)."""

    def __init__(self, run: _Run, **kw: Any) -> None:
        self.run = run
        super().__init__(run.stream(), **kw)
        self.raw_send: Any = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self.raw_send = scope.get("vattn.send")
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body_send = self.raw_send or send
        events = self.body_iterator
        try:
            async for chunk in events:
                if self.run.ended:
                    await body_send({"type": "http.response.body", "body": chunk, "more_body": False})
                    return
                await body_send({"type": "http.response.body", "body": chunk, "more_body": True})
            await body_send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await events.aclose()


def _tail(o: CompletionOutput, start: int) -> CompletionOutput:
    """`o` with its tokens (and their logprobs) from `start` on: the part a stream did not send."""
    if not start:
        return o
    return CompletionOutput(o.index, o.token_ids[start:], o.text, o.finish_reason, o.error, o.stop_reason,
                            None if o.logprobs is None else o.logprobs[start:], o.cumulative_logprob)


def _finite(logprob: float) -> float:
    """-inf as -9999.0, what OpenAI sends (JSON has no infinity)."""
    return max(logprob, -9999.0)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _event(obj: dict) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


def _is_client_error(e: Exception) -> bool:
    from vattn.errors import InvalidRequestError

    return isinstance(e, InvalidRequestError)


async def _disconnected(request: Any) -> None:
    """Returns once the client closed the connection (the body was read before)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
