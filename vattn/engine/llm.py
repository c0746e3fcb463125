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
"""
from __future__ import annotations

import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from typing import Sequence as Seq

import torch

from vattn.checks import is_int
from vattn.engine.config import EngineConfig
from vattn.engine.detokenizer import make_detokenizer
from vattn.engine.model_runner import InFlight, LoadedModel, ModelRunner, load_model, prefix_salt
from vattn.engine.parallel import AgreedSlots, TensorParallel, TPModelRunner
from vattn.engine.sampling_params import SamplingParams
from vattn.engine.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from vattn.engine.spec_decode import NgramProposer, SpecCounters, SpecDecodeStats
from vattn.engine.sequence import CompletionOutput, RequestMetrics, RequestOutput, Sequence
from vattn.engine.turns import TurnLock
from vattn.errors import ClosedError, ContextLengthError, InvalidConfigError, InvalidRequestError
from vattn.idle import IdleTrim

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix caching figures. Every sequence that gets a new slot (a new request, or one
    recomputing after a preemption) is looked up; forked samples are not."""

    num_query_tokens: int  # tokens of the sequences looked up
    num_hit_tokens: int  # of those, mapped from cached pages instead of computed (every tier's)
    num_pinned_pages: int  # page groups the cache keeps now
    block_tokens: int  # tokens a cached block covers: the sharing granularity (`Geometry.share_tokens`)
    # the offload tiers (offload_bytes, offload_dir): hits restored from each (inside num_hit_tokens),
    # and the bytes each holds now (the host tier's include swapped-out requests)
    num_host_hit_tokens: int = 0
    num_disk_hit_tokens: int = 0
    host_bytes: int = 0
    disk_bytes: int = 0

    @property
    def num_device_hit_tokens(self) -> int:
        """Hits mapped from pages in device memory (no copy)."""
        return self.num_hit_tokens - self.num_host_hit_tokens - self.num_disk_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class LLM:
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
                                   eos_token_ids=_eos_token_ids(loaded.model), prefix_cache=self.prefix_cache,
                                   proposer=NgramProposer(spec) if spec is not None else None,
                                   spec_counters=self._spec_counters)
        self.runner.eos_token_ids = self.scheduler.eos_token_ids  # the sampler masks them under min_tokens
        self.max_context_len = self.runner.max_context_len
        self._next_id = 0
        self._unclaimed: list[RequestOutput] = []  # final outputs the next step() returns
        # iterations launched whose outputs were not taken yet, oldest first; at most `_depth`
        # stay in flight when step() returns: 1 with asynchronous scheduling, else 0
        self._in_flight: deque[tuple[list[ScheduledSequence], InFlight]] = deque()
        self._depth = 1 if self.config.uses_async_scheduling() else 0
        self._lock = TurnLock()  # handed over between iterations: another thread's abort waits one step, not a generate
        self._closed = False
        self._generating: int | None = None  # the thread in generate, if any
        self.num_idle_trims = 0  # times the idle engine gave its unused pages back
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
        ids = [request_id] if is_int(request_id) else _as_id_list(request_id)
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
                self._launch(batch)  # on the device; with async scheduling it runs on after this step
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
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
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

    # ------------------------------------------------------------------ figures ----
    def memory_stats(self):
        """The cache's `MemoryStats` (mapped, used, fragmentation, ...; `host_bytes` and
        `disk_bytes`: what the offload tiers hold)."""
        return self.runner.cache.stats()

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """How much the prefix cache saved (None without enable_prefix_caching)."""
        pc = self.prefix_cache
        if pc is None:
            return None
        with self._lock:
            pinned = self.runner.cache.stats().num_pinned_pages if not self._closed else 0
            host = self.runner.cache.host
            return PrefixCacheStats(pc.num_query_tokens, pc.num_hit_tokens, pinned, pc.block_tokens,
                                    pc.num_host_hit_tokens, pc.num_disk_hit_tokens, host.nbytes,
                                    host.sink.disk_bytes if host.sink is not None else 0)

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculative decoding's figures: draft tokens proposed and accepted, in total and per
        request, and the acceptance rate (None without speculative_config)."""
        if self._spec_counters is None:
            return None
        with self._lock:
            return self._spec_counters.stats()

    @property
    def async_scheduling(self) -> bool:
        """Whether the engine schedules asynchronously (`EngineConfig.async_scheduling`, see `step`)."""
        return self._depth > 0

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end-of-sequence tokens: a sample stops after one (unless ignore_eos)."""
        return self.scheduler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Iterable[int]) -> None:
        self.scheduler.eos_token_ids = self.runner.eos_token_ids = frozenset(ids)

    @property
    def cache(self):
        """The engine's `vattn.KVCache`."""
        return self.runner.cache

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
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
                + (" (write SamplingParams(**d))" if isinstance(params, Mapping) else ""))
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                f"stop strings ({params.stop!r}) need a tokenizer to find them in the text, and this engine has "
                "none; pass tokenizer= to LLM (or load a checkpoint that has one), or stop on stop_token_ids")
        text, ids = self._tokenize(prompt)
        if len(ids) + params.max_tokens > self.max_context_len:
            raise ContextLengthError(
                f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} exceeds max_context_len="
                f"{self.max_context_len}; shorten the prompt, lower max_tokens or raise max_context_len")
        seq = Sequence(self._next_id, ids, params, time.perf_counter(), prompt=text)
        if self.tokenizer is not None:  # the text grows token by token (its samples get their own)
            seq.detokenizer = make_detokenizer(self.tokenizer, params.skip_special_tokens)
        if self.tp is not None:
            self.tp.note_request(seq.request_id, ids, params)
        self._next_id += 1
        return seq

    def _tokenize(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("string prompts need a tokenizer (the model has none); pass token ids")
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return prompt, list(self.tokenizer.encode(prompt))
        if hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:  # a tensor or array
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequestError(
                f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        vocab = self.runner.vocab_size
        bad = [t for t in prompt if not is_int(t) or not 0 <= operator.index(t) < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be ints in [0, {vocab}), got {bad[:5]}")
        return None, [operator.index(t) for t in prompt]

    def _report_finished(self, seqs: list[Sequence]) -> None:
        """Sequences finished outside postprocess (errors while scheduling, aborts): keep the
        final output of each request they complete for the next step()."""
        for samples in _requests_of(seqs):
            if all(s.is_finished for s in samples):
                self._release(samples)
                self._unclaimed.append(self._output(samples))

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

    def _launch(self, batch: SchedulerOutput) -> None:
        """Queue the model's iteration on the device and count its tokens computed (its samples
        are placeholders until its outputs are taken: `_postprocess`)."""
        run = self.runner.launch(batch.scheduled)
        self.scheduler.commit(batch.scheduled, run.errors)
        self._in_flight.append((batch.scheduled, run))

    def _postprocess(self, drain: bool = False) -> list[RequestOutput]:
        """Final outputs not returned yet, and those of the iterations launched, oldest first,
        until `_depth` are left in flight (none when `drain`, or when no request is left
        unfinished: what is in flight would only be dropped)."""
        outputs, self._unclaimed = self._unclaimed, []
        while self._in_flight and (drain or len(self._in_flight) > self._depth or not self.scheduler.has_unfinished()):
            scheduled, run = self._in_flight.popleft()
            result = run.result()  # waits for the device
            changed = self.scheduler.postprocess(scheduled, result.tokens, result.errors, logprobs=result.logprobs,
                                                 accepted=result.accepted)
            for samples in _requests_of(changed):
                out = self._output(samples)
                if out.finished:
                    self._release(samples)
                outputs.append(out)
        return outputs

    def _release(self, samples: list[Sequence]) -> None:
        """Forget the sampling state of a finished request's samples."""
        for seq in samples:
            self.runner.release(seq.seq_id)

    def _output(self, samples: list[Sequence]) -> RequestOutput:
        """The RequestOutput of one request, from its samples (index order)."""
        first = samples[0]
        outputs = [CompletionOutput(s.index, s.output_token_ids, s.text, s.finish_reason, s.error, s.stop_reason,
                                    None if s.logprobs is None else list(s.logprobs), s.cumulative_logprob)
                   for s in samples]
        finished = all(s.is_finished for s in samples)
        first_times = [s.first_token_time for s in samples if s.first_token_time is not None]
        metrics = RequestMetrics(
            first.arrival_time, min(first_times, default=None),
            max(s.finished_time for s in samples) if finished else None,
            sum(len(o.token_ids) for o in outputs), sum(s.spec.num_draft_tokens for s in samples),
            sum(s.spec.num_accepted_tokens for s in samples))
        return RequestOutput(
            request_id=first.request_id, prompt=first.prompt, prompt_token_ids=list(first.prompt_token_ids),
            outputs=outputs, finished=finished, num_preemptions=sum(s.num_preemptions for s in samples),
            metrics=metrics)


def _requests_of(seqs: Iterable[Sequence]) -> list[list[Sequence]]:
    """The distinct requests (their samples lists) of `seqs`, in order of first appearance."""
    return list({id(s.samples): s.samples for s in seqs}.values())


def _as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string, token ids) or a sequence of prompts -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if hasattr(prompts, "tolist") and getattr(prompts, "ndim", None) in (1, 2):  # a tensor or array
        prompts = prompts.tolist()
    if (isinstance(prompts, (bytes, Mapping, set, frozenset)) or not isinstance(prompts, Iterable)
            or getattr(prompts, "ndim", None) == 0):
        raise InvalidRequestError(
            "prompts must be a string, a list of token ids, or a list of those; "
            f"got {type(prompts).__name__}")
    prompts = list(prompts)
    if prompts and all(is_int(t) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _as_id_list(request_ids: Any) -> list[int]:
    if isinstance(request_ids, (str, bytes, Mapping)) or not isinstance(request_ids, Iterable):
        raise InvalidRequestError(f"request_id must be an int or a list of ints, got {type(request_ids).__name__}")
    ids = list(request_ids)
    bad = [i for i in ids if not is_int(i)]
    if bad:
        raise InvalidRequestError(f"request ids must be ints, got {bad[:5]}")
    return [operator.index(i) for i in ids]


def _as_params_list(sampling_params: Any, n: int) -> list[Any]:
    """None, one SamplingParams for every prompt, or one per prompt -> a list of n."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, (str, bytes, Mapping)) or not isinstance(sampling_params, Iterable):
        raise InvalidRequestError(
            "sampling_params must be a SamplingParams or a list of them (one per prompt); got "
            f"{type(sampling_params).__name__}"
            + (" (write SamplingParams(**d))" if isinstance(sampling_params, Mapping) else ""))
    params = list(sampling_params)
    if len(params) != n:
        raise InvalidRequestError(f"got {len(params)} sampling_params for {n} prompts; give one per prompt")
    return params


def _eos_token_ids(model: Any) -> frozenset[int]:
    eos = None
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        eos = gen.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
