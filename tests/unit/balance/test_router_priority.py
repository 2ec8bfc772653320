"""Priority in the gossiped load and the router's choice: a node advertises its waiting
requests by priority (LoadVector.waiting_by_priority, folded to two pairs so the largest Alive
still fits a packet), the wire reads it and the release before's shape, and the router weighs
only the queue a request of its priority joins."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from moed.api.priority import routing_priority
from moed.balance.candidate import Candidate
from moed.balance.router import PlacementLimits, pick_backend, place
from moed.cluster import wire
from moed.cluster.service import PrefixDigest, load_of
from moed.cluster.state import (MAX_DIGEST, MAX_PRIORITY_COUNT, MAX_QUEUED, LoadVector,
                                NodeMeta, fold_priorities)
from moed.cluster.wire import Alive, DecodeError, Keyring, Load
from moed.config import PriorityConfig

KEY = Keyring(b"k" * 32)


def _node(name: str, waiting: int, by: tuple[tuple[int, int], ...] = ()) -> Candidate:
    return Candidate(name, f"http://{name}",
                     load=LoadVector(waiting=waiting, waiting_by_priority=by))


def test_waiting_ahead_counts_the_requests_no_less_urgent():
    lv = LoadVector(waiting=12, waiting_by_priority=((0, 2), (10, 10)))
    assert [lv.waiting_ahead(p) for p in (None, -1, 0, 5, 10, 99)] == [12, 0, 2, 2, 12, 12]
    assert LoadVector(waiting=7).waiting_ahead(0) == 7        # not advertised: all of it


def test_fold_keeps_the_most_urgent_and_counts_the_rest_ahead_of_the_second():
    assert fold_priorities([(10, 4), (0, 1)]) == ((0, 1), (10, 4))
    assert fold_priorities([(10, 4), (0, 1), (5, 2), (20, 0)]) == ((0, 1), (5, 6))
    assert fold_priorities([(3, 1 << 40)]) == ((3, MAX_PRIORITY_COUNT),)
    assert fold_priorities([]) == ()


def test_an_interactive_request_skips_the_batch_flood_and_a_batch_one_does_not():
    flooded = _node("flooded", 21, ((0, 1), (10, 20)))    # one interactive, a batch flood
    busy = _node("busy", 4, ((0, 4),))                     # four interactive waiting
    limits = PlacementLimits(affinity_weight=0)
    assert place([flooded, busy], {}, 0, limits, priority=0).node.name == "flooded"
    assert place([flooded, busy], {}, 0, limits, priority=10).node.name == "busy"
    assert place([flooded, busy], {}, 0, limits).node.name == "busy"   # no priority: totals
    assert pick_backend([flooded, busy], priority=0).name == "flooded"
    assert pick_backend([flooded, busy], priority=10).name == "busy"
    # saturation (router admission) is judged on the same queue
    tight = PlacementLimits(affinity_weight=0, max_waiting=3)
    assert place([flooded], {}, 0, tight, priority=0).node.name == "flooded"
    assert place([flooded], {}, 0, tight, priority=10).reason == "saturated"
    # a node of the release before (no pairs) counts everything for everyone
    old = _node("old", 21)
    assert place([old, busy], {}, 0, limits, priority=0).node.name == "busy"


def test_the_pairs_round_trip_and_the_release_befores_load_reads_without_them():
    lv = LoadVector(3, 5, 900, 12, waiting_by_priority=((-7, 1), (10, 2)))
    got = wire.decode(KEY, wire.encode(KEY, "n0", 1, [wire.fragment(Load("n1", 4, lv))]),
                      wire.MAX_PACKET)[2][0]
    assert got.load == lv and got.load.waiting_ahead(0) == 1
    old = LoadVector(3, 5, 900, 12).to_list()[:-1]          # every field but the pairs
    assert wire.from_fields(["L", "n1", 3, old]).load.waiting_by_priority == ()
    nxt = wire.from_fields(["L", "n1", 3, lv.to_list() + [{"later": 1}]])
    assert nxt.load == lv


@pytest.mark.parametrize("bad", [[0], [0, 1, 2, 3, 4, 5], [0, -1], ["0", 1], [0, 1.5],
                                 [1 << 31, 1], [0, MAX_PRIORITY_COUNT + 1], "0,1"])
def test_malformed_pairs_are_refused(bad):
    fields = LoadVector().to_list()
    fields[-1] = bad
    with pytest.raises(DecodeError) as e:
        wire.from_fields(json.loads(json.dumps(["L", "n1", 3, fields])))
    assert e.value.reason == "malformed"


def test_an_alive_with_the_largest_load_and_pairs_fits_a_packet():
    load = LoadVector(*(wire.MAX_INT,) * 4, tuple(range(1 << 29, (1 << 29) + 7)),
                      (MAX_QUEUED,) * 8, (MAX_QUEUED,) * 8, (1.234e-05,) * 5, 0.1234, 1 << 24,
                      1024, tuple((1 << 64) - 1 - i for i in range(MAX_DIGEST)),
                      1.234e5, 1.234e-3, 1.234e-3, 1.234e-3, 1.234e-3, MAX_QUEUED,
                      ((-(1 << 31), MAX_PRIORITY_COUNT), (-(1 << 31) + 1, MAX_PRIORITY_COUNT)))
    meta = NodeMeta("decode", "http://decode-node-17.example.internal:8200", "Qwen3-30B-A3B",
                    "a" * 16, "decode-node-17.example.internal-8200-1733000000",
                    "0.1.0.dev123+g0123abcd", "release-2026-12-01", "b" * 64, "c" * 16, "1-1")
    frag = wire.fragment(Alive("decode-node-17.example.internal-8200", 1733000000,
                               "10.200.30.40:7946", meta, 1 << 40, load))
    budget = wire.MAX_PACKET - wire.packet_overhead("decode-node-17.example.internal-8200") - 64
    assert len(frag) + 1 <= budget, (len(frag), budget)


def test_load_of_advertises_the_engines_waiting_by_priority():
    stats = SimpleNamespace(waiting=5, waiting_remote_kv=0, running=1, kv_blocks_free=10,
                            queued_prompt_tokens=0,
                            waiting_by_priority=((0, 1), (5, 1), (10, 3)))
    engine = SimpleNamespace(stats=lambda: stats)
    lv = load_of(engine, PrefixDigest(), 0)
    assert lv.waiting_by_priority == ((0, 1), (5, 4)) and lv.waiting_ahead(0) == 1


def test_routing_priority_reads_the_body_else_the_keys_class():
    cfg = PriorityConfig()
    keys, classes = (b"kb", b"ki"), ("batch", "")
    assert routing_priority({"priority": 3}, b"", b"ki", keys, classes, cfg) == 3
    assert routing_priority(None, b'{"priority": 7, "prompt": "x"}', b"kb", keys, classes,
                            cfg) == 7
    assert routing_priority(None, b'{"prompt": "x"}', b"kb", keys, classes, cfg) == 10
    assert routing_priority(None, b'{"prompt": "x"}', b"ki", keys, classes, cfg) == 0
    assert routing_priority(None, b'{"priority": "high"}', None, (), (), cfg) == 0
    assert routing_priority(None, b"not json \"priority\"", None, (), (), cfg) == 0
