"""Which prefill node takes a decode node's next job (pure).

Today: the breaker first, then the fewest jobs in flight. The prefill balancer (length buckets,
an attention cost model) lands here as another function over the same Candidates.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

from moed.balance.breaker import PeerState, available
from moed.balance.candidate import Candidate, layout_compatible


def pick_prefill(cands: Sequence[Candidate], exclude: Collection[str], now: float,
                 cooldown_s: float, layout: str = "") -> Candidate | None:
    """A peer whose cooldown is over gets the next job (its half-open trial: otherwise a
    lightly loaded cluster would never try it again); else the available peer with the fewest
    jobs in flight (ties: by name). When every remaining peer is cooling down, the one that
    failed longest ago is tried anyway: the alternative is failing the request for sure.
    Peers whose KV layout differs from `layout` are never picked. None when none is left."""
    left = [c for c in cands if c.name not in exclude and layout_compatible(layout, c.layout)]
    ready = [c for c in left if available(c.health, now, cooldown_s)]
    if not ready:
        return min(left, key=lambda c: (c.health.opened_at, c.name)) if left else None
    return min(ready, key=lambda c: (c.health.state is PeerState.CLOSED, c.inflight, c.name))
