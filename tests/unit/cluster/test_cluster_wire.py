"""Wire codec: round trips, authentication, key rotation, and fuzzing the decoder."""
from __future__ import annotations

import dataclasses

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moed.cluster import wire
from moed.cluster.state import LoadVector, MemberState, NodeMeta
from moed.cluster.wire import (Ack, Alive, Dead, DecodeError, IndirectPing, Keyring, Load, Nack,
                               Ping, PushPull, StateEntry, Suspect)

KEY = Keyring(b"k" * 32)
META = NodeMeta("decode", "http://10.0.0.1:8000", "qwen3-moe", "ab12", "10.0.0.1:9000")
LOAD = LoadVector(1, 2, 300, 4000)
MESSAGES = [
    Ping(1, "n1", "n0", "10.0.0.1:7946"), IndirectPing(2, "n2", "10.0.0.2:7946", "n0", "a:1", True),
    Ack(3), Nack(4), Alive("n1", 7, "10.0.0.2:7946", META, 12, LOAD), Suspect("n1", 7, "n0"),
    Dead("n1", 8, "n1"), Load("n1", 13, LOAD),
]


def _pack(msgs, key: Keyring = KEY, sender: str = "n0", ts: int = 1000) -> bytes:
    return wire.encode(key, sender, ts, [wire.fragment(m) for m in msgs])


def test_round_trip_every_message() -> None:
    data = _pack(MESSAGES)
    sender, ts, got = wire.decode(KEY, data, wire.MAX_PACKET)
    assert (sender, ts, got) == ("n0", 1000, MESSAGES)
    assert Dead("n1", 8, "n1").is_leave and not Dead("n1", 8, "n0").is_leave


def test_push_pull_round_trip() -> None:
    entry = StateEntry("n1", 5, MemberState.SUSPECT, "a:1", META, 3, LOAD)
    pp = PushPull(True, False, "a:2", (entry,) * 3)
    data = wire.encode(KEY, "n0", 5, [wire.fragment(pp)])
    assert wire.decode(KEY, data, wire.MAX_STREAM)[2] == [pp]


def test_wrong_key_and_rotation() -> None:
    data = _pack(MESSAGES[:2])
    with pytest.raises(DecodeError) as e:
        wire.decode(Keyring(b"x" * 32), data, wire.MAX_PACKET)
    assert e.value.reason == "auth"
    rotating = Keyring(b"new" * 11, (b"k" * 32,))       # new primary, old accepted
    assert wire.decode(rotating, data, wire.MAX_PACKET)[2] == MESSAGES[:2]
    signed_new = _pack(MESSAGES[:1], key=rotating)
    with pytest.raises(DecodeError):                    # a node without the new key refuses it
        wire.decode(KEY, signed_new, wire.MAX_PACKET)
    with pytest.raises(DecodeError):                    # insecure never mixes with keyed
        wire.decode(Keyring.insecure(), data, wire.MAX_PACKET)


@pytest.mark.parametrize("mangle,reason", [
    (lambda d: d[:10], "truncated"),
    (lambda d: b"", "truncated"),
    (lambda d: b"\x02" + d[1:], "version"),
    (lambda d: d + b"x" * 2000, "oversized"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "auth"),
    (lambda d: d[:5] + b"X" + d[6:], "auth"),
])
def test_bad_packets_have_reasons(mangle, reason) -> None:
    with pytest.raises(DecodeError) as e:
        wire.decode(KEY, mangle(_pack(MESSAGES[:3])), wire.MAX_PACKET)
    assert e.value.reason == reason


def _signed_body(body: bytes) -> bytes:
    data = bytes([wire.VERSION]) + body
    return data + KEY.sign(data)


@pytest.mark.parametrize("body", [
    b"not json", b"[]", b'["n0",1]', b'["n0",-1,[]]', b'["",1,[]]', b'["n0",1,{}]',
    b'["n0",1,[[""]]]', b'["n0",1,[[7,1]]]', b'["n0",1,[["a"]]]', b'["n0",1,[["a",1.5]]]',
    b'["n0",1,[["a",true]]]', b'["n0",1,[["S","n1",1]]]', b'["n0",1,[["a",99999999999999999999999]]]',
    b'["n0",1,[["A","n1",1,"a",["r","h","m","l"],1,[1,2,3,4]]]]',
    b'["n0",1,[["S","n1",1,"' + b"x" * 300 + b'"]]]',
    b"[" * 5000 + b"]" * 5000, b'["\xff\xfe",1,[]]',
])
def test_well_signed_garbage_is_malformed(body: bytes) -> None:
    """Even with a valid MAC (a buggy or compromised peer) the decoder only says no."""
    with pytest.raises(DecodeError) as e:
        wire.decode(KEY, _signed_body(body), wire.MAX_STREAM)
    assert e.value.reason == "malformed"


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=1600))
def test_fuzz_random_bytes_never_crash(data: bytes) -> None:
    with pytest.raises(DecodeError):
        wire.decode(KEY, data, wire.MAX_PACKET)


@settings(max_examples=1000, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 255), st.integers(0, 64))
def test_fuzz_mutated_valid_packets_are_rejected(pos: int, byte: int, cut: int) -> None:
    data = bytearray(_pack(MESSAGES))
    pos %= len(data)
    if data[pos] == byte:
        return
    data[pos] = byte
    with pytest.raises(DecodeError):
        wire.decode(KEY, bytes(data[:len(data) - cut]), wire.MAX_PACKET)


_ODD_VALUES = [None, True, False, -1, 0, 1, 2**63, 2**64, 1.5, float("nan"), "", "x" * 300,
               "\u0000", [], [1], {}, {"a": 1}, [[[]]], "alive", "n1"]


def test_fuzz_signed_mutations_of_every_message_decode_or_raise_decode_error() -> None:
    """5,000 well-signed bodies made by mutating real messages field by field: each either
    decodes to a well-typed message or raises DecodeError("malformed") -- nothing else."""
    import random
    rng = random.Random(1234)
    entry = StateEntry("n1", 5, MemberState.ALIVE, "a:1", META, 3, LOAD)
    seeds = [wire.to_fields(m) for m in MESSAGES + [PushPull(False, True, "a:1", (entry,))]]
    decoded = rejected = 0
    for _ in range(5000):
        f = json.loads(json.dumps(rng.choice(seeds)))
        for _ in range(rng.randint(1, 3)):
            op = rng.random()
            target = f
            if len(f) > 1 and rng.random() < 0.3:           # sometimes go one level deeper
                inner = rng.choice(f[1:])
                if isinstance(inner, list) and inner:
                    target = inner
            i = rng.randrange(len(target)) if target else 0
            if op < 0.6 and target:
                target[i] = rng.choice(_ODD_VALUES)
            elif op < 0.8 and target:
                del target[i]
            else:
                target.insert(i, rng.choice(_ODD_VALUES))
        body = json.dumps(["n0", 1, [f]]).encode()
        try:
            _, _, msgs = wire.decode(KEY, _signed_body(body), wire.MAX_STREAM)
        except DecodeError as e:
            assert e.reason == "malformed"
            rejected += 1
        else:
            # one message, or none when a mutation made its tag one this release does not know
            assert len(msgs) <= 1
            assert all(type(m) in {type(x) for x in MESSAGES} | {PushPull} for m in msgs)
            decoded += 1
    assert rejected > 2000 and decoded > 500    # the mutations did reach both outcomes


def test_stream_frame_header() -> None:
    head = wire.frame_header(KEY, 1234, 50_000)
    assert len(head) == wire.FRAME_HEADER
    assert wire.check_frame_header(KEY, head, wire.MAX_STREAM, 50_000, 0) == 1234
    rotating = Keyring(b"new" * 11, (b"k" * 32,))        # signed with the secondary: accepted
    assert wire.check_frame_header(rotating, head, wire.MAX_STREAM, 60_000, 20_000) == 1234
    insecure = wire.frame_header(Keyring.insecure(), 10, 0)
    assert wire.check_frame_header(Keyring.insecure(), insecure, 10, 0, 0) == 10
    cases = [
        (head[:-1], KEY, wire.MAX_STREAM, 0, "truncated"),
        (b"\x02" + head[1:], KEY, wire.MAX_STREAM, 0, "version"),
        (head, KEY, 1233, 0, "oversized"),
        (head[:-1] + bytes([head[-1] ^ 1]), KEY, wire.MAX_STREAM, 0, "auth"),
        (head, Keyring(b"x" * 32), wire.MAX_STREAM, 0, "auth"),
        (insecure, KEY, wire.MAX_STREAM, 0, "auth"),       # insecure never mixes with keyed
        (head, KEY, wire.MAX_STREAM, 10_000, "stale_time"),  # 40 s old, 10 s window
    ]
    for data, ring, limit, window, reason in cases:
        with pytest.raises(DecodeError) as e:
            wire.check_frame_header(ring, data, limit, 90_000 if window else 50_000, window)
        assert e.value.reason == reason


# ---- mixed versions: this release and the next gossip with each other -------------------

def _next_release(fields: list) -> list:
    """What a later release might send: one more field at the end of every message, of
    NodeMeta and LoadVector lists inside it, and a message type we do not know."""
    out = list(fields)
    for i, v in enumerate(out):
        if isinstance(v, list) and v and all(isinstance(x, str) for x in v) and \
                len(v) == len(dataclasses.fields(NodeMeta)):
            out[i] = v + ["kv=mla-v2"]                    # NodeMeta grew a field
        elif isinstance(v, list) and len(v) == 4 and all(isinstance(x, int) for x in v):
            out[i] = v + [12345]                          # LoadVector grew a field
    if out[0] == "P":                                     # push-pull: its state entries too
        out[4] = [_next_release(["e", *e])[1:] + [{"zone": "b"}] for e in out[4]]
    return out + [{"new": "field"}]


def test_next_release_packets_decode_here_with_new_fields_ignored() -> None:
    entry = StateEntry("n1", 5, MemberState.ALIVE, "a:1", META, 3, LOAD)
    msgs = MESSAGES + [PushPull(True, False, "a:1", (entry,))]
    frags = [json.dumps(_next_release(wire.to_fields(m))).encode() for m in msgs]
    frags.insert(2, b'["X",1,"a brand-new message"]')     # unknown tag: skipped
    packet = wire.encode(KEY, "n0", 1, frags)
    sender, _, got = wire.decode(KEY, packet, wire.MAX_STREAM)
    assert sender == "n0" and got == msgs                  # exactly what we know, no more


def test_todays_packets_still_decode() -> None:
    """The records as the release before this one wrote them (exactly 5 meta strings, 4 load
    ints) decode; and a record with only its version-1 fields gets defaults for newer ones."""
    old = b'["n0",7,[["A","n1",3,"h:1",["decode","http://x","m","lay","ag"],2,[1,2,3,4]]]]'
    _, _, got = wire.decode(KEY, _signed_body(old), wire.MAX_PACKET)
    assert got == [Alive("n1", 3, "h:1", NodeMeta("decode", "http://x", "m", "lay", "ag"), 2,
                         LoadVector(1, 2, 3, 4))]

    @dataclasses.dataclass(frozen=True)
    class GrownLoad:                    # a later LoadVector with one more field
        waiting: int = 0
        running: int = 0
        free_kv_blocks: int = 0
        queued_prefill_tokens: int = 0
        queued_seconds: int = 0
    assert wire.record([1, 2, 3, 4], GrownLoad, 4, int) == GrownLoad(1, 2, 3, 4, 0)
    with pytest.raises(DecodeError):
        wire.record([1, 2, 3], GrownLoad, 4, int)        # fewer than version 1 had


def test_nodes_of_two_releases_converge() -> None:
    """Two members on the in-memory network, one encoding like the next release: each sees
    the other alive with the right metadata and load."""
    from moed.cluster.clock import SimScheduler
    from moed.cluster.members import SwimConfig
    from moed.cluster.swim import Membership
    from moed.cluster.transport import InMemoryNetwork

    class NextCodec(wire.WireCodec):
        def fragment(self, m):
            return json.dumps(_next_release(wire.to_fields(m))).encode()

    sched = SimScheduler()
    net = InMemoryNetwork(sched)
    a = Membership("old", net.attach("a:1"), sched, SwimConfig(), wire.WireCodec(KEY),
                   meta=NodeMeta("prefill", "http://a", "m", "L1", "agent-a"))
    b = Membership("new", net.attach("b:1"), sched, SwimConfig(), NextCodec(KEY),
                   meta=NodeMeta("decode", "http://b", "m", "L1", "agent-b"), seeds=("a:1",))
    a.start()
    b.start()
    b.set_load(LoadVector(waiting=3, running=4))
    sched.run_for(10.0)
    va, vb = a.view(), b.view()
    assert va.get("new").state is MemberState.ALIVE and vb.get("old").state is MemberState.ALIVE
    assert va.get("new").meta == NodeMeta("decode", "http://b", "m", "L1", "agent-b")
    assert vb.get("old").meta == NodeMeta("prefill", "http://a", "m", "L1", "agent-a")
    assert va.get("new").load.running == 4
    assert a.stats.get("dropped.malformed", 0) == 0 and b.stats.get("dropped.malformed", 0) == 0
    a.stop()
    b.stop()
