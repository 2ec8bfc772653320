"""balance.router.pick_backend: least waiting (reported + in flight), then least running."""
from __future__ import annotations

from moed.balance.candidate import Candidate
from moed.balance.router import pick_backend
from moed.cluster.state import LoadVector


def _c(name: str, waiting: int = 0, running: int = 0, inflight: int = 0) -> Candidate:
    return Candidate(name, f"http://{name}", load=LoadVector(waiting=waiting, running=running),
                     inflight=inflight)


def test_pick_least_waiting_then_round_robin() -> None:
    bs = [_c("a", 3), _c("b", 1), _c("c", 1)]
    assert pick_backend(bs).name in ("b", "c")
    assert pick_backend([_c("a", 3), _c("b", 1, inflight=5), _c("c", 1)]).name == "c"
    assert {pick_backend(bs, turn=t).name for t in range(4)} == {"b", "c"}
    assert pick_backend(bs, exclude=["b", "c"]).name == "a"
    assert pick_backend(bs, exclude=["a", "b", "c"]) is None
    assert pick_backend([]) is None


def test_pick_balances_on_running_when_queues_are_equal() -> None:
    bs = [_c("a", 0, 7), _c("b", 0, 2), _c("c", 1, 0)]
    assert {pick_backend(bs, turn=t).name for t in range(4)} == {"b"}   # not round-robin
    # in flight at b counts as queued
    assert pick_backend([_c("a", 0, 7), _c("b", 0, 2, 1), _c("c", 1, 0)]).name == "a"
    # all queue 1: c runs the fewest
    assert pick_backend([_c("a", 0, 7, 1), _c("b", 0, 2, 1), _c("c", 1, 0)]).name == "c"
    assert pick_backend(bs, exclude=["b"]).name == "a"  # a queue outweighs any batch size
