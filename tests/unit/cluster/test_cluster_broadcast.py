"""Transmit-limited broadcast queue."""
from __future__ import annotations

from moed.cluster.broadcast import BroadcastQueue


def test_fewest_sent_first_newest_first_and_dropped_after_limit() -> None:
    q = BroadcastQueue()
    q.add("a", b"A" * 10)
    q.add("b", b"B" * 10)
    assert q.take(100, limit=2) == [b"B" * 10, b"A" * 10]      # newest first among equals
    q.add("c", b"C" * 10)
    assert q.take(100, limit=2)[0] == b"C" * 10               # never sent beats sent once
    assert len(q) == 1 and q.transmits("c") == 1              # a and b hit the limit
    assert q.take(100, limit=2) == [b"C" * 10] and len(q) == 0


def test_newer_update_about_same_member_replaces_queued_one() -> None:
    q = BroadcastQueue()
    q.add("a", b"old-alive")
    q.take(100, limit=5)
    q.add("a", b"new-suspect")
    assert len(q) == 1 and q.transmits("a") == 0
    assert q.take(100, limit=5) == [b"new-suspect"]


def test_budget_is_respected_and_big_items_wait() -> None:
    q = BroadcastQueue()
    q.add("big", b"x" * 80)
    for i in range(5):
        q.add(f"s{i}", b"y" * 9)
    got = q.take(40, limit=3)
    assert sum(len(f) + 1 for f in got) <= 40 and len(got) == 3
    assert q.transmits("big") == 0
    assert q.take(10, limit=3) == [] or all(len(f) + 1 <= 10 for f in q.take(10, limit=3))
