"""A per-peer circuit breaker (pure): error counting with a half-open retry.

A peer is CLOSED (healthy) until a failure opens it; an OPEN peer gets no work until
`cooldown_s` has passed, then exactly one trial job (HALF_OPEN); the trial's success closes it,
its failure re-opens it for another cooldown. Nothing is sticky: a transient error costs a pair
one cooldown, never its future. Functions take `now` so they are tested without clocks.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class PeerState(str, enum.Enum):
    CLOSED = "closed"          # healthy: gets work
    OPEN = "open"              # failed recently: no work until the cooldown passes
    HALF_OPEN = "half_open"    # one trial job in flight


@dataclass(frozen=True)
class PeerHealth:
    state: PeerState = PeerState.CLOSED
    consecutive_failures: int = 0
    total_failures: int = 0
    opened_at: float = 0.0


def on_success(h: PeerHealth) -> PeerHealth:
    return replace(h, state=PeerState.CLOSED, consecutive_failures=0)


def on_failure(h: PeerHealth, now: float) -> PeerHealth:
    return replace(h, state=PeerState.OPEN, consecutive_failures=h.consecutive_failures + 1,
                   total_failures=h.total_failures + 1, opened_at=now)


def available(h: PeerHealth, now: float, cooldown_s: float) -> bool:
    if h.state is PeerState.CLOSED:
        return True
    if h.state is PeerState.OPEN:
        return now - h.opened_at >= cooldown_s
    return False               # HALF_OPEN: its one trial is still out


def on_pick(h: PeerHealth) -> PeerHealth:
    """An OPEN peer past its cooldown that gets picked becomes the half-open trial."""
    return replace(h, state=PeerState.HALF_OPEN) if h.state is PeerState.OPEN else h
