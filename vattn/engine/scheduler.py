"""`Scheduler`: continuous batching over vattn slots. Plain Python, no torch.

Every iteration:

1. running sequences: decodes first (one token each), then unfinished prompts in arrival
   order, each a chunk of at most what is left of the token budget;
2. waiting sequences in arrival order (FCFS) while a slot, a seat (max_num_seqs) and
   budget are left: each gets a slot (`alloc_reqid`) and a first chunk;
3. `kv.step({slot: num_computed_tokens + num_new_tokens})` backs the batch with pages.
   When it cannot, the newest running sequence is preempted by recomputation (its slot is
   freed; it goes back to the waiting queue keeping its generated tokens and recomputes
   prompt + generated as a prefill later) and step is tried again. A sequence that cannot
   be backed even when it runs alone is finished with finish_reason "error".

When `kv.step` raises (a `BackendError`, the host's mapping limit, ...), the failure
belongs to no one request: the iteration runs nothing, and every sequence it had
scheduled is sent back to the waiting queue like a preempted one (it keeps its generated
tokens and recomputes). A sequence whose iteration fails that way `MAX_FAILURES` times in
a row finishes with "error" and the cache's message; one that completes an iteration
starts counting again. The cache's books stay consistent through such a failure (its
`step` changes nothing it cannot undo), so the engine keeps serving.
"""
from __future__ import annotations

import bisect
import logging
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping, NamedTuple, Protocol

from vattn.checks import as_int
from vattn.engine.sequence import FinishReason, Sequence, SequenceStatus
from vattn.errors import InvalidConfigError

logger = logging.getLogger(__name__)

MAX_FAILURES = 2  # failed iterations in a row after which a sequence finishes with "error"


class StepOutcome(Protocol):
    failed: tuple[int, ...]

    def __bool__(self) -> bool: ...


class KVSlots(Protocol):
    """What the scheduler needs of the cache (`vattn.KVCache` fits)."""

    @property
    def num_free_reqids(self) -> int: ...

    def alloc_reqid(self) -> int: ...

    def free_reqid(self, reqid: int) -> None: ...

    def step(self, seq_lens: Mapping[int, int]) -> StepOutcome: ...


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: sequences running at once; max_num_batched_tokens: tokens per
    iteration (the prefill chunk size follows from it: what decodes leave)."""

    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            object.__setattr__(self, name, as_int(getattr(self, name), name, InvalidConfigError, low=1))
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                f"{self.max_num_seqs}, so that every running sequence can decode each iteration")


class ScheduledSequence(NamedTuple):
    seq: Sequence
    num_new_tokens: int  # tokens computed this iteration, from seq.num_computed_tokens on


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledSequence]  # backed by the cache: run these
    preempted: list[Sequence]  # sent back to the waiting queue this iteration (memory or a failed step)
    finished: list[Sequence]  # finished with "error": cannot fit even alone, or the cache failed again

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """FCFS continuous batching with a token budget, chunked prefill and preemption."""

    def __init__(self, config: SchedulerConfig, kv: KVSlots) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()  # arrival order (request ids grow with arrival)
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (O(1): see `_enqueue`)."""
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this iteration's sequences and token counts, and back them with pages."""
        budget = self.config.max_num_batched_tokens
        plan: list[ScheduledSequence] = []
        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        prompts = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + prompts:
            if budget == 0:
                break
            n = min(seq.num_uncomputed_tokens, budget)
            plan.append(ScheduledSequence(seq, n))
            budget -= n
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and self.kv.num_free_reqids > 0):
            seq = self.waiting.popleft()
            seq.slot = self.kv.alloc_reqid()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            plan.append(ScheduledSequence(seq, n))
            budget -= n

        preempted: list[Sequence] = []
        finished: list[Sequence] = []
        while plan:
            try:
                backed = self.kv.step({s.seq.slot: s.seq.num_computed_tokens + s.num_new_tokens for s in plan})
            except Exception as e:  # noqa: BLE001 - any cache failure: see the module docstring
                self._fail([s.seq for s in plan], e, preempted, finished)
                plan = []
                break
            if backed:
                break
            victim = max(self.running, key=lambda s: s.request_id)  # the newest request
            if len(self.running) == 1:  # then it is the whole plan
                need = victim.num_computed_tokens + plan[0].num_new_tokens
                self.finish(victim, "error", error=(
                    f"request {victim.request_id} needs {need} "
                    "tokens of KV cache, more than the physical memory can hold even when it runs "
                    "alone; raise physical_memory or lower max_tokens / the prompt length"))
                finished.append(victim)
            else:
                self.preempt(victim)
                preempted.append(victim)
            plan = [s for s in plan if s.seq is not victim]
        return SchedulerOutput(plan, preempted, finished)

    def _fail(self, seqs: list[Sequence], error: Exception, preempted: list[Sequence],
              finished: list[Sequence]) -> None:
        """The cache could not back an iteration of `seqs`: requeue them, or finish those
        that failed MAX_FAILURES times in a row."""
        logger.warning("vattn: the KV cache failed to back an iteration of requests %s (%s: %s); "
                       "they recompute, or finish with an error after %d failures in a row",
                       [s.request_id for s in seqs], type(error).__name__, error, MAX_FAILURES)
        for seq in seqs:
            seq.num_failures += 1
            if seq.num_failures >= MAX_FAILURES:
                self.finish(seq, "error", error=(
                    f"the KV cache failed {seq.num_failures} times in a row to back an iteration of "
                    f"request {seq.request_id}: {type(error).__name__}: {error}"))
                finished.append(seq)
            else:
                self.preempt(seq, count=False)
                preempted.append(seq)

    def abort(self, request_ids: Iterable[int]) -> list[Sequence]:
        """Finish the waiting or running sequences with these ids ("abort") and free their
        slots. Ids of no unfinished sequence are skipped. Returns the sequences finished."""
        wanted = set(request_ids)
        seqs = sorted((s for s in [*self.running, *self.waiting] if s.request_id in wanted),
                      key=lambda s: s.request_id)
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def preempt(self, seq: Sequence, count: bool = True) -> None:
        """Free `seq`'s slot and queue it for recomputation (it keeps its generated tokens).
        `count`: a preemption for memory (counted in num_preemptions)."""
        self.running.remove(seq)
        self.kv.free_reqid(seq.slot)
        if count and seq.num_computed_tokens:  # one never computed was only admitted too early
            seq.num_preemptions += 1
            self.num_preemptions += 1
        seq.slot, seq.num_computed_tokens = None, 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Mark `seq` finished and give its slot back (its pages stay for the next request)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free_reqid(seq.slot)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.slot = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.error = reason, error

    def _enqueue(self, seq: Sequence) -> None:
        """Keep `waiting` in arrival order, in O(1) for what happens all the time: a new
        request is the newest (it goes to the back) and a preempted one is older than every
        waiting one (it goes to the front: the victim is always the newest running sequence,
        and admission takes the oldest waiting first). Anything else is put in place."""
        waiting, key = self.waiting, seq.request_id
        if not waiting or waiting[-1].request_id < key:
            waiting.append(seq)
        elif key < waiting[0].request_id:
            waiting.appendleft(seq)
        else:
            waiting.insert(bisect.bisect(waiting, key, key=lambda s: s.request_id), seq)
