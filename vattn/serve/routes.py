"""What every route of `vattn serve --engine vattn` shares, and the routes besides generation
(which are `vattn.serve.app`'s): `ServerState`, OpenAI error bodies and refusals, the API key
check; the error handlers; `/health`, `/version`, `/v1/models`, `/metrics` (`info_routes`)
and vLLM's `/tokenize` and `/detokenize` (`utility_routes`), each group an `APIRouter` that
`app.build_app` includes.
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

import vattn
from vattn.integrations.hf_serve.contract import Refusal, parse_json
from vattn.serve.engine import EngineLoop
from vattn.serve.metrics import CONTENT_TYPE, ServeMetrics

logger = logging.getLogger("vattn.serve")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ServerState:
    """What the routes share: the engine loop, the tokenizer, names and figures."""

    loop: EngineLoop
    tokenizer: Any
    served_names: tuple[str, ...]
    model_path: str
    max_model_len: int
    metrics: ServeMetrics
    api_key: str | None = None
    created: int = 0
    vocab_size: int = 0  # the model's (token id prompts are checked against it)
    token_texts: dict = field(default_factory=dict)  # token id -> its text alone (logprobs), filled as asked

    def token_text(self, token_id: int) -> str:
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    @property
    def name(self) -> str:
        return self.served_names[0]


def refuse(state: ServerState, e: Refusal) -> JSONResponse:
    """The OpenAI error response of refusal `e` (counted in the metrics)."""
    state.metrics.on_refused(e.code)
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    return JSONResponse(error_body(str(e), kind, e.param, e.code), status_code=e.status)


def unauthorized(state: ServerState, request: Request) -> JSONResponse | None:
    """401 unless the request carries `Authorization: Bearer <--api-key>` (checked in each route
    but /health and /metrics: a plain function, not an HTTP middleware, which would sit in
    every stream's path)."""
    if state.api_key is None:
        return None
    given = request.headers.get("authorization", "")
    token = given[7:] if given[:7].lower() == "bearer " else ""
    if hmac.compare_digest(token.encode(), state.api_key.encode()):
        return None
    state.metrics.on_refused("invalid_api_key")
    return JSONResponse(error_body("missing or wrong API key: send 'Authorization: Bearer <key>' with the key "
                                   "given to --api-key", code="invalid_api_key"), status_code=401)


def check_served(state: ServerState, model: Any) -> None:
    """Refuse (404) a request that names a `model` this server does not serve (None: any)."""
    if model is not None and model not in state.served_names:
        raise Refusal(f"the model {model!r} does not exist: this server serves "
                      f"{', '.join(map(repr, state.served_names))}", param="model", code="model_not_found",
                      status=404)


def add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Errors as OpenAI error bodies, never FastAPI's 422 `{"detail"}`."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = (exc.errors() or [{}])[0]
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return refuse(state, Refusal(f"invalid request: {first.get('msg', exc)}", param=param, code="invalid_value"))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error" if exc.status_code < 500
                                       else "server_error", code=exc.status_code), status_code=exc.status_code)


def info_routes(state: ServerState) -> APIRouter:
    """`/health` (503 once the engine loop died), `/version`, `/v1/models`, `/metrics`."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if not state.loop.is_alive():
            return JSONResponse(error_body("the engine loop is not running; restart the server", "server_error",
                                           code=503), status_code=503)
        return Response(status_code=200)

    @router.get("/version")
    async def version(request: Request) -> Any:
        return unauthorized(state, request) or {"version": vattn.__version__}

    @router.get("/v1/models")
    async def models(request: Request) -> Any:
        return unauthorized(state, request) or {"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "vattn", "root": state.model_path,
             "parent": None, "max_model_len": state.max_model_len} for name in state.served_names]}

    @router.get("/metrics")
    async def metrics() -> Response:
        from vattn.serve.metrics import engine_figures

        if state.loop.is_alive():
            try:
                state.metrics.figures = await asyncio.wait_for(
                    state.loop.call(functools.partial(engine_figures, state.loop.llm)), 10)
            except Exception:  # noqa: BLE001 - the histograms and counters are still worth a scrape
                logger.warning("vattn serve: reading the engine's figures for /metrics failed", exc_info=True)
        return Response(state.metrics.text(), media_type=CONTENT_TYPE)

    return router


def utility_routes(state: ServerState) -> APIRouter:
    """vLLM's `/tokenize` and `/detokenize`."""
    router = APIRouter()

    async def utility(request: Request, answer: Callable[[dict], dict]) -> Response:
        """A vLLM utility route: the API key, the JSON body, its `model` served here, then
        `answer(body)` (a Refusal from any of them is the OpenAI error it names)."""
        refused = unauthorized(state, request)
        if refused is not None:
            return refused
        try:
            body = parse_json(await request.body())
            check_served(state, body.get("model"))
            return JSONResponse(answer(body))
        except Refusal as e:
            return refuse(state, e)
        except ClientDisconnect:
            return Response(status_code=499)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's /tokenize: a `prompt` (`add_special_tokens`, default true) or chat `messages`
        (through the chat template, as /v1/chat/completions); `vllm bench serve` aligns its
        random prompts with it."""
        return await utility(request, functools.partial(_tokenized, state))

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM's /detokenize: `tokens` (ids of this vocabulary) to `prompt` (text)."""
        return await utility(request, functools.partial(_detokenized, state))

    return router


def _tokenized(state: ServerState, body: dict) -> dict:
    tok = state.tokenizer
    if isinstance(body.get("messages"), list):
        try:
            text = tok.apply_chat_template(body["messages"], tokenize=False,
                                           add_generation_prompt=bool(body.get("add_generation_prompt", True)))
        except Exception as e:  # noqa: BLE001 - the template's own error, as a 400
            raise Refusal(f"the chat template cannot render these messages: {e}", param="messages",
                          code="invalid_value") from None
        ids = tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
    elif isinstance(body.get("prompt"), str):
        ids = tok.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
    else:
        raise Refusal("/tokenize needs `prompt` (a string) or `messages` (a list)", param="prompt",
                      code="invalid_value")
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}


def _detokenized(state: ServerState, body: dict) -> dict:
    ids = body.get("tokens")
    vocab = len(state.tokenizer)
    if not isinstance(ids, list) or not all(type(i) is int and 0 <= i < vocab for i in ids):
        raise Refusal(f"`tokens` must be a list of token ids in [0, {vocab})", param="tokens",
                      code="invalid_value")
    return {"prompt": state.tokenizer.decode(ids)}
