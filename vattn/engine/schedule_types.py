"""What the scheduler plans and what it needs of its parts: `SchedulerConfig`, an iteration's
`ScheduledSequence`s and `SchedulerOutput`, and the protocols of the cache (`KVSlots`), the
prefix cache (`PrefixSlots`) and a draft proposer (`Proposer`). Shared by `scheduler.py` and
its bases (`admission.py`, `preemption.py`); every name is importable from
`vattn.engine.scheduler` too. Plain Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Protocol

from vattn.checks import as_int
from vattn.engine.sequence import Sequence
from vattn.errors import InvalidConfigError

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
    preemption_mode: 'recompute' | 'swap' (see `vattn.engine.preemption`)."""

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
