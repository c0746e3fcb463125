"""Admission: how a waiting sequence gets a slot (`Admission`, a base of `Scheduler`). Plain
Python, no torch.

In order, a waiting sequence is
- swapped back in when it was swapped out (`kv.swap_in`: no copy at all when nobody took its
  old slot or pages meanwhile), with its tokens computed. One that finds no slot or memory
  waits (FCFS: nothing behind it is admitted in that iteration) unless nothing runs that
  could free memory: then it recomputes;
- forked from a running sibling whose slot holds the whole prompt (parallel sampling,
  `kv.fork`: whole prompt pages shared, the partial last page copied), computing only its
  own tokens; a fork that finds no page for its copy leaves it waiting;
- else given a new slot, into which the prefix cache maps the longest cached prefix of its
  tokens (`map_prefix`). While other sequences run this iteration, the lookup restores from
  a lower tier only what the request can then run with beside them (`Fits`, planned with
  `kv.can_step` from the books, all or nothing), and a request that cannot run beside them
  even with its device hit is left waiting, its slot given back (`_release`): an admission
  never takes the pages of a running sequence and never restores blocks it cannot keep.
"""
from __future__ import annotations

import logging
from typing import Callable, Mapping

from vattn.engine.schedule_types import KVSlots, PrefixSlots, ScheduledSequence
from vattn.engine.sequence import Sequence, SequenceStatus
from vattn.errors import FatalEngineError, NoFreeSlotError, OutOfPhysicalMemoryError

logger = logging.getLogger(__name__)


class Fits:
    """`fits(n)` of one admission (see `Admission._fits`). `sticky` (other sequences run this
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


class Admission:
    """How `Scheduler` admits a waiting sequence (see the module docstring); the scheduler
    sets the attributes read here and gives `_enqueue`."""

    kv: KVSlots
    prefix_cache: PrefixSlots | None
    running: list[Sequence]
    num_swapped_in: int
    num_admissions_held: int
    num_unadmitted: int
    _looked_up: set[int]
    _enqueue: Callable[[Sequence], None]

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

    def _fits(self, seq: Sequence, plan: list[ScheduledSequence], budget: int) -> Fits | None:
        """`fits(n)`: whether `seq`, holding its first `n` tokens in its new slot, can run its
        first chunk this iteration beside `plan` (planned by `kv.can_step`, nothing mapped);
        None when the cache cannot tell (the step decides)."""
        can_step = getattr(self.kv, "can_step", None)
        if can_step is None:
            return None
        lens = {s.seq.slot: s.seq.num_computed_tokens + s.num_new_tokens for s in plan}
        return Fits(can_step, lens, seq.slot, seq.num_tokens, budget, sticky=bool(plan))

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
