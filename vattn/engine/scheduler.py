"""`Scheduler`: continuous batching over vattn slots. Plain Python, no torch.

It owns the sequence state machine: `schedule` picks an iteration's tokens and backs them
with pages, `commit` counts them computed once the iteration is launched, `postprocess`
takes the tokens it sampled.

```
            add            admit (slot)            finish
  PENDING -------> WAITING ------------> RUNNING ----------> FINISHED
  (sample i > 0:      ^                     |
   first token from   +------ preempt ------+
   sample 0's prompt)
```

Every iteration:

1. running sequences: decodes first (one token each), then unfinished prompts in arrival
   order, each a chunk of at most what is left of the token budget;
2. waiting sequences in arrival order (FCFS) while a slot, a seat (max_num_seqs) and
   budget are left: each gets a slot and a first chunk, planned with the step: while other
   sequences run this iteration, a request is admitted only when its cached prefix and first
   chunk fit beside them (`kv.can_step`, decided from the books; its restore from a lower
   tier is all or nothing), else it and everything behind it waits (the running sequences
   free memory as they finish): an admission never takes a running sequence's pages;
3. `kv.step({slot: num_computed_tokens + num_new_tokens})` backs the batch with pages.
   When it cannot, drafts, then this iteration's admissions, then running sequences (the
   newest first) give way, and a prompt left alone runs a shorter chunk; one that cannot be
   backed even alone finishes with "error" (`vattn.engine.preemption`, which also says what
   preemption by recompute or swap does, and what happens when the cache's `step` raises).

How a waiting sequence gets its slot (swapped back in, forked from a sibling, or a new slot
with its cached prefix mapped) is `vattn.engine.admission`'s.

Parallel sampling (`SamplingParams.n > 1`): only sample 0 is queued; the others are
PENDING. The iteration that computes the end of sample 0's prompt draws the first token of
every sample from that one logits row (`ScheduledSequence.fan_out`); the others then wait
for a slot like preempted sequences. A waiting sample whose sibling runs with the prompt
computed is admitted by forking that sibling's slot (`kv.fork`: whole prompt pages shared,
the partial last page copied) and computes only its own tokens; when no sibling has the
prompt (they finished or were preempted), it recomputes the prompt in a slot of its own.
A sample preempted later comes back the same way. A fork that finds no page for its copy
leaves the sample waiting (FCFS: nothing behind it is admitted in that iteration).

Prefix caching (a `prefix_cache`, see `vattn.prefix_cache.PrefixCache`): a sequence that
gets a new slot maps the longest cached prefix of its tokens into it (`map_prefix`: no
copy, at least one token left to compute; blocks restored from the host or disk tier only
where the request can then run, see 2. above) and starts with those tokens computed. With a
disk tier, a waiting sequence whose cached blocks are on disk only first waits for them to
be read in the background (`load`, as vLLM's WAITING_FOR_REMOTE_KVS): it keeps its place,
the sequences behind it may be admitted meanwhile, and it is admitted when the reads end
(its blocks are host hits then), failed or not, or after LOAD_PATIENCE_S. A prompt counts
in the cache's `num_query_tokens` once per admission: a request sent back to waiting before
it ran takes its lookup back (`uncount`). When a
sequence's prompt is computed, the pages of its whole prompt blocks (whole tokens in whole
pages) are pinned in the cache (`insert`); a sequence preempted for memory pins the whole
blocks of everything it computed, so that its recomputation maps them back unless memory
pressure evicted them first (least recently used first). With a host tier (`offload_bytes`)
those blocks are written through to host memory as they are pinned, so the re-admission of a
preempted sequence restores them from there rather than computing them again: in "recompute"
mode only the tokens after its last whole block are computed again (a swap of whole blocks,
no second copy of what the host tier holds already).

Asynchronous scheduling (the engine's `EngineConfig.async_scheduling`): the engine schedules
and launches iteration N+1 before it takes N's outputs. `commit` has counted N's tokens
computed and given each sequence that samples in N a placeholder (`Sequence.num_placeholders`),
so N+1 decodes it (its input is read on the device). `postprocess` of N then replaces the
placeholder with the token; a sequence that stops there (a stop token, max_tokens), or was
aborted meanwhile, is finished and the token N+1 computed for it is dropped. A sequence whose
placeholder already makes max_tokens, or whose iteration failed (`commit` sets its `error`), is
not scheduled: nothing it could compute would be kept. One that `schedule` must fail (it cannot
fit even alone; the cache failed again) while its token is in flight keeps its `error` and its
slot until `postprocess` has taken that token, so it ends with the tokens it would have had.
Synchronous scheduling is the same calls with `postprocess` right after `commit`.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from typing import Any, Collection, Iterable, Mapping

from vattn.engine.admission import Admission
from vattn.engine.preemption import MAX_FAILURES, Preemption  # noqa: F401 - MAX_FAILURES importable here too
from vattn.engine.schedule_types import (  # noqa: F401 - importable from here too
    PREEMPTION_MODES, KVSlots, PrefixSlots, Proposer, ScheduledSequence, SchedulerConfig, SchedulerOutput, SeqId,
    StepOutcome)
from vattn.engine.sequence import FinishReason, Sequence, SequenceStatus
from vattn.errors import FatalEngineError

logger = logging.getLogger(__name__)

LOAD_PATIENCE_S = 10.0  # a request waits this long at most for its blocks read from disk
LOAD_POLL_S = 0.005  # a schedule with only such requests waits this long for a read, not spinning

class Scheduler(Admission, Preemption):
    """FCFS continuous batching with a token budget, chunked prefill, preemption and
    parallel sampling by forking."""

    def __init__(self, config: SchedulerConfig, kv: KVSlots, eos_token_ids: Collection[int] = frozenset(),
                 prefix_cache: PrefixSlots | None = None, proposer: Proposer | None = None,
                 spec_counters: Any = None) -> None:
        self.config = config
        self.proposer = proposer  # speculative decoding: drafts for decodes (see `_drafts`)
        self.spec_counters = spec_counters  # `vattn.engine.spec_decode.SpecCounters`, with a proposer
        self.kv = kv
        self.prefix_cache = prefix_cache
        self.eos_token_ids = frozenset(eos_token_ids)  # stop tokens unless SamplingParams.ignore_eos
        self.waiting: deque[Sequence] = deque()  # arrival order: seq_id (request id, then sample index)
        self.running: list[Sequence] = []  # admission order
        self.requests: dict[int, list[Sequence]] = {}  # unfinished requests: request id -> samples
        self.num_preemptions = 0
        self.num_swapped_out = 0  # preemptions by swapping (their tokens copied to host)
        self.num_swapped_in = 0  # re-admissions by swapping in
        self.num_computed_tokens = 0  # tokens computed (forward passes) over the scheduler's life
        self.loading: dict[SeqId, float] = {}  # waiting sequences whose blocks are read from disk -> since
        self.num_admissions_held = 0  # admissions left waiting: the request could not run beside the others
        self.num_unadmitted = 0  # admitted, then sent back before running: the step could not back it
        self._looked_up: set[int] = set()  # slots given a prefix lookup in this schedule (see `_release`)

    def add(self, seq: Sequence) -> None:
        """Queue a new request, given as its sample 0 (O(1): see `_enqueue`). With
        `params.n > 1` its other samples are created here, PENDING."""
        for index in range(len(seq.samples), seq.params.n):
            seq.spawn(index)
        self.requests[seq.request_id] = seq.samples
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        """Sequences waiting or running."""
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ schedule ----
    def schedule(self) -> SchedulerOutput:
        """Pick this iteration's sequences and token counts, and back them with pages."""
        budget = self.config.max_num_batched_tokens
        plan: list[ScheduledSequence] = []
        decodes: list[Sequence] = []
        prompts: list[Sequence] = []
        for seq in self.running:
            if seq.error is not None or (seq.num_placeholders and seq.num_output_tokens >= seq.params.max_tokens):
                continue  # an iteration in flight ends it (its error, or its last token): nothing more to compute
            (decodes if seq.num_uncomputed_tokens == 1 else prompts).append(seq)
        for seq in decodes + prompts:
            if budget == 0:
                break
            n = min(seq.num_uncomputed_tokens, budget)
            drafts = self._drafts(seq, budget - 1) if n == 1 and self.proposer is not None else ()
            plan.append(ScheduledSequence(seq, n + len(drafts), drafts=drafts))
            budget -= n + len(drafts)
        admitted: list[Sequence] = []
        self._looked_up.clear()
        skip = 0  # waiting sequences left waiting for their blocks read from disk: those behind go first
        while (len(self.waiting) > skip and budget > 0 and len(self.running) < self.config.max_num_seqs
               and self.kv.num_free_reqids > 0):
            seq = self.waiting[skip]
            if self._loading(seq):
                skip += 1
                continue
            if not self._admit(seq, plan, budget):
                break
            del self.waiting[skip]
            seq.status, seq.has_run = SequenceStatus.RUNNING, False
            self.running.append(seq)
            admitted.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            # (a sample forked or swapped in with its tokens computed decodes at once: drafts too)
            drafts = self._drafts(seq, budget - 1) if n == 1 and self.proposer is not None else ()
            plan.append(ScheduledSequence(seq, n + len(drafts), drafts=drafts))
            budget -= n + len(drafts)

        if skip and not plan:  # nothing to run but reads from disk: wait a little for one, not spin
            getattr(self.prefix_cache, "wait_loads", time.sleep)(LOAD_POLL_S)
        plan, preempted, finished = self._back(plan, admitted)
        return SchedulerOutput([self._with_fan_out(s) for s in plan], preempted, finished)

    def _drafts(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """Speculative decoding: draft tokens for decoding `seq` (at most `budget`, and never past
        max_tokens: the drafts accepted and the target's token must fit). None for a sequence with
        a token in flight (its tokens are not all on the host)."""
        limit = min(budget, seq.params.max_tokens - seq.num_output_tokens - 1)
        if limit <= 0 or seq.num_placeholders:
            return ()
        return tuple(self.proposer.propose(seq, limit)[:limit])

    def _loading(self, seq: Sequence) -> bool:
        """Whether waiting `seq` waits for its cached blocks read from disk (`PrefixCache.load`
        starts the reads, off the engine's thread). It is admitted once they ended, failed or
        not, or after LOAD_PATIENCE_S: never forever."""
        load = getattr(self.prefix_cache, "load", None)
        if load is None or seq.swap is not None:
            return False
        now = time.monotonic()
        try:
            if now - self.loading.get(seq.seq_id, now) < LOAD_PATIENCE_S and load(seq.token_ids):
                self.loading.setdefault(seq.seq_id, now)
                return True
        except FatalEngineError:  # e.g. a failed collective: the engine stops
            raise
        except Exception as e:  # noqa: BLE001 - not read ahead: its lookup misses those blocks
            logger.warning("vattn: reading request %d's cached blocks ahead failed (%s: %s)",
                           seq.request_id, type(e).__name__, e)
        self.loading.pop(seq.seq_id, None)
        return False

    @staticmethod
    def _with_fan_out(item: ScheduledSequence) -> ScheduledSequence:
        seq = item.seq
        if seq.num_computed_tokens + item.num_new_tokens == seq.num_tokens and seq.num_output_tokens == 0:
            pending = seq.pending_samples
            if pending:
                return item._replace(fan_out=tuple(pending))
        return item

    # --------------------------------------------------------------- postprocess ----
    def commit(self, scheduled: list[ScheduledSequence], errors: Mapping[SeqId, str] | None = None) -> None:
        """Count the tokens of an iteration that was launched as computed (before its outputs
        are known: see the module docstring); a sequence whose computed tokens reach its end
        samples a token, a placeholder until `postprocess`. A sequence in `errors` (its forward
        or sampling raised at launch) computed nothing: it gets its error and is not scheduled
        again; `postprocess` finishes it."""
        for item in scheduled:
            seq = item.seq
            if errors and seq.seq_id in errors:
                seq.error = errors[seq.seq_id]
                continue
            before = seq.num_computed_tokens
            seq.num_computed_tokens += item.num_new_tokens - len(item.drafts)  # drafts: once accepted (postprocess)
            self.num_computed_tokens += item.num_new_tokens
            seq.num_failures, seq.has_run, seq.swap = 0, True, None  # a host copy is stale now
            if before < seq.num_prompt_tokens <= seq.num_computed_tokens:
                self._cache_prefix(seq, seq.prompt_token_ids)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.num_placeholders += 1  # it samples

    def postprocess(self, scheduled: list[ScheduledSequence], tokens: Mapping[SeqId, int],
                    errors: Mapping[SeqId, str], now: float | None = None,
                    logprobs: Mapping[SeqId, Any] | None = None,
                    accepted: Mapping[SeqId, list[int]] | None = None) -> list[Sequence]:
        """Take the outputs of a committed iteration: a sequence that sampled gets its token
        (`tokens`, in place of its placeholder; its `logprobs` entry too, when it asked) and
        finishes on a stop token, a stop string or max_tokens; one in `errors` finishes with
        "error". A sequence that finished since the iteration was launched (an abort, or its
        previous token stopped it) drops its token. The samples
        of a fan-out get their first token and wait for a slot. Returns every sequence that
        got a token or finished. A sequence that ran drafts gets its `accepted` ones first, each
        counted computed and checked for a stop like any token (a stop cuts the run there), then its
        token; the rows of the rest are written over by the next iteration."""
        now = time.perf_counter() if now is None else now
        changed: list[Sequence] = []
        for item in scheduled:
            seq = item.seq
            for child in item.fan_out:
                if child.is_finished:  # aborted with its request while the iteration ran
                    continue
                if child.seq_id in tokens:
                    self._append_token(child, tokens[child.seq_id], now, logprobs)
                    if not child.is_finished:
                        child.status = SequenceStatus.WAITING
                        self._enqueue(child)
                else:
                    self.finish(child, "error", errors.get(child.seq_id, errors.get(seq.seq_id)), now)
                changed.append(child)
            if seq.is_finished:
                continue
            error = errors.get(seq.seq_id)
            if error is not None:
                self.finish(seq, "error", error, now)
                changed.append(seq)
                continue
            token = tokens.get(seq.seq_id)
            if token is None:  # a prompt chunk that does not reach the end yet
                continue
            seq.num_placeholders -= 1
            if item.drafts:
                kept = (accepted or {}).get(seq.seq_id, ())
                self._note_drafts(seq, len(item.drafts), len(kept))
                for draft in kept:
                    self._append_token(seq, draft, now)
                    seq.num_computed_tokens += 1  # its row was computed by this iteration
                    if seq.is_finished:
                        break
                if seq.is_finished:
                    changed.append(seq)
                    continue
            self._append_token(seq, token, now, logprobs)
            if seq.error is not None and not seq.is_finished:  # failed while this token was in flight
                self.finish(seq, "error", seq.error, now)
            changed.append(seq)
        return changed

    def _note_drafts(self, seq: Sequence, proposed: int, accepted: int) -> None:
        state = seq.spec
        state.num_drafts += 1
        state.num_draft_tokens += proposed
        state.num_accepted_tokens += accepted
        if self.spec_counters is not None:
            self.spec_counters.add(seq.request_id, proposed, accepted)
        if self.proposer is not None:
            self.proposer.observe(seq, proposed, accepted)

    def _append_token(self, seq: Sequence, token: int, now: float,
                      logprobs: Mapping[SeqId, Any] | None = None) -> None:
        """Append a sampled token (its logprobs, its text) and finish `seq` if it stops there:
        a stop token, a stop string its text now contains (none before min_tokens), max_tokens."""
        seq.token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        if seq.logprobs is not None and logprobs and seq.seq_id in logprobs:
            entry = logprobs[seq.seq_id]
            seq.logprobs.append(entry)
            seq.cumulative_logprob += entry[token].logprob
        new_text = seq.detokenizer.add(token) if seq.detokenizer is not None else ""
        p = seq.params
        num_output = len(seq.token_ids) - seq.num_prompt_tokens  # (not counting a token in flight)
        if num_output >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.stop_reason = token
                self.finish(seq, "stop", now=now)
                return
            if not p.ignore_eos and token in self.eos_token_ids:
                self.finish(seq, "stop", now=now)
                return
            if p.stop and new_text:
                stop = seq.detokenizer.find_stop(p.stop, len(new_text), p.include_stop_str_in_output)
                if stop is not None:
                    seq.stop_reason = stop
                    self.finish(seq, "stop", now=now)
                    return
        if num_output >= p.max_tokens:
            self.finish(seq, "length", now=now)

    # -------------------------------------------------------------- state changes ----
    def abort(self, request_ids: Iterable[int]) -> list[Sequence]:
        """Finish every unfinished sample of these requests ("abort") and free their slots.
        Ids of no unfinished request are skipped. Returns the sequences finished."""
        seqs: list[Sequence] = []
        for rid in sorted(set(request_ids)):
            live = [s for s in self.requests.get(rid, ()) if not s.is_finished]
            for seq in live:
                if not seq.is_finished:  # sample 0's abort finished the PENDING ones already
                    self.finish(seq, "abort")
            seqs += live
        return seqs

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None, now: float | None = None) -> None:
        """Mark `seq` finished and give its slot back (its pages stay for the next request).
        Sample 0 finishing before its prompt was sampled ("error", "abort") takes the
        PENDING samples of its request with it."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free_reqid(seq.slot)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.loading.pop(seq.seq_id, None)
        now = time.perf_counter() if now is None else now
        seq.swap = None  # its host copy, if swapped out
        for s in [seq, *seq.pending_samples]:
            s.slot, s.num_placeholders = None, 0  # a token still in flight is dropped
            s.status = SequenceStatus.FINISHED
            s.finish_reason, s.error, s.finished_time = reason, error, now
        if all(s.is_finished for s in seq.samples):
            self.requests.pop(seq.request_id, None)

    def _cache_prefix(self, seq: Sequence, token_ids: list[int]) -> None:
        """Pin the whole blocks of `token_ids`, computed in `seq`'s slot, for later requests."""
        if self.prefix_cache is None:
            return
        try:
            self.prefix_cache.insert(seq.slot, token_ids)
        except FatalEngineError:  # e.g. a failed collective: the engine stops
            raise
        except Exception as e:  # noqa: BLE001 - not cached: later requests compute it
            logger.warning("vattn: caching the prefix of request %d failed (%s: %s)",
                           seq.request_id, type(e).__name__, e)

    def _enqueue(self, seq: Sequence) -> None:
        """Keep `waiting` in arrival order, in O(1) for what happens all the time: a new
        request is the newest (it goes to the back) and a preempted one is older than every
        waiting one (it goes to the front: the victim is always the newest running sequence,
        and admission takes the oldest waiting first). Anything else is put in place."""
        waiting, key = self.waiting, seq.seq_id
        if not waiting or waiting[-1].seq_id < key:
            waiting.append(seq)
        elif key < waiting[0].seq_id:
            waiting.appendleft(seq)
        else:
            waiting.insert(bisect.bisect(waiting, key, key=lambda s: s.seq_id), seq)
