"""Counters released in batches of requests, so /metrics never shows what one request did.

The prefix cache's and the KV tiers' counters (hit tokens, blocks loaded, blocks read from a
peer) say whether a prompt's prefix was cached: a reader who sends a guess and watches them
move learns whether someone else sent that prefix. Released only once at least `batch` more
requests have contributed since the last release, a move is the sum over >= `batch` requests
(on a busy node, the guesser's own request is lost in the others'). This blurs, it does not
seal: on an idle node a reader can send batch - 1 requests of known effect besides the guess.
What seals is salting (moed.api.salt: server.prefix_cache_isolation, cache_salt) and keeping
tenants off /metrics (server.metrics_access = "operator"). Pure: no prometheus here.
"""
from __future__ import annotations

from collections.abc import Mapping


class CoarseTotals:
    """Running totals, as of the last release (the caller copies them into counters)."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self._released_at = 0            # requests counted at the last release
        self._totals: dict[str, float] = {}

    def update(self, requests: int, totals: Mapping[str, float]) -> Mapping[str, float]:
        """`requests`: how many requests contributed to `totals` so far (both monotonic).
        -> the totals as last released (all keys of one release move together)."""
        if requests < self._released_at:          # the source restarted (a new engine)
            self._released_at = 0
        if self.batch <= 1 or requests - self._released_at >= self.batch:
            self._released_at = requests
            self._totals = dict(totals)
        for k in totals:                          # before a key's first release: zero
            self._totals.setdefault(k, 0.0)
        return self._totals
