"""`vattn serve`'s contract for one request: what its body may hold (`read_body`: strict JSON,
fields of the right type and range, the sampling extensions load generators send), the room
one request can ever hold in the cache (`Room`), and the refusals (`Refusal`, 4xx) of what
can never run."""
from __future__ import annotations

import contextvars
import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from vattn.integrations import hf_cb
from vattn.integrations.hf_cb.probe import request_blocks

MAX_N = 128  # choices one request may ask for (OpenAI's bound): each is a request of the batch
# vLLM's and SGLang's sampling extensions that load generators send (guidellm: ignore_eos; vLLM's benchmark
# client: ignore_eos, min_tokens), honoured; transformers' own handlers would answer 422
EXTENSIONS = ("ignore_eos", "min_tokens")


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
    ignore_eos: bool = False  # generation goes on past the end-of-sequence token (to max_tokens or the room)
    min_tokens: int = 0  # the end-of-sequence token cannot be generated before this many tokens


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
        blocks = request_blocks(cache)
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


# ------------------------------------------------------------- the body ----
def _no_constant(name: str) -> float:
    raise Refusal(f"the request body is not valid JSON: {name} is not a JSON value (send a number or null)",
                  code="invalid_json")


def parse_json(raw: bytes) -> dict:
    """The body of a completion request: a JSON object, strictly (no NaN or Infinity, which
    Python's json module would take; no text that is not Unicode: `check_text`), or `Refusal`
    (400)."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise Refusal(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # json's C scanner counts its depth against Python's limit (about 1000)
        raise Refusal("the request body nests arrays or objects deeper than this server reads JSON (about 1000 "
                      "levels): send a flatter body", code="invalid_json") from None
    if not isinstance(body, dict):
        raise Refusal(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_type")
    check_text(body)
    return body


def check_text(body: dict) -> None:
    """`Refusal` (400) for a string of `body`, or a key, that is not Unicode text: JSON's
    `\\uXXXX` escapes can spell a lone UTF-16 surrogate (`"\\ud800"`), which Python's json
    module takes as it is, and which no tokenizer can encode (transformers' handler failed with
    a 500). The error names the field (`messages[0].content`) and where in it."""
    try:  # one pass in C (a 4 MiB body of small strings: 0.1 s, the walk below 0.7 s, on the event loop)
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return
    except (UnicodeEncodeError, RecursionError):  # a surrogate somewhere (or nesting at the limit): find where
        pass
    stack: list[tuple[str, bool, Any]] = [("", False, body)]  # (field, a key of it?, value)
    while stack:  # not recursive: json.loads takes nesting as deep as Python's recursion limit
        param, key, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                where = (f"a key of {param!r}" if param else "a key of the body") if key else repr(param)
                raise Refusal(f"invalid {where}: it holds a lone UTF-16 surrogate (U+{ord(value[e.start]):04X} at "
                              f"character {e.start}), which is not Unicode text: send the text as UTF-8, or a "
                              "surrogate escape only as a pair (\\ud83d\\ude00)", param=param or None,
                              code="invalid_unicode") from None
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((param, True, k))
                stack.append((f"{param}.{k}" if param else k, False, v))
        elif isinstance(value, list):
            stack.extend((f"{param}[{i}]", False, v) for i, v in enumerate(value))


def _bad(param: str, expected: str, value: Any, code: str = "invalid_type") -> Refusal:
    got = json.dumps(value) if isinstance(value, (str, bool, int, float)) or value is None else type(value).__name__
    return Refusal(f"invalid {param!r}: expected {expected}, got {got[:80]}", param=param, code=code)


def _integer(body: dict, param: str, low: int, high: int | None = None) -> int | None:
    """body[param]: None or an int in [low, high] (OpenAI's rule: a string or a float is no integer)."""
    v = body.get(param)
    if v is None:
        return None
    span = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(param, f"an integer {span}", v)
    if v < low:
        raise _bad(param, f"an integer {span}", v, "integer_below_min_value")
    if high is not None and v > high:
        raise _bad(param, f"an integer {span}", v, "integer_above_max_value")
    return v


def _number(body: dict, param: str, low: float, high: float) -> None:
    v = body.get(param)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(param, f"a number in [{low}, {high}]", v)
    if not low <= v <= high:
        raise _bad(param, f"a number in [{low}, {high}]", v,
                   "decimal_below_min_value" if v < low else "decimal_above_max_value")


def _messages(body: dict) -> None:
    """`messages`: a non-empty array of objects with a string `role` and a string, array or
    null `content` (transformers' handler would fail on anything else with a 500)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad("messages", "an array of messages", messages, "missing_required_parameter"
                   if messages is None else "invalid_type")
    if not messages:
        raise Refusal("invalid 'messages': an empty array; a chat needs at least one message", param="messages",
                      code="empty_array")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "an object with a string 'role'", m)
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise _bad(f"messages[{i}].content", "a string, an array of content parts or null", content)
        if isinstance(content, list) and not all(isinstance(c, dict) and isinstance(c.get("type"), str)
                                                 for c in content):
            raise _bad(f"messages[{i}].content", "content parts, objects with a string 'type'", content)


def read_body(body: dict, chat: bool) -> tuple[int, _Asked]:
    """Check a completion request's fields (OpenAI's types and ranges; vattn's decisions are
    in docs/servers.md) and take out what transformers' handler does not know: `n` and the
    extensions (`EXTENSIONS`). Returns (n, what the client asked for); `Refusal` (400) for a
    field of the wrong type or out of range, before anything is tokenized or queued."""
    prompt_param = "messages" if chat else "prompt"
    if chat:
        _messages(body)
    elif not isinstance(body.get("prompt"), str):
        raise _bad("prompt", "a string (one prompt a request)", body.get("prompt"),
                   "missing_required_parameter" if body.get("prompt") is None else "invalid_type")
    limits = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
    given = [v for k in limits if (v := _integer(body, k, 1)) is not None]
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1)
    _number(body, "frequency_penalty", -2, 2)
    _number(body, "presence_penalty", -2, 2)
    _integer(body, "seed", -(1 << 63), (1 << 63) - 1)  # OpenAI's int64 (torch.manual_seed fails past 2**64)
    for flag in ("stream", "ignore_eos"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise _bad(flag, "a boolean", body[flag])
    min_tokens = _integer(body, "min_tokens", 0) or 0
    if given and min_tokens > min(given):
        raise Refusal(f"min_tokens ({min_tokens}) is more than max_tokens ({min(given)})", param="min_tokens",
                      code="invalid_value")
    n = _choices(body)
    ignore_eos = bool(body.pop("ignore_eos", None))
    body.pop("min_tokens", None)
    return n, _Asked(frozenset(given), prompt_param, ignore_eos, min_tokens)


def _choices(body: dict) -> int:
    """The `n` of a request (taken out of the body: transformers ignores it), 1 by default."""
    n = body.pop("n", None)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise Refusal(f"n must be an int in [1, {MAX_N}] (choices of one request), got {n!r}", param="n",
                      code="invalid_value")
    return n

