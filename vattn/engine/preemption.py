"""Memory pressure and failures (`Preemption`, a base of `Scheduler`): backing an iteration's
plan with pages, and what gives way when it cannot. Plain Python, no torch.

`kv.step({slot: num_computed_tokens + num_new_tokens})` backs the batch with pages. When it
cannot, a sequence's drafts go first (speculative decoding), then a sequence admitted in this
iteration goes back to waiting (the newest: it has not run; not a preemption), then the
newest running sequence is preempted, and step is tried again. A sequence left alone whose
prompt chunk still cannot be backed runs a shorter chunk (halved until it fits: what a chunk
needs grows with its length, a sliding window's pages too, not only the prompt's); one that
cannot be backed even alone, one token at a time, is finished with finish_reason "error".

Preemption (`SchedulerConfig.preemption_mode`, vLLM's names):
- "recompute" (the default): the slot is freed; the sequence goes back to the waiting
  queue keeping its generated tokens and computes prompt + generated as a prefill later.
- "swap": its computed tokens are copied to host memory (`kv.swap_out`) and its slot is
  freed; re-admission takes it back (`kv.swap_in`: no copy at all when nobody took its old
  slot or pages meanwhile) with its tokens computed. A swap-in that finds no slot or
  memory leaves it waiting (FCFS: nothing behind it is admitted in that iteration), unless
  nothing runs that could free memory: then it recomputes. A sequence preempted again
  before it ran keeps its host copy (nothing changed), and one that never ran in its slot
  (admitted too early) is not copied either. A swap-in that must copy first drops the
  pages its new slot shares with a live request or the prefix cache, so sharing (forks,
  prefix caching) works in this mode too.

When `kv.step` raises (a `BackendError`, the host's mapping limit, ...), the failure
belongs to no one request: the iteration runs nothing, and every sequence it had
scheduled is sent back to the waiting queue like a preempted one (it keeps its generated
tokens and recomputes). A sequence whose iteration fails that way `MAX_FAILURES` times in
a row finishes with "error" and the cache's message; one that completes an iteration
starts counting again. The cache keeps its books consistent when its `step` raises (a
failed map changes nothing; see `vattn.allocator`), so the engine keeps serving. A
`FatalEngineError` (e.g. a tensor-parallel collective that failed because a peer died) is
no cache failure: the scheduler lets it propagate from every cache call, untouched.
"""
from __future__ import annotations

import logging
from typing import Callable, Collection

from vattn.engine.schedule_types import KVSlots, ScheduledSequence, SchedulerConfig
from vattn.engine.sequence import Sequence, SequenceStatus
from vattn.errors import FatalEngineError

logger = logging.getLogger(__name__)

MAX_FAILURES = 2  # failed iterations in a row after which a sequence finishes with "error"


def _shorter_chunks(plan: list[ScheduledSequence], failed: Collection[int]) -> list[ScheduledSequence] | None:
    """`plan` with the prompt chunks of the `failed` slots halved, or None when every failed
    slot computes one token already."""
    failed = set(failed)
    if not any(item.seq.slot in failed and item.num_new_tokens > 1 for item in plan):
        return None
    return [item._replace(num_new_tokens=item.num_new_tokens // 2)
            if item.seq.slot in failed and item.num_new_tokens > 1 else item for item in plan]


class Preemption:
    """How `Scheduler` backs a plan and makes room (see the module docstring); the scheduler
    sets the attributes read here and gives the methods it calls."""

    config: SchedulerConfig
    kv: KVSlots
    running: list[Sequence]
    num_preemptions: int
    num_swapped_out: int
    _unadmit: Callable[[Sequence], None]  # (`Admission`'s)
    finish: Callable[..., None]
    _cache_prefix: Callable[[Sequence, list[int]], None]
    _enqueue: Callable[[Sequence], None]

    def _back(self, plan: list[ScheduledSequence],
              admitted: list[Sequence]) -> tuple[list[ScheduledSequence], list[Sequence], list[Sequence]]:
        """Back `plan` with pages (`kv.step`), making room where it cannot (see the module
        docstring; `admitted`: the sequences admitted in this schedule, newest last). Returns
        what is backed, the sequences sent back to waiting and those finished with "error"."""
        preempted: list[Sequence] = []
        finished: list[Sequence] = []
        while plan:
            try:
                backed = self.kv.step({s.seq.slot: s.seq.num_computed_tokens + s.num_new_tokens for s in plan})
            except FatalEngineError:  # e.g. a failed collective: the engine stops
                raise
            except Exception as e:  # noqa: BLE001 - any cache failure: see the module docstring
                self._fail([s.seq for s in plan], e, preempted, finished)
                plan = []
                break
            if backed:
                break
            if any(s.drafts for s in plan):  # drafts never cost a sequence its place: run without them first
                plan = [s._replace(num_new_tokens=s.num_new_tokens - len(s.drafts), drafts=()) if s.drafts else s
                        for s in plan]
                continue
            if admitted and len(self.running) > 1:  # never preempt a running sequence for an admission:
                victim = admitted.pop()  # the newest admitted goes back to waiting (it has not run)
                self._unadmit(victim)
                preempted.append(victim)
                plan = [s for s in plan if s.seq is not victim]
                continue
            if len(self.running) == 1:  # then it is the whole plan: a shorter prompt chunk may fit (what a
                shorter = _shorter_chunks(plan, backed.failed)  # chunk needs grows with its length: a sliding
                if shorter is not None:                          # window's pages, not only the prompt's)
                    plan = shorter
                    continue
            victim = max(self.running, key=lambda s: s.seq_id)  # the newest sequence
            if len(self.running) == 1:  # it alone, one token at a time
                need = victim.num_computed_tokens + plan[0].num_new_tokens
                self._fail_seq(victim, finished, (
                    f"request {victim.request_id} (sample {victim.index}) needs {need} "
                    "tokens of KV cache, more than the physical memory can hold even when it runs "
                    "alone; raise physical_memory or lower max_tokens / the prompt length"))
            else:
                self.preempt(victim)
                preempted.append(victim)
            plan = [s for s in plan if s.seq is not victim]
        return plan, preempted, finished

    def preempt(self, seq: Sequence, count: bool = True) -> None:
        """Free `seq`'s slot and queue it again (it keeps its generated tokens): swapped out,
        or to recompute. `count`: a preemption for memory (counted in num_preemptions;
        swapped out in "swap" mode; with prefix caching, what it computed stays cached)."""
        self.running.remove(seq)
        ran = count and seq.has_run  # one that never ran in its slot was only admitted too early
        if not (ran and self.config.preemption_mode == "swap" and self._swap_out(seq)):
            if ran:
                self._cache_prefix(seq, seq.token_ids[:seq.num_computed_tokens])
            self.kv.free_reqid(seq.slot)  # one swapped in that has not run since keeps its host copy
        if ran:
            seq.num_preemptions += 1
            self.num_preemptions += 1
        seq.slot, seq.num_computed_tokens = None, 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def _swap_out(self, seq: Sequence) -> bool:
        """Copy `seq`'s computed tokens to host memory and free its slot; False (slot kept)
        when the copy fails."""
        try:
            seq.swap = self.kv.swap_out(seq.slot, seq.num_computed_tokens)
        except FatalEngineError:  # e.g. a failed collective: the engine stops
            raise
        except Exception as e:  # noqa: BLE001 - e.g. no host memory: recompute instead
            logger.warning("vattn: swapping request %d out failed (%s: %s); it recomputes",
                           seq.request_id, type(e).__name__, e)
            return False
        self.num_swapped_out += 1
        return True

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
                self._fail_seq(seq, finished, (
                    f"the KV cache failed {seq.num_failures} times in a row to back an iteration of "
                    f"request {seq.request_id}: {type(error).__name__}: {error}"))
            else:
                self.preempt(seq, count=False)
                preempted.append(seq)

    def _fail_seq(self, seq: Sequence, finished: list[Sequence], error: str) -> None:
        """Finish running `seq` with "error" now (into `finished`), or, while a token it sampled
        is in flight, when that token is taken (`postprocess`): the tokens it ends with are
        those of synchronous scheduling. Meanwhile it keeps its slot and is not scheduled."""
        if seq.num_placeholders:
            seq.error = error
        else:
            self.finish(seq, "error", error=error)
            finished.append(seq)
