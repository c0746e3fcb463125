"""Long prompts tokenized off the event loop.

transformers' handlers tokenize on the event loop (`tokenizer(prompt)`, `apply_chat_template`):
a prompt of megabytes stalled every other client for seconds (35 s for 10 MB). Its tokenizer
(`install`) hands a long input back to `tokenizing_off_loop`, which tokenizes it on a worker
thread (the Rust tokenizer releases the GIL: the loop keeps serving meanwhile) and runs the
handler again; the handler's second call gets the result. Everything the handlers do before
they tokenize is repeatable (checks, the model lookup, a log line); nothing is queued before.

```
handler -> tokenizer(long prompt) -> _Offload -> worker thread tokenizes -> handler again -> result
```
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
from typing import Any, Awaitable, Callable

OFFLOAD_CHARS = 8192  # inputs of more characters are tokenized on a worker thread (a few ms and more on the loop)
MAX_OFFLOADS = 8  # per request (n choices tokenize alike): past it, tokenized where asked (never a loop)

# The results of one request's worker-thread tokenization: (what, characters) -> [result, uses]
_memo: contextvars.ContextVar[dict | None] = contextvars.ContextVar("vattn_serve_tokenized", default=None)


class _Offload(Exception):
    """Raised by a tokenizer call on the event loop for a long input: tokenize `call` elsewhere."""

    def __init__(self, key: tuple, call: Callable[[], Any]) -> None:
        super().__init__("a long input, to be tokenized off the event loop")
        self.key, self.call = key, call


async def tokenizing_off_loop(answer: Callable[[], Awaitable[Any]]) -> Any:
    """`await answer()`, where a long input's tokenization inside it runs on a worker thread."""
    memo: dict = {}
    token = _memo.set(memo)
    try:
        for _ in range(MAX_OFFLOADS):
            try:
                return await answer()
            except _Offload as o:
                memo[o.key] = [await asyncio.to_thread(o.call), 0]
        memo.clear()
        _memo.set(None)  # a handler that keeps asking for other inputs: tokenized where it asks
        return await answer()
    finally:
        _memo.reset(token)


def _chars(x: Any) -> int:
    """Characters of text in a prompt, or a conversation's messages."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, dict):
        return sum(_chars(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(_chars(v) for v in x)
    return 0


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def _tokenize(what: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
    memo = _memo.get()
    if memo is None or not _on_loop():  # outside a request, or on the worker thread itself
        return fn(*args, **kwargs)
    key = (what, _chars(args[:1]) + _chars(kwargs.get("text")) + _chars(kwargs.get("conversation")))
    done = memo.get(key)
    if done is not None:
        done[1] += 1
        return done[0] if done[1] == 1 else _copy(done[0])  # n choices: each its own lists
    if key[1] <= OFFLOAD_CHARS:
        return fn(*args, **kwargs)
    raise _Offload(key, functools.partial(fn, *args, **kwargs))


def _copy(encoding: Any) -> Any:
    out = type(encoding)(dict(encoding)) if hasattr(encoding, "keys") else encoding
    if hasattr(out, "keys"):
        for k in list(out.keys()):
            if isinstance(out[k], list):
                out[k] = list(out[k])
    return out


@functools.cache
def _offloading(cls: type) -> type:
    """`cls` (a tokenizer or processor class) whose calls tokenize a long input off the loop."""

    class Offloading(cls):  # type: ignore[misc, valid-type]
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return _tokenize("call", super().__call__, args, kwargs)

        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
            return _tokenize("chat", super().apply_chat_template, args, kwargs)

    Offloading.__name__, Offloading.__qualname__, Offloading.__module__ = cls.__name__, cls.__qualname__, cls.__module__
    return Offloading


def install(processor: Any) -> None:
    """Make `processor` (the served model's tokenizer or processor, and its tokenizer) hand a
    long input to `tokenizing_off_loop` (idempotent; inert outside a request)."""
    for obj in {id(o): o for o in (processor, getattr(processor, "tokenizer", None)) if o is not None}.values():
        if not getattr(type(obj), "_vattn_offloading", False):
            cls = _offloading(type(obj))
            cls._vattn_offloading = True
            obj.__class__ = cls
