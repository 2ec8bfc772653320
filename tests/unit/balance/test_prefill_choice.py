"""Prefill node choice by predicted finish time (pick_prefill_cost)."""
import random
from collections import Counter

from moed.balance.breaker import PeerHealth, PeerState
from moed.balance.candidate import Candidate
from moed.balance.cost import AdvertisedCost, Coefficients
from moed.balance.prefill import CostCandidate, pick_prefill_cost, predicted_finish

COEF = Coefficients(overhead_s=0.002, per_token_s=2e-5, per_pair_s=2e-10, per_decode_s=2e-4)
EDGES = (512, 4096, 32768)


def _adv(queued=(0, 0, 0, 0), reqs=None, coef=COEF):
    return AdvertisedCost(coef, EDGES, tuple(queued),
                          tuple(reqs) if reqs else tuple(1 if q else 0 for q in queued))


def _cand(name, adv, layout="L", alive=True, health=PeerHealth(), inflight=0):
    return CostCandidate(Candidate(name, f"http://{name}", "prefill", layout, health=health),
                         adv, alive, inflight)


def test_predicted_finish_grows_with_queue_and_inflight():
    idle, busy = _cand("a", _adv()), _cand("b", _adv((0, 4000, 0, 0)))
    assert predicted_finish(busy, 2000) > predicted_finish(idle, 2000)
    assert predicted_finish(_cand("c", _adv(), inflight=8000), 2000) > predicted_finish(idle, 2000)
    # a long prompt queued does not delay a short job (shorter buckets run first)...
    assert predicted_finish(_cand("d", _adv((0, 0, 0, 100_000))), 200) == \
        predicted_finish(idle, 200)
    # ...but it does delay another long one
    assert predicted_finish(_cand("d", _adv((0, 0, 0, 100_000))), 50_000) > \
        predicted_finish(idle, 50_000)
    assert predicted_finish(_cand("e", None), 10) == float("inf")


def test_picks_the_faster_of_two_and_spreads_ties():
    rng = random.Random(0)
    fast, slow = _cand("fast", _adv()), _cand("slow", _adv((0, 20_000, 0, 0)))
    assert all(pick_prefill_cost([slow, fast], 1000, (), 0.0, 5.0, rng, "L").node.name == "fast"
               for _ in range(20))
    slower = Coefficients(*(3 * c for c in COEF.as_tuple()))
    assert pick_prefill_cost([_cand("x", _adv(coef=slower)), fast], 1000, (), 0.0, 5.0, rng,
                             "L").node.name == "fast"
    equal = [_cand(f"n{i}", _adv()) for i in range(8)]
    got = Counter(pick_prefill_cost(equal, 1000, (), 0.0, 5.0, rng, "L").node.name
                  for _ in range(800))
    assert len(got) == 8 and min(got.values()) > 50       # random among equals, not herding


def test_power_of_two_never_picks_the_worst_of_many():
    rng = random.Random(1)
    cands = [_cand(f"n{i}", _adv((0, 1000 * i, 0, 0))) for i in range(10)]
    picks = Counter(pick_prefill_cost(cands, 1000, (), 0.0, 5.0, rng, "L").node.name
                    for _ in range(500))
    assert "n9" not in picks                # the most loaded node loses every draw it is in
    assert picks["n0"] > picks["n8"]


def test_skips_dead_incompatible_excluded_and_breaker_open_nodes():
    rng = random.Random(2)
    ok = _cand("ok", _adv((0, 30_000, 0, 0)))       # the busiest, but the only eligible one
    dead = _cand("dead", _adv(), alive=False)
    other_layout = _cand("other", _adv(), layout="M")
    opened = _cand("open", _adv(), health=PeerHealth(PeerState.OPEN, 1, 1, opened_at=9.0))
    trial = _cand("trial", _adv(), health=PeerHealth(PeerState.HALF_OPEN, 1, 1, opened_at=0.0))
    excluded = _cand("tried", _adv())
    cands = [dead, other_layout, opened, trial, excluded, ok]
    for _ in range(50):
        assert pick_prefill_cost(cands, 1000, {"tried"}, 10.0, 5.0, rng, "L").node.name == "ok"
    # past its cooldown the open peer gets the next job (its half-open trial)
    assert pick_prefill_cost(cands, 1000, {"tried"}, 20.0, 5.0, rng, "L").node.name == "open"
    # all cooling down: the one that failed longest ago rather than failing the request
    only_open = [opened, _cand("o2", _adv(), health=PeerHealth(PeerState.OPEN, 1, 1, 5.0))]
    assert pick_prefill_cost(only_open, 1000, (), 10.0, 60.0, rng, "L").node.name == "o2"
    assert pick_prefill_cost([dead, other_layout], 1000, (), 0.0, 5.0, rng, "L") is None
    # a node that advertises nothing is still usable, after any that do
    static = _cand("static", None, layout="")
    assert pick_prefill_cost([static, ok], 1000, (), 0.0, 5.0, rng, "L").node.name == "ok"
    assert pick_prefill_cost([static], 1000, (), 0.0, 5.0, rng, "L").node.name == "static"
