"""Pure timing policies: Lifeguard suspicion timeout, awareness, retransmits, push-pull."""
from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moed.cluster import policy


def test_suspicion_starts_at_max_and_reaches_min_at_k_confirmations() -> None:
    assert policy.suspicion_timeout(0, 3, 2.0, 12.0) == pytest.approx(12.0)
    assert policy.suspicion_timeout(3, 3, 2.0, 12.0) == pytest.approx(2.0)
    assert policy.suspicion_timeout(9, 3, 2.0, 12.0) == pytest.approx(2.0)   # extra ones: floor
    one = policy.suspicion_timeout(1, 3, 2.0, 12.0)
    # log curve: the first confirmation buys half the drop when k = 3 (log 2 / log 4)
    assert one == pytest.approx(12.0 - 10.0 * math.log(2) / math.log(4))


def test_suspicion_without_expected_confirmations_is_min() -> None:
    assert policy.suspicion_timeout(0, 0, 2.0, 12.0) == 2.0


@given(st.integers(0, 10), st.integers(0, 10), st.floats(0.1, 10), st.floats(1, 10),
       st.floats(0, 100))
def test_suspicion_remaining_is_bounded_and_monotone(c: int, k: int, lo: float, mult: float,
                                                      elapsed: float) -> None:
    hi = lo * mult
    t = policy.suspicion_timeout(c, k, lo, hi)
    assert lo - 1e-9 <= t <= hi + 1e-9
    assert policy.suspicion_timeout(c + 1, k, lo, hi) <= t + 1e-9      # more confirmations: sooner
    left = policy.suspicion_remaining(c, k, elapsed, lo, hi)
    assert left == pytest.approx(max(0.0, t - elapsed))


def test_suspicion_bounds_grow_with_log_cluster_size() -> None:
    assert policy.suspicion_bounds(4, 6, 1, 1.0) == (4.0, 24.0)      # log10 floor of 1
    assert policy.suspicion_bounds(4, 6, 100, 1.0) == pytest.approx((8.0, 48.0))
    assert policy.suspicion_bounds(1, 6, 1000, 0.5) == pytest.approx((1.5, 9.0))


def test_expected_confirmations_capped_by_possible_suspecters() -> None:
    assert policy.expected_confirmations(3, 100) == 3
    assert policy.expected_confirmations(3, 3) == 1     # us, the suspect, one other
    assert policy.expected_confirmations(3, 2) == 0


def test_awareness_clamps_and_scales() -> None:
    assert policy.awareness_apply(0, -1, 8) == 0
    assert policy.awareness_apply(6, 5, 8) == 7
    assert policy.awareness_apply(3, 2, 8) == 5
    assert policy.awareness_scale(0, 0.5) == 0.5
    assert policy.awareness_scale(3, 0.5) == 2.0


def test_probe_failure_delta_blames_us_for_missing_nacks() -> None:
    assert policy.probe_failure_delta(3, 3) == 0     # helpers answered: the target is the problem
    assert policy.probe_failure_delta(3, 1) == 2
    assert policy.probe_failure_delta(0, 0) == 1


def test_retransmit_limit_and_push_pull_scale() -> None:
    assert policy.retransmit_limit(4, 1) == 4
    assert policy.retransmit_limit(4, 9) == 4
    assert policy.retransmit_limit(4, 100) == 12
    assert policy.retransmit_limit(4, 1000) == 16
    assert policy.push_pull_interval(30, 10) == 30
    assert policy.push_pull_interval(30, 64) == 60
    assert policy.push_pull_interval(30, 1000) == 30 * 6
