"""`LLM`: continuous-batching generation with Hugging Face models on a vattn cache.

```
with LLM("path/to/checkpoint", max_batch_size=8, page_size=64 << 10) as llm:
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=32))
    rid = llm.add_request([5, 6, 7], SamplingParams(max_tokens=8))   # online use
    while llm.has_unfinished():
        for out in llm.step(): ...
```
"""
from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Mapping
from typing import Any
from typing import Sequence as Seq

import torch

from vattn.engine.checks import is_int
from vattn.engine.config import EngineConfig
from vattn.engine.model_runner import ModelRunner, load_model
from vattn.engine.sampling_params import SamplingParams
from vattn.engine.scheduler import Scheduler, SchedulerOutput
from vattn.engine.sequence import FinishReason, RequestMetrics, RequestOutput, Sequence
from vattn.errors import ClosedError, ContextLengthError, InvalidConfigError, InvalidRequestError


class LLM:
    """A generation engine: `LLM(model, **config).generate(prompts, sampling_params)`.

    `model`: a local checkpoint directory (loaded with `local_files_only=True`; its
    tokenizer too, when it has one), a `transformers.PretrainedConfig` (random weights,
    seeded by `seed`), or a loaded `PreTrainedModel` (used in place: moved to the engine's
    device/dtype, and its attention implementation is "vattn" until `close()`).
    `tokenizer`: overrides the checkpoint's; string prompts need one.
    `**config`: see `EngineConfig` (the cache's arguments by `vattn.init`'s names plus
    device, dtype, max_num_seqs, max_num_batched_tokens, seed, attention).
    """

    def __init__(self, model: Any, tokenizer: Any = None, **config: Any) -> None:
        self.config = EngineConfig.from_kwargs(**config)
        device = self.config.torch_device()
        if device.type == "cuda" and not torch.cuda.is_available():
            raise InvalidConfigError(f"device {device} was asked for but CUDA is not available")
        loaded = load_model(model, self.config, device)
        self.tokenizer = tokenizer if tokenizer is not None else loaded.tokenizer
        self.runner = ModelRunner(loaded.model, loaded.dtype, device, self.config)
        self.scheduler = Scheduler(self.config.scheduler_config(), self.runner.cache)
        self.max_context_len = self.runner.max_context_len
        self.eos_token_ids = _eos_token_ids(loaded.model)
        self._next_id = 0
        self._unclaimed: list[RequestOutput] = []  # finished outputs generate() read for others
        self._closed = False

    # ----------------------------------------------------------------- requests ----
    def add_request(self, prompt: str | Seq[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Raises InvalidRequestError (bad prompt or
        params) or ContextLengthError before anything is queued."""
        seq = self._make_sequence(prompt, params)
        self.scheduler.add(seq)
        return seq.request_id

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> run the model -> postprocess. Returns the outputs of
        the requests that got a token or finished in it."""
        self._check_open()
        batch = self.scheduler.schedule()
        tokens = self.runner.run(batch.scheduled) if batch.scheduled else {}
        return self._postprocess(batch, tokens)

    def generate(self, prompts: str | Seq[int] | Iterable[str | Seq[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a list of those) and
        return the final outputs in prompt order. Every prompt is checked before any is
        queued. Requests added online before keep running meanwhile; their final outputs
        are returned by the next step()."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompt_list, params_list)]
        for seq in seqs:
            self.scheduler.add(seq)
        pending = {seq.request_id for seq in seqs}
        results: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        try:
            while pending:
                for out in self.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                    elif out.finished:
                        self._unclaimed.append(out)
        finally:
            if bar is not None:
                bar.close()
        return [results[seq.request_id] for seq in seqs]

    # ------------------------------------------------------------------ figures ----
    def memory_stats(self):
        """The cache's `MemoryStats` (mapped, used, fragmentation, ...)."""
        return self.runner.cache.stats()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def cache(self):
        """The engine's `vattn.KVCache`."""
        return self.runner.cache

    # ------------------------------------------------------------------ closing ----
    def close(self) -> None:
        """Release the cache and give the model back its attention implementation. Idempotent."""
        if not self._closed:
            self._closed = True
            self.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---------------------------------------------------------------- internals ----
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
        text, ids = self._tokenize(prompt)
        if len(ids) + params.max_tokens > self.max_context_len:
            raise ContextLengthError(
                f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} exceeds max_context_len="
                f"{self.max_context_len}; shorten the prompt, lower max_tokens or raise max_context_len")
        seq = Sequence(self._next_id, ids, params, time.perf_counter(), prompt=text)
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

    def _postprocess(self, batch: SchedulerOutput, tokens: dict[int, int]) -> list[RequestOutput]:
        now = time.perf_counter()
        outputs = self._unclaimed
        self._unclaimed = []
        for seq in batch.aborted:
            seq.finished_time = now
            self.runner.release(seq.request_id)
            outputs.append(self._output(seq))
        for item in batch.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            token = tokens.get(seq.request_id)
            if token is None:  # a prompt chunk that does not reach the end yet
                continue
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq, token)
            if reason is not None:
                seq.finished_time = now
                self.scheduler.finish(seq, reason)
                self.runner.release(seq.request_id)
            outputs.append(self._output(seq))
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        out_ids = seq.output_token_ids
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=list(seq.prompt_token_ids),
            token_ids=out_ids, text=text, finished=seq.is_finished, finish_reason=seq.finish_reason,
            num_preemptions=seq.num_preemptions,
            metrics=RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finished_time, len(out_ids)),
            error=seq.error)


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
