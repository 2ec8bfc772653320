"""Which serving node a router sends the next request to (pure).

`pick_backend`: least waiting, then least running (no prefix information).

`place`: decode placement with prefix affinity. Each node gossips its load (waiting, running,
free KV blocks) and a digest of its cached leading blocks (moed.cluster.state.LoadVector:
the low 8 bytes of the chained block hashes at depths 1, 2, 4, 8, ... of its recent prompts
that are still cached). The router hashes the request's prompt the same way (at each node's
block size) and, per candidate c:

    overlap_c   = the deepest sampled depth d whose hash is in c's digest (0: none), in blocks
    fraction_c  = overlap_c · block_size_c / prompt_tokens          (0..1: share already cached)
    pressure_c  = waiting_c + inflight_c    (reported queue + this router's own unanswered
                                             requests there, which cover the report's lag)
    waiting_c   = the node's waiting requests no less urgent than this request (its
                  `priority`, vLLM's, lower first; LoadVector.waiting_ahead): an interactive
                  request does not count the batch flood queued behind it. A node that does
                  not advertise priorities (the release before) counts all its waiting
    score_c     = pressure_c − affinity_weight · fraction_c

and the lowest score wins (ties: fewer running, then round-robin by `turn`). So a node holding
the whole prompt gets it unless it has `affinity_weight` more queued requests than the least
loaded node: a repeated prefix sticks to its node until that node is overloaded, and then
spreads (where it gets cached again). With affinity_weight 0 this is `pick_backend`.

Saturation (router admission): a node is saturated when pressure_c ≥ max_waiting (> 0), or when
it advertises its KV (block_size > 0) and has fewer free blocks than the prompt needs beyond
the overlap. Saturated nodes get nothing; when every candidate is, the answer is "saturated"
and the router refuses with 429 + Retry-After instead of queueing onto a full cluster.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from moed.balance.candidate import Candidate

# reasons a placement gives (moed_router_placements_total{reason})
REASONS = ("affinity", "overloaded", "load", "saturated", "none")


def pick_backend(cands: Sequence[Candidate], exclude: Collection[str] = (),
                 turn: int = 0, priority: int | None = None) -> Candidate | None:
    """Least waiting requests (reported + this router's in flight: it covers the report's
    lag), then least running (ITL grows with the batch); remaining ties go round-robin by `turn`
    so equal nodes share the load."""
    left = [c for c in cands if c.name not in exclude]
    if not left:
        return None
    n = len(left)
    order = {c.name: (i - turn) % n for i, c in enumerate(sorted(left, key=lambda c: c.name))}
    return min(left, key=lambda c: (pressure(c, priority), c.load.running, order[c.name]))


def pressure(c: Candidate, priority: int | None = None) -> int:
    """The queue a request of `priority` (None: any) joins at `c`: the waiting requests no
    less urgent, plus this router's own requests there not yet answered."""
    return c.load.waiting_ahead(priority) + c.inflight


@dataclass(frozen=True)
class PlacementLimits:
    affinity_weight: float = 2.0   # queued requests a fully cached prompt is worth; 0 = off
    max_waiting: int = 0           # pressure at which a node is saturated; 0 = no limit


@dataclass(frozen=True)
class Placement:
    node: Candidate | None
    reason: str                    # one of REASONS
    overlap_blocks: int = 0        # of the chosen node


# The request's prompt as a digest sees it: block size → ((depth, digest key), ...) by depth.
PromptPrefix = Mapping[int, Sequence[tuple[int, int]]]


def overlap_blocks(c: Candidate, prefix: PromptPrefix) -> int:
    """Leading blocks of the prompt that `c` advertises as cached (0 without a digest)."""
    digest = c.load.prefix_digest
    if not digest or c.load.block_size <= 0:
        return 0
    keys = set(digest)
    best = 0
    for depth, key in prefix.get(c.load.block_size, ()):
        if key in keys:
            best = max(best, depth)
    return best


def saturated(c: Candidate, prompt_tokens: int, overlap: int, limits: PlacementLimits,
              priority: int | None = None) -> bool:
    if limits.max_waiting > 0 and pressure(c, priority) >= limits.max_waiting:
        return True
    bs = c.load.block_size
    if bs > 0 and prompt_tokens > 0:
        need = max(-(-prompt_tokens // bs) - overlap, 1)
        return c.load.free_kv_blocks < need
    return False


def place(cands: Sequence[Candidate], prefix: PromptPrefix, prompt_tokens: int,
          limits: PlacementLimits, turn: int = 0, priority: int | None = None) -> Placement:
    """The node for a request by the score in the module docstring; `prefix` empty (the
    router could not tokenize the prompt) leaves only the load terms. prompt_tokens 0 =
    unknown (no KV headroom check)."""
    if not cands:
        return Placement(None, "none")
    overlap = {c.name: overlap_blocks(c, prefix) for c in cands}
    open_ = [c for c in cands
             if not saturated(c, prompt_tokens, overlap[c.name], limits, priority)]
    if not open_:
        return Placement(None, "saturated")
    n = len(open_)
    order = {c.name: (i - turn) % n for i, c in enumerate(sorted(open_, key=lambda c: c.name))}
    total = max(prompt_tokens, 1)

    def score(c: Candidate) -> tuple[float, int, int]:
        frac = min(overlap[c.name] * c.load.block_size / total, 1.0) if prompt_tokens else 0.0
        return (pressure(c, priority) - limits.affinity_weight * frac, c.load.running,
                order[c.name])

    best = min(open_, key=score)
    got = overlap[best.name] if limits.affinity_weight > 0 else 0
    if got > 0:
        return Placement(best, "affinity", got)
    holders = limits.affinity_weight > 0 and any(overlap[c.name] for c in cands)
    return Placement(best, "overloaded" if holders else "load")
