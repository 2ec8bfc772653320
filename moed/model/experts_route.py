"""Token → replica: which slot serves each routed token of a replicated expert (pure, no loops
over tokens). The balancer (balance/experts.py) assumes an expert's tokens split evenly over
its replicas; this is the split that makes that true.

Why not `token index % replicas` (what moe.Router does today): with top-k routing a token's
flat index is t·k + j, so an expert that is mostly some token's j-th choice sees indices of one
residue class, e.g. all even for k = 2, and with 2 replicas every one of its tokens lands on
replica 0. Numbering each expert's own tokens 0, 1, 2, ... and taking that modulo its replica
count gives every replica the same count to within one token, for any batch.
"""
from __future__ import annotations

import torch


def split_over_replicas(logical: torch.Tensor, logical_to_physical: torch.Tensor,
                        replicas: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """logical [T, k] int64 (the router's top-k expert ids, moe.Router.route), one layer's
    logical_to_physical [E, R] (-1 padded) and replicas [E] → physical slots [T, k].

    The n-th token (in flat order t·k + j) routed to expert e goes to replica
    (n + offset) mod replicas[e]: each replica of e gets floor or ceil of e's tokens / replicas.
    Deterministic; pass the step number as offset so the replica that takes the one extra token
    rotates (at batch 1 it would otherwise always be replica 0)."""
    if logical_to_physical.dim() != 2 or replicas.shape != logical_to_physical.shape[:1]:
        raise ValueError("logical_to_physical must be [E, R] and replicas [E]")
    flat = logical.reshape(-1).to(torch.long)
    if logical_to_physical.shape[1] == 1:
        return logical_to_physical[flat, 0].view(logical.shape)
    n_exp = logical_to_physical.shape[0]
    order = torch.argsort(flat, stable=True)                   # tokens grouped by expert, in order
    counts = torch.bincount(flat, minlength=n_exp)
    starts = counts.cumsum(0) - counts
    nth = torch.empty_like(flat)
    nth[order] = torch.arange(flat.numel()) - starts[flat[order]]
    slot = (nth + offset) % replicas.to(torch.long)[flat]
    return logical_to_physical[flat, slot].view(logical.shape)
