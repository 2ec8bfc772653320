"""Prompt logprobs (vLLM's `prompt_logprobs`, the legacy API's echo + logprobs): pure tensor code.

The logits at prompt position j predict token j + 1, so a chunk of new prompt tokens at
positions s .. s+n-1 yields the logprobs of prompt tokens s+1 .. s+n (those that exist). Values
are log_softmax of the raw logits, as for sampled tokens (moed.model.sampler): no penalty,
bias or temperature touches them. Rank is vLLM's: 1 + the number of tokens strictly likelier.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from moed.types import PromptLogprob

SLICE_ROWS = 256    # log_softmax over at most this many rows at once: [256, V] fp32 temporaries


def prompt_positions(start: int, num_new: int, num_prompt: int, done: int) -> range:
    """Positions of a chunk (start .. start+num_new-1) whose next token is a prompt token not
    yet given a logprob (`done` of prompt tokens 1.. have one)."""
    return range(max(start, done), min(start + num_new, num_prompt - 1))


def compute(logits: torch.Tensor, targets: Sequence[int], top_n: int) -> list[PromptLogprob]:
    """logits [m, V] fp32 (row i predicts targets[i]) -> one PromptLogprob per row."""
    if logits.shape[0] != len(targets):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(targets)} targets")
    out: list[PromptLogprob] = []
    for lo in range(0, len(targets), SLICE_ROWS):
        rows = logits[lo:lo + SLICE_ROWS].float()
        tgt = torch.tensor(targets[lo:lo + SLICE_ROWS], dtype=torch.long, device=rows.device)
        lsm = torch.log_softmax(rows, dim=-1)
        lp = lsm.gather(1, tgt.unsqueeze(1))
        ranks = ((lsm > lp).sum(dim=-1) + 1).tolist()
        lps = lp.squeeze(1).tolist()
        tops: list[tuple[tuple[int, float], ...]] = [()] * len(lps)
        if top_n > 0:
            vals, idx = lsm.topk(min(top_n, lsm.shape[1]), dim=-1)
            tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
        out.extend(PromptLogprob(int(t), float(v), int(r), top)
                   for t, v, r, top in zip(targets[lo:lo + SLICE_ROWS], lps, ranks, tops))
    return out
