"""Speculative decoding by n-gram prompt lookup: its settings, the proposer, the figures.

`LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": 4, "prompt_lookup_min": 2})` (vLLM's spelling). Before a decode the
scheduler asks `NgramProposer.propose` for up to `k` draft tokens: the tokens that followed the
earliest earlier occurrence of the sequence's last n tokens (n from `prompt_lookup_max` down to
`prompt_lookup_min`; transformers' `prompt_lookup_num_tokens` looks the same way). The iteration
then computes the last token and the drafts in one forward (a query of 1 + d tokens, the cache
stepped to the longer length), the target model's rows verify them
(`vattn.engine.rejection.verify`: greedy, the drafts equal to the argmax; sampled, the standard
rejection sampler for a draft that is a point mass), and the sequence keeps the accepted drafts and
one token of the target's. The computed length then stands after the accepted ones: the rows the
rejected drafts wrote stay in pages that stay mapped, and the next iteration writes over them.
Nothing is unmapped, nothing copied, and nothing past the accepted tokens is ever pinned in the
prefix cache (it pins `token_ids[:num_computed_tokens]`, the accepted tokens only).

Speculation that does not pay turns itself down, per sequence (`NgramProposer`): no n-gram match,
no proposal (the iteration is a plain decode, at no cost); a proposal of which nothing was accepted
halves the next draft length and, at one draft token, pauses proposals for a few steps (doubling
each time up to `MAX_BACKOFF`); a proposal wholly accepted lengthens the next by 2 (up to k), as
transformers' "heuristic" schedule does.

Plain Python (numpy for the lookup, imported when a proposal is made): the scheduler calls it.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vattn.checks import as_int
from vattn.errors import InvalidConfigError

METHODS = ("ngram",)
NOT_YET = ("draft_model", "eagle", "eagle3", "medusa", "mlp_speculator", "deepseek_mtp", "mtp", "suffix")
MAX_BACKOFF = 16  # most decode steps a sequence skips proposing after drafts that were all rejected
MAX_TRACKED_REQUESTS = 4096  # per-request figures kept (the most recent requests)
# `SamplingParams` that make a request decode without drafts: their rows depend on the tokens before
# them in ways the verification does not model (counts, masks, per-token logprobs)
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(frozen=True)
class SpecConfig:
    """The speculative decoding asked for (`EngineConfig.speculative_config`, parsed)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    adaptive: bool = True  # turn speculation down where it does not pay (see the module docstring)


def parse_speculative_config(value: Any) -> SpecConfig | None:
    """vLLM's `speculative_config` dict (or None, or a `SpecConfig`) -> a `SpecConfig`;
    InvalidConfigError naming what to change otherwise. vLLM's defaults: with neither
    prompt_lookup bound given both are 5; with one given the other equals it."""
    if value is None or isinstance(value, SpecConfig):
        return value
    if not isinstance(value, Mapping):
        raise InvalidConfigError(
            f"speculative_config must be a dict like {{'method': 'ngram', 'num_speculative_tokens': 4}}, "
            f"got {type(value).__name__}")
    d = dict(value)
    method = d.get("method")
    if method is None and "model" in d:
        method = d["model"] if d["model"] in ("ngram", "[ngram]") else "draft_model"
    if method in ("[ngram]",):
        method = "ngram"
    if method in NOT_YET or (method is None and "model" in d):
        raise InvalidConfigError(
            f"speculative_config method {method!r} is not supported yet: vattn speculates by n-gram prompt lookup "
            "only; pass {'method': 'ngram', 'num_speculative_tokens': k}")
    if method not in METHODS:
        raise InvalidConfigError(f"speculative_config needs 'method': one of {METHODS}, got {method!r}")
    unknown = sorted(set(d) - set(_KEYS) - {"model", "adaptive"})
    if unknown:
        raise InvalidConfigError(f"unknown speculative_config key(s) {unknown}; valid ones: {list(_KEYS)} (+ 'adaptive')")
    if "num_speculative_tokens" not in d:
        raise InvalidConfigError("speculative_config needs 'num_speculative_tokens' (the draft tokens per step, >= 1)")
    k = as_int(d["num_speculative_tokens"], "num_speculative_tokens", InvalidConfigError, low=1, high=64)
    lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    elif lo is None:
        lo = hi
    elif hi is None:
        hi = lo
    lo = as_int(lo, "prompt_lookup_min", InvalidConfigError, low=1)
    hi = as_int(hi, "prompt_lookup_max", InvalidConfigError, low=1)
    if hi < lo:
        raise InvalidConfigError(f"prompt_lookup_max={hi} must be >= prompt_lookup_min={lo}")
    adaptive = d.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise InvalidConfigError(f"speculative_config 'adaptive' must be a bool, got {adaptive!r}")
    return SpecConfig("ngram", k, hi, lo, adaptive)


def drafts_allowed(params: Any) -> bool:
    """Whether a request with these `SamplingParams` decodes with drafts: not with penalties,
    min_tokens or logprobs (it decodes one token a step, as without speculation)."""
    return not (params.has_penalties or params.min_tokens or params.logprobs is not None)


def ngram_lookup(tokens: Any, n_min: int, n_max: int, k: int) -> list[int]:
    """Up to `k` tokens that followed the earliest earlier occurrence of the last n tokens of
    `tokens` (a list of ints), for the longest n in [n_min, n_max] that has one; [] if none."""
    import numpy as np

    length = len(tokens)
    n_max = min(n_max, length - 1)
    if n_max < n_min or k <= 0:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    match = arr[:-1] == arr[-1]  # match[p]: an occurrence of the last n tokens ends at p (p <= length - 2)
    first = -1
    for n in range(1, n_max + 1):
        if n > 1:  # it ends at p for n when it does for n - 1 and tokens[p - n + 1] == tokens[length - n]
            match[n - 1:] &= arr[:length - n] == arr[length - n]
            match[n - 2] = False
        if not match.any():
            break
        if n >= n_min:
            first = int(match.argmax())
    if first < 0:
        return []
    return arr[first + 1:first + 1 + k].tolist()


class NgramProposer:
    """Draft tokens by prompt lookup, per sequence, turned down where they are not accepted."""

    def __init__(self, config: SpecConfig) -> None:
        self.config = config

    def propose(self, seq: Any, limit: int) -> list[int]:
        """At most `limit` draft tokens to follow `seq`'s tokens (all known on the host)."""
        if limit <= 0 or not drafts_allowed(seq.params):
            return []
        c = self.config
        state = seq.spec
        if state.skip:
            state.skip -= 1
            return []
        n = min(limit, state.length if c.adaptive and state.length else c.num_speculative_tokens)
        return ngram_lookup(seq.token_ids, c.prompt_lookup_min, c.prompt_lookup_max, n)

    def observe(self, seq: Any, proposed: int, accepted: int) -> None:
        """The outcome of `proposed` drafts of which `accepted` were kept (the adaptive length)."""
        if not self.config.adaptive:
            return
        k, state = self.config.num_speculative_tokens, seq.spec
        length = state.length or k
        if accepted >= proposed:
            state.length, state.backoff = min(k, length + 2), 0
        elif accepted == 0:
            if length <= 1:
                state.backoff = min(MAX_BACKOFF, max(1, 2 * state.backoff))
                state.skip = state.backoff
            state.length = max(1, length // 2)
        else:
            state.length = max(1, accepted + 1)


class DraftState:
    """One sequence's speculation: its adaptive draft length and pause, and its figures."""

    __slots__ = ("length", "skip", "backoff", "num_drafts", "num_draft_tokens", "num_accepted_tokens")

    def __init__(self) -> None:
        self.length = 0  # the next proposal's length (0: num_speculative_tokens)
        self.skip = 0  # decode steps left without proposing
        self.backoff = 0
        self.num_drafts = 0  # verifications of a proposal
        self.num_draft_tokens = 0  # draft tokens proposed (and computed)
        self.num_accepted_tokens = 0  # of those, accepted


@dataclass(frozen=True)
class RequestSpecStats:
    """One request's drafts (every sample's)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0


@dataclass(frozen=True)
class SpecDecodeStats:
    """`LLM.spec_decode_stats()`: drafts proposed and accepted in total (vLLM's
    `vattn:spec_decode_num_drafts`, `_num_draft_tokens`, `_num_accepted_tokens`) and per request
    (the most recent `MAX_TRACKED_REQUESTS`, running ones included)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    requests: dict[int, RequestSpecStats]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step gave on average (accepted drafts + the target's own)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class SpecCounters:
    """The totals and the per-request figures the scheduler keeps (see `SpecDecodeStats`)."""

    def __init__(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.requests: OrderedDict[int, list[int]] = OrderedDict()

    def add(self, request_id: int, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        row = self.requests.get(request_id)
        if row is None:
            row = self.requests[request_id] = [0, 0, 0]
            if len(self.requests) > MAX_TRACKED_REQUESTS:
                self.requests.popitem(last=False)
        row[0] += 1
        row[1] += proposed
        row[2] += accepted

    def stats(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               {rid: RequestSpecStats(*row) for rid, row in self.requests.items()})
