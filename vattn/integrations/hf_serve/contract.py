"""`vattn serve`'s contract for one request: what it may ask for (`n`, `max_tokens`), the room
one request can ever hold in the cache (`Room`), and the refusals (`Refusal`, 400) of what can never run."""
from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Callable

from vattn.integrations import hf_cb

MAX_N = 128  # choices one request may ask for (OpenAI's bound): each is a request of the batch
_PROBE = "vattn-serve-probe"  # a request id no request has: asks transformers' allocators what a request needs


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


def _choices(body: dict) -> int:
    """The `n` of a request (taken out of the body: transformers ignores it), 1 by default."""
    n = body.pop("n", None)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise Refusal(f"n must be an int in [1, {MAX_N}] (choices of one request), got {n!r}", param="n",
                      code="invalid_value")
    return n

