"""`Sampler`: the next token of every row of a batch of logits `[S, V]`, on the device.

Every step of a row's processing is one tensor op over the batch, with per-row parameters as
`[S, 1]` tensors (vLLM v1's order):
```
logits [S, V] --log_softmax--> raw logprobs of the rows that asked (SamplingParams.logprobs)
  -> min_tokens: stop tokens -inf in rows that generated fewer   (one index_put)
  -> penalties: repetition, frequency, presence from token counts (rows that have one)
  -> greedy rows: argmax
  -> other rows: / temperature -> min_p -> top_k (one topk) -> top_p (one sort) -> softmax -> draw
```
Draws: the unseeded rows draw together from the engine's generator (one `torch.multinomial`);
a seeded row draws from its own generator (sample i of a request with `seed`: seeded with
`params.sample_seed(i)`), one `multinomial` over its `[V]` row, so its tokens do not depend
on what else is in the batch. That loop is over seeded rows, never over the vocabulary.

Penalties read each sequence's token counts, kept on the device in `TokenCounts` (a row per
sequence that has a penalty: its prompt's tokens as a mask, its generated tokens' counts),
built from its token ids the first time it samples and then moved on by the tokens this
sampler draws (one `index_put_` a step), so a token still in flight (asynchronous
scheduling) is counted without the host seeing it.

A row whose draw raises (a seeded row's generator, NaN logits) fails alone (`Sampled.errors`);
a failure of the batched part raises, and the engine runs each request alone
(`ModelRunner.launch`).
"""
from __future__ import annotations

import logging
from collections.abc import Collection
from typing import NamedTuple, Sequence as Seq

import torch

from vattn.engine.sampling_params import SamplingParams
from vattn.engine.scheduler import SeqId
from vattn.engine.sequence import Logprob, Sequence, TokenLogprobs

logger = logging.getLogger(__name__)


class LogprobRows(NamedTuple):
    """The logprobs of the rows that asked, on the device: column 0 is the sampled token, then
    the top `max(ks)` tokens."""

    seq_ids: list[SeqId]
    ks: list[int]  # alternatives each row asked for
    ids: torch.Tensor  # [L, 1 + K] int64
    values: torch.Tensor  # [L, 1 + K] float32
    ranks: torch.Tensor  # [L] int64: the sampled token's rank (1: the most likely)

    def to_host(self) -> dict[SeqId, TokenLogprobs]:
        """Per sequence: token id -> Logprob, the sampled token first (waits for the device)."""
        ids, values, ranks = self.ids.tolist(), self.values.tolist(), self.ranks.tolist()
        out: dict[SeqId, TokenLogprobs] = {}
        for i, (sid, k) in enumerate(zip(self.seq_ids, self.ks)):
            entry = {ids[i][0]: Logprob(values[i][0], ranks[i])}
            for j in range(1, k + 1):
                entry.setdefault(ids[i][j], Logprob(values[i][j], j))
            out[sid] = entry
        return out


class Sampled(NamedTuple):
    """What sampling rows of logits gave, on the device."""

    seq_ids: list[SeqId]  # the sequence of each row
    tokens: torch.Tensor | None  # [S] int64 on the device, one token a row (0 in a row that failed); None: no row
    errors: dict[SeqId, str]  # sequences that failed (their rows' tokens mean nothing)
    logprobs: tuple[LogprobRows, ...] = ()  # of the rows that asked
    # speculative decoding: the drafts each verified sequence keeps, before its token (never mutated)
    accepted: dict[SeqId, list[int]] = {}

    @staticmethod
    def merge(parts: list[Sampled]) -> Sampled:
        """The rows of `parts` one after the other, and all their errors."""
        tokens = [p.tokens for p in parts if p.tokens is not None]
        return Sampled([sid for p in parts for sid in p.seq_ids], torch.cat(tokens) if tokens else None,
                       {sid: e for p in parts for sid, e in p.errors.items()},
                       tuple(lp for p in parts for lp in p.logprobs),
                       {sid: a for p in parts for sid, a in p.accepted.items()})


NOTHING_SAMPLED = Sampled([], None, {})


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of `[S, V]` float32 logits: `[S]` int64 on their device, the first maximum
    of each row, a NaN counting as the maximum (torch.argmax's rules). On the CPU numpy's
    vectorized argmax does it (about 20x faster than torch's CPU argmax at V = 32000); elsewhere
    torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        try:
            return torch.from_numpy(logits.numpy().argmax(-1).astype("int64", copy=False))
        except RuntimeError:  # torch built without numpy
            pass
    return logits.argmax(dim=-1)


def _column(values: list[float] | list[int], like: torch.Tensor) -> torch.Tensor:
    """Per-row parameters as a `[R, 1]` tensor on `like`'s device, in its dtype."""
    return torch.tensor(values, dtype=like.dtype).to(like.device, non_blocking=True)[:, None]


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Logits `[R, V]` with every token less likely than `min_p [R, 1]` times its row's most
    likely one at -inf (transformers' MinPLogitsWarper; min_p 0 keeps the row)."""
    probs = x.softmax(-1)  # [R, V]
    threshold = probs.amax(-1, keepdim=True) * min_p  # [R, 1]
    return x.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(x: torch.Tensor, top_k: list[int] | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Logits `[R, V]` with the tokens outside each row's top-k (one int a row, >= V = off), then
    outside its top-p nucleus (`[R, 1]`, 1 = off), at -inf: the masks of transformers'
    TopKLogitsWarper (ties with the k-th kept) and TopPLogitsWarper (drop the tokens whose
    ascending cumulative probability is <= 1 - p, never the most likely one). Top-k takes one
    `topk` of the largest k asked; top-p one ascending sort, cheap where top-k left few tokens."""
    vocab = x.shape[-1]
    if top_k is not None:
        max_k = max((k for k in top_k if k < vocab), default=0)
        if max_k:
            k = torch.tensor(top_k, dtype=torch.int64).to(x.device, non_blocking=True)[:, None]  # [R, 1]
            top = x.topk(max_k, dim=-1).values  # [R, K]
            kth = top.gather(-1, k.clamp(max=max_k) - 1)  # [R, 1]: the k-th largest
            kth = kth.masked_fill(k >= vocab, float("-inf"))  # rows without top-k keep every token
            x = x.masked_fill(x < kth, float("-inf"))
            if top_p is not None and max_k == max(top_k) and x.device.type == "cpu":
                return _top_p_of_few(x, top_p)
    if top_p is not None:
        sorted_x, order = x.sort(dim=-1, descending=False)  # [R, V]
        cumulative = sorted_x.softmax(-1).cumsum(-1)  # [R, V]
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        x = x.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))
    return x


def _top_p_of_few(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p of logits `[R, V]` of which top-k left few finite ones in every row: sorted by one
    `topk` of the most finite entries of a row (ties with the k-th included) instead of a sort of
    the whole vocabulary; the mask TopPLogitsWarper gives after TopKLogitsWarper. On the host,
    where reading that count costs no device sync."""
    width = int(torch.isfinite(x).sum(-1).max())
    top = x.topk(max(width, 1), dim=-1)  # [R, W] descending
    values, ids = top.values.flip(-1), top.indices.flip(-1)  # ascending, as TopPLogitsWarper sorts
    drop = values.softmax(-1).cumsum(-1) <= 1 - top_p  # [R, W]
    drop[:, -1] = False
    return x.scatter(-1, ids, values.masked_fill(drop, float("-inf")))


class TokenCounts:
    """Per sequence with a penalty, on the device: its prompt's tokens (a mask) and how often
    it generated each token. One row each of `in_prompt [R, V]` and `counts [R, V]`, grown by
    doubling and reused when a sequence is released."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.in_prompt: torch.Tensor | None = None  # [R, V] bool
        self.counts: torch.Tensor | None = None  # [R, V] float32
        self.rows: dict[SeqId, int] = {}
        self.free_rows: list[int] = []

    def rows_of(self, seqs: Seq[Sequence], vocab: int) -> torch.Tensor:
        """The rows of `seqs` (`[P]` int64 on the device); a sequence seen for the first time
        gets one built from its token ids (the host's: it has sampled nothing in flight yet)."""
        rows = []
        for seq in seqs:
            row = self.rows.get(seq.seq_id)
            if row is None:
                row = self.rows[seq.seq_id] = self._new_row(vocab)
                prompt = torch.tensor(seq.prompt_token_ids, dtype=torch.int64).to(self.device)
                self.in_prompt[row].index_fill_(0, prompt.clamp(max=vocab - 1), True)
                output = seq.output_token_ids
                if output:
                    ids = torch.tensor(output, dtype=torch.int64).to(self.device).clamp(max=vocab - 1)
                    self.counts[row].index_add_(0, ids, torch.ones(len(output), device=self.device))
            rows.append(row)
        return torch.tensor(rows, dtype=torch.int64).to(self.device)

    def _new_row(self, vocab: int) -> int:
        if self.counts is None:
            self.in_prompt = torch.zeros(4, vocab, dtype=torch.bool, device=self.device)
            self.counts = torch.zeros(4, vocab, dtype=torch.float32, device=self.device)
            self.free_rows = [3, 2, 1, 0]
        if not self.free_rows:
            n = self.counts.shape[0]
            self.in_prompt = torch.cat([self.in_prompt, torch.zeros_like(self.in_prompt)])
            self.counts = torch.cat([self.counts, torch.zeros_like(self.counts)])
            self.free_rows = list(range(2 * n - 1, n - 1, -1))
        row = self.free_rows.pop()
        self.in_prompt[row].zero_()
        self.counts[row].zero_()
        return row

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count one generated token per row (`rows`, `tokens`: `[P]` on the device)."""
        self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.float32), accumulate=True)

    def release(self, seq_id: SeqId) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.free_rows.append(row)


def apply_penalties(x: torch.Tensor, in_prompt: torch.Tensor, counts: torch.Tensor, repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Logits `[P, V]` with the penalties of `[P, 1]` rows: repetition over prompt and generated
    tokens (divide a positive logit, multiply a negative one: transformers' and vLLM's), then
    frequency (times each generated token's count) and presence (once per generated token)
    subtracted (OpenAI's)."""
    generated = counts > 0  # [P, V]
    seen = in_prompt | generated
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - frequency * counts - presence * generated.to(x.dtype)


class Sampler:
    """Batched sampling of one token per row (see the module docstring), with one generator per
    seeded sequence and the engine's for the others."""

    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self.default_generator = torch.Generator(device=device).manual_seed(seed)
        self.generators: dict[SeqId, torch.Generator] = {}
        self.token_counts = TokenCounts(device)

    def generator(self, seq_id: SeqId, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.default_generator
        g = self.generators.get(seq_id)
        if g is None:
            seed = params.sample_seed(seq_id[1])
            g = self.generators[seq_id] = torch.Generator(device=self.device).manual_seed(seed)
        return g

    def release(self, seq_id: SeqId) -> None:
        """Forget a finished sequence's generator and token counts."""
        self.generators.pop(seq_id, None)
        self.token_counts.release(seq_id)

    def sample(self, logits: torch.Tensor, seq_ids: list[SeqId], params: list[SamplingParams],
               seqs: Seq[Sequence] | None = None, eos_token_ids: Collection[int] = ()) -> Sampled:
        """logits `[S, V]` -> one token per row, on the device (nothing waits for it). `seqs`:
        the sequence of each row (their tokens so far: penalties, min_tokens); needed when a
        row has either. `eos_token_ids`: masked with min_tokens (unless ignore_eos). A row whose
        draw raises is reported in `errors`; the other rows keep their tokens."""
        logits = logits.float()  # [S, V]
        if all(p.greedy and not p.has_penalties and not p.min_tokens and p.logprobs is None for p in params):
            return Sampled(list(seq_ids), argmax_tokens(logits), {})  # the common case, as cheap as it gets
        x = logits
        if any(p.min_tokens for p in params):
            x = self._mask_stop_tokens(x, params, seqs, eos_token_ids)
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        counted = None  # (rows of x, their TokenCounts rows)
        if penalized:
            x, counted = self._apply_penalties(x, penalized, params, seqs)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        tokens = argmax_tokens(x) if greedy else torch.zeros(len(seq_ids), dtype=torch.long, device=x.device)
        errors: dict[SeqId, str] = {}
        if len(greedy) < len(params):
            self._draw(x, tokens, seq_ids, params, errors)
        if counted is not None:  # after every draw: a batch that raised counted nothing
            self.token_counts.add(counted[1], tokens[counted[0]])
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs = (self._logprobs(logits, tokens, asked, seq_ids, params),) if asked else ()
        return Sampled(list(seq_ids), tokens, errors, logprobs)

    def _mask_stop_tokens(self, x: torch.Tensor, params: list[SamplingParams], seqs: Seq[Sequence] | None,
                          eos_token_ids: Collection[int]) -> torch.Tensor:
        """`x` with the stop tokens of the rows still under their min_tokens at -inf."""
        if seqs is None:
            raise ValueError("min_tokens needs the rows' sequences (seqs=)")
        vocab = x.shape[-1]
        rows: list[int] = []
        cols: list[int] = []
        for i, (p, seq) in enumerate(zip(params, seqs)):
            if p.min_tokens and seq.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                stops = [t for t in stops if t < vocab]
                rows += [i] * len(stops)
                cols += stops
        if not rows:
            return x
        x = x.clone()
        where = torch.tensor([rows, cols], dtype=torch.int64).to(x.device)  # [2, M]
        x[where[0], where[1]] = float("-inf")
        return x

    def _apply_penalties(self, x: torch.Tensor, penalized: list[int], params: list[SamplingParams],
                         seqs: Seq[Sequence] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """`x` with the penalties of rows `penalized` applied, and (those rows, their count rows)."""
        if seqs is None:
            raise ValueError("penalties need the rows' sequences (seqs=)")
        counts = self.token_counts
        count_rows = counts.rows_of([seqs[i] for i in penalized], x.shape[-1])  # [P]
        rows = torch.tensor(penalized, dtype=torch.int64).to(x.device)  # [P]
        ps = [params[i] for i in penalized]
        penalized_x = apply_penalties(
            x[rows], counts.in_prompt[count_rows], counts.counts[count_rows],
            _column([p.repetition_penalty for p in ps], x), _column([p.frequency_penalty for p in ps], x),
            _column([p.presence_penalty for p in ps], x))  # [P, V]
        x = x.index_copy(0, rows, penalized_x)
        return x, (rows, count_rows)

    def _draw(self, x: torch.Tensor, tokens: torch.Tensor, seq_ids: list[SeqId], params: list[SamplingParams],
              errors: dict[SeqId, str]) -> None:
        """Sample the non-greedy rows of processed logits `x [S, V]` into `tokens [S]`."""
        rows = [i for i, p in enumerate(params) if not p.greedy]
        ps = [params[i] for i in rows]
        index = torch.tensor(rows, dtype=torch.int64).to(x.device)
        probs = self.probs(x[index], ps)  # [R, V]
        unseeded = [j for j, p in enumerate(ps) if p.seed is None]
        if unseeded:
            self._draw_unseeded(probs, unseeded, rows, tokens, seq_ids, errors)
        for j, p in enumerate(ps):
            if p.seed is None:
                continue
            i = rows[j]
            try:
                tokens[i] = self.draw(probs[j], seq_ids[i], p)
            except Exception as e:  # noqa: BLE001 - this sequence fails, not the batch
                self._fail(tokens, i, seq_ids[i], e, errors)

    @staticmethod
    def probs(x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
        """The distributions `[R, V]` that rows of (penalised) logits `x [R, V]` draw from, one
        non-greedy `SamplingParams` a row: / temperature, min_p, top_k, top_p, softmax."""
        xs = x / _column([p.temperature for p in ps], x)  # [R, V]
        if any(p.min_p for p in ps):
            xs = apply_min_p(xs, _column([p.min_p for p in ps], xs))
        vocab = xs.shape[-1]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in ps]
        use_k, use_p = any(k < vocab for k in top_k), any(p.top_p < 1.0 for p in ps)
        if use_k or use_p:
            xs = apply_top_k_top_p(xs, top_k if use_k else None, _column([p.top_p for p in ps], xs) if use_p else None)
        return xs.softmax(-1)

    def _draw_unseeded(self, probs: torch.Tensor, unseeded: list[int], rows: list[int], tokens: torch.Tensor,
                       seq_ids: list[SeqId], errors: dict[SeqId, str]) -> None:
        """The unseeded rows' draws, together from the engine's generator; when that raises (a
        row of NaN), row by row so that only the bad rows fail."""
        where = torch.tensor([rows[j] for j in unseeded], dtype=torch.int64).to(tokens.device)
        sub = probs if len(unseeded) == len(rows) else probs[torch.tensor(unseeded).to(probs.device)]
        try:
            tokens[where] = torch.multinomial(sub, 1, generator=self.default_generator)[:, 0]
            return
        except RuntimeError:
            pass
        for j in unseeded:
            i = rows[j]
            try:
                tokens[i] = torch.multinomial(probs[j], 1, generator=self.default_generator)[0]
            except Exception as e:  # noqa: BLE001 - this sequence fails, not the batch
                self._fail(tokens, i, seq_ids[i], e, errors)

    def draw(self, probs: torch.Tensor, seq_id: SeqId, p: SamplingParams) -> torch.Tensor:
        """A seeded row's token (a 0-d tensor on the device) from its probabilities `[V]` and its
        own generator."""
        return torch.multinomial(probs, 1, generator=self.generator(seq_id, p))[0]

    @staticmethod
    def _fail(tokens: torch.Tensor, i: int, sid: SeqId, e: Exception, errors: dict[SeqId, str]) -> None:
        logger.warning("vattn: sampling request %d (sample %d) failed", sid[0], sid[1], exc_info=True)
        errors[sid] = f"sampling request {sid[0]} failed: {type(e).__name__}: {e}"
        tokens[i] = 0  # a valid id: the next iteration may read it before the error is seen

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, asked: list[int], seq_ids: list[SeqId],
                  params: list[SamplingParams]) -> LogprobRows:
        """The raw logprobs (log_softmax of the unprocessed logits) of the sampled tokens and the
        top alternatives of rows `asked`: one log_softmax and one topk over them."""
        index = torch.tensor(asked, dtype=torch.int64).to(logits.device)
        raw = logits[index].log_softmax(-1)  # [L, V]
        sampled = tokens.to(logits.device)[index][:, None]  # [L, 1]
        sampled_values = raw.gather(-1, sampled)  # [L, 1]
        ranks = (raw > sampled_values).sum(-1) + 1  # [L]
        ks = [min(params[i].logprobs, raw.shape[-1]) for i in asked]
        ids, values = sampled, sampled_values
        if max(ks):
            top = raw.topk(max(ks), dim=-1)  # [L, K]
            ids, values = torch.cat([sampled, top.indices], -1), torch.cat([sampled_values, top.values], -1)
        return LogprobRows([seq_ids[i] for i in asked], ks, ids, values, ranks)
