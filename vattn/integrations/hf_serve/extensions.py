"""The sampling extensions of vLLM and SGLang that `vattn serve` honours (load generators send
them: guidellm `ignore_eos`, vLLM's benchmark client `ignore_eos` and `min_tokens`), on
transformers' continuous batching, which has neither:

- `ignore_eos`: the request's end-of-sequence id is none (transformers' own per-request
  `eos_token_id`, -1: no end), so it runs to `max_tokens` or the end of its room.
- `min_tokens`: the end-of-sequence ids cannot be generated before that many tokens: one more
  of transformers' continuous-batching logits processors (`MinTokens`, installed before the
  loop starts) sets their logits to -inf for the requests still short of it, as vLLM's
  `MinTokensLogitsProcessor` does (with `ignore_eos` there is no end to hold back).
"""
from __future__ import annotations

import functools
from typing import Any

import torch

MIN_TOKENS = "min_tokens"  # the request's logits-processor argument (transformers' per-request kwargs)


def _processor_base() -> type:
    from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessor

    return ContinuousBatchingLogitsProcessor


def min_tokens_processor(eos_ids: list[int]) -> Any:
    """A transformers continuous-batching logits processor: per request, 1 while it has
    generated fewer than its `min_tokens` (else 0), and those rows' `eos_ids` logits -inf."""

    class MinTokens(_processor_base()):  # type: ignore[misc]
        supported_kwargs = {MIN_TOKENS: int}
        ignored_kwargs = ()

        def __init__(self) -> None:
            self.eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.int64)  # [E]

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            int32_tensor.fill_(0)

        def prepare_tensor_args(self, requests_with_new_token: list) -> torch.Tensor:
            held = [int(r.state.generated_len() < r.state.logit_processor_kwargs.get(MIN_TOKENS, 0))
                    for r in requests_with_new_token]
            return torch.tensor(held, dtype=torch.int32)  # [B]

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            held = tensor_arg[: scores.size(0)].bool()  # [B]
            if self.eos.numel() == 0 or not bool(held.any()):
                return scores
            rows = held.nonzero().squeeze(-1)  # [H]
            scores = scores.clone()
            scores[rows.unsqueeze(-1), self.eos.to(scores.device).unsqueeze(0)] = float("-inf")  # [H, E]
            return scores

    return MinTokens()


def eos_ids(gen_config: Any) -> list[int]:
    """The end-of-sequence ids of a generation config (none, one or several), the valid ones."""
    eos = getattr(gen_config, "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return [int(e) for e in eos if int(e) >= 0]


def install_min_tokens(cb: Any, gen_config: Any) -> None:
    """Add `MinTokens` to the logits processors of `cb` (a ContinuousBatchingManager not yet
    started: its loop sizes the processors' argument tensors when it starts). It costs a step
    nothing while no request of the batch is held back: the processor list (`_gated`) then
    leaves it out, and skips logits processing altogether when transformers had none (each
    torch call of the loop's thread lets the event loop take the GIL: time to first token).
    With CUDA graphs, whose captured steps cannot change, it is always in."""
    processors = cb.logit_processor
    base = processors.logits_processor
    mine = min_tokens_processor(eos_ids(gen_config))
    processors.tensors_required += 1  # its argument row comes last: the others' rows stay where they are
    processors.supported_keys[MIN_TOKENS] = int
    graphs = getattr(getattr(cb, "continuous_batching_config", None), "use_cuda_graph", False)
    processors.__class__ = _gated(type(processors))
    processors.vattn_lists = (base, type(base)([*base, mine]))  # (without, with) MinTokens
    processors.vattn_processing = processors.do_processing  # transformers' own: any processor of its own
    processors.vattn_static = any(graphs) if isinstance(graphs, (tuple, list)) else bool(graphs)
    processors.logits_processor, processors.do_processing = processors.vattn_lists[1], True


def _held(requests: list) -> bool:
    """Whether a request of the batch is still short of its `min_tokens` (plain Python)."""
    for r in requests:
        least = r.state.logit_processor_kwargs.get(MIN_TOKENS, 0)
        if least and r.state.generated_len() < least:
            return True
    return False


@functools.cache
def _gated(cls: type) -> type:
    """transformers' ContinuousBatchingLogitsProcessorList whose `MinTokens` takes part in a
    batch only when a request of it is held back (set as the batch is prepared: before the
    step that processes its logits, also with asynchronous batching)."""

    class Gated(cls):  # type: ignore[misc, valid-type]
        def prepare_tensor_args(self, requests_in_batch: list, arg_storage: Any) -> Any:
            if not self.vattn_static:
                held = _held(requests_in_batch)
                self.logits_processor = self.vattn_lists[held]
                self.do_processing = held or self.vattn_processing
            return super().prepare_tensor_args(requests_in_batch, arg_storage)

    Gated.__name__, Gated.__qualname__ = cls.__name__, cls.__qualname__
    return Gated


def request_config(gen_config: Any, asked: Any) -> Any:
    """The generation config of one request with `ignore_eos` applied (a copy when it changes)."""
    if not asked.ignore_eos:
        return gen_config
    import copy

    gen_config = copy.copy(gen_config)
    gen_config.eos_token_id = -1  # transformers' "no end-of-sequence" (None would mean the loop's default)
    return gen_config


def queue_kwargs(asked: Any) -> dict:
    """The per-request logits-processor arguments to queue a request with (`min_tokens`)."""
    return {MIN_TOKENS: asked.min_tokens} if asked.min_tokens and not asked.ignore_eos else {}
