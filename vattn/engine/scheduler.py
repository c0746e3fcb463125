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
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Protocol

from vattn.engine.checks import as_int
from vattn.engine.sequence import FinishReason, Sequence, SequenceStatus
from vattn.errors import InvalidConfigError


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
    preempted: list[Sequence]  # sent back to the waiting queue this iteration
    aborted: list[Sequence]  # finished with "error": cannot fit even alone

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    """FCFS continuous batching with a token budget, chunked prefill and preemption."""

    def __init__(self, config: SchedulerConfig, kv: KVSlots) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Sequence] = []  # arrival order (request ids grow with arrival)
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
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
            seq = self.waiting.pop(0)
            seq.slot = self.kv.alloc_reqid()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            plan.append(ScheduledSequence(seq, n))
            budget -= n

        preempted: list[Sequence] = []
        aborted: list[Sequence] = []
        while plan:
            if self.kv.step({s.seq.slot: s.seq.num_computed_tokens + s.num_new_tokens for s in plan}):
                break
            victim = max(self.running, key=lambda s: s.request_id)  # the newest request
            if len(self.running) == 1:  # then it is the whole plan
                need = victim.num_computed_tokens + plan[0].num_new_tokens
                self.finish(victim, "error", error=(
                    f"request {victim.request_id} needs {need} "
                    "tokens of KV cache, more than the physical memory can hold even when it runs "
                    "alone; raise physical_memory or lower max_tokens / the prompt length"))
                aborted.append(victim)
            else:
                self.preempt(victim)
                preempted.append(victim)
            plan = [s for s in plan if s.seq is not victim]
        return SchedulerOutput(plan, preempted, aborted)

    def preempt(self, seq: Sequence) -> None:
        """Free `seq`'s slot and queue it for recomputation (it keeps its generated tokens)."""
        self.running.remove(seq)
        self.kv.free_reqid(seq.slot)
        if seq.num_computed_tokens:  # one never computed was only admitted too early
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
        keys = [s.request_id for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, seq.request_id), seq)
