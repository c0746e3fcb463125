"""`SamplingParams`: how one request picks its tokens and when it stops. Plain Python."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from vattn.checks import SEED_MAX, SEED_MIN, as_float, as_int
from vattn.errors import InvalidRequestError

# Temperatures below this are greedy: dividing logits by a tinier one overflows to inf.
GREEDY_TEMPERATURE = 1e-5
# Most samples one request may ask for: every sample is a sequence created at add_request and drawn in the step that
# computes the prompt (under the engine's lock), so n = 10**6 took 3.6 s and 467 MiB there, then an 18.7 s step.
MAX_N = 1024


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (the vLLM names).

    temperature: 0 (or below 1e-5) means greedy (argmax); otherwise logits are divided by it.
    top_p: keep the smallest set of tokens whose probability adds up to top_p (1 = off).
    top_k: keep the k most likely tokens (-1 or 0 = off).
    max_tokens: at most this many generated tokens (at least 1).
    stop_token_ids: generation stops after producing any of these (the token is kept).
    ignore_eos: keep going past the model's end-of-sequence token.
    seed: per-request random seed, an int in [-2**63, 2**64 - 1] (what torch.Generator
        takes): the same seed gives the same tokens whatever else runs in the batch. None
        draws from the engine's generator (seeded by the engine's `seed`).
    n: samples (completions) of the prompt, computed once (parallel sampling). Sample i
        has a generator of its own seeded with `sample_seed(i)` = seed + i (modulo 2**64,
        as vLLM derives its child requests' seeds), so it draws the tokens a request with
        `seed + i` and n = 1 would; with seed None all samples draw from the engine's.
        At most `MAX_N` (1024): ask for more with several requests of different seeds.

    Every value is checked here, so a request that passed is safe to run: a bad one raises
    InvalidRequestError before anything is queued. Ints may be numpy integers or 0-d
    tensors; they are stored as Python ints (floats as Python floats).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        err = InvalidRequestError
        set_ = functools.partial(object.__setattr__, self)
        set_("temperature", as_float(self.temperature, "temperature", err, what="a finite number >= 0"))
        if self.temperature < 0:
            raise err(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        set_("top_p", as_float(self.top_p, "top_p", err, what="a number in (0, 1]"))
        if not 0 < self.top_p <= 1:
            raise err(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        set_("top_k", as_int(self.top_k, "top_k", err, low=-1, what="an int >= 1, or -1 / 0 to turn it off"))
        set_("max_tokens", as_int(self.max_tokens, "max_tokens", err, low=1))
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise err(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}")
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:  # e.g. a 0-d tensor
            raise err(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}") from None
        set_("stop_token_ids", tuple(as_int(t, "stop_token_ids", err, low=0, what="non-negative ints")
                                     for t in stop))
        if not isinstance(self.ignore_eos, bool):
            raise err(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            set_("seed", as_int(self.seed, "seed", err, low=SEED_MIN, high=SEED_MAX,
                                what="None or an int in [-2**63, 2**64 - 1] (what torch.Generator takes)"))
        set_("n", as_int(self.n, "n", err, low=1, high=MAX_N,
                         what=f"an int in [1, {MAX_N}] (more samples: several requests with other seeds)"))

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample `index` (0 .. n-1): `seed` itself for sample 0, else
        (seed + index) mod 2**64 (torch reads a negative seed modulo 2**64 too)."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index) % 2**64

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
