"""Pure timing policies of the membership protocol (SWIM + Lifeguard). No state, no clock.

Glossary: n = members this node knows that are not dead/left (itself included);
k = confirmations a suspicion expects from independent suspecters before it reaches its
minimum timeout; awareness score = Lifeguard's local health, 0 (healthy) .. max-1 (slow).
"""
from __future__ import annotations

import math


def suspicion_bounds(mult: float, max_mult: float, n: int, probe_interval_s: float
                     ) -> tuple[float, float]:
    """(min, max) suspicion timeout in seconds: min grows with log10(n) like memberlist's."""
    lo = mult * max(1.0, math.log10(max(1, n))) * probe_interval_s
    return lo, lo * max_mult


def suspicion_timeout(confirmations: int, expected: int, min_s: float, max_s: float) -> float:
    """Lifeguard's total timeout: starts at max_s and falls on a log curve to min_s as the
    expected independent confirmations arrive (more suspecters -> more likely truly dead)."""
    if expected < 1:
        return min_s
    frac = math.log(min(confirmations, expected) + 1.0) / math.log(expected + 1.0)
    return max(min_s, max_s - (max_s - min_s) * frac)


def suspicion_remaining(confirmations: int, expected: int, elapsed_s: float,
                        min_s: float, max_s: float) -> float:
    """Seconds left before a suspicion started `elapsed_s` ago declares the member dead."""
    return max(0.0, suspicion_timeout(confirmations, expected, min_s, max_s) - elapsed_s)


def expected_confirmations(configured: int, n: int) -> int:
    """k, capped by how many other members could confirm (n minus us and the suspect)."""
    return max(0, min(configured, n - 2))


def awareness_apply(score: int, delta: int, max_multiplier: int) -> int:
    """New local-health score after a probe outcome; clamped to [0, max_multiplier - 1]."""
    return min(max(score + delta, 0), max_multiplier - 1)


def awareness_scale(score: int, timeout_s: float) -> float:
    """A timeout stretched by local health: a node that is itself slow waits longer
    before blaming others (score 0 -> unchanged)."""
    return timeout_s * (score + 1)


def probe_failure_delta(expected_nacks: int, nacks: int) -> int:
    """Awareness change after a failed probe: missing nacks from indirect helpers mean
    *we* are likely the problem; with no helpers any failure counts once."""
    if expected_nacks > 0:
        return max(0, expected_nacks - nacks)
    return 1


def retransmit_limit(mult: int, n: int) -> int:
    """How many times each broadcast is piggybacked: mult * ceil(log10(n + 1))."""
    return mult * max(1, math.ceil(math.log10(n + 1)))


def push_pull_interval(base_s: float, n: int) -> float:
    """Anti-entropy interval, stretched above 32 members so full-state traffic stays flat."""
    if n <= 32:
        return base_s
    return base_s * (math.ceil(math.log2(n) - math.log2(32)) + 1)
