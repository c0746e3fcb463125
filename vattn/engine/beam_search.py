"""Beam search for `LLM.beam_search` (vLLM's `BeamSearchParams` / `BeamSearchOutput` names).

Every beam is a slot of the cache. A step runs one forward over every live beam (its last
token), then each prompt's `BeamGroup` picks the next `beam_width` beams among the best
continuations of all its beams. A parent chosen k times keeps its slot for one child and is
forked for the others (`KVCache.fork` at the parent's length: its whole pages are mapped into
the child, shared, and only its partly filled last page is copied); a parent not chosen is
freed at once, so a search never holds more than `beam_width` slots per prompt.

The selection is transformers' (`GenerationMixin._beam_search`, transformers 5.x), step for
step, in float32, so that the sequences and scores equal `generate(num_beams=W,
do_sample=False, length_penalty=..., early_stopping=...)`:
- the top `max(2, 1 + number of EOS tokens) * W` continuations of all beams by cumulative
  log-probability (raw `log_softmax` of the logits, no processors), the first step from the
  prompt alone;
- a continuation that ends with an EOS token (unless `ignore_eos`), or reaches `max_tokens`,
  is a finished hypothesis when it is among the top W of them, scored
  `cum_logprob / generated_len ** length_penalty` (generated_len counts the generated tokens,
  the EOS included, not the prompt); the W best finished hypotheses are kept;
- the W best continuations that did not finish run on;
- the search stops at max_tokens, when every continuation finished, with
  `early_stopping=True` once W hypotheses finished, and otherwise when the best running beam
  cannot beat the worst kept hypothesis (transformers' heuristic: its score divided by its
  current generated length ** length_penalty; with `early_stopping="never"` and a positive
  length_penalty, by max_tokens ** length_penalty).

Where vLLM differs, transformers is followed: vLLM's `LLM.beam_search` normalises by the
whole sequence's length (prompt included, the EOS excluded) and never stops early. What is
returned is vLLM's: per prompt the `beam_width` best sequences, best first, each with all its
`tokens` (the prompt's first), `cum_logprob` (the raw sum of the generated tokens' logprobs),
and `text` (the whole sequence decoded) when the engine has a tokenizer; `score` is the
length-penalised score (transformers' `sequences_scores`).

`search_batch` drives the groups of prompts searched together on the engine's slots and runner.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from vattn.checks import as_int
from vattn.errors import InvalidRequestError, OutOfPhysicalMemoryError

NEG = -1.0e9  # transformers' "impossible" score


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's names. `beam_width`: beams kept per prompt (and sequences returned);
    `max_tokens`: tokens generated at most; `length_penalty`: exponent of the generated length
    that divides a finished hypothesis's cumulative logprob; `ignore_eos`: an EOS token does
    not finish a beam; `early_stopping` (transformers'): False (its heuristic), True (stop once
    `beam_width` hypotheses finished) or "never"."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "beam_width", as_int(self.beam_width, "beam_width", InvalidRequestError, low=1))
        object.__setattr__(self, "max_tokens", as_int(self.max_tokens, "max_tokens", InvalidRequestError, low=1))
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            raise InvalidRequestError(f"length_penalty must be a number, got {self.length_penalty!r}")
        object.__setattr__(self, "length_penalty", float(self.length_penalty))
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequestError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    """One finished beam: `tokens` (prompt + generated), `cum_logprob` (sum of the generated
    tokens' logprobs), `score` (cum_logprob / generated_len ** length_penalty), `text` (the
    whole sequence decoded, with a tokenizer), `finish_reason` ("stop": an EOS; "length")."""

    tokens: list[int]
    cum_logprob: float
    score: float
    num_prompt_tokens: int
    finish_reason: str
    text: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass(frozen=True)
class BeamSearchStats:
    """What forking beams cost: `num_forks`, and the page groups the forks shared (mapped from
    the parent, no copy) and copied (the parent's partly filled last page). Copying every
    beam's KV would have cost `pages_shared + pages_copied` page groups. `peak_kv_bytes`: the
    most physical memory the search's live tokens held after a step (a shared page counted
    once; for prompts searched together, their batch's; summed stats keep the largest)."""

    num_forks: int = 0
    pages_shared: int = 0
    pages_copied: int = 0
    peak_kv_bytes: int = 0

    @property
    def pages_if_copied(self) -> int:
        return self.pages_shared + self.pages_copied

    @property
    def shared_fraction(self) -> float:
        return self.pages_shared / self.pages_if_copied if self.pages_if_copied else 0.0

    def __add__(self, other: BeamSearchStats) -> BeamSearchStats:
        return BeamSearchStats(self.num_forks + other.num_forks, self.pages_shared + other.pages_shared,
                               self.pages_copied + other.pages_copied, max(self.peak_kv_bytes, other.peak_kv_bytes))


@dataclass
class BeamSearchOutput:
    """Per prompt: `sequences`, the `beam_width` best, best first; `stats`: its forks' pages."""

    sequences: list[BeamSearchSequence]
    stats: BeamSearchStats = field(default_factory=BeamSearchStats)


class BeamGroup:
    """One prompt's search state, transformers' selection on `[W, V]` logprobs a step (see the
    module docstring). `beams[i]`: what running beam i is (the driver's object: at the first
    step all W are the prompt); `advance` returns, per next running beam, (parent index, token)."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos_token_ids: Collection[int]) -> None:
        w = params.beam_width
        self.params, self.prompt = params, list(prompt)
        self.eos = torch.tensor(sorted(eos_token_ids), dtype=torch.int64)
        self.width, self.keep = w, max(2, 1 + len(self.eos)) * w
        self.prompt_len = len(prompt)
        self.max_length = self.prompt_len + params.max_tokens
        self.cur_len = self.prompt_len
        self.scores = torch.zeros(w)  # running beams' cumulative logprobs; the copies of the prompt: impossible
        self.scores[1:] = NEG
        self.generated: list[list[int]] = [[] for _ in range(w)]  # running beams' generated tokens
        self.fin_scores = torch.full((w,), NEG)
        self.fin_done = torch.zeros(w, dtype=torch.bool)
        self.fin: list[tuple[list[int], float] | None] = [None] * w  # (generated, cum_logprob)
        self.unsatisfied = True  # the early-stop heuristic: the running beams may still improve
        self.done = False
        self.beams: list = []

    def advance(self, logprobs: torch.Tensor) -> list[tuple[int, int]]:
        """`logprobs` `[W, V]` float32 (running beam i's row i). Returns the next running beams
        as (parent index, token); [] once the search is done (`self.done`)."""
        w, k, lp = self.width, self.keep, self.params.length_penalty
        vocab = logprobs.shape[-1]
        acc = (logprobs + self.scores[:, None]).reshape(-1)
        top, idx = torch.topk(acc, k=min(k, acc.numel()))
        parents, tokens = idx // vocab, idx % vocab
        new_len = self.cur_len + 1
        hits = torch.isin(tokens, self.eos) if not self.params.ignore_eos and len(self.eos) else \
            torch.zeros_like(tokens, dtype=torch.bool)
        if new_len >= self.max_length:
            hits = torch.ones_like(hits)
        candidates = [self.generated[p] + [t] for p, t in zip(parents.tolist(), tokens.tolist())]
        # e. the running beams of the next step
        running = top + hits.to(torch.float32) * NEG
        nxt = torch.topk(running, k=w)[1]
        # f. the finished hypotheses
        just = hits & (torch.arange(len(top)) < w)
        scored = top / ((new_len - self.prompt_len) ** lp)
        scored = scored + float(bool(self.fin_done.all()) and self.params.early_stopping is True) * NEG
        scored = scored + float(not self.unsatisfied) * NEG
        scored = scored + (~just).to(torch.float32) * NEG
        merged = torch.cat((self.fin_scores, scored))
        merged_done = torch.cat((self.fin_done, just))
        merged_fin = self.fin + [(c, s) for c, s in zip(candidates, top.tolist())]
        best = torch.topk(merged, k=w)[1]
        self.fin_scores, self.fin_done = merged[best], merged_done[best]
        self.fin = [merged_fin[i] for i in best.tolist()]
        # g. next step's state and whether the search goes on
        self.scores = running[nxt]
        chosen = [(int(parents[i]), int(tokens[i])) for i in nxt.tolist()]
        self.generated = [candidates[i] for i in nxt.tolist()]
        self.cur_len = new_len
        if self.params.early_stopping == "never" and lp > 0.0:
            best_len = self.max_length - self.prompt_len
        else:
            best_len = self.cur_len - self.prompt_len
        best_running = self.scores[0] / (best_len ** lp)
        worst = torch.where(self.fin_done, torch.min(self.fin_scores), torch.tensor(NEG))
        self.unsatisfied = self.unsatisfied and bool(torch.any(best_running > worst))
        all_full = bool(self.fin_done.all()) and self.params.early_stopping is True
        self.done = not (self.unsatisfied and not all_full and not bool(hits.all()))
        return [] if self.done else chosen

    def sequences(self, eos_token_ids: Collection[int], decode=None) -> list[BeamSearchSequence]:
        """The kept hypotheses, best first (transformers' order)."""
        out = []
        for entry, score in zip(self.fin, self.fin_scores.tolist()):
            if entry is None:  # (never at the end of a search: max_tokens finishes the top W)
                continue
            generated, cum = entry
            reason = "stop" if not self.params.ignore_eos and generated[-1] in eos_token_ids else "length"
            tokens = self.prompt + generated
            out.append(BeamSearchSequence(tokens, cum, score, self.prompt_len, reason,
                                          decode(tokens) if decode is not None else None))
        return out


class _Beam:
    """A live beam of `search_batch`: its slot, its tokens (prompt + generated), and how many
    of them the slot holds computed (all but the last chosen token)."""

    __slots__ = ("slot", "tokens", "computed")

    def __init__(self, slot: int, tokens: list[int], computed: int = 0) -> None:
        self.slot, self.tokens, self.computed = slot, tokens, computed


def search_batch(kv: Any, runner: Any, prompts: list[list[int]], params: BeamSearchParams, eos: frozenset[int],
                 decode: Callable[[list[int]], str] | None,
                 record: Callable[[BeamSearchStats], None]) -> list[BeamSearchOutput]:
    """Search `prompts` together, their beams in free slots of `kv` (the engine's `KVSlots`,
    which must hold them all): each step backs every live beam (`kv.step`), runs one forward
    over them (`runner.last_logits`) and lets each prompt's group choose. Every slot of the
    search is freed at the end, and each prompt's stats go to `record`, whatever happens.
    OutOfPhysicalMemoryError when the beams do not fit into physical memory."""
    g = runner.cache.geometry
    groups = [BeamGroup(p, params, eos) for p in prompts]
    stats = [BeamSearchStats() for _ in prompts]
    live: set[int] = set()  # slots of the search
    peak = 0  # the most bytes the live tokens held after a step
    try:
        for group, prompt in zip(groups, prompts):
            slot = kv.alloc_reqid()
            live.add(slot)
            group.beams = [_Beam(slot, list(prompt))] * params.beam_width
        while any(not grp.done for grp in groups):
            rows = list({id(b): b for grp in groups if not grp.done for b in grp.beams}.values())
            if not kv.step({b.slot: len(b.tokens) for b in rows}):
                raise OutOfPhysicalMemoryError(
                    f"the {len(rows)} beams of this search do not fit into physical memory; raise "
                    "physical_memory, lower beam_width or max_tokens, or search fewer prompts at once")
            peak = max(peak, runner.cache.stats().active_bytes)
            logits = runner.last_logits([(b.slot, b.computed, b.tokens[b.computed:]) for b in rows])
            logprobs = torch.log_softmax(logits, dim=-1).cpu()
            row_of = {id(b): i for i, b in enumerate(rows)}
            for b in rows:
                b.computed = len(b.tokens)
            for n, grp in enumerate(groups):
                if not grp.done:
                    chosen = grp.advance(logprobs[[row_of[id(b)] for b in grp.beams]])
                    _next_beams(kv, g, grp, chosen, live, stats, n)
    finally:
        for slot in live:
            kv.free_reqid(slot)
        stats = [dataclasses.replace(s, peak_kv_bytes=peak) for s in stats]
        for s in stats:
            record(s)
    return [BeamSearchOutput(grp.sequences(eos, decode), s) for grp, s in zip(groups, stats)]


def _next_beams(kv: Any, g: Any, grp: BeamGroup, chosen: list[tuple[int, int]], live: set[int],
                stats: list[BeamSearchStats], n: int) -> None:
    """Give `grp` (prompt `n`) the beams it `chose` (parent index, token): a parent not chosen
    is freed, one chosen k times keeps its slot for its last child and is forked (at its
    computed length, `g` the cache's geometry) for the others, counted in `stats[n]`."""
    old = list({id(b): b for b in grp.beams}.values())
    if grp.done:
        for b in old:
            kv.free_reqid(b.slot)
            live.discard(b.slot)
        return
    left: dict[int, int] = {}
    for p, _ in chosen:
        left[id(grp.beams[p])] = left.get(id(grp.beams[p]), 0) + 1
    for b in old:  # pruned: freed before the forks, which need slots
        if id(b) not in left:
            kv.free_reqid(b.slot)
            live.discard(b.slot)
    beams = []
    for p, token in chosen:
        parent = grp.beams[p]
        left[id(parent)] -= 1
        if left[id(parent)]:  # chosen again later: fork it, it keeps its slot for the last
            slot = kv.fork(parent.slot, parent.computed)
            live.add(slot)
            shared = g.shared_pages(parent.computed)
            stats[n] = stats[n] + BeamSearchStats(1, shared, g.pages_for(parent.computed) - shared)
            beams.append(_Beam(slot, parent.tokens + [token], parent.computed))
        else:
            parent.tokens.append(token)
            beams.append(parent)
    grp.beams = beams
