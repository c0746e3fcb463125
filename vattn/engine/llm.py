"""`LLM`: continuous-batching generation with Hugging Face models on a vattn cache.

```
with LLM("path/to/checkpoint", max_batch_size=8, page_size=64 << 10) as llm:
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
    rid = llm.add_request([5, 6, 7], SamplingParams(max_tokens=8))   # online use
    while llm.has_unfinished():
        for out in llm.step(): ...
    llm.abort_request(rid)                                           # a client went away
    four = llm.generate("Hi", SamplingParams(n=4, temperature=0.8, seed=1))[0].outputs  # one prefill, 4 samples
```
Sharing physical pages (see `Scheduler`): parallel samples fork the prompt's slot;
`enable_prefix_caching=True` maps cached prompt pages into new requests;
`preemption_mode="swap"` parks a preempted request in host memory instead of recomputing it.

Its parts: the requests checked at the edges (`requests.py`), the model loaded (`loader.py`),
the iterations in flight (`inflight.py`), beam search's driver (`beam_search.py`) and the
figures it reports (`figures.py`).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any
from typing import Sequence as Seq

import torch

from vattn.checks import is_int
from vattn.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchStats, search_batch
from vattn.engine.config import EngineConfig
from vattn.engine.figures import EngineFigures
from vattn.engine.inflight import InFlightQueue
from vattn.engine.loader import LoadedModel, load_model, prefix_salt
from vattn.engine.model_runner import ModelRunner
from vattn.engine.parallel import AgreedSlots, TensorParallel, TPModelRunner
from vattn.engine.requests import (as_id_list, as_params_list, as_prompt_list, check_context_length, eos_token_ids,
                                   make_sequence, request_output, requests_of, tokenize)
from vattn.engine.sampling_params import SamplingParams
from vattn.engine.scheduler import Scheduler, SchedulerOutput
from vattn.engine.spec_decode import NgramProposer, SpecCounters
from vattn.engine.sequence import RequestOutput, Sequence
from vattn.engine.turns import TurnLock
from vattn.errors import ClosedError, InvalidConfigError, InvalidRequestError
from vattn.idle import IdleTrim

logger = logging.getLogger(__name__)


class LLM(EngineFigures):
    """A generation engine: `LLM(model, **config).generate(prompts, sampling_params)`.

    `model`: a local checkpoint directory (loaded with `local_files_only=True`; its
    tokenizer too, when it has one), a `transformers.PretrainedConfig` (random weights,
    seeded by `seed`), or a loaded `PreTrainedModel` (used in place: moved to the engine's
    device/dtype, and its attention implementation is "vattn" until `close()`).
    `tokenizer`: overrides the checkpoint's; string prompts need one.
    `**config`: see `EngineConfig` (the cache's arguments by `vattn.init`'s names plus
    device, dtype, max_num_seqs, max_num_batched_tokens, seed, attention, and `budget=`:
    a `vattn.Budget` several engines share, e.g. two models on one GPU).

    Tensor parallelism (`tensor_parallel_size=N`, see `vattn.engine.parallel`): one process
    per rank under `torchrun`, each making the same calls; rank 0 gets the outputs, the
    others get [] from generate and step. A failure of the group raises TensorParallelError.

    Failures never poison the engine:
    - Bad input raises `InvalidRequestError` / `ContextLengthError` from add_request or
      generate before anything is queued (`SamplingParams` checks its own values).
    - A failure inside an iteration finishes the requests it belongs to with
      finish_reason "error" and `error` saying why, frees their slots, and the engine keeps
      serving the others: a request whose sampling raises fails alone; when the model's
      forward raises, each request of the batch is retried alone at once and fails only if
      it fails alone too (`ModelRunner.run`); when the cache's `step` raises, the
      iteration's requests recompute and fail only when that happens twice in a row
      (`Scheduler`).
    - A request that cannot fit into physical_memory even alone finishes with "error".
    - If `generate` is interrupted (KeyboardInterrupt, ...), its own requests are
      aborted; the final outputs of other requests are kept for the next `step()`.

    Threads: add_request, abort_request and step may be called from different threads
    (one lock, handed over in turn: abort_request waits for the iteration in flight, never
    for the iterations after it; `vattn.engine.turns`). generate steps the engine
    itself: run one generate at a time, and abort its requests from another thread.
    Under tensor parallelism every rank must make the same calls at the same point of its
    schedule, aborts included: a thread cannot time that, so abort_request while another
    thread is in generate raises InvalidRequestError there, and an abort made on some ranks
    only (or between different steps) makes the ranks' schedules differ, which is fatal
    (TensorParallelError at the next step). Abort from the thread that steps, between steps.

    Idle give-back (`idle_trim_s`): once the engine has had no request for that many
    seconds, it calls `cache.trim()` (every page no live token needs goes back to the device
    or host, cached prefixes too): from the idle policy's thread (`llm.idle`, a
    `vattn.idle.IdleTrim`), and at `step()` for an engine that is stepped while idle. New
    work maps pages again as usual.
    """

    def __init__(self, model: Any, tokenizer: Any = None, **config: Any) -> None:
        self.config = EngineConfig.from_kwargs(**config)
        device = self.config.torch_device()
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidConfigError(f"device {device} was asked for but CUDA is not available")
        self.tp: TensorParallel | None = None  # tensor parallelism: this rank (vattn.engine.parallel)
        if self.config.tensor_parallel_size > 1:
            self._start_parallel(model, tokenizer)
            return
        loaded = load_model(model, self.config, device)
        self.tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer
        self.runner = ModelRunner(loaded.model, loaded.dtype, device, self.config)
        try:
            self._start(loaded, self.runner.cache)
        except BaseException:
            self.runner.close()
            raise

    def _start_parallel(self, model: Any, tokenizer: Any) -> None:
        """This rank's shard, cache and agreed view of it (see vattn.engine.parallel)."""
        self.tp = tp = TensorParallel.start(self.config)
        try:
            loaded = tp.load_model(model, self.config)
            self.tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer
            self.runner = TPModelRunner(loaded.model, loaded.dtype, tp.device, self.config, tp)  # closed if it raises
        except BaseException:
            tp.close()
            raise
        try:
            self._start(loaded, AgreedSlots(self.runner.cache, tp))
        except BaseException:
            try:
                self.runner.close()
            finally:
                tp.close()
            raise

    def _start(self, loaded: LoadedModel, kv: Any) -> None:
        self.prefix_cache = None
        if self.config.enable_prefix_caching:  # (the salt: the rank's shard config, the same on every rank)
            self.prefix_cache = self.runner.prefix_cache(prefix_salt(loaded.model, loaded.dtype))
        spec = self.config.speculative_config
        self._spec_counters = SpecCounters() if spec is not None else None
        self.scheduler = Scheduler(self.config.scheduler_config(), kv,
                                   eos_token_ids=eos_token_ids(loaded.model), prefix_cache=self.prefix_cache,
                                   proposer=NgramProposer(spec) if spec is not None else None,
                                   spec_counters=self._spec_counters)
        self.runner.eos_token_ids = self.scheduler.eos_token_ids  # the sampler masks them under min_tokens
        self.max_context_len = self.runner.max_context_len
        self._next_id = 0
        self._unclaimed: list[RequestOutput] = []  # final outputs the next step() returns
        self._in_flight = InFlightQueue(1 if self.config.uses_async_scheduling() else 0)  # launched, not taken
        self._lock = TurnLock()  # handed over between iterations: another thread's abort waits one step, not a generate
        self._closed = False
        self._generating: int | None = None  # the thread in generate, if any
        self.num_idle_trims = 0  # times the idle engine gave its unused pages back
        self._beam_stats = BeamSearchStats()  # every beam search's forks (`beam_search_stats`)
        self.idle = IdleTrim(self.config.idle_trim_s, name="vattn-llm-idle-trim")  # the idle policy (vattn.idle)
        if self.idle.delay is not None:
            self.idle.start(self._on_idle_timer)
        self._note_idle()

    # ----------------------------------------------------------------- requests ----
    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Raises InvalidRequestError (bad prompt or
        params) or ContextLengthError before anything is queued."""
        with self._lock:
            seq = self._make_sequence(prompt, params)
            self.scheduler.add(seq)
            self._note_busy()
            return seq.request_id

    def abort_request(self, request_id: int | Iterable[int]) -> list[int]:
        """Stop requests (one id or several), waiting or running: each finishes with
        finish_reason "abort" and the tokens it has, and its slot is free at once. Their
        final outputs are returned by the next `step()` (and by `generate`, for its own).
        Ids of requests that already finished, or that this engine never issued, are
        ignored: a client may go away just as its request finishes. Returns the ids it
        aborted. Raises InvalidRequestError for an id that is not an int, and under tensor
        parallelism while another thread is in generate (see the class docstring)."""
        ids = [request_id] if is_int(request_id) else as_id_list(request_id)
        generating = self._generating  # read without the lock: generate may hold it for a step
        if self.tp is not None and generating is not None and generating != threading.get_ident():
            raise InvalidRequestError(
                "under tensor parallelism every rank must abort at the same point of its schedule; an abort from "
                "another thread while generate runs cannot be: abort from the thread that steps, between steps")
        with self._lock:
            self._check_open()
            if self.tp is not None:
                self.tp.note_abort(ids)
            seqs = self.scheduler.abort(ids)
            self._report_finished(seqs)
            self._note_idle()
        return list(dict.fromkeys(seq.request_id for seq in seqs))

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running, or has a final output that step()
        has not returned yet."""
        return self.scheduler.has_unfinished() or bool(self._unclaimed)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> run the model -> postprocess. Returns the outputs of
        the requests that got a token or finished in it (and final outputs not returned
        yet: aborts, those generate() read for others). With tensor parallelism every rank
        must call it; ranks other than 0 return [].

        With asynchronous scheduling (`EngineConfig.async_scheduling`) the outputs are those
        of the iteration before: step N+1 schedules and launches N+1 (its decodes read N's
        sampled tokens on the device), then takes N's outputs while N+1 runs. A request that
        N finishes (a stop token, max_tokens; or aborted meanwhile) drops the token N+1
        computed for it. A step that has nothing to launch, or no request left unfinished,
        takes every output in flight."""
        outputs = self._step()
        return outputs if self.is_output_rank else []

    @property
    def is_output_rank(self) -> bool:
        """Whether this process returns outputs: always, except on tensor-parallel ranks > 0."""
        return self.tp is None or self.tp.rank == 0

    def _step(self) -> list[RequestOutput]:
        with self._lock:
            self._check_open()
            self._trim_if_idle()
            batch = self._schedule()
            if batch.scheduled:
                # on the device (its samples placeholders until taken); with async scheduling it runs on after this step
                self._in_flight.launch(self.runner, self.scheduler, batch.scheduled)
            outputs = self._postprocess(drain=not batch.scheduled)  # with async: the iteration before's
            self._note_idle()
        self._lock.hand_over()  # threads waiting for the lock (an abort, an add) go before the next step
        return outputs

    def generate(self, prompts: str | Seq[int] | Iterable[str | Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a list of those) and
        return the final outputs in prompt order (with tensor parallelism: on rank 0; the
        other ranks, which must make the same call, return []). Every prompt is checked before any is
        queued. Requests added online before keep running meanwhile; their final outputs
        are returned by the next step(). If this call raises after queueing (an interrupt),
        its requests are aborted and the engine stays usable."""
        prompt_list = as_prompt_list(prompts)
        params_list = as_params_list(sampling_params, len(prompt_list))
        with self._lock:
            seqs = [self._make_sequence(p, sp) for p, sp in zip(prompt_list, params_list)]
            for seq in seqs:
                self.scheduler.add(seq)
            if seqs:
                self._note_busy()
        pending = {seq.request_id for seq in seqs}
        results: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        self._generating = threading.get_ident()
        try:
            while pending:
                for out in self._step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                    elif out.finished:
                        with self._lock:
                            self._unclaimed.append(out)
        except BaseException:
            with self._lock:  # nobody will read these requests' outputs: stop them, drop theirs
                if not self._closed:
                    for seq in self.scheduler.abort(pending):
                        self.runner.release(seq.seq_id)
                self._unclaimed = [o for o in self._unclaimed if o.request_id not in pending]
            raise
        finally:
            self._generating = None
            if bar is not None:
                bar.close()
        if not self.is_output_rank:
            return []
        return [results[seq.request_id] for seq in seqs]

    def beam_search(self, prompts: str | Seq[int] | Iterable[str | Seq[int]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search (vLLM's `LLM.beam_search`): per prompt a `BeamSearchOutput` whose
        `sequences` are the `params.beam_width` best, best first (see
        `vattn.engine.beam_search` for the selection, transformers' `generate(num_beams=...)`
        step for step, and where it differs from vLLM's).

        Every beam is a slot; a step is one forward over all live beams. A parent chosen by
        several beams is forked (`KVCache.fork`: its whole pages shared, its partly filled last
        page copied), one not chosen is freed at once; `BeamSearchOutput.stats` and
        `beam_search_stats()` count the pages the forks shared against what copying would have
        cost. Prompts are searched together while their beams fit into the free slots, the rest
        after them.

        It runs alone: it holds the engine for its whole search (other threads' calls wait), and
        raises InvalidRequestError while requests added before are unfinished (finish or abort
        them first). InvalidConfigError: a beam_width larger than the engine's free slots
        (max_batch_size), tensor parallelism. OutOfPhysicalMemoryError when the beams do not fit
        into physical memory (every slot of the search is freed)."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompt_list = as_prompt_list(prompts)
        with self._lock:
            self._check_open()
            if self.tp is not None:
                raise InvalidConfigError("beam_search does not run under tensor parallelism yet")
            if self.scheduler.has_unfinished() or self._in_flight or self._unclaimed:
                raise InvalidRequestError(
                    "beam_search runs alone: this engine has unfinished requests (or outputs step() has not "
                    "returned yet); finish or abort them first")
            width = params.beam_width
            free = self.scheduler.kv.num_free_reqids
            if width > free:
                raise InvalidConfigError(
                    f"beam_width={width} needs {width} slots and this engine has {free} free "
                    f"(max_batch_size={self.config.max_batch_size}); raise max_batch_size or lower beam_width")
            token_lists = []
            for prompt in prompt_list:
                _, ids = tokenize(prompt, self.tokenizer, self.runner.vocab_size)
                check_context_length(len(ids), params.max_tokens, self.max_context_len)
                token_lists.append(ids)
            self._note_busy()
            try:
                eos = frozenset() if params.ignore_eos else self.eos_token_ids
                decode = None if self.tokenizer is None else self.tokenizer.decode
                per_batch = max(1, free // width)
                outputs: list[BeamSearchOutput] = []
                for i in range(0, len(token_lists), per_batch):
                    outputs += search_batch(self.scheduler.kv, self.runner, token_lists[i:i + per_batch], params, eos,
                                            decode, self._record_beam_stats)
            finally:
                self._note_idle()
            return outputs

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end-of-sequence tokens: a sample stops after one (unless ignore_eos)."""
        return self.scheduler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Iterable[int]) -> None:
        self.scheduler.eos_token_ids = self.runner.eos_token_ids = frozenset(ids)

    # ------------------------------------------------------------------ closing ----
    def close(self) -> None:
        """Release the cache and give the model back its attention implementation. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self.idle.stop()
                self._in_flight.clear()  # (the runner waits for the device before it closes the cache)
                try:
                    self.runner.close()
                finally:
                    if self.tp is not None:
                        self.tp.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- internals ----
    def _note_busy(self) -> None:
        self.idle.note_busy()

    def _note_idle(self) -> None:
        """After a change (lock held): if the engine has no work left, its idle time starts
        (the idle policy's thread then gives the cache's unused pages back when it is due)."""
        if self.idle.delay is not None and not self.scheduler.has_unfinished():
            self.idle.note_idle()

    def _on_idle_timer(self) -> None:
        with self._lock:
            if not self._closed:
                self._trim_if_idle()

    def _trim_if_idle(self) -> None:
        """Give the cache's unused pages back if the engine has been idle for idle_trim_s
        (lock held); once per idle period."""
        since = self.idle.idle_since
        if self.scheduler.has_unfinished():
            return
        if self.idle.due():
            self.idle.note_trimmed()
            try:
                released = self.runner.cache.trim()
            except Exception:  # noqa: BLE001 - memory stays mapped; serving goes on
                logger.warning("vattn: giving idle KV memory back failed", exc_info=True)
                return
            self.num_idle_trims += 1
            logger.debug("vattn: idle for %.3g s: gave %d page groups back", self.idle.clock() - since, released)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this LLM was closed; create a new one")

    def _make_sequence(self, prompt: str | Seq[int], params: SamplingParams | None) -> Sequence:
        self._check_open()
        seq = make_sequence(self._next_id, prompt, params, self.tokenizer, self.runner.vocab_size,
                            self.max_context_len)
        if self.tp is not None:
            self.tp.note_request(seq.request_id, seq.prompt_token_ids, seq.params)
        self._next_id += 1
        return seq

    def _report_finished(self, seqs: list[Sequence]) -> None:
        """Sequences finished outside postprocess (errors while scheduling, aborts): keep the
        final output of each request they complete for the next step()."""
        for samples in requests_of(seqs):
            if all(s.is_finished for s in samples):
                self._release(samples)
                self._unclaimed.append(request_output(samples))

    def _schedule(self) -> SchedulerOutput:
        """The next iteration's batch, backed by the cache (under tensor parallelism the same
        on every rank, checked); requests it had to fail are reported."""
        if self.tp is not None:  # the schedule's digest rides on its control messages
            self.tp.begin_iteration(self.scheduler)
        batch = self.scheduler.schedule()
        if self.tp is not None:  # none carried it (nothing scheduled): it goes alone
            self.tp.check_schedule()
        self._report_finished(batch.finished)  # before the run: kept even if it is interrupted
        return batch

    def _postprocess(self, drain: bool = False) -> list[RequestOutput]:
        """Final outputs not returned yet, and those of the iterations launched (see
        `InFlightQueue.take`)."""
        outputs, self._unclaimed = self._unclaimed, []
        for changed in self._in_flight.take(self.scheduler, drain):
            for samples in requests_of(changed):
                out = request_output(samples)
                if out.finished:
                    self._release(samples)
                outputs.append(out)
        return outputs

    def _release(self, samples: list[Sequence]) -> None:
        """Forget the sampling state of a finished request's samples."""
        for seq in samples:
            self.runner.release(seq.seq_id)
