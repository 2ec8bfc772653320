"""KV events (moed/kvcache/events.py, publisher.py): the recorder turns the pool's and the tiers'
hooks into vLLM's events (a request's blocks as one chained BlockStored with their tokens,
evictions as BlockRemoved, per medium); the encoding decodes with vLLM's own struct
definitions (tests/vllm_kv_events.py); the ZMQ publisher sends [topic, seq, payload] from 0
and replays its buffer through the ROUTER socket, ending with seq -1."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from moed.config import KVEventsConfig  # noqa: E402
from moed.kvcache.events import (MEDIUM_DISK, MEDIUM_HOST, MEDIUM_L1, Cleared,  # noqa: E402
                                 KVEventRecorder, Removed, Stored, encode_batch, wire_hash)
from moed.kvcache.manager import KVCacheManager  # noqa: E402
from moed.kvcache.pool import hash_block  # noqa: E402
from moed.kvcache.publisher import ZmqPublisher, binds, offset_port  # noqa: E402
from moed.kvcache.tiers import TieredCache, TierSettings  # noqa: E402
from vllm_kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,  # noqa: E402
                            LegacyBatch, LegacyCleared, PrefixIndex, Subscriber, decode)

BS = 2


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def manager(n: int = 6) -> tuple[KVCacheManager, KVEventRecorder]:
    m = KVCacheManager(n, BS)
    rec = KVEventRecorder(BS)
    m.set_events(rec)
    return m, rec


def run(m: KVCacheManager, rid: str, toks: list[int]) -> None:
    m.allocate_prompt(rid, toks, m.prefix_hit(toks), len(toks))
    m.commit(rid, toks, len(toks))


def test_a_request_s_blocks_are_one_chained_store_with_their_tokens() -> None:
    m, rec = manager()
    toks = [1, 2, 3, 4, 5, 6, 7]
    run(m, "a", toks)
    h0 = hash_block(None, [1, 2])
    h1 = hash_block(h0, [3, 4])
    h2 = hash_block(h1, [5, 6])
    assert rec.drain() == [Stored((h0, h1, h2), None, (1, 2, 3, 4, 5, 6), MEDIUM_L1)]
    m.free("a")
    run(m, "b", toks)       # a prefix hit on every full block: nothing new is stored
    assert rec.drain() == []
    assert rec.held(MEDIUM_L1) == {h0, h1, h2}


def test_eviction_and_reset_are_removals() -> None:
    m, rec = manager(4)
    run(m, "a", [1, 2, 3, 4, 5, 6, 7])      # 4 blocks, 3 cached
    m.free("a")
    rec.drain()
    run(m, "b", [9, 9, 9])                  # reuses the least recently freed: block 0's tail
    evs = rec.drain()
    assert isinstance(evs[0], Removed) and evs[0].medium == MEDIUM_L1
    assert isinstance(evs[-1], Stored) and evs[-1].hashes == (hash_block(None, [9, 9]),)
    gone = set(evs[0].hashes)
    assert not gone & rec.held(MEDIUM_L1) and len(rec.held(MEDIUM_L1)) == 3 - len(gone) + 1
    before = rec.held(MEDIUM_L1)
    m.reset_prefix_cache()
    out = rec.drain()
    assert len(out) == 1 and isinstance(out[0], Removed) and set(out[0].hashes) == before
    assert rec.held(MEDIUM_L1) == set()


def test_wire_format_decodes_with_vllm_structs() -> None:
    h0 = (1 << 127) | 5                     # a 128-bit moed hash: its low 64 bits go out
    evs = [Cleared(), Stored((h0, 7), None, (1, 2, 3, 4), MEDIUM_L1),
           Stored((9,), 7, (), MEDIUM_DISK), Removed((h0,), MEDIUM_L1)]
    batch = decode(encode_batch(123.5, evs, BS, data_parallel_rank=2))
    assert batch.ts == 123.5 and batch.data_parallel_rank == 2
    c, s, d, r = batch.events
    assert isinstance(c, AllBlocksCleared)
    assert isinstance(s, BlockStored) and s.block_hashes == [5, 7] and s.parent_block_hash is None
    assert s.token_ids == [1, 2, 3, 4] and s.block_size == BS and s.medium == "GPU"
    assert s.lora_id is None and s.lora_name is None and s.group_idx == 0
    assert isinstance(d, BlockStored) and d.parent_block_hash == 7 and d.medium == "STORAGE"
    assert isinstance(r, BlockRemoved) and r.block_hashes == [5] and r.medium == "GPU"
    assert wire_hash(h0) == 5 and wire_hash((1 << 64) - 1) == (1 << 64) - 1


def test_array_format_decodes_with_the_legacy_array_structs() -> None:
    """event_format "array": what consumers written before vLLM's map encoding decode (the
    same structs with array_like=True; the oldest stop at medium, extra fields ignored)."""
    import msgspec

    evs = [Cleared(), Stored((3, 4), 2, (1, 2, 3, 4), MEDIUM_HOST), Removed((3,), MEDIUM_L1)]
    raw = encode_batch(1.0, evs, BS, event_format="array")
    b = msgspec.msgpack.decode(raw, type=LegacyBatch)
    c, st, r = b.events
    assert isinstance(c, LegacyCleared) and b.data_parallel_rank == 0
    assert (st.block_hashes, st.parent_block_hash, st.token_ids, st.block_size, st.medium) == \
        ([3, 4], 2, [1, 2, 3, 4], BS, "CPU")
    assert (r.block_hashes, r.medium) == ([3], "GPU")
    assert msgspec.msgpack.decode(raw)[1][1][7] is None      # lora_name, as vLLM 0.11 sent


def test_tiers_announce_with_the_tokens_l1_learnt(tmp_path: Path) -> None:
    class IO:
        block_bytes = 16

        def read(self, block_id: int) -> bytes:
            return bytes([block_id]) * 16

        def write(self, block_id: int, data: bytes) -> None:
            pass

    m, rec = manager(4)
    c = TieredCache(TierSettings(host_bytes=32, disk_bytes=1 << 20, disk_dir=str(tmp_path),
                                 calibrate=False), IO(), "gqa-events")
    c.on_change = rec.tier_changed
    m.set_tier_hooks(c.offer, c.on_cached)
    toks = [1, 2, 3, 4, 5, 6, 7]
    run(m, "a", toks)
    m.free("a")
    rec.drain()
    run(m, "b", [8, 8, 8, 8, 8, 8, 8])      # every block of "a" leaves L1 for host (2 fit)
    assert c.wait(10.0)
    c.collect()                              # the disk writes land (loop-thread apply)
    h0 = hash_block(None, [1, 2])
    held = rec.held(MEDIUM_HOST) | rec.held(MEDIUM_DISK)
    assert h0 in held and not rec.held(MEDIUM_L1) & {h0}
    stored = [e for e in rec.drain() if isinstance(e, Stored) and e.medium != MEDIUM_L1]
    assert stored and all(e.token_ids and len(e.token_ids) == BS * len(e.hashes)
                          for e in stored)
    assert {e.medium for e in stored} == {MEDIUM_HOST, MEDIUM_DISK}   # host overflowed to disk
    assert rec.held(MEDIUM_HOST) == {k for t, k in c.held() if t == "host"}
    assert rec.held(MEDIUM_DISK) == {k for t, k in c.held() if t == "disk"}
    c.close()


def test_endpoints_follow_vllm_rules() -> None:
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and not binds("tcp://10.0.0.1:5557")
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_port("inproc://kv", 1) == "inproc://kv_dp1"


def _wait_subscribed(pub: ZmqPublisher, sub: Subscriber) -> int:
    """PUB drops what it sends before the SUB's subscription arrives: send empty batches
    until one is seen; -> the next sequence number."""
    for _ in range(100):
        pub.publish([Cleared()])
        got = sub.recv(timeout=0.1)
        if got is not None:
            while (more := sub.recv(timeout=0.2)) is not None:
                got = more
            return got[1] + 1
    raise AssertionError("subscriber never received")


def test_publisher_sequence_topic_and_replay() -> None:
    port, rport = free_port(), free_port()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                         replay_endpoint=f"tcp://*:{rport}", topic="kv@n1", buffer_steps=50)
    pub = ZmqPublisher(cfg, BS)
    sub = Subscriber(f"tcp://127.0.0.1:{port}", "kv@n1", f"tcp://127.0.0.1:{rport}")
    try:
        nxt = _wait_subscribed(pub, sub)
        for i in range(3):
            pub.publish([Stored((i + 1,), None, (i, i), MEDIUM_L1)])
        got = [sub.recv() for _ in range(3)]
        assert [g[0] for g in got] == [b"kv@n1"] * 3
        assert [g[1] for g in got] == [nxt, nxt + 1, nxt + 2]
        assert [g[2].events[0].block_hashes for g in got] == [[1], [2], [3]]
        replayed = sub.replay(nxt + 1)
        assert [(t, s) for t, s, _ in replayed] == [(b"kv@n1", nxt + 1), (b"kv@n1", nxt + 2)]
        assert replayed[1][2].events[0].block_hashes == [3]
        idx = PrefixIndex()
        for _, _, batch in sub.replay(0):
            idx.apply("n1", batch)
        assert idx.blocks["n1"]["GPU"] == {1, 2, 3}
    finally:
        sub.close()
        pub.close()


def test_a_full_queue_drops_and_never_blocks() -> None:
    port = free_port()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}",
                         max_queue_size=1)
    pub = ZmqPublisher(cfg, BS)
    try:
        t0 = time.monotonic()
        for _ in range(200):
            pub.publish([Cleared()])
        assert time.monotonic() - t0 < 5.0       # a hang is the failure, not the speed
    finally:
        pub.close()


def test_a_taken_port_is_a_clear_error() -> None:
    port = free_port()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{port}")
    first = ZmqPublisher(cfg, BS)
    try:
        with pytest.raises(ValueError, match=f"cannot open tcp://\\*:{port}"):
            ZmqPublisher(cfg, BS)
    finally:
        first.close()


def test_blocks_read_from_a_peer_are_announced_without_tokens() -> None:
    m, rec = manager(6)
    ids = m.reserve(2)
    assert ids is not None
    assert m.adopt(ids, [101, 102]) == 2
    assert rec.drain() == [Stored((101, 102), None, (), MEDIUM_L1)]
    assert rec.held(MEDIUM_L1) == {101, 102}


def test_a_long_prompt_is_one_chained_event() -> None:
    m, rec = manager(5000)
    toks = list(range(2 * 4096 + 1))
    run(m, "long", toks)
    (ev,) = rec.drain()
    assert len(ev.hashes) == 4096 and ev.token_ids == tuple(toks[:8192]) and ev.parent is None
    assert rec.drain() == []
