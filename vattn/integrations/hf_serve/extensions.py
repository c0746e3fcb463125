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
    started: its loop sizes the processors' argument tensors when it starts)."""
    processors = cb.logit_processor
    processors.logits_processor.append(min_tokens_processor(eos_ids(gen_config)))
    processors.tensors_required += 1
    processors.supported_keys[MIN_TOKENS] = int
    processors.do_processing = True


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
