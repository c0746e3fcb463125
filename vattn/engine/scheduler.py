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
   When it cannot, a sequence admitted in this iteration goes back to waiting first (the
   newest: it has not run; not a preemption), then the newest running sequence is
   preempted, and step is tried again. A
   sequence left alone whose prompt chunk still cannot be backed runs a shorter chunk
   (halved until it fits: what a chunk needs grows with its length, a sliding window's
   pages too, not only the prompt's); one that cannot be backed even alone, one token at a
   time, is finished with finish_reason "error".

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

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Mapping, NamedTuple, Protocol

from vattn.checks import as_int
from vattn.engine.sequence import FinishReason, Sequence, SequenceStatus
from vattn.errors import FatalEngineError, InvalidConfigError, NoFreeSlotError, OutOfPhysicalMemoryError

logger = logging.getLogger(__name__)

MAX_FAILURES = 2  # failed iterations in a row after which a sequence finishes with "error"
LOAD_PATIENCE_S = 10.0  # a request waits this long at most for its blocks read from disk
LOAD_POLL_S = 0.005  # a schedule with only such requests waits this long for a read, not spinning

SeqId = tuple[int, int]  # (request_id, sample index)


class StepOutcome(Protocol):
    failed: tuple[int, ...]

    def __bool__(self) -> bool: ...


class PrefixSlots(Protocol):
    """What the scheduler needs of a prefix cache (`vattn.prefix_cache.PrefixCache` fits)."""

    def map_prefix(self, reqid: int, token_ids: list[int], fits: Callable[[int], bool] | None = None) -> int: ...

    def uncount(self, reqid: int) -> None: ...

    def insert(self, reqid: int, token_ids: list[int]) -> None: ...


class KVSlots(Protocol):
    """What the scheduler needs of the cache (`vattn.KVCache` fits). `can_fork` and `fork`
    are called only for requests with n > 1; `can_step` is optional (without it, admission
    is decided by the step alone, as with tensor parallelism)."""

    @property
    def num_free_reqids(self) -> int: ...

    def alloc_reqid(self) -> int: ...

    def free_reqid(self, reqid: int) -> None: ...

    def step(self, seq_lens: Mapping[int, int]) -> StepOutcome: ...

    def can_step(self, seq_lens: Mapping[int, int]) -> bool: ...

    def can_fork(self, reqid: int, num_tokens: int) -> bool: ...

    def fork(self, reqid: int, num_tokens: int) -> int: ...

    def swap_out(self, reqid: int, num_tokens: int) -> Any: ...

    def swap_in(self, handle: Any) -> int: ...


PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: sequences running at once; max_num_batched_tokens: tokens per
    iteration (the prefill chunk size follows from it: what decodes leave);
    preemption_mode: 'recompute' | 'swap' (see the module docstring)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            object.__setattr__(self, name, as_int(getattr(self, name), name, InvalidConfigError, low=1))
        if self.preemption_mode not in PREEMPTION_MODES:
            raise InvalidConfigError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= max_num_seqs="
                f"{self.max_num_seqs}, so that every running sequence can decode each iteration")


class ScheduledSequence(NamedTuple):
    seq: Sequence
    num_new_tokens: int  # tokens computed this iteration, from seq.num_computed_tokens on (drafts included)
    # PENDING samples of seq's request that draw their first token from seq's logits row
    # (seq is sample 0 and this iteration computes the end of its prompt)
    fan_out: tuple[Sequence, ...] = ()
    # speculative decoding: draft tokens computed after seq's last token (the last num_new_tokens),
    # verified by the target's rows; the computed length then stands after those accepted
    drafts: tuple[int, ...] = ()


class Proposer(Protocol):
    """Draft tokens for speculative decoding (`vattn.engine.spec_decode.NgramProposer` fits)."""

    def propose(self, seq: Sequence, limit: int) -> list[int]: ...

    def observe(self, seq: Sequence, proposed: int, accepted: int) -> None: ...


class SchedulerOutput(NamedTuple):
    scheduled: list[ScheduledSequence]  # backed by the cache: run these
    preempted: list[Sequence]  # sent back to the waiting queue this iteration (memory or a failed step)
    finished: list[Sequence]  # finished with "error": cannot fit even alone, or the cache failed again

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def _shorter_chunks(plan: list[ScheduledSequence], failed: Collection[int]) -> list[ScheduledSequence] | None:
    """`plan` with the prompt chunks of the `failed` slots halved, or None when every failed
    slot computes one token already."""
    failed = set(failed)
    if not any(item.seq.slot in failed and item.num_new_tokens > 1 for item in plan):
        return None
    return [item._replace(num_new_tokens=item.num_new_tokens // 2)
            if item.seq.slot in failed and item.num_new_tokens > 1 else item for item in plan]


class _Fits:
    """`fits(n)` of one admission (see `Scheduler._fits`). `sticky` (other sequences run this
    iteration): once a length is refused every later ask is, so a lookup restores its whole
    chain from the lower tiers or nothing, and the scheduler leaves the request waiting
    (`refused`): a request restored in part computes the rest, and needs the same pages for
    it a little later, where it preempts the newest running sequence (measured: 5x the
    preemptions of waiting)."""

    def __init__(self, can_step: Callable[[Mapping[int, int]], bool], lens: dict[int, int], slot: int,
                 total: int, budget: int, sticky: bool) -> None:
        self.can_step, self.lens, self.slot, self.total, self.budget = can_step, lens, slot, total, budget
        self.sticky = sticky
        self.refused = False

    def __call__(self, n: int) -> bool:
        if self.refused and self.sticky:
            return False
        self.lens[self.slot] = n + min(self.total - n, self.budget)
        try:
            ok = bool(self.can_step(self.lens))
        except FatalEngineError:  # e.g. a failed collective: the engine stops
            raise
        except Exception:  # noqa: BLE001 - the step itself will say what is wrong
            ok = True
        self.refused |= not ok
        return ok


class Scheduler:
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

    def _admit(self, seq: Sequence, plan: list[ScheduledSequence], budget: int) -> bool:
        """Give waiting `seq` a slot (and what of its tokens the slot already holds), or
        return False to leave it waiting. `plan`: this iteration's sequences so far, `budget`
        the tokens left. With prefix caching the lookup restores from a lower tier only
        what the request can then run with beside `plan` (`kv.can_step`), and a request that
        cannot run beside `plan` even with its device hit is left waiting (while `plan` runs:
        its sequences free memory), so an admission never takes the pages of a running
        sequence and never restores blocks it cannot keep."""
        if seq.swap is not None:
            try:
                seq.slot = self.kv.swap_in(seq.swap)
            except (NoFreeSlotError, OutOfPhysicalMemoryError):
                if self.running:
                    return False  # wait for memory: the running sequences will free some
                seq.swap = None  # nothing runs that could free memory: recompute instead
            except FatalEngineError:  # e.g. a failed collective: the engine stops
                raise
            except Exception as e:  # noqa: BLE001 - the cache's books hold: recompute instead
                logger.warning("vattn: swapping request %d back in failed (%s: %s); it recomputes",
                               seq.request_id, type(e).__name__, e)
                seq.swap = None
            else:
                seq.num_computed_tokens = seq.swap.num_tokens
                self.num_swapped_in += 1
                return True
        source = self._fork_source(seq)
        if source is not None:
            try:
                seq.slot = self.kv.fork(source.slot, seq.num_prompt_tokens)
            except (NoFreeSlotError, OutOfPhysicalMemoryError):
                return False  # no page for the copy of the partial page: wait for memory
            except FatalEngineError:  # e.g. a failed collective: the engine stops
                raise
            except Exception as e:  # noqa: BLE001 - the cache's books hold: compute the prompt instead
                logger.warning("vattn: forking request %d's prompt failed (%s: %s); sample %d computes it",
                               seq.request_id, type(e).__name__, e, seq.index)
            else:
                seq.num_computed_tokens = seq.num_prompt_tokens
                return True
        seq.slot = self.kv.alloc_reqid()
        fits = self._fits(seq, plan, budget)
        if self.prefix_cache is not None:
            self._looked_up.add(seq.slot)
            try:
                if fits is None:
                    seq.num_computed_tokens = self.prefix_cache.map_prefix(seq.slot, seq.token_ids)
                else:
                    seq.num_computed_tokens = self.prefix_cache.map_prefix(seq.slot, seq.token_ids, fits=fits)
            except FatalEngineError:  # e.g. a failed collective: the engine stops
                raise
            except Exception as e:  # noqa: BLE001 - a miss: the books hold, the sequence computes it all
                logger.warning("vattn: mapping cached prefix pages for request %d failed (%s: %s)",
                               seq.request_id, type(e).__name__, e)
        if plan and fits is not None and (fits.refused or not fits(seq.num_computed_tokens)):
            self.num_admissions_held += 1
            self._release(seq)
            return False
        return True

    def _fits(self, seq: Sequence, plan: list[ScheduledSequence], budget: int) -> _Fits | None:
        """`fits(n)`: whether `seq`, holding its first `n` tokens in its new slot, can run its
        first chunk this iteration beside `plan` (planned by `kv.can_step`, nothing mapped);
        None when the cache cannot tell (the step decides)."""
        can_step = getattr(self.kv, "can_step", None)
        if can_step is None:
            return None
        lens = {s.seq.slot: s.seq.num_computed_tokens + s.num_new_tokens for s in plan}
        return _Fits(can_step, lens, seq.slot, seq.num_tokens, budget, sticky=bool(plan))

    def _release(self, seq: Sequence) -> None:
        """Give back the slot `_admit` gave `seq` (it stays waiting; what it mapped stays
        cached) and take back its lookup's counts: it is looked up again when admitted."""
        if self.prefix_cache is not None and seq.slot in self._looked_up:
            self._looked_up.discard(seq.slot)
            uncount = getattr(self.prefix_cache, "uncount", None)
            if uncount is not None:
                uncount(seq.slot)
        self.kv.free_reqid(seq.slot)
        seq.slot, seq.num_computed_tokens = None, 0

    def _unadmit(self, seq: Sequence) -> None:
        """Send `seq`, admitted in this schedule, back to waiting before it ran (the step
        could not back it): no preemption, nothing computed to keep."""
        self.running.remove(seq)
        self.num_unadmitted += 1
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def _fork_source(self, seq: Sequence) -> Sequence | None:
        """A running sibling of `seq` whose slot holds the whole prompt and can be forked
        there (`kv.can_fork`: a sliding window may have moved past the prompt, recurrent
        states are right at one length only), if any."""
        if len(seq.samples) == 1:
            return None
        n = seq.num_prompt_tokens
        return next((s for s in seq.samples if s is not seq and s.status is SequenceStatus.RUNNING
                     and s.num_computed_tokens >= n and self.kv.can_fork(s.slot, n)), None)

    @staticmethod
    def _with_fan_out(item: ScheduledSequence) -> ScheduledSequence:
        seq = item.seq
        if seq.num_computed_tokens + item.num_new_tokens == seq.num_tokens and seq.num_output_tokens == 0:
            pending = seq.pending_samples
            if pending:
                return item._replace(fan_out=tuple(pending))
        return item

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
