"""Verifying draft tokens against the target model's rows (speculative decoding).

A sequence with drafts `d_1 .. d_k` ran a query of `1 + k` tokens (its last token, then the
drafts), so it has `1 + k` logits rows: row i is the target's distribution `p_i` of the token
after `d_i` (row 0: after the last token). Draft i + 1 is checked against row i:
- greedy: accepted while `d_{i+1} == argmax p_i`; the first mismatch's row gives the token
  instead (its argmax), and when every draft is accepted row k gives one more. The tokens are
  exactly those of decoding one token a step.
- sampled: an n-gram draft has no probabilities of its own (a point mass q = 1 on d), so the
  standard rejection sampler is: accept `d_{i+1}` with probability `min(1, p_i(d) / q(d)) =
  p_i(d)`; on a rejection draw from `max(0, p_i - q)` renormalised, i.e. `p_i` with d's mass
  removed. Every emitted token is then distributed as the target's `p_i` (tests: a seeded
  chi-square over many draws). `p_i` is the request's processed distribution (temperature,
  min_p, top_k, top_p: `Sampler.probs`); draws come from the sequence's generator (its own when
  seeded: the same tokens from the same seed).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from vattn.engine.sampler import Sampled, Sampler, argmax_tokens
from vattn.engine.sampling_params import SamplingParams
from vattn.engine.scheduler import SeqId


def accept_point_mass(probs: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None) -> tuple[int, int]:
    """The rejection sampler for one sequence: `probs [k + 1, V]` the target's processed rows,
    `drafts [k]` int64 on their device. Returns (accepted drafts, the token that follows them)."""
    k = drafts.numel()
    if k:
        p_draft = probs[:k].gather(-1, drafts[:, None])[:, 0]  # [k]
        u = torch.rand(k, generator=generator, device=probs.device, dtype=probs.dtype)  # [k] in [0, 1)
        rejected = (u >= p_draft).tolist()
        j = rejected.index(True) if True in rejected else k
    else:
        j = 0
    row = probs[j]
    if j < k:  # p with the rejected draft's mass removed
        row = row.clone()
        row[drafts[j]] = 0
        if not bool(row.sum() > 0):  # (p(d) = 1 was rejected: cannot be; keep the draw defined)
            row = probs[j]
    token = int(torch.multinomial(row, 1, generator=generator)[0])
    return j, token


def verify(sampler: Sampler, logits: torch.Tensor, items: Seq[tuple[SeqId, SamplingParams, tuple[int, ...]]]) -> Sampled:
    """Verify the drafts of every sequence of `items` ((seq id, params, drafts), in order) from
    `logits [sum(1 + k), V]` (each sequence's rows one after the other). Returns one token per
    sequence (the target's, after the accepted drafts) and `accepted`: each sequence's accepted
    drafts. A sequence whose verification raises fails alone (`errors`)."""
    logits = logits.float()
    tokens: list[int] = []
    accepted: dict[SeqId, list[int]] = {}
    errors: dict[SeqId, str] = {}
    greedy_rows = [i for i, (_, p, _) in enumerate(items) if p.greedy]
    offsets, row = [], 0
    for _, _, drafts in items:
        offsets.append(row)
        row += 1 + len(drafts)
    best: list[int] | None = argmax_tokens(logits).tolist() if greedy_rows else None
    for i, (sid, p, drafts) in enumerate(items):
        start, k = offsets[i], len(drafts)
        try:
            if p.greedy:
                target = best[start:start + k + 1]
                j = 0
                while j < k and drafts[j] == target[j]:
                    j += 1
                token = target[j]
            else:
                probs = sampler.probs(logits[start:start + k + 1], [p] * (k + 1))  # [k + 1, V]
                d = torch.tensor(drafts, dtype=torch.int64).to(probs.device)
                j, token = accept_point_mass(probs, d, sampler.generator(sid, p))
        except Exception as e:  # noqa: BLE001 - this sequence fails, not the batch
            errors[sid] = f"verifying the drafts of request {sid[0]} failed: {type(e).__name__}: {e}"
            j, token = 0, 0
        accepted[sid] = list(drafts[:j])
        tokens.append(token)
    t = torch.tensor(tokens, dtype=torch.int64).to(logits.device)
    return Sampled([sid for sid, _, _ in items], t, errors, (), accepted)
