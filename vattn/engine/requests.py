"""A request at the engine's edges: what `LLM` is given, checked before anything is queued
(prompts, sampling params, request ids: `InvalidRequestError` / `ContextLengthError` saying
what was wrong), turned into a `Sequence`; and what it gives back, a request's samples as one
`RequestOutput`. Plain Python (a prompt given as a tensor or array is read through `tolist`).
"""
from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Mapping
from typing import Any
from typing import Sequence as Seq

from vattn.checks import is_int
from vattn.engine.detokenizer import make_detokenizer
from vattn.engine.sampling_params import SamplingParams
from vattn.engine.sequence import CompletionOutput, RequestMetrics, RequestOutput, Sequence
from vattn.errors import ContextLengthError, InvalidRequestError


def make_sequence(request_id: int, prompt: str | Seq[int], params: SamplingParams | None, tokenizer: Any,
                  vocab_size: int, max_context_len: int) -> Sequence:
    """A new request's sample 0, its prompt and params checked (None: the default params)."""
    params = check_params(params, tokenizer)
    text, ids = tokenize(prompt, tokenizer, vocab_size)
    check_context_length(len(ids), params.max_tokens, max_context_len)
    seq = Sequence(request_id, ids, params, time.perf_counter(), prompt=text)
    if tokenizer is not None:  # the text grows token by token (its samples get their own)
        seq.detokenizer = make_detokenizer(tokenizer, params.skip_special_tokens)
    return seq


def check_params(params: SamplingParams | None, tokenizer: Any) -> SamplingParams:
    """`params` (None: `SamplingParams()`), refused when it is no SamplingParams or asks for stop
    strings without a tokenizer."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"sampling params must be a SamplingParams, got {type(params).__name__}"
            + (" (write SamplingParams(**d))" if isinstance(params, Mapping) else ""))
    if params.stop and tokenizer is None:
        raise InvalidRequestError(
            f"stop strings ({params.stop!r}) need a tokenizer to find them in the text, and this engine has "
            "none; pass tokenizer= to LLM (or load a checkpoint that has one), or stop on stop_token_ids")
    return params


def check_context_length(num_prompt_tokens: int, max_tokens: int, max_context_len: int) -> None:
    """ContextLengthError when a prompt and its `max_tokens` do not fit into the context."""
    if num_prompt_tokens + max_tokens > max_context_len:
        raise ContextLengthError(
            f"prompt of {num_prompt_tokens} tokens + max_tokens={max_tokens} exceeds max_context_len="
            f"{max_context_len}; shorten the prompt, lower max_tokens or raise max_context_len")


def tokenize(prompt: str | Seq[int], tokenizer: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """A prompt's text (None for token ids) and token ids, each in [0, vocab_size)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("string prompts need a tokenizer (the model has none); pass token ids")
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        return prompt, list(tokenizer.encode(prompt))
    if hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:  # a tensor or array
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)):
        raise InvalidRequestError(
            f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise InvalidRequestError("the prompt is empty: give at least one token")
    bad = [t for t in prompt if not is_int(t) or not 0 <= operator.index(t) < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be ints in [0, {vocab_size}), got {bad[:5]}")
    return None, [operator.index(t) for t in prompt]


def as_prompt_list(prompts: Any) -> list[Any]:
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


def as_id_list(request_ids: Any) -> list[int]:
    """A list of request ids (ints), else InvalidRequestError."""
    if isinstance(request_ids, (str, bytes, Mapping)) or not isinstance(request_ids, Iterable):
        raise InvalidRequestError(f"request_id must be an int or a list of ints, got {type(request_ids).__name__}")
    ids = list(request_ids)
    bad = [i for i in ids if not is_int(i)]
    if bad:
        raise InvalidRequestError(f"request ids must be ints, got {bad[:5]}")
    return [operator.index(i) for i in ids]


def as_params_list(sampling_params: Any, n: int) -> list[Any]:
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


def eos_token_ids(model: Any) -> frozenset[int]:
    """A transformers model's end-of-sequence tokens (its generation config's, else its config's)."""
    eos = None
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        eos = gen.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


def requests_of(seqs: Iterable[Sequence]) -> list[list[Sequence]]:
    """The distinct requests (their samples lists) of `seqs`, in order of first appearance."""
    return list({id(s.samples): s.samples for s in seqs}.values())


def request_output(samples: list[Sequence]) -> RequestOutput:
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
