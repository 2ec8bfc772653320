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

Structured outputs (moed.model.grammar): a row with a grammar matcher has every token its
grammar forbids set to -inf first, before everything above (vLLM applies the grammar bitmask to
the logits before its sampler), so greedy and sampled rows both pick an allowed token; the
bitmask is the row's `mask` when the engine computed it beside the forward pass
(moed.engine.masks), else filled here. Rows without a grammar pay nothing.
Banned ids (min_tokens) yield to the grammar: if they would leave a grammar row no token, the
row keeps the grammar's mask alone.

The processing is two functions, `process_logits` (grammar, logit_bias and penalties, banned
ids) and `probabilities` (temperature, top-k/p, min-p, softmax); moed.model.spec_verify scores
drafts through the same two, so a verified token comes from exactly what `sample` draws from.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moed.model.grammar import mask_logits
from moed.model.kernels import cpu_kernels
from moed.types import SamplingParams


@dataclass(frozen=True)
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None = None     # seeded requests only
    banned_ids: tuple[int, ...] = ()             # e.g. EOS while min_tokens are not out yet
    # penalized rows only: prompt + output so far, and how many of them are the prompt
    token_ids: Sequence[int] = ()
    num_prompt: int = 0
    grammar: Any = None                          # moed.model.grammar.GrammarMatcher
    mask: Any = None            # the grammar's int32 [words] bitmask, if already computed


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


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a [B, V] tensor. CPU fp32 goes to the native kernel where it loads:
    torch's CPU argmax compares one scalar at a time (~55 us a 32000-entry row, 0.8 ms at batch
    32 on the 2-core bench, a decode step's 3%); the kernel gives the same index (first on ties,
    a NaN wins) in ~5 us a row."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.shape[1]:
        k = cpu_kernels()
        if k is not None:
            return k.argmax_f32(x)
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, rows: Sequence[SampleRow],
           argmax: torch.Tensor | None = None) -> SampleResult:
    """logits: fp32 [B, V]; rows: one per batch row. Returns B token ids (+ logprobs).
    argmax: logits.argmax(-1) when the caller has it (ModelRunner.argmax_of): all-greedy rows
    that leave the logits as they are take it instead of reading the logits again."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    raw = logits.float()
    logits = process_logits(raw, rows)
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        out = argmax if argmax is not None and logits is raw else argmax_rows(logits)
    else:
        out = _draw(logits, probabilities(logits, rows), rows, greedy)
    lps, tops = raw_logprobs(raw, out, rows)
    return SampleResult(out.tolist(), lps, tops)


def process_logits(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """fp32 [B, V] -> the logits each row's token is chosen from: the grammar mask, logit_bias
    and penalties, banned ids, in that order. Greedy rows take their argmax; `probabilities`
    gives what the others draw from. `logits` itself when no row changes anything (so a
    caller's argmax of it still holds). Shared with moed.model.spec_verify, which must score
    drafts against exactly this."""
    gram = [i for i, r in enumerate(rows) if r.grammar is not None]
    if gram:
        masks = [rows[i].mask for i in gram]
        logits = mask_logits(logits, gram, [rows[i].grammar for i in gram],
                             torch.stack(masks) if all(m is not None for m in masks) else None)
    pen = [i for i, r in enumerate(rows) if r.params.penalized]
    if pen:
        logits = _penalize(logits, rows, pen)
    banned = [(i, t) for i, r in enumerate(rows) for t in r.banned_ids]
    if banned:
        before = logits
        logits = logits.clone()
        ri, ti = zip(*banned)       # one write for every row (a write a row added up at 10k rows)
        logits[torch.tensor(ri, device=logits.device), torch.tensor(ti, device=logits.device)] = float("-inf")
        for i in gram:
            if rows[i].banned_ids and bool(torch.isneginf(logits[i]).all()):
                logits[i] = before[i]       # the grammar allows only banned ids: it wins
    return logits


def probabilities(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Processed logits [B, V] (`process_logits`) -> the distribution [B, V] each sampled row
    draws from: temperature, top-k, top-p, min-p, softmax. Greedy rows come out at temperature
    1 without min-p (they never draw; their argmax is taken from the processed logits)."""
    dev = logits.device
    greedy = [r.params.greedy for r in rows]
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
    return torch.softmax(scaled, dim=-1)


def raw_logprobs(raw: torch.Tensor, chosen: torch.Tensor, rows: Sequence[SampleRow]
                 ) -> tuple[list[float] | None, list[list[tuple[int, float]]] | None]:
    """What a SampleResult reports for tokens `chosen` [B] of unprocessed logits `raw` [B, V]:
    log_softmax(raw) at each chosen token (None when no row asks for logprobs or top
    logprobs), and each row's params.top_logprobs best (None when no row asks for any)."""
    n_top = max((r.params.top_logprobs for r in rows), default=0)
    if n_top == 0 and not any(r.params.logprobs for r in rows):
        return None, None
    lsm = torch.log_softmax(raw, dim=-1)
    lps = lsm.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    tops = None
    if n_top > 0:       # one topk for the batch, cut per row (only when some row asks)
        vals, idx = lsm.topk(min(n_top, lsm.shape[1]), dim=-1)
        vals, idx = vals.tolist(), idx.tolist()
        tops = [list(zip(idx[i][:r.params.top_logprobs], vals[i][:r.params.top_logprobs]))
                for i, r in enumerate(rows)]
    return lps, tops


def _draw(logits: torch.Tensor, probs: torch.Tensor, rows: Sequence[SampleRow],
          greedy: list[bool]) -> torch.Tensor:
    """One token a row: sampled rows from `probs` by the exponential race, greedy rows the
    argmax of the processed `logits`."""
    dev = logits.device
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
    drawn = argmax_rows(probs / noise)
    if any(greedy):
        g = torch.tensor(greedy, device=dev)
        drawn = torch.where(g, argmax_rows(logits), drawn)
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
    """A copy of `logits` with rows `pen` biased and penalised. Sparse: only the entries of the
    tokens in a row's history (and its logit_bias ids) are read and written — O(history), where
    dense [rows, V] masks cost ~14 passes over the vocabulary (bench/sampling.py: 5x slower
    decode at batch 8 with a 152k vocabulary). Every other entry is copied bit for bit, and
    the touched ones get the same float operations as the definitions (x - f*0 is x)."""
    dev, vocab = logits.device, logits.shape[1]
    out = logits.clone()
    ps = [rows[i].params for i in pen]
    bias = [(i, t, b) for i, p in zip(pen, ps) for t, b in p.logit_bias if t < vocab]
    if bias:
        ri, ti, bi = zip(*bias)
        out.index_put_((torch.tensor(ri, device=dev), torch.tensor(ti, device=dev)),
                       torch.tensor(bi, device=dev, dtype=out.dtype), accumulate=True)
    if all(p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
           and p.presence_penalty == 0.0 for p in ps):
        return out
    # each (row, token) of the histories once, with its count in the output part
    seqs = [rows[i].token_ids for i in pen]
    lens = torch.tensor([len(q) for q in seqs], device=dev)
    flat = torch.tensor([t for q in seqs for t in q], device=dev, dtype=torch.long)
    if not flat.numel():
        return out
    j = torch.repeat_interleave(torch.arange(len(pen), device=dev), lens)
    local = torch.arange(flat.numel(), device=dev) - (lens.cumsum(0) - lens)[j]
    prompt = torch.tensor([rows[i].num_prompt for i in pen], device=dev)
    keys, inv = torch.unique(j * vocab + flat, return_inverse=True)
    counts = torch.zeros(keys.numel(), device=dev, dtype=out.dtype).index_add_(
        0, inv, (local >= prompt[j]).to(out.dtype))
    kj, tok = keys // vocab, keys % vocab
    row = torch.tensor(pen, device=dev)[kj]
    vals = out[row, tok]

    def per_entry(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in ps], device=dev, dtype=out.dtype)[kj]
    if any(p.repetition_penalty != 1.0 for p in ps):        # prompt + output
        rp = per_entry("repetition_penalty")
        vals = torch.where(vals > 0, vals / rp, vals * rp)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in ps):   # output
        vals = vals - per_entry("frequency_penalty") * counts \
            - per_entry("presence_penalty") * (counts > 0).to(out.dtype)
    out[row, tok] = vals
    return out
