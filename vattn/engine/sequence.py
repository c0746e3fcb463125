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

With asynchronous scheduling (`EngineConfig.async_scheduling`) an iteration's tokens count as
computed once it is launched, and the token it samples is a placeholder until its outputs are
processed: `num_tokens` counts it, `token_ids` does not have it yet. The next iteration may
already compute it (its input is read on the device, see `ModelRunner.launch`):
```
token_ids:  [ prompt ...... | generated ... ] (?)   <- num_placeholders = 1: sampled, in flight
            |<------ num_computed_tokens ------>|
```

A request with `SamplingParams(n > 1)` has n sequences, its samples, which share one
`samples` list. Sample 0 computes the prompt; the others are PENDING until then, each
draws its first token from the same logits row, and from there on each is a sequence of
its own (it gets its slot by forking sample 0's: see `Scheduler`).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

from vattn.engine.sampling_params import SamplingParams
from vattn.engine.spec_decode import DraftState

FinishReason = Literal["stop", "length", "abort", "error"]


class Logprob(NamedTuple):
    """One token's log-probability (vLLM's `Logprob`, without the decoded token): `rank` 1
    is the most likely token."""

    logprob: float
    rank: int


# Per generated token: token id -> Logprob, the sampled token first, then the top alternatives.
TokenLogprobs = dict[int, Logprob]


class Detokenizer(Protocol):
    """What a sequence's incremental detokenizer does (`vattn.engine.detokenizer` makes them)."""

    text: str | None  # the text so far (None: the tokenizer failed)

    def add(self, token_id: int) -> str: ...

    def find_stop(self, stops: tuple[str, ...], num_new_chars: int, include: bool) -> str | None: ...

    def fresh(self) -> Detokenizer: ...


class SequenceStatus(enum.Enum):
    PENDING = "pending"  # a parallel sample waiting for sample 0's prompt (its first token comes from it)
    WAITING = "waiting"  # no slot: new, or preempted (recomputes, or swaps back in)
    RUNNING = "running"  # holds a slot (reqid) of the cache
    FINISHED = "finished"


class Sequence:
    """One sample of a request: its tokens, how many of them are in the cache, and its slot.
    `seq_id` = (request_id, index) orders sequences by arrival (FCFS) and names them."""

    def __init__(self, request_id: int, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_time: float, prompt: str | None = None, index: int = 0) -> None:
        self.request_id = request_id
        self.index = index
        self.seq_id = (request_id, index)
        self.samples: list[Sequence] = [self]  # every sample of the request, shared by them (index order)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.num_computed_tokens = 0
        self.num_placeholders = 0  # sampled tokens in flight, not in token_ids yet (asynchronous scheduling)
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None  # why it failed; set from when its iteration failed (see Scheduler.commit)
        self.num_preemptions = 0
        self.num_failures = 0  # iterations in a row that failed in the cache (see Scheduler)
        self.has_run = False  # ran an iteration since it got its slot (a preemption before does not count)
        self.swap: Any = None  # a `vattn.cache.SwapHandle`: swapped out, or swapped in and not run since
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.detokenizer: Detokenizer | None = None  # the engine's tokenizer, fed token by token
        self.stop_reason: int | str | None = None  # the stop token id or stop string that finished it
        asked = params.logprobs is not None
        self.logprobs: list[TokenLogprobs] | None = [] if asked else None  # one per generated token
        self.cumulative_logprob: float | None = 0.0 if asked else None  # sum of the sampled tokens' logprobs
        self.spec = DraftState()  # speculative decoding: its draft length, its drafts proposed and accepted

    def spawn(self, index: int) -> Sequence:
        """A sibling sample (PENDING) of this request, sharing its `samples` list."""
        seq = Sequence(self.request_id, self.prompt_token_ids, self.params, self.arrival_time, self.prompt, index)
        seq.status = SequenceStatus.PENDING
        if self.detokenizer is not None:
            seq.detokenizer = self.detokenizer.fresh()
        seq.samples = self.samples
        self.samples.append(seq)
        return seq

    @property
    def pending_samples(self) -> list[Sequence]:
        """The siblings still waiting for this sequence's prompt (sample 0 only)."""
        if self.index or len(self.samples) == 1:
            return []
        return [s for s in self.samples if s.status is SequenceStatus.PENDING]

    @property
    def num_tokens(self) -> int:
        """Its tokens, a sampled token still in flight included."""
        return len(self.token_ids) + self.num_placeholders

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Its generated tokens, a sampled token still in flight included."""
        return self.num_tokens - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Its generated tokens known on the host."""
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def text(self) -> str | None:
        """Its generated tokens detokenized so far (cut at a stop string), or None without a
        tokenizer. While it runs with `stop` strings, the last (longest stop - 1) characters are
        held back (vLLM's): they may be the start of a stop string, which a stream must never show."""
        text = None if self.detokenizer is None else self.detokenizer.text
        p = self.params
        if text is None or not p.stop or p.include_stop_str_in_output or self.is_finished:
            return text
        return text[:max(0, len(text) - (max(map(len, p.stop)) - 1))]

    def __repr__(self) -> str:
        return (f"Sequence(id={self.request_id}.{self.index}, {self.status.value}, slot={self.slot}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens}, prompt={self.num_prompt_tokens}"
                + (f", in flight={self.num_placeholders})" if self.num_placeholders else ")"))


@dataclass(frozen=True)
class RequestMetrics:
    """Times of one request, in seconds of `time.perf_counter()`."""

    arrival_time: float
    first_token_time: float | None
    finished_time: float | None
    num_output_tokens: int
    # speculative decoding (every sample's): draft tokens proposed (computed) and, of those, accepted
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

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
class CompletionOutput:
    """One sample of a request (vLLM's name): its generated tokens so far, or final ones.

    `finish_reason`: "stop" (an end-of-sequence or stop token, kept as the last token, or a
    stop string), "length" (max_tokens reached), "abort" (`LLM.abort_request`), "error" (the
    sample could not continue; `error` says why: it does not fit into physical_memory even
    alone, its sampling or its forward failed, see `LLM`), None while running.
    `stop_reason` (vLLM's): the `stop_token_ids` entry or `stop` string that finished it;
    None for an end-of-sequence token, or any other reason.
    `text`: the generated tokens detokenized incrementally (`SamplingParams.skip_special_tokens`),
    cut before a stop string (or after it, with include_stop_str_in_output); None when the
    engine has no tokenizer (or its tokenizer failed).
    `logprobs` (`SamplingParams.logprobs`, else None): per generated token a dict token id ->
    `Logprob`, the sampled token's first, then the top alternatives (vLLM's shape);
    `cumulative_logprob` the sum of the sampled tokens' logprobs.
    """

    index: int  # which sample, 0 .. n-1
    token_ids: list[int]  # generated tokens
    text: str | None  # the generated tokens decoded, when the engine has a tokenizer
    finish_reason: FinishReason | None
    error: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """A request's state after a step: its samples' generated tokens so far, or final ones.

    `outputs`: one `CompletionOutput` per sample (`SamplingParams.n`), in index order.
    `token_ids` and `text` are those of `outputs[0]` (the whole story when n = 1);
    `finish_reason` and `error` too, unless another sample failed: then "error", and that
    sample's error naming it (a failed sample is never hidden behind sample 0's "length").
    `finished`: every sample finished.
    `num_preemptions`: how often the request's samples lost their KV cache to make room
    for older requests (a sample only admitted and sent back before it ran does not count).
    `metrics` count the tokens of every sample.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_preemptions: int
    metrics: RequestMetrics

    @property
    def token_ids(self) -> list[int]:
        """Sample 0's generated tokens."""
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> FinishReason | None:
        return "error" if self._failed is not None else self.outputs[0].finish_reason

    @property
    def error(self) -> str | None:
        failed = self._failed
        if failed is None or failed.index == 0:
            return self.outputs[0].error
        return f"sample {failed.index} of request {self.request_id}: {failed.error}"

    @property
    def _failed(self) -> CompletionOutput | None:
        """The first sample that finished with "error", if any."""
        return next((o for o in self.outputs if o.finish_reason == "error"), None)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from add_request to the first generated token."""
        return self.metrics.time_to_first_token

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds per generated token after the first (None until finished)."""
        return self.metrics.time_per_output_token
