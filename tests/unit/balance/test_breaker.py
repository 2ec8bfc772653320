"""balance.breaker: the per-peer half-open circuit breaker."""
from __future__ import annotations

from moed.balance.breaker import PeerHealth, PeerState, available, on_failure, on_pick, on_success


def test_breaker_half_open_cycle() -> None:
    h = PeerHealth()
    assert available(h, 0.0, 5.0)
    h = on_failure(h, now=10.0)
    assert h.state is PeerState.OPEN and h.consecutive_failures == 1
    assert not available(h, 14.9, 5.0)          # cooling down
    assert available(h, 15.0, 5.0)              # cooldown over: one trial
    h = on_pick(h)
    assert h.state is PeerState.HALF_OPEN and not available(h, 100.0, 5.0)
    h2 = on_failure(h, now=20.0)                # trial failed: open again, from now
    assert h2.state is PeerState.OPEN and h2.total_failures == 2 and not available(h2, 24.0, 5.0)
    h3 = on_success(h)                          # trial succeeded: healthy, count reset
    assert h3.state is PeerState.CLOSED and h3.consecutive_failures == 0
    assert h3.total_failures == 1
    assert on_pick(h3) is h3
