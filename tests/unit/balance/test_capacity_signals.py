"""moed.balance.capacity: the formulas, the meter's decaying sums, and the signals in the
gossip load vector (new fields at the end; the older shapes still decode)."""
from __future__ import annotations

import json

import pytest

from moed.balance import capacity as cap
from moed.balance.cost import AdvertisedCost, Coefficients, predict_ttft
from moed.cluster import wire
from moed.cluster.state import MAX_DIGEST, MAX_QUEUED, LoadVector, NodeMeta
from moed.cluster.wire import Alive, DecodeError
from moed.config import BalanceConfig
from moed.types import RequestTimings


def test_formulas() -> None:
    assert cap.capacity_tokens(2.0, 0.5, 1000.0) == 1500      # (target - predicted) x rate
    assert cap.capacity_tokens(0.5, 0.7, 1000.0) == 0         # past the SLO
    assert cap.capacity_tokens(2.0, cap.UNKNOWN, 1000.0) == 0
    assert cap.capacity_tokens(2.0, 0.5, cap.UNKNOWN) == 0
    assert cap.itl_headroom(0.025, 0.1) == pytest.approx(0.75)
    assert cap.itl_headroom(0.2, 0.1) == pytest.approx(-1.0)
    assert cap.itl_headroom(cap.UNKNOWN, 0.1) == 1.0
    # no fitted model: queued + reference tokens at the measured rate
    assert cap.predicted_ttft_s(None, 512, 1488, 1000.0) == pytest.approx(2.0)
    assert cap.predicted_ttft_s(None, 512, 0, cap.UNKNOWN) == cap.UNKNOWN
    adv = AdvertisedCost(Coefficients(0.001, 1e-4, 0.0, 0.0, 0.0), (512, 4096), (1000, 0, 0),
                         (2, 0, 0), 0.5, 256)
    assert cap.predicted_ttft_s(adv, 512, 1000, 10.0) == predict_ttft(adv, 512)


def test_meter_measures_prefill_rate_decode_step_and_queue_vs_compute() -> None:
    m = cap.CapacityMeter()
    bal = BalanceConfig(policy="tokens")
    fresh = m.report(None, 0, bal)
    assert fresh.prefill_tps == fresh.decode_step_s == fresh.queue_s == cap.UNKNOWN
    assert fresh.capacity_tokens == 0 and fresh.itl_headroom == 1.0
    for _ in range(100):
        m.on_step(prefill_tokens=256, decode_tokens=0, seconds=0.128)   # 2000 tok/s
        m.on_step(prefill_tokens=0, decode_tokens=8, seconds=0.02)
    m.on_step(0, 0, 0.0)                                              # idle: no change
    for q, p in ((0.1, 0.3), (0.1, 0.3)):
        m.on_finish(RequestTimings(queue_s=q, prefill_s=p, decode_s=1.0))
    m.on_finish(RequestTimings())                                     # aborted while queued
    r = m.report(None, queued_tokens=488, balance=bal)
    assert r.prefill_tps == pytest.approx(2000.0) and r.decode_step_s == pytest.approx(0.02)
    assert r.queue_s == pytest.approx(0.1) and r.compute_s == pytest.approx(0.3)
    # reference prompt 512 (bucket_edges[0]), target 0.5 s (ttft_targets_ms[0])
    assert r.predicted_ttft_s == pytest.approx((488 + 512) / 2000.0)
    assert r.capacity_tokens == int((0.5 - 0.5) * 2000) == 0
    assert m.report(None, 0, bal).capacity_tokens == int((0.5 - 512 / 2000) * 2000)
    assert r.itl_headroom == pytest.approx(1 - 0.02 / 0.1)


SIGNALS = dict(prefill_tps=2000.0, decode_step_s=0.02, queue_s=0.1, compute_s=0.3,
               predicted_ttft_s=0.5, capacity_tokens=1234)


def test_signals_round_trip_and_older_shapes_decode() -> None:
    full = LoadVector(3, 2, 100, 488, (512,), (10, 0), (1, 0), (0.001,) * 5, 0.5, 256, 16,
                      (7,), **SIGNALS)
    raw = json.loads(json.dumps(["L", "n1", 3, full.to_list()]))
    assert wire.from_fields(raw).load == full
    unmeasured = LoadVector(1, 1, 1, 1, **{k: -1.0 for k in SIGNALS if k != "capacity_tokens"})
    assert wire.from_fields(json.loads(json.dumps(["L", "n", 1, unmeasured.to_list()]))
                            ).load == unmeasured
    # the release before (12 fields) and wire version 1 (4): the signals read "not advertised"
    for n in (12, 4):
        old = wire.from_fields(["L", "n1", 3, full.to_list()[:n]]).load
        assert (old.prefill_tps, old.predicted_ttft_s, old.capacity_tokens) == (-1.0, -1.0, 0)
        assert old.waiting == 3
    assert LoadVector().to_dict()["capacity_tokens"] == 0
    assert full.to_dict()["prefill_tps"] == 2000.0


@pytest.mark.parametrize("i,bad", [(12, -2), (12, "1"), (13, float("nan")), (16, -1.5),
                                   (17, -1), (17, 1.5)])
def test_malformed_signals_are_refused(i, bad) -> None:
    fields = LoadVector(**SIGNALS).to_list()
    fields[i] = bad
    with pytest.raises(DecodeError):
        wire.from_fields(["L", "n1", 3, fields])


def test_the_largest_load_with_signals_still_fits_a_packet() -> None:
    big = 1.234e+15
    load = LoadVector(*(wire.MAX_INT,) * 4, tuple(range(1 << 29, (1 << 29) + 7)),
                      (MAX_QUEUED,) * 8, (MAX_QUEUED,) * 8, (1.234e-05,) * 5, 0.1234,
                      1 << 24, 1024, tuple((1 << 64) - 1 - i for i in range(MAX_DIGEST)),
                      big, 1.234e-05, big, big, big, MAX_QUEUED)
    meta = NodeMeta("decode", "http://decode-node-17.example.internal:8200", "Qwen3-30B-A3B",
                    "a" * 16, "decode-node-17.example.internal-8200-1733000000",
                    "0.1.0.dev123+g0123abcd", "release-2026-12-01", "b" * 64, "c" * 16, "1-1")
    frag = wire.fragment(Alive("decode-node-17.example.internal-8200", 1733000000,
                               "10.200.30.40:7946", meta, 1 << 40, load))
    budget = wire.MAX_PACKET - wire.packet_overhead("decode-node-17.example.internal-8200") - 64
    assert len(frag) + 1 <= budget, (len(frag), budget)


def test_load_of_gossips_the_signals_rounded_and_unmeasured_as_minus_one() -> None:
    from moed.cluster.service import PrefixDigest, load_of
    from moed.types import EngineStats

    class Engine:
        def stats(self) -> EngineStats:
            return EngineStats(running=1, waiting=2, queued_prompt_tokens=300)

    c = cap.Capacity(prefill_tps=1987.654321, decode_step_s=0.0212345, queue_s=cap.UNKNOWN,
                     compute_s=0.3, predicted_ttft_s=0.41, capacity_tokens=MAX_QUEUED + 5)
    load = load_of(Engine(), PrefixDigest(), 0, c)
    assert (load.prefill_tps, load.decode_step_s, load.queue_s) == (1988.0, 0.02123, -1.0)
    assert load.capacity_tokens == MAX_QUEUED and load.queued_prefill_tokens == 300
    assert wire.from_fields(json.loads(json.dumps(["L", "n", 1, load.to_list()]))).load == load
    assert load_of(Engine(), PrefixDigest(), 0).prefill_tps == -1.0    # no signals: not sent
