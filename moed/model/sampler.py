"""Batched token sampling from fp32 logits with per-request parameters.

Rows are independent: greedy rows take the argmax; the others are scaled by temperature,
filtered by top-k then top-p, and drawn with the exponential-race trick (argmax of p / E,
E ~ Exp(1)), which equals sampling from p. A seeded request draws its noise from its own
torch.Generator, only for its own row, so the same seed gives the same tokens whatever the
batch mates. Logprobs (the chosen token's, and the top-N when a row asks for `top_logprobs`)
are log_softmax of the raw model logits (before penalties, logit_bias, temperature, filtering
and masking): what vLLM returns by default (logprobs_mode "raw_logprobs").

Order, as vLLM's: logit_bias, then repetition_penalty (prompt + output), then frequency and
presence penalties (output only) on the logits; greedy rows take the argmax of THESE logits;
the others then apply temperature, top-k, top-p and min-p (vLLM's v0 order; min-p's cut is
relative to the top token, so only its place after top-p matters). Rows with none of these
extras (`params.penalized` false) skip that path: their logits are not touched.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from moed.types import SamplingParams


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None = None     # seeded requests only
    banned_ids: tuple[int, ...] = ()             # e.g. EOS while min_tokens are not out yet
    # penalized rows only: prompt + output so far, and how many of them are the prompt
    token_ids: Sequence[int] = ()
    num_prompt: int = 0


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None                 # None when no row asked for logprobs
    # per row: its params.top_logprobs best (token id, logprob), best first; None when no row
    # asked (rows that did not ask get [])
    top_logprobs: list[list[tuple[int, float]]] | None = None


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def seeded_noise(g: torch.Generator, vocab: int) -> torch.Tensor:
    """The randomness one sampled token consumes from a seeded request's generator: Exp(1)
    noise over the vocabulary (on the generator's device). The ONLY place a seeded draw is made,
    so `skip_one_token` can replay it exactly."""
    return torch.empty(vocab, device=g.device).exponential_(generator=g)


def skip_one_token(g: torch.Generator | None, params: SamplingParams, vocab: int) -> None:
    """Advance `g` as sampling one token with `params` would (the decode node's request after the
    prefill node sampled token one), so later tokens match a colocated run."""
    if g is not None and not params.greedy:
        seeded_noise(g, vocab)


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
    """logits: fp32 [B, V]; rows: one per batch row. Returns B token ids (+ logprobs)."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    logits = logits.float()
    raw = logits
    pen = [i for i, r in enumerate(rows) if r.params.penalized]
    if pen:
        logits = _penalize(logits, rows, pen)
    if any(r.banned_ids for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.banned_ids:
                logits[i, list(r.banned_ids)] = float("-inf")
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        out = logits.argmax(dim=-1)
    else:
        out = _sample_random(logits, rows, greedy)
    lps = tops = None
    n_top = max(r.params.top_logprobs for r in rows)
    if n_top > 0 or any(r.params.logprobs for r in rows):
        lsm = torch.log_softmax(raw, dim=-1)
        lps = lsm.gather(1, out.unsqueeze(1)).squeeze(1).tolist()
        if n_top > 0:       # one topk for the batch, cut per row (only when some row asks)
            vals, idx = lsm.topk(min(n_top, lsm.shape[1]), dim=-1)
            vals, idx = vals.tolist(), idx.tolist()
            tops = [list(zip(idx[i][:r.params.top_logprobs], vals[i][:r.params.top_logprobs]))
                    for i, r in enumerate(rows)]
    return SampleResult(out.tolist(), lps, tops)


def _sample_random(logits: torch.Tensor, rows: Sequence[SampleRow], greedy: list[bool]) -> torch.Tensor:
    dev = logits.device
    temps = torch.tensor([1.0 if g else r.params.temperature for r, g in zip(rows, greedy)],
                         device=dev, dtype=torch.float32)
    scaled = logits / temps.unsqueeze(1)
    top_ks = [r.params.top_k for r in rows]
    top_ps = [r.params.top_p for r in rows]
    if any(p < 1.0 for p in top_ps) or any(k > 0 for k in top_ks):
        scaled = _filter_top_k_top_p(scaled, top_ks, top_ps)
    min_ps = [0.0 if g else r.params.min_p for r, g in zip(rows, greedy)]
    if any(m > 0.0 for m in min_ps):
        scaled = _filter_min_p(scaled, min_ps)
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(rows) if r.generator is None]
    if unseeded:
        if len(unseeded) == len(rows):
            noise.exponential_()
        else:
            idx = torch.tensor(unseeded, device=dev)
            noise[idx] = torch.empty((len(unseeded), probs.shape[1]), device=dev).exponential_()
    for i, r in enumerate(rows):
        g = r.generator
        if g is None or greedy[i]:      # greedy rows draw nothing, whatever their batch mates
            continue
        noise[i] = seeded_noise(g, probs.shape[1]).to(dev)   # CPU generator: same numbers on CUDA
    drawn = (probs / noise).argmax(dim=-1)
    if any(greedy):
        g = torch.tensor(greedy, device=dev)
        drawn = torch.where(g, logits.argmax(dim=-1), drawn)
    return drawn


def _filter_top_k_top_p(scaled: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf (always keeps the best)."""
    dev = scaled.device
    vocab = scaled.shape[1]
    if all(p >= 1.0 for p in top_ps):      # top-k only: a k-th value threshold, no full sort
        kmax = min(max(top_ks), vocab)
        kth = scaled.topk(kmax, dim=-1).values
        ks = torch.tensor([min(k, kmax) - 1 if k > 0 else kmax - 1 for k in top_ks], device=dev)
        thr = kth.gather(1, ks.unsqueeze(1))
        off = torch.tensor([k <= 0 or k >= vocab for k in top_ks], device=dev).unsqueeze(1)
        return scaled.masked_fill((scaled < thr) & ~off, float("-inf"))
    srt, idx = scaled.sort(dim=-1, descending=True)
    mask = torch.zeros_like(srt, dtype=torch.bool)
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=dev)
    mask |= torch.arange(vocab, device=dev).unsqueeze(0) >= ks.unsqueeze(1)
    if any(p < 1.0 for p in top_ps):
        ps = torch.tensor(top_ps, device=dev, dtype=torch.float32)
        probs = torch.softmax(srt.masked_fill(mask, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs          # mass strictly above each token
        mask |= before >= ps.unsqueeze(1)
    mask[:, 0] = False
    return scaled.scatter(1, idx, srt.masked_fill(mask, float("-inf")))


def _filter_min_p(scaled: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the top token's (rows with 0 keep all)."""
    probs = torch.softmax(scaled, dim=-1)
    mp = torch.tensor(min_ps, device=scaled.device, dtype=torch.float32).unsqueeze(1)
    thr = probs.max(dim=-1, keepdim=True).values * mp
    return scaled.masked_fill(probs < thr, float("-inf"))


def _penalize(logits: torch.Tensor, rows: Sequence[SampleRow], pen: list[int]) -> torch.Tensor:
    """A copy of `logits` with rows `pen` biased and penalised (vectorised over those rows;
    the other rows are copied bit for bit)."""
    dev, vocab = logits.device, logits.shape[1]
    ps = [rows[i].params for i in pen]
    sub = logits[pen] if len(pen) < len(rows) else logits.clone()
    n = len(pen)
    bias = [(j, t, b) for j, p in enumerate(ps) for t, b in p.logit_bias if t < vocab]
    if bias:
        rj, tj, bj = zip(*bias)
        sub.index_put_((torch.tensor(rj, device=dev), torch.tensor(tj, device=dev)),
                       torch.tensor(bj, device=dev, dtype=sub.dtype), accumulate=True)

    def occurrences(start: Callable[[SampleRow], int]) -> torch.Tensor:
        """[n, V] counts of each row's token_ids[start(row):] (one scatter for all rows)."""
        seqs = [list(rows[i].token_ids[start(rows[i]):]) for i in pen]
        lens = torch.tensor([len(q) for q in seqs], device=dev)
        flat = torch.tensor([t for q in seqs for t in q], device=dev, dtype=torch.long)
        counts = torch.zeros((n, vocab), device=dev, dtype=sub.dtype)
        if flat.numel():
            ri = torch.repeat_interleave(torch.arange(n, device=dev), lens)
            counts.index_put_((ri, flat), torch.ones_like(flat, dtype=sub.dtype), accumulate=True)
        return counts

    if any(p.repetition_penalty != 1.0 for p in ps):
        seen = occurrences(lambda r: 0) > 0
        rp = torch.tensor([p.repetition_penalty for p in ps], device=dev,
                          dtype=sub.dtype).unsqueeze(1).expand_as(sub)
        sub = torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in ps):
        counts = occurrences(lambda r: r.num_prompt)
        fp = torch.tensor([p.frequency_penalty for p in ps], device=dev, dtype=sub.dtype)
        pp = torch.tensor([p.presence_penalty for p in ps], device=dev, dtype=sub.dtype)
        sub = sub - fp.unsqueeze(1) * counts - pp.unsqueeze(1) * (counts > 0).to(sub.dtype)
    if len(pen) == len(rows):
        return sub
    out = logits.clone()
    out[pen] = sub
    return out
