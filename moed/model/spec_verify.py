"""Verifying speculative drafts against the target model: exact speculative sampling.

A speculating request brings k draft tokens d_0..d_{k-1} and the target model's logits at
k + 1 positions: row i scores the token after context + d_0..d_{i-1}, so rows 0..k-1 judge
the drafts and row k gives the bonus token. `verify` keeps the longest prefix of the drafts
that the rules below accept and emits one token more: 1 to k + 1 tokens whose distribution is
exactly that of plain decoding with the same SamplingParams (Leviathan et al. 2023, Chen et
al. 2023).

- p_i is what moed.model.sampler draws from at position i: `process_logits`, then
  `probabilities`, on row i with the history the sampler would have there (`position_rows`):
  the penalties count d_0..d_{i-1} as output, min_tokens' banned ids hold while the output
  is still short, and the grammar's mask is the one after d_0..d_{i-1}.
- Sampled rows: accept d_i when u_i < p_i(d_i) / q_i(d_i), u_i ~ U[0, 1) (probability
  min(1, p/q)); at the first rejection draw from normalize(max(p_i - q_i, 0)); all k
  accepted: the bonus from p_k. A point-mass draft (no q: prompt lookup, a greedy draft model)
  has q_i = one-hot(d_i): accepted with probability p_i(d_i), else a draw from p_i without
  d_i. A residual that rounding leaves empty (p ~ q) falls back to p_i.
- Greedy rows (params.greedy): accept while d_i is the argmax of processed row i; then that
  row's argmax (row k's when all are accepted): token for token plain greedy decoding.
- Logprobs of the emitted tokens (and top logprobs) are the raw ones `sample` reports: the
  log_softmax of the unprocessed row (vLLM's raw_logprobs).

Randomness. A seeded request's draws all come from its own generator, in one fixed order per
call: k uniforms (the accept tests, drawn whether or not a test is reached), then one Exp(1)
vector over the vocabulary (`seeded_noise`) that picks the last token by the sampler's
exponential race. Greedy rows draw nothing; unseeded rows use torch's default generator.
What stays reproducible: the same seed with the same drafts (same method, same lengths)
gives the same tokens, and an empty draft gives the very token `sample` would. Speculation on
and off with one seed give the same distribution, not the same tokens (the generator is
consumed differently); vLLM documents the same of its own.

The caller (moed.engine.speculate and Scheduler._apply_verified) cuts the emitted tokens
at a stop token, stop string or max_tokens as after plain decoding (a prefix of an exactly
distributed sequence is exactly distributed), rolls back the KV of the rejected positions,
and advances the grammar matcher through the emitted tokens only. Exact up to what `sample`
itself leaves to its batch: top-k ties at the k-th value (sampler._filter_top_k_top_p).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from moed.model.grammar import fill_bitmask
from moed.model.sampler import (SampleRow, argmax_rows, probabilities, process_logits,
                                raw_logprobs, seeded_noise)


@dataclass(frozen=True)
class DraftRow:
    """One speculating request in a `verify` call."""

    # what the step would give `sample` for the request's next token (moed.engine.step
    # StepCore._sample_row): params, generator, banned ids now, the history of a penalized
    # row, the grammar matcher (its state: before d_0) and position 0's mask if computed
    row: SampleRow
    draft: tuple[int, ...]          # d_0..d_{k-1}; () samples one token, as `sample` would
    # output tokens before d_0: row.banned_ids (min_tokens) also hold at position i > 0
    # while num_output + i < params.min_tokens
    num_output: int
    # q: fp32 [k, V], row i the distribution d_i was drawn from; None: a point mass on each
    # d_i. Greedy rows ignore it (their target is a point mass: the draft matches it or not)
    draft_probs: torch.Tensor | None = None
    # grammar rows with k > 0: int32 [k + 1, words], row i the grammar's bitmask after
    # d_0..d_{i-1} (moed.model.grammar.fill_bitmask on a matcher advanced through them). The
    # caller cuts the draft before the first token its grammar refuses: no mask exists past it
    masks: torch.Tensor | None = None


@dataclass(frozen=True)
class Verified:
    accepted: int                       # drafts accepted, 0..k
    token_ids: tuple[int, ...]          # the accepted drafts, then the correction or the bonus
    # raw logprob of each emitted token: when params.logprobs or params.top_logprobs
    logprobs: tuple[float, ...] | None = None
    # each emitted token's params.top_logprobs best (token id, logprob): when that is > 0
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None


def position_rows(d: DraftRow) -> list[SampleRow]:
    """The k + 1 SampleRows `sample` would get at positions 0..k, each with the drafts before
    it taken as accepted (no generator: `verify` makes the draws)."""
    r, k, p = d.row, len(d.draft), d.row.params
    if r.grammar is None and d.masks is not None:
        raise ValueError("masks given for a row without a grammar")
    if d.masks is not None and d.masks.shape[0] != k + 1:
        raise ValueError(f"masks {tuple(d.masks.shape)} for a draft of {k}: need {k + 1} rows")
    if r.grammar is not None and d.masks is None and k > 0:
        raise ValueError("a grammar row with drafts needs the grammar's mask at every position")
    out = []
    for i in range(k + 1):
        banned = r.banned_ids if i == 0 or d.num_output + i < p.min_tokens else ()
        mask = r.mask if d.masks is None else d.masks[i]
        if r.grammar is not None and mask is None:     # position 0: the matcher's own state
            mask = fill_bitmask([r.grammar])[0]
        hist = list(r.token_ids) + list(d.draft[:i]) if p.penalized and i else r.token_ids
        if r.generator is None and banned is r.banned_ids and mask is r.mask and hist is r.token_ids:
            out.append(r)       # nothing differs: the row itself (replace() per position added up)
        else:
            # the constructor, not dataclasses.replace (~4x its cost, per position of every row)
            out.append(SampleRow(params=p, generator=None, banned_ids=banned, token_ids=hist,
                                 num_prompt=r.num_prompt, grammar=r.grammar, mask=mask))
    return out


def verify(logits: torch.Tensor, reqs: Sequence[DraftRow]) -> list[Verified]:
    """logits: fp32 [sum(k_r + 1), V], request r's k_r + 1 rows after the rows of those before
    it, row i of each scoring the token after its context + d_0..d_{i-1}. One Verified per
    request, in order. All rows are processed together (one softmax for every sampled row)."""
    sizes = [len(d.draft) + 1 for d in reqs]
    if logits.dim() != 2 or logits.shape[0] != sum(sizes):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {sum(sizes)} rows "
                         f"({len(reqs)} requests)")
    vocab = logits.shape[1]
    for d in reqs:
        if any(not 0 <= t < vocab for t in d.draft):
            raise ValueError(f"draft {d.draft} has ids outside the vocabulary of {vocab}")
        if d.draft_probs is not None and tuple(d.draft_probs.shape) != (len(d.draft), vocab):
            raise ValueError(f"draft_probs {tuple(d.draft_probs.shape)} for a draft of "
                             f"{len(d.draft)}: need ({len(d.draft)}, {vocab})")
    raw = logits.float()
    if all(_bare_greedy(d) for d in reqs):  # nothing changes a row: its argmax decides
        got = _greedy(argmax_rows(raw).tolist(), reqs)
        return [Verified(a, tuple(d.draft[:a]) + (t,)) for d, (a, t) in zip(reqs, got)]
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    rows = [r for d in reqs for r in position_rows(d)]
    processed = process_logits(raw, rows)
    accepted, last = [0] * len(reqs), [0] * len(reqs)
    for greedy in (True, False):
        idx = [j for j, d in enumerate(reqs) if d.row.params.greedy == greedy]
        if not idx:
            continue
        pos = [starts[j] + i for j in idx for i in range(sizes[j])]
        sub = [reqs[j] for j in idx]
        if greedy:
            got = _greedy(argmax_rows(processed[pos]).tolist(), sub)
        else:
            got = _sampled(probabilities(processed[pos], [rows[i] for i in pos]), sub)
        for j, (a, t) in zip(idx, got):
            accepted[j], last[j] = a, t
    emitted = [tuple(d.draft[:a]) + (t,) for d, a, t in zip(reqs, accepted, last)]
    lps, tops = _logprobs(raw, rows, reqs, starts, emitted)
    return [Verified(a, e, lp, tp) for a, e, lp, tp in zip(accepted, emitted, lps, tops)]


def _bare_greedy(d: DraftRow) -> bool:
    """A greedy row that no processing changes at any of its positions (no grammar, penalty,
    logit_bias or banned id: min_tokens' bans hold at position i only while they hold at 0)
    and that wants no logprobs: `verify` takes the raw rows' argmax, ~0.1 ms less a step at
    batch 1 than building k + 1 SampleRows and processing them."""
    r, p = d.row, d.row.params
    return p.greedy and r.grammar is None and not p.penalized and not r.banned_ids \
        and not p.logprobs and not p.top_logprobs


def _greedy(best: list[int], reqs: Sequence[DraftRow]) -> list[tuple[int, int]]:
    """(accepted, last token) per request from the argmax of each of its k + 1 rows."""
    out, o = [], 0
    for d in reqs:
        k, a = len(d.draft), 0
        while a < k and d.draft[a] == best[o + a]:
            a += 1
        out.append((a, best[o + a]))
        o += k + 1
    return out


def _sampled(probs: torch.Tensor, reqs: Sequence[DraftRow]) -> list[tuple[int, int]]:
    """(accepted, last token) per request; probs: p of each request's k + 1 rows, stacked."""
    dev, vocab = probs.device, probs.shape[1]
    ks = [len(d.draft) for d in reqs]
    offs = [0]
    for k in ks[:-1]:
        offs.append(offs[-1] + k + 1)
    dpos = [o + i for o, k in zip(offs, ks) for i in range(k)]
    u = _uniforms(reqs, ks, dev)
    acc = [True] * len(dpos)
    if dpos:
        toks = torch.tensor([t for d in reqs for t in d.draft], device=dev)
        p_d = probs[torch.tensor(dpos, device=dev), toks]
        q_d = torch.ones(len(dpos), device=dev)         # a point draft: q = 1
        has_q = [d.draft_probs is not None and k > 0 for d, k in zip(reqs, ks)]
        if any(has_q):      # one gather over every q row (per-request indexing added up)
            at = torch.tensor([c + i for c, k, h in zip(accumulate(ks, initial=0), ks, has_q) if h for i in range(k)],
                              device=dev)
            q_rows = torch.cat([d.draft_probs.to(dev, torch.float32) for d, h in zip(reqs, has_q) if h])
            q_d[at] = q_rows[torch.arange(len(at), device=dev), toks[at]]
        acc = (u < p_d / q_d).tolist()      # q = 0: inf accepts (p > 0), nan (p = 0) rejects
    accepted, c = [], 0
    for k in ks:
        a = 0
        while a < k and acc[c + a]:
            a += 1
        accepted.append(a)
        c += k
    # the last token's distribution: the residual max(p_a - q_a, 0) after a rejection, else
    # p_k; the exponential race needs no normalising
    p_last = probs[torch.tensor([o + a for o, a in zip(offs, accepted)], device=dev)]
    q_last = torch.zeros_like(p_last)
    for j, (d, a) in enumerate(zip(reqs, accepted)):
        if a < len(d.draft):
            if d.draft_probs is None:
                q_last[j, d.draft[a]] = 1.0          # p - 1 <= 0: the draft token drops out
            else:
                q_last[j] = d.draft_probs[a].to(dev, torch.float32)
    res = torch.clamp(p_last - q_last, min=0.0)
    res = torch.where(res.sum(dim=-1, keepdim=True) > 0, res, p_last)
    return list(zip(accepted, argmax_rows(res / _race_noise(reqs, vocab, dev)).tolist()))


def _uniforms(reqs: Sequence[DraftRow], ks: list[int], dev: torch.device) -> torch.Tensor:
    """The accept tests' U[0, 1) draws, k per request (a seeded request's from its generator,
    before its race noise)."""
    parts = []
    unseeded = sum(k for d, k in zip(reqs, ks) if d.row.generator is None)
    shared = torch.rand(unseeded, device=dev) if unseeded else None
    c = 0
    for d, k in zip(reqs, ks):
        g = d.row.generator
        if g is None:
            parts.append(shared[c:c + k] if shared is not None else torch.empty(0, device=dev))
            c += k
        elif k:         # an empty draft draws no uniform: its race noise is sample()'s
            parts.append(torch.rand(k, generator=g, device=g.device).to(dev))
    return torch.cat(parts) if parts else torch.empty(0, device=dev)


def _race_noise(reqs: Sequence[DraftRow], vocab: int, dev: torch.device) -> torch.Tensor:
    """Exp(1) noise [R, V] for the last token's race: seeded rows from their generator (as
    `sample` draws it: the empty draft gives sample's token), the rest from torch's."""
    noise = torch.empty((len(reqs), vocab), device=dev).exponential_()
    for j, d in enumerate(reqs):
        if d.row.generator is not None:
            noise[j] = seeded_noise(d.row.generator, vocab).to(dev)
    return noise


def _logprobs(raw: torch.Tensor, rows: list[SampleRow], reqs: Sequence[DraftRow],
              starts: list[int], emitted: list[tuple[int, ...]]
              ) -> tuple[list, list]:
    """Per request: the raw logprobs (and top logprobs) of its emitted tokens, or None when
    its params do not ask; one log_softmax over the emitted rows of the requests that ask."""
    lps: list = [None] * len(reqs)
    tops: list = [None] * len(reqs)
    ask = [j for j, d in enumerate(reqs)
           if d.row.params.logprobs or d.row.params.top_logprobs > 0]
    if not ask:
        return lps, tops
    pos = [starts[j] + i for j in ask for i in range(len(emitted[j]))]
    chosen = torch.tensor([t for j in ask for t in emitted[j]], device=raw.device)
    got, top = raw_logprobs(raw[pos], chosen, [rows[i] for i in pos])
    c = 0
    for j in ask:
        n = len(emitted[j])
        lps[j] = tuple(got[c:c + n]) if got is not None else None
        if top is not None and reqs[j].row.params.top_logprobs > 0:
            tops[j] = tuple(tuple(t) for t in top[c:c + n])
        c += n
    return lps, tops
