"""Which serving node a router sends the next request to (pure)."""
from __future__ import annotations

from collections.abc import Collection, Sequence

from moed.balance.candidate import Candidate


def pick_backend(cands: Sequence[Candidate], exclude: Collection[str] = (),
                 turn: int = 0) -> Candidate | None:
    """Least waiting requests (reported + this router's in flight: it covers the report's
    lag), then least running (ITL grows with the batch); remaining ties go round-robin by `turn`
    so equal nodes share the load."""
    left = [c for c in cands if c.name not in exclude]
    if not left:
        return None
    n = len(left)
    order = {c.name: (i - turn) % n for i, c in enumerate(sorted(left, key=lambda c: c.name))}
    return min(left, key=lambda c: (c.load.waiting + c.inflight, c.load.running, order[c.name]))
