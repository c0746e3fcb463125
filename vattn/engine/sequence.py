"""A request's state (`Sequence`) and what the engine reports about it (`RequestOutput`).

Plain Python: the scheduler works on these without torch.

```
token_ids:  [ prompt ............ | generated ...... ]
            |<- num_computed_tokens ->|               K/V in the cache
            |<------------------ num_tokens ---------------->|
```
Prefill, chunked prefill, decode and recomputation after a preemption are one thing: the
next iteration computes `num_tokens - num_computed_tokens` tokens (or fewer, a chunk) and,
when that reaches the end, samples one more token.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from vattn.engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort", "error"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # no slot: new, or preempted (recomputes from scratch)
    RUNNING = "running"  # holds a slot (reqid) of the cache
    FINISHED = "finished"


class Sequence:
    """One request: its tokens, how many of them are in the cache, and its slot."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, prompt: str | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.num_computed_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.num_failures = 0  # iterations in a row that failed in the cache (see Scheduler)
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence(id={self.request_id}, {self.status.value}, slot={self.slot}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens}, prompt={self.num_prompt_tokens})")


@dataclass(frozen=True)
class RequestMetrics:
    """Times of one request, in seconds of `time.perf_counter()`."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_output_tokens: int

    @property
    def time_to_first_token(self) -> float | None:
        """From add_request to the first generated token (TTFT)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between generated tokens after the first (TPOT); None with fewer than 2
        tokens or before the request finished."""
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step: its generated tokens so far, or final ones.

    `finish_reason`: "stop" (an end-of-sequence or stop token, kept as the last token),
    "length" (max_tokens reached), "abort" (`LLM.abort_request`), "error" (the request
    could not continue; `error` says why: it does not fit into physical_memory even alone,
    its sampling or its forward failed, see `LLM`), None while running.
    `num_preemptions`: how often the request lost its KV cache to make room for older
    requests and recomputed it (a request only admitted and sent back before it ran any
    token does not count).
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens
    text: str | None  # the generated tokens decoded, when the engine has a tokenizer
    finished: bool
    finish_reason: FinishReason | None
    num_preemptions: int
    metrics: RequestMetrics
    error: str | None = None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from add_request to the first generated token."""
        return self.metrics.time_to_first_token

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds per generated token after the first (None until finished)."""
        return self.metrics.time_per_output_token
