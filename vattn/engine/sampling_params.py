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
# Most alternatives `logprobs` may ask for per token: vLLM's default `max_logprobs`.
MAX_LOGPROBS = 20
# Penalties' range: OpenAI's for presence and frequency (vLLM's too).
MAX_PENALTY = 2.0


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings of one request (the vLLM names).

    temperature: 0 (or below 1e-5) means greedy (argmax); otherwise logits are divided by it.
    top_p: keep the smallest set of tokens whose probability adds up to top_p (1 = off).
    top_k: keep the k most likely tokens (-1 or 0 = off).
    min_p: drop tokens less likely than min_p times the most likely one (0 = off), in [0, 1].
    presence_penalty: subtracted from the logit of every token generated so far (OpenAI's;
        > 0 favours new tokens), in [-2, 2]; 0 = off. Over the generated tokens only.
    frequency_penalty: subtracted from a token's logit once per time it was generated so far
        (OpenAI's), in [-2, 2]; 0 = off. Over the generated tokens only.
    repetition_penalty: a number > 0 (1 = off); every token of the prompt or generated so far
        has its logit divided by it when positive, multiplied when negative (transformers'
        and vLLM's). The penalties apply before the greedy argmax and temperature (vLLM's order:
        penalties, temperature, min_p, top_k, top_p).
    max_tokens: at most this many generated tokens (at least 1).
    min_tokens: the end-of-sequence token(s) and `stop_token_ids` cannot be sampled (their
        logits are -inf), and `stop` strings are not looked for, before this many tokens
        were generated; in [0, max_tokens].
    stop_token_ids: generation stops after producing any of these (the token is kept;
        `CompletionOutput.stop_reason` is its id).
    stop: strings (one or several) that end generation when the detokenized text contains
        one (found across token boundaries, by incremental detokenization); finish_reason
        "stop", `stop_reason` the string, the text cut before it. Needs an engine with a
        tokenizer (InvalidRequestError at add_request otherwise). The token ids keep every
        token generated, the one that completed the string included.
    include_stop_str_in_output: keep the stop string at the end of the text.
    ignore_eos: keep going past the model's end-of-sequence token.
    skip_special_tokens: leave special tokens out of the text (the token ids keep them).
    logprobs: None, or an int in [0, 20]: per generated token, the log-probability of the
        sampled token and of the `logprobs` most likely tokens (`CompletionOutput.logprobs`,
        vLLM's shape). They are the model's raw log-probabilities: log_softmax of the logits
        before penalties, temperature and top-k/top-p/min-p (vLLM v1's default
        `logprobs_mode="raw_logprobs"`).
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
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

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
        set_("min_p", as_float(self.min_p, "min_p", err, what="a number in [0, 1]"))
        if not 0 <= self.min_p <= 1:
            raise err(f"min_p must be a number in [0, 1] (0 = off), got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            what = f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off)"
            set_(name, as_float(getattr(self, name), name, err, what=what))
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise err(f"{name} must be {what}, got {getattr(self, name)!r}")
        set_("repetition_penalty", as_float(self.repetition_penalty, "repetition_penalty", err,
                                            what="a finite number > 0 (1 = off)"))
        if not self.repetition_penalty > 0:
            raise err(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        set_("min_tokens", as_int(self.min_tokens, "min_tokens", err, low=0, high=self.max_tokens,
                                  what=f"an int in [0, max_tokens={self.max_tokens}]"))
        if self.logprobs is not None:
            set_("logprobs", as_int(self.logprobs, "logprobs", err, low=0, high=MAX_LOGPROBS,
                                    what=f"None or an int in [0, {MAX_LOGPROBS}]"))
        set_("stop", _as_stop_strings(self.stop))
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise err(f"{name} must be a bool, got {getattr(self, name)!r}")

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample `index` (0 .. n-1): `seed` itself for sample 0, else
        (seed + index) mod 2**64 (torch reads a negative seed modulo 2**64 too)."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index) % 2**64

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty is on (the sampler then counts this sequence's tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


def _as_stop_strings(stop: object) -> tuple[str, ...]:
    """`stop` (None, a string or a sequence of strings) as a tuple of non-empty strings."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if isinstance(items, (bytes, dict)) or not hasattr(items, "__iter__"):
        raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")
    items = tuple(items)
    if not all(isinstance(s, str) and s for s in items):
        raise InvalidRequestError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
    return items
