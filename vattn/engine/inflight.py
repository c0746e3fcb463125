"""An iteration launched on the device (`InFlight`, what `ModelRunner.launch` returns), what
it produced once its tokens reach the host (`RunOutput`), and the engine's queue of them
(`InFlightQueue`).

With asynchronous scheduling the engine launches iteration N+1 before it takes N's outputs:
N's sampled tokens stay on the device (`InFlight.tokens`), where N+1's inputs read them, while a
copy to pinned host memory is under way; `InFlight.result()` waits for that copy only.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from vattn.engine.sampler import Sampled
from vattn.engine.scheduler import ScheduledSequence, Scheduler, SeqId
from vattn.engine.sequence import Sequence, TokenLogprobs


class RunOutput(NamedTuple):
    """What one iteration produced, by sequence id (request id, sample index)."""

    tokens: dict[SeqId, int]  # the sampled token of every sequence whose computed tokens reached its end
    errors: dict[SeqId, str]  # why a sequence failed (it finishes with "error"); its tokens are not computed
    logprobs: dict[SeqId, TokenLogprobs] = {}  # of sequences that asked (SamplingParams.logprobs); never mutated
    accepted: dict[SeqId, list[int]] = {}  # speculative decoding: the drafts each verified sequence keeps; never mutated


class InFlight:
    """An iteration launched on the device (`ModelRunner.launch`): its sampled tokens stay
    there (`tokens`: the next iteration's inputs read them) while a copy goes to the host;
    `result()` waits for that copy. What failed at launch is known at once (`errors`)."""

    def __init__(self, sampled: Sampled) -> None:
        self.rows = {sid: row for row, sid in enumerate(sampled.seq_ids)}  # each sampled sequence's row
        self.tokens = sampled.tokens  # [S] int64 on the device, or None
        self.errors = sampled.errors
        self.logprobs = sampled.logprobs  # on the device; read by result(), after the tokens' copy
        self.accepted = sampled.accepted  # on the host (verification reads the target's tokens there)
        self._host = self.tokens  # on CUDA a pinned copy, written when the device gets there
        self._copied: Any = None  # the CUDA event after that copy
        if self.tokens is not None and self.tokens.device.type == "cuda":
            self._host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self._host.copy_(self.tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> RunOutput:
        """The sampled tokens as ints (waiting for the device), and the errors."""
        if self._copied is not None:
            self._copied.synchronize()
        ids = self._host.tolist() if self._host is not None else []
        errors = self.errors
        logprobs = {sid: entry for rows in self.logprobs for sid, entry in rows.to_host().items()
                    if sid not in errors}
        return RunOutput({sid: ids[row] for sid, row in self.rows.items() if sid not in errors}, errors, logprobs,
                         self.accepted)


class InFlightQueue:
    """The iterations `LLM.step` launched whose outputs were not taken yet, oldest first: at
    most `depth` stay in flight when a step returns (1 with asynchronous scheduling, else 0)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._runs: deque[tuple[list[ScheduledSequence], InFlight]] = deque()

    def __len__(self) -> int:
        return len(self._runs)

    def clear(self) -> None:
        self._runs.clear()

    def launch(self, runner: Any, scheduler: Scheduler, scheduled: list[ScheduledSequence]) -> None:
        """Queue the model's iteration on the device (`runner.launch`) and count its tokens
        computed (`scheduler.commit`: its samples are placeholders until `take`)."""
        run = runner.launch(scheduled)
        scheduler.commit(scheduled, run.errors)
        self._runs.append((scheduled, run))

    def take(self, scheduler: Scheduler, drain: bool = False) -> Iterator[list[Sequence]]:
        """The outputs of the iterations launched, oldest first, each given to the scheduler
        (`postprocess`), until `depth` are left in flight (none when `drain`, or when no request
        is left unfinished: what is in flight would only be dropped). Yields, per iteration, the
        sequences that got a token or finished (read them before the next is taken)."""
        while self._runs and (drain or len(self._runs) > self.depth or not scheduler.has_unfinished()):
            scheduled, run = self._runs.popleft()
            result = run.result()  # waits for the device
            yield scheduler.postprocess(scheduled, result.tokens, result.errors, logprobs=result.logprobs,
                                        accepted=result.accepted)
