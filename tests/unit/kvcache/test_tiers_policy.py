"""KV tier policies (pure): eviction by expected benefit, never a pinned entry; the
load-or-recompute plan picks the cheapest split; the bandwidth estimate follows measurements,
the latency estimate cautiously (fast up, slowly down)."""
from __future__ import annotations

import pytest

from moed.kvcache.tiers.policy import Bandwidth, EvictionCandidate, Latency, benefit, plan_load, victims


def test_benefit_grows_with_reuse_and_recompute_cost_and_decays_with_age() -> None:
    assert benefit(3, 0, 1.0) > benefit(0, 0, 1.0)
    assert benefit(1, 0, 2.0) == pytest.approx(2 * benefit(1, 0, 1.0))
    assert benefit(1, 120, 1.0, half_life_s=60) < benefit(1, 10, 1.0, half_life_s=60)


def test_victims_lowest_benefit_first_never_pinned() -> None:
    c = [EvictionCandidate(1, 10, 0.5), EvictionCandidate(2, 10, 0.1, pinned=True),
         EvictionCandidate(3, 10, 0.2), EvictionCandidate(4, 10, 0.9)]
    assert victims(c, 15) == [3, 1]
    assert victims(c, 0) == []
    assert victims(c, 31) is None           # only 30 unpinned bytes exist
    assert 2 not in (victims(c, 30) or [])


def test_plan_load_minimises_load_plus_recompute() -> None:
    rec = lambda k: 1.0 + (10 - k) * 0.1     # 10 blocks to go, 0.1 s each plus a 1 s step
    p = plan_load([0.01] * 10, rec)
    assert p.num_load == 10 and p.decision == "load"
    assert p.load_s == pytest.approx(0.1) and p.recompute_s == pytest.approx(2.0)
    slow = plan_load([0.5] * 10, rec)       # loading a block costs more than computing it
    assert slow.num_load == 0 and slow.decision == "recompute" and slow.total_s == 2.0
    mixed = plan_load([0.01] * 4 + [0.5] * 6, rec)     # fast tier first, then a slow one
    assert mixed.num_load == 4
    assert plan_load([0.01] * 10, rec, overhead_s=5.0).num_load == 0


def test_bandwidth_moves_toward_measurements() -> None:
    b = Bandwidth(1e9)
    for _ in range(50):
        b.observe(1_000_000, 0.01)      # 1e8 B/s
    assert b.value == pytest.approx(1e8, rel=0.01) and b.samples == 50
    assert b.seconds(1e8) == pytest.approx(1.0, rel=0.01)
    b.observe(0, 1.0)
    assert b.samples == 50


def test_latency_is_learnt_cautiously() -> None:
    lat = Latency(0.002)                # the warm-up probe's figure
    lat.observe(0.001)                  # a first load faster than the probe: the probe stays
    assert lat.value == pytest.approx(0.002)
    lat = Latency(0.002)
    lat.observe(0.010)                  # slower (a busy machine): taken at once
    assert lat.value == pytest.approx(0.010)
    lat.observe(0.030)                  # up fast (half the gap) ...
    assert lat.value == pytest.approx(0.020)
    lat.observe(0.0)                    # ... down slowly (a tenth)
    assert lat.value == pytest.approx(0.018) and lat.samples == 3
    lat.observe(-1.0)                   # clock noise never makes it negative
    assert lat.value >= 0.0


def test_the_step_prediction_scans_only_the_prompts_that_could_join(monkeypatch) -> None:
    """others_step runs at every admission: with a long queue it looks at the waiting prompts
    that have a seat in this step, not at the whole queue."""
    from collections import deque
    from types import SimpleNamespace

    from moed.kvcache.tiers import admission
    from moed.types import RequestState

    asked: list[object] = []
    monkeypatch.setattr(admission, "would_load", lambda sched, r: asked.append(r) or ())
    monkeypatch.setattr(admission, "shape_of", lambda chunks, experts: len(chunks))
    cost = SimpleNamespace(ready=True, error_quantiles=lambda: (0.0, 0.5),
                           coefficients=SimpleNamespace(predict=lambda shape: 0.01 * shape))
    waiting = deque(SimpleNamespace(num_tokens=10, num_computed_tokens=0, remote_kv=False,
                                    state=RequestState.WAITING) for _ in range(5000))
    running = [SimpleNamespace(num_tokens=20, num_computed_tokens=19, remote_kv=False,
                               state=RequestState.RUNNING)]
    sched = SimpleNamespace(cost=cost, max_num_batched_tokens=1 << 30, max_num_seqs=4,
                            running=running, waiting=waiting, experts=None)
    me = waiting[0]
    step_s, coload = admission.others_step(sched, me)
    assert len(asked) == 3                 # 3 free seats; `me` itself is skipped
    assert coload == [] and abs(step_s - 0.01 * 4 * 1.5) < 1e-9    # 1 decode + 3 prompts
