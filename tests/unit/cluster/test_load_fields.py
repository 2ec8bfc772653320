"""The load vector's newer fields (cost state per length bucket, block size, prefix digest):
wire round trip, old and next-release shapes, bounds, the packet budget, and what a node
advertises (moed.cluster.service.load_of / PrefixDigest)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from moed.cluster import wire
from moed.cluster.service import PrefixDigest, load_of
from moed.cluster.state import (MAX_BUCKETS, MAX_DIGEST, MAX_QUEUED, LoadVector, NodeMeta,
                                digest_depths, digest_key, digest_of_text, digest_text)
from moed.cluster.wire import Alive, DecodeError, Keyring, Load
from moed.kvcache.manager import KVCacheManager

KEY = Keyring(b"k" * 32)
FULL = LoadVector(3, 5, 900, 12000, (512, 4096, 32768), (100, 2000, 0, 0), (2, 1, 0, 0),
                  (0.0021, 1.3e-5, 2.9e-7, 0.0022, 0.004), 0.75, 256, 16,
                  tuple(range(1 << 60, (1 << 60) + 16)))


def _round(msg):
    data = wire.encode(KEY, "n0", 1, [wire.fragment(msg)])
    return wire.decode(KEY, data, wire.MAX_PACKET)[2][0]


def test_every_field_round_trips_in_load_and_alive() -> None:
    assert _round(Load("n1", 4, FULL)).load == FULL
    meta = NodeMeta("decode", "http://10.0.0.1:8000", "m", "ab", "agent")
    assert _round(Alive("n1", 2, "10.0.0.1:7946", meta, 4, FULL)).load == FULL
    assert digest_of_text(digest_text(FULL.prefix_digest)) == FULL.prefix_digest


def test_old_shape_reads_with_defaults_and_next_release_extras_are_dropped() -> None:
    old = wire.from_fields(["L", "n1", 3, [1, 2, 3, 4]])
    assert old.load == LoadVector(1, 2, 3, 4) and old.load.cost == () \
        and old.load.prefix_digest == () and old.load.prefill_share == 1.0
    part = wire.from_fields(["L", "n1", 3, [1, 2, 3, 4, [512], [7, 0]]])   # some new fields
    assert part.load.bucket_edges == (512,) and part.load.queued_tokens == (7, 0)
    assert part.load.queued_requests == ()
    nxt = wire.from_fields(["L", "n1", 3, FULL.to_list() + [{"later": 1}, "x"]])
    assert nxt.load == FULL


@pytest.mark.parametrize("i,bad", [
    (4, [1] * (MAX_BUCKETS + 1)),          # too many buckets
    (5, [-1]),                             # negative queued tokens
    (7, [float("nan")]), (7, [-0.5]), (7, ["x"]),
    (8, "0.5"), (8, -1.0),                 # prefill share
    (11, "not base64!"), (11, digest_text(tuple(range(MAX_DIGEST + 1)))),
    (11, "QUJD"),                          # 3 bytes: not whole entries
])
def test_malformed_fields_are_refused(i, bad) -> None:
    fields = FULL.to_list()
    fields[i] = bad
    raw = json.loads(json.dumps(["L", "n1", 3, fields]))
    with pytest.raises(DecodeError) as e:
        wire.from_fields(raw)
    assert e.value.reason == "malformed"


def test_an_alive_with_the_largest_load_fits_a_packet() -> None:
    # the worst case the bounds allow, beside metadata with every field at a realistic length
    # (queued values are clamped to MAX_QUEUED by load_of, bucket edges are at most 2^30)
    load = LoadVector(*(wire.MAX_INT,) * 4, tuple(range(1 << 29, (1 << 29) + 7)),
                      (MAX_QUEUED,) * 8, (MAX_QUEUED,) * 8,
                      (1.234e-05,) * 5, 0.1234, 1 << 24, 1024,
                      tuple((1 << 64) - 1 - i for i in range(MAX_DIGEST)))
    meta = NodeMeta("decode", "http://decode-node-17.example.internal:8200", "Qwen3-30B-A3B",
                    "a" * 16, "decode-node-17.example.internal-8200-1733000000",
                    "0.1.0.dev123+g0123abcd", "release-2026-12-01", "b" * 64, "c" * 16, "1-1")
    frag = wire.fragment(Alive("decode-node-17.example.internal-8200", 1733000000,
                               "10.200.30.40:7946", meta, 1 << 40, load))
    budget = wire.MAX_PACKET - wire.packet_overhead("decode-node-17.example.internal-8200") - 64
    assert len(frag) + 1 <= budget, (len(frag), budget)


def _kv_with(prompts: list[list[int]], bs: int = 4) -> KVCacheManager:
    kv = KVCacheManager(64, bs)
    for i, p in enumerate(prompts):
        hit = kv.prefix_hit(p)
        kv.allocate_prompt(f"r{i}", p, hit, len(p))
        kv.commit(f"r{i}", p, len(p))
    return kv


def test_prefix_digest_samples_leading_depths_newest_first_and_forgets_evicted() -> None:
    kv = _kv_with([list(range(40))])                 # 10 full blocks: depths 1, 2, 4, 8
    hashes = list(kv._tables["r0"].hashes)
    d = PrefixDigest()
    got = d.update(kv, 16)
    assert digest_depths(10) == [1, 2, 4, 8]
    assert set(got) == {digest_key(hashes[i - 1]) for i in (1, 2, 4, 8)}
    assert got[0] == digest_key(hashes[7])           # the last one added comes first
    assert len(d.update(kv, 2)) == 2 and d.update(kv, 0) == ()
    d.update(kv, 16)
    kv.free("r0")
    kv.allocate_prompt("big", list(range(1000, 1256)), kv.prefix_hit([]), 256)  # evicts all
    assert d.update(kv, 16) == ()


def test_a_request_that_came_and_went_between_two_ticks_is_in_the_digest() -> None:
    d = PrefixDigest()
    kv = KVCacheManager(64, 4)
    assert d.update(kv, 16) == ()
    p = list(range(16))
    kv.allocate_prompt("r", p, kv.prefix_hit(p), 16)
    kv.commit("r", p, 16)
    kv.free("r")                                     # freed, still cached
    got = d.update(kv, 16)
    assert len(got) == 3                             # depths 1, 2, 4
    assert d.update(kv, 16) == got                   # read once, kept while cached


def test_load_of_advertises_the_cost_state_block_size_and_digest() -> None:
    kv = _kv_with([list(range(20))])
    adv = SimpleNamespace(bucket_edges=(512,), queued_tokens=(10, 0), queued_requests=(1, 0),
                          coefficients=SimpleNamespace(as_tuple=lambda: (0.00123456, 1e-5, 0,
                                                                         -1.0, 0.5)),
                          prefill_share=0.5, chunk_tokens=128)
    stats = SimpleNamespace(waiting=2, waiting_remote_kv=1, running=4, kv_blocks_free=50,
                            queued_prompt_tokens=10)
    engine = SimpleNamespace(stats=lambda: stats, kv=kv, advertised=lambda: adv)
    # every node's engine is the engine (a decode node's remote prefill is its prompt source,
    # moed.engine.prompts); the gossip loop passes its KV manager and cost state
    lv = load_of(engine, PrefixDigest(), 8, kv=engine.kv, adv=engine.advertised())
    assert (lv.waiting, lv.running, lv.free_kv_blocks, lv.block_size) == (3, 4, 50, 4)
    assert lv.cost == (0.001235, 1e-5, 0.0, 0.0, 0.5)       # 4 digits, never negative
    assert lv.queued_tokens == (10, 0) and lv.prefill_share == 0.5
    assert len(lv.prefix_digest) == 3                          # depths 1, 2, 4 of 4 blocks
    unfitted = SimpleNamespace(stats=lambda: stats, kv=kv, advertised=lambda: None)
    assert load_of(unfitted, PrefixDigest(), 8, kv=unfitted.kv,
                   adv=unfitted.advertised()).cost == ()
