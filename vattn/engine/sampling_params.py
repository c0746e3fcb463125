"""`SamplingParams`: how one request picks its tokens and when it stops. Plain Python."""
from __future__ import annotations

from dataclasses import dataclass

from vattn.errors import InvalidRequestError


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (the vLLM names).

    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_p: keep the smallest set of tokens whose probability adds up to top_p (1 = off).
    top_k: keep the k most likely tokens (-1 or 0 = off).
    max_tokens: at most this many generated tokens (at least 1).
    stop_token_ids: generation stops after producing any of these (the token is kept).
    ignore_eos: keep going past the model's end-of-sequence token.
    seed: per-request random seed: the same seed gives the same tokens whatever else runs
        in the batch. None draws from the engine's generator (seeded by the engine's `seed`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or self.temperature < 0 or self.temperature == float("inf"):
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be an int >= 1, or -1 / 0 to turn it off, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            raise InvalidRequestError(
                f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}") from None
        if not all(_is_int(t) and t >= 0 for t in stop):
            raise InvalidRequestError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an int or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
