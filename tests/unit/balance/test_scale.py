"""The scaling planner (moed/balance/scale.py): scale-out on a queue-token ramp, scale-in only
after the cool-down, no flapping on a square-wave load at the threshold; the /cluster parse,
the drain choice, the predictor and the config checks."""
from __future__ import annotations

import pytest

from moed.balance.cost import Coefficients
from moed.balance.scale import (Holt, PlanConfig, Planner, decode_capacity, drains, pick_drain,
                                prefill_capacity)
from moed.balance.scale_view import NodeLoad, Snapshot, snapshot_of
from moed.cluster.state import ClusterView, LoadVector, MemberInfo, MemberState, NodeMeta

COEF = Coefficients(overhead_s=0.004, per_token_s=4.5e-4, per_pair_s=2.9e-7,
                    per_decode_s=1.5e-3, per_expert_s=0.0)
INTERVAL = 10.0


def prefill_nodes(n: int, backlog_each: int = 0, busy: bool = True) -> tuple[NodeLoad, ...]:
    return tuple(NodeLoad(f"p{i}", "prefill", waiting=int(busy), running=int(busy),
                          queued_prefill_tokens=backlog_each,
                          queued_requests=max(backlog_each // 512, 0), cost=COEF)
                 for i in range(n))


def decode_nodes(seqs: list[int]) -> tuple[NodeLoad, ...]:
    return tuple(NodeLoad(f"d{i}", "decode", running=s, cost=COEF) for i, s in enumerate(seqs))


def cfg(**kw) -> PlanConfig:
    base = dict(ttft_target_s=2.0, itl_target_s=0.1, cooldown_out_s=30.0, cooldown_in_s=120.0,
                in_stable=3)
    base.update(kw)
    return PlanConfig(**base)


def test_capacity_from_the_cost_model() -> None:
    n = NodeLoad("p", "prefill", cost=COEF)
    cap = prefill_capacity(n, 512)
    assert cap == pytest.approx(512 / COEF.prefill_seconds(512), rel=1e-6)   # ~1.9k tok/s
    assert prefill_capacity(NodeLoad("x", "prefill"), 512) is None
    # (0.1 - 0.004) / (1.5e-3 + 1025 * 2.9e-7) = 53.7 sequences under a 100 ms step
    assert decode_capacity(NodeLoad("d", "decode", cost=COEF), 0.1, 1024, 256) == \
        pytest.approx(0.096 / (1.5e-3 + 1025 * 2.9e-7))
    assert decode_capacity(NodeLoad("d", "decode", cost=COEF), 0.1, 1024, 16) == 16
    # a measured step twice the model's prediction halves the batch that fits
    slow = NodeLoad("d", "decode", running=10, cost=COEF, decode_step_s=2 * (
        0.004 + 10 * (1.5e-3 + 1025 * 2.9e-7)))
    assert decode_capacity(slow, 0.1, 1024, 256) == pytest.approx(
        (0.1 - 0.008) / (2 * (1.5e-3 + 1025 * 2.9e-7)))


def ramp(measured: bool) -> tuple[list, list[float], float]:
    """Prompt tokens arriving ramp from 0.5 to 4 nodes' worth over 16 intervals; the nodes
    serve what they can (a node the planner asks for arrives 2 intervals later) and the rest
    queues. -> (decisions, backlog per interval, one node's tok/s)."""
    p = Planner(cfg())
    cap = prefill_capacity(NodeLoad("p", "prefill", cost=COEF), 512)
    assert cap is not None
    n, backlog, arriving = 2, 0.0, []
    decisions, backlogs = [], []
    for k in range(16):
        rate = cap * (0.5 + 3.5 * k / 15)
        served = min(rate + backlog / INTERVAL, n * cap)
        backlog = max(0.0, backlog + (rate - served) * INTERVAL)
        busy = served / (n * cap)
        nodes = tuple(NodeLoad(f"p{i}", "prefill", running=int(i < round(busy * n)),
                               queued_prefill_tokens=int(backlog / n),
                               queued_requests=int(backlog / n / 512), cost=COEF,
                               prefill_tps=cap if measured else None)
                      for i in range(n))
        [d] = p.step(Snapshot(k * INTERVAL, nodes))
        decisions.append(d)
        backlogs.append(backlog)
        if d.action == "out":
            arriving.append((k + 2, d.desired))
        n = max([n] + [want for at, want in arriving if at <= k + 1])
    return decisions, backlogs, cap


@pytest.mark.parametrize("measured", [True, False])
def test_scale_out_on_a_queue_token_ramp(measured: bool) -> None:
    """Scale-out comes while the load ramps, before the backlog takes the TTFT target to
    drain; nodes asked for count as there while they load."""
    decisions, backlogs, cap = ramp(measured)
    outs = [k for k, d in enumerate(decisions) if d.action == "out"]
    assert outs, [d.reason for d in decisions]
    assert decisions[0].action == "hold"                # 0.5 of 2 nodes' worth: nothing to do
    first = decisions[outs[0]]
    assert first.current == 2 and first.desired > 2
    assert "tok/s" in first.reason and "backlog" in first.reason
    # while the first scale-out was decided the backlog still drained within the target
    assert backlogs[outs[0]] / (2 * cap) < 2.0, (outs, backlogs)
    # while asked-for nodes load they count as there: a later ask within the cool-down
    # only adds to it (it never asks again for the same nodes)
    for a, b in zip(outs, outs[1:]):
        if b - a < 3:                                               # 30 s cool-down
            assert decisions[b].current >= decisions[a].desired
            assert decisions[b].desired > decisions[a].desired
    assert decisions[-1].current >= 4 or decisions[-1].desired >= 4   # it kept up with 4x
    # the backlog never runs away: at the end it drains within the TTFT target again
    assert backlogs[-1] / (decisions[-1].current * cap) < 2.0, backlogs


def test_backlog_alone_scales_out() -> None:
    """Prompt work dumped at once (a batch job): the rate is modest but the queued tokens
    would take 3x the TTFT target on 2 nodes: the drain term asks for more — enough to
    drain the excess within drain_s (0: within the TTFT target itself)."""
    p = Planner(cfg(drain_s=0.0))
    cap = prefill_capacity(NodeLoad("p", "prefill", cost=COEF), 512)
    assert cap is not None
    backlog = int(3 * 2.0 * 2 * cap)
    nodes = tuple(NodeLoad(f"p{i}", "prefill", running=1, queued_prefill_tokens=backlog // 2,
                           queued_requests=backlog // 1024, cost=COEF)
                  for i in range(2))
    [d] = p.step(Snapshot(0.0, nodes))
    assert d.action == "out" and d.desired >= 6, d.reason
    [slow] = Planner(cfg(drain_s=30.0)).step(Snapshot(0.0, nodes))
    assert slow.action == "out" and 2 < slow.desired < d.desired, slow.reason


def test_scale_in_after_the_cool_down_only() -> None:
    c = cfg(cooldown_in_s=120.0, in_stable=3)
    p = Planner(c)
    # a burst: 4 decode nodes full, the planner scales out to more
    t = 0.0
    for _ in range(3):
        d = {x.role: x for x in p.step(Snapshot(t, decode_nodes([60, 60, 60, 60])))}["decode"]
        t += INTERVAL
    out_t = p.state["decode"].last_change_t
    assert out_t is not None and p.state["decode"].asked_out > 4
    # then nearly idle, on the 5 nodes that started; d3, then d1 and d4 have the least work
    actions = []
    while t < out_t + 300:
        snap = Snapshot(t, decode_nodes([3, 2, 4, 1, 2]))
        d = {x.role: x for x in p.step(snap)}["decode"]
        actions.append((t, d))
        t += INTERVAL
    ins = [(t, d) for t, d in actions if d.action == "in"]
    assert ins, [d.reason for _, d in actions]
    t_in, d_in = ins[0]
    assert t_in >= out_t + 120.0                         # never inside the cool-down
    # and soon after the window forgets the burst's last interval (t = 20): 120 s, then
    # in_stable intervals of a quiet load
    assert t_in <= 20.0 + 120.0 + 3 * INTERVAL, t_in
    # down to what the load needs at once (min 1), the least-loaded nodes first
    assert d_in.desired == 1 and [n.name for n in d_in.drain] == ["d3", "d1", "d4", "d0"]
    held = [d for t, d in actions if t < out_t + 120.0]
    assert held and all(d.action == "hold" for d in held)
    assert any("cool-down" in d.reason for d in held)
    assert len(ins) == 1                       # the drained nodes are not counted again


def test_no_flapping_on_a_square_wave_at_the_threshold() -> None:
    """Running sequences alternate every 2 intervals between just above and just below what
    2 decode nodes carry at util_high: one scale-out, then the hysteresis holds."""
    c = cfg(cooldown_out_s=20.0, cooldown_in_s=30.0, in_stable=2)
    cap = decode_capacity(NodeLoad("d", "decode", cost=COEF), c.itl_target_s, c.context_tokens,
                          c.max_batch)
    assert cap is not None
    threshold = 2 * cap * c.util_high
    p = Planner(c)
    n_nodes, events = 2, []
    for k in range(200):
        total = threshold * (1.08 if (k // 2) % 2 == 0 else 0.92)
        each = [int(total / n_nodes)] * n_nodes
        for d in p.step(Snapshot(k * INTERVAL, decode_nodes(each))):
            if d.action != "hold":
                events.append((k, d.action, d.desired))
                n_nodes = d.desired            # the nodes come and go at once here
    assert [e[1] for e in events] == ["out"], events
    assert n_nodes == 3


def test_utilisation_band_is_the_hysteresis() -> None:
    """A load just under util_high on 3 nodes is not scaled in: it would need util_low."""
    c = cfg(cooldown_in_s=0.0, in_stable=1)
    cap = decode_capacity(NodeLoad("d", "decode", cost=COEF), 0.1, 1024, 64)
    assert cap is not None
    p = Planner(c)
    seqs = int(2 * cap * 0.75 / 3)          # 2 nodes would carry it at 75 %, above util_low
    for k in range(10):
        [d] = p.step(Snapshot(k * INTERVAL, decode_nodes([seqs] * 3)))
        assert d.action == "hold", d.reason
    seqs = int(2 * cap * 0.4 / 3)           # 2 nodes at 40 %: now it goes
    [d] = p.step(Snapshot(100.0, decode_nodes([seqs] * 3)))
    [d] = p.step(Snapshot(110.0, decode_nodes([seqs] * 3)))
    assert d.action == "in" and d.desired == 2


def test_bounds_and_no_cost_model() -> None:
    c = cfg(min_nodes={"prefill": 2, "decode": 1, "colocated": 1},
            max_nodes={"prefill": 3, "decode": 8, "colocated": 8})
    p = Planner(c)
    [d] = p.step(Snapshot(0.0, prefill_nodes(2, 200_000)))
    assert d.action == "out" and d.desired == 3                  # capped at max
    p = Planner(c)
    bare = tuple(NodeLoad(f"p{i}", "prefill", running=1, queued_prefill_tokens=9999)
                 for i in range(2))
    [d] = p.step(Snapshot(0.0, bare))
    assert d.action == "hold" and "no cost model" in d.reason      # no signal: no guess
    p = Planner(c)
    [d] = p.step(Snapshot(0.0, tuple(NodeLoad(f"d{i}", "decode", running=1) for i in range(2))))
    assert "batch cap" in d.reason                # decode without a model: the batch cap


def test_pick_drain_least_inflight() -> None:
    nodes = (NodeLoad("a", "decode", running=3), NodeLoad("b", "decode", running=1, waiting=1),
             NodeLoad("c", "decode", running=2), NodeLoad("d", "decode", state="suspect"))
    assert pick_drain(nodes).name == "b"         # a suspect node is not chosen while others live
    assert pick_drain([NodeLoad("x", "decode", running=1, queued_prefill_tokens=5),
                       NodeLoad("y", "decode", running=1)]).name == "y"
    assert pick_drain([]) is None
    assert [n.name for n in drains(nodes, 2)] == ["b", "c"]


def test_holt_follows_a_ramp() -> None:
    h = Holt()
    for x in range(0, 100, 10):
        h = h.update(float(x), 0.5, 0.3)
    assert h.forecast(1.0) > 90.0                  # ahead of the last sample, 90
    assert Holt().update(5.0, 0.5, 0.3).forecast(3.0) == 5.0
    h = Holt(level=1.0, trend=-5.0, n=3)
    assert h.forecast(1.0) == 0.0                  # never negative


def test_snapshot_of_cluster_json() -> None:
    load = LoadVector(waiting=2, running=3, free_kv_blocks=40, queued_prefill_tokens=900,
                      bucket_edges=(512,), queued_tokens=(400, 500), queued_requests=(1, 1),
                      cost=COEF.as_tuple(), prefill_share=1.0, chunk_tokens=256)
    members = [MemberInfo("P1", MemberState.ALIVE, 1, "127.0.0.1:1",
                          NodeMeta(role="prefill", http="http://127.0.0.1:9"), load, 1, 0.0),
               MemberInfo("R", MemberState.ALIVE, 1, "127.0.0.1:2",
                          NodeMeta(role="router", http="http://127.0.0.1:8"), LoadVector(), 1, 0.0),
               MemberInfo("D1", MemberState.LEFT, 1, "127.0.0.1:3",
                          NodeMeta(role="decode"), LoadVector(running=1), 1, 0.0)]
    js = ClusterView.build("R", members, 3).to_json()
    [m] = [m for m in js["members"] if m["name"] == "P1"]
    m["load"]["prefill_tps"] = 1234.5                      # capacity signals, when gossiped
    m["load"]["decode_step_s"] = -1.0                      # -1: not measured
    snap = snapshot_of(js, 7.0)
    assert [n.name for n in snap.nodes] == ["D1", "P1"]    # the router is not planned
    p1 = snap.nodes[1]
    assert (p1.waiting, p1.running, p1.queued_prefill_tokens, p1.queued_requests) == (2, 3, 900, 2)
    assert p1.cost == COEF and p1.chunk_tokens == 256 and p1.http == "http://127.0.0.1:9"
    assert p1.prefill_tps == 1234.5 and p1.decode_step_s is None
    assert snap.counted("decode") == [] and len(snap.counted("prefill")) == 1
    with pytest.raises(ValueError):
        snapshot_of({"error": "x"}, 0.0)


@pytest.mark.parametrize("kw", [dict(util_low=0.9), dict(util_high=0.0), dict(in_stable=0),
                                dict(ttft_target_s=0.0), dict(alpha=0.0),
                                dict(min_nodes={"decode": 5}, max_nodes={"decode": 2})])
def test_plan_config_refuses(kw) -> None:
    with pytest.raises(ValueError, match="plan:"):
        PlanConfig(**kw)


def test_a_draining_node_is_not_counted_nor_picked_again() -> None:
    """A drained node gossips "alive" until it leaves: the planner counts it gone at once,
    so it neither drains more nodes for the same need nor picks the same one again."""
    c = cfg(cooldown_in_s=30.0, in_stable=1, min_nodes={"decode": 2, "prefill": 1,
                                                         "colocated": 1})
    p = Planner(c)
    nodes = decode_nodes([1, 0, 2])
    [d] = p.step(Snapshot(0.0, nodes))
    assert d.action == "in" and [n.name for n in d.drain] == ["d1"] and d.desired == 2
    seen = []
    for k in range(1, 8):                        # d1 still reported alive while it drains
        [d] = p.step(Snapshot(k * INTERVAL, nodes))
        seen.append((d.current, d.action))
    assert seen == [(2, "hold")] * 7, seen       # at the min: nothing more goes
    # it is counted again if it is still there after drain_timeout_s (the drain failed)
    p = Planner(PlanConfig(cooldown_in_s=0.0, in_stable=1, drain_timeout_s=15.0,
                           min_nodes={"decode": 2, "prefill": 1, "colocated": 1}))
    [d] = p.step(Snapshot(0.0, nodes))
    [d] = p.step(Snapshot(10.0, nodes))
    assert (d.current, d.action) == (2, "hold")
    [d] = p.step(Snapshot(20.0, nodes))
    assert d.current == 3 and d.action == "in"


def test_measured_capacity_overrides_the_model() -> None:
    """A node measured at half the tok/s its cost model says needs twice the nodes: the
    gossiped capacity signal wins over the fit."""
    cap = prefill_capacity(NodeLoad("p", "prefill", cost=COEF), 512)
    assert cap is not None
    def nodes(tps):
        return tuple(NodeLoad(f"p{i}", "prefill", running=1, cost=COEF, prefill_tps=tps)
                     for i in range(2))
    assert prefill_capacity(nodes(cap / 2)[0], 512) == cap / 2
    [fit] = Planner(cfg()).step(Snapshot(0.0, nodes(None)))
    [slow] = Planner(cfg()).step(Snapshot(0.0, nodes(cap / 2)))
    assert fit.need == pytest.approx(2 / 0.8) and slow.need == pytest.approx(2 / 0.8)
    # same busy nodes: the arrival estimate follows the measured rate, so the need per
    # node-capacity is the same, but a backlog weighs twice as much
    p_fit, p_slow = Planner(cfg()), Planner(cfg())
    for p, tps in ((p_fit, None), (p_slow, cap / 2)):
        p.step(Snapshot(0.0, nodes(tps)))
    q = tuple(NodeLoad(f"p{i}", "prefill", running=1, cost=COEF, queued_prefill_tokens=int(4 * cap),
                       queued_requests=int(4 * cap / 512), prefill_tps=t)
              for i, t in ((0, None), (1, None)))
    [a] = p_fit.step(Snapshot(10.0, q))
    q2 = tuple(NodeLoad(n.name, "prefill", running=1, cost=COEF,
                        queued_prefill_tokens=n.queued_prefill_tokens,
                        queued_requests=n.queued_requests, prefill_tps=cap / 2) for n in q)
    [b] = p_slow.step(Snapshot(10.0, q2))
    assert b.need > a.need and "predicted TTFT" in b.reason


def test_a_role_whose_nodes_all_went_asks_for_its_min() -> None:
    p = Planner(cfg(min_nodes={"decode": 2, "prefill": 1, "colocated": 1}))
    p.step(Snapshot(0.0, decode_nodes([3, 3])))
    [d] = p.step(Snapshot(10.0, ()))
    assert (d.current, d.desired, d.action) == (0, 2, "out") and "no live node" in d.reason
    [d] = p.step(Snapshot(20.0, ()))              # loading: asked for once, not every look
    assert (d.current, d.action) == (2, "hold"), d.reason
