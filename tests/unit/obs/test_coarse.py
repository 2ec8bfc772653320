"""moed.obs.coarse: totals released only in batches of requests (no single request visible)."""
from __future__ import annotations

from moed.obs.coarse import CoarseTotals


def test_totals_move_only_after_a_batch_of_requests() -> None:
    g = CoarseTotals(3)
    assert g.update(0, {"hits": 0}) == {"hits": 0.0}
    assert g.update(1, {"hits": 5}) == {"hits": 0.0}          # one request's hit: hidden
    assert g.update(2, {"hits": 5}) == {"hits": 0.0}
    assert g.update(3, {"hits": 7}) == {"hits": 7}            # three requests: their sum
    assert g.update(4, {"hits": 9, "new": 1}) == {"hits": 7, "new": 0.0}
    assert g.update(6, {"hits": 9, "new": 1}) == {"hits": 9, "new": 1}


def test_batch_one_releases_at_once_and_a_restart_counts_again() -> None:
    g = CoarseTotals(1)
    assert g.update(0, {"hits": 2}) == {"hits": 2}            # even with no new request
    g.batch = 2
    assert g.update(5, {"hits": 4}) == {"hits": 4}            # 5 requests since 0: release
    assert g.update(6, {"hits": 6}) == {"hits": 4}
    assert g.update(1, {"hits": 1}) == {"hits": 4}            # a new engine: counts from 0 ...
    assert g.update(2, {"hits": 3}) == {"hits": 3}            # ... and releases after 2
