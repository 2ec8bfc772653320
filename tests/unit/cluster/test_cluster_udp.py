"""The protocol core over real UDP/TCP sockets on 127.0.0.1, in one event loop; the stream
frame's checks (header MAC, version, length, age, concurrency cap, read deadline)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time

from moed.cluster import wire
from moed.cluster.clock import AsyncioScheduler
from moed.cluster.members import SwimConfig
from moed.cluster.state import MemberState
from moed.cluster.swim import Membership
from moed.cluster.udp import UdpTransport
from moed.cluster.wire import Keyring, WireCodec

FAST = SwimConfig(probe_interval_s=0.2, probe_timeout_s=0.1, gossip_interval_s=0.05,
                  push_pull_interval_s=2.0, join_retry_s=0.2)
KEY = Keyring(os.urandom(32))


async def _node(name: str, seeds: tuple[str, ...] = ()) -> Membership:
    t = UdpTransport("127.0.0.1", 0, keyring=KEY)
    await t.start()
    m = Membership(name, t, AsyncioScheduler(), FAST, WireCodec(KEY), seeds=seeds)
    m.start()
    return m


async def _until(cond, timeout: float) -> bool:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


def _state(m: Membership, name: str) -> MemberState | None:
    info = m.view().get(name)
    return info.state if info else None


async def test_udp_cluster_join_bad_packets_crash_and_leave() -> None:
    seed = await _node("seed")
    nodes = [seed] + [await _node(f"n{i}", seeds=(seed.addr,)) for i in range(3)]
    try:
        assert await _until(lambda: all(len(m.view().alive()) == 4 for m in nodes), 5.0)

        # garbage at the seed's UDP port: dropped and counted, the loop keeps running
        host, port = seed.addr.split(":")
        good = wire.encode(KEY, "x", 0, [])
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for data in [os.urandom(100), good[:10], wire.encode(Keyring(b"w" * 32), "x", 1, []),
                         os.urandom(9000), b""]:
                s.sendto(data, (host, int(port)))
        # garbage on the push-pull stream port too: refused at its header, never decoded
        _, w = await asyncio.open_connection(host, int(port))
        w.write((50).to_bytes(4, "big") + os.urandom(50))
        await w.drain()
        w.close()
        assert await _until(lambda: seed.stats["dropped.truncated"] >= 2 and
                            seed.stats["dropped.auth"] >= 1 and
                            seed.stats["dropped.oversized"] >= 1 and
                            seed.stats["dropped.version"] + seed.stats["dropped.auth"] >= 2, 3.0)
        assert await _until(lambda: seed.transport.stats["stream_version"] == 1, 3.0)

        # kill -9 equivalent: stop without leaving
        nodes[3].stop()
        assert await _until(lambda: all(_state(m, "n2") is MemberState.DEAD
                                         for m in nodes[:3]), 10.0)
        # graceful leave: LEFT quickly, never dead
        nodes[2].leave()
        assert await _until(lambda: all(_state(m, "n1") is MemberState.LEFT
                                         for m in nodes[:2]), 1.0)
        assert seed.transport.stats["handler_errors"] == 0
    finally:
        for m in nodes:
            if not m._stopped:
                m.stop()



async def test_ephemeral_port_retries_when_the_tcp_twin_is_taken() -> None:
    """bind_port 0: if the UDP port picked has its TCP twin in use, start() picks again."""
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    busy = tcp.getsockname()[1]

    class ClashFirst(UdpTransport):
        picks: list[int] = []

        async def _bind(self) -> None:
            if not self.picks:   # first pick: the UDP twin of a busy TCP port
                loop = asyncio.get_running_loop()
                self._udp, _ = await loop.create_datagram_endpoint(
                    asyncio.DatagramProtocol, local_addr=("127.0.0.1", busy))
                self._port = busy
            else:
                await super()._bind()
            self.picks.append(self._port)

    t = ClashFirst("127.0.0.1", 0, keyring=KEY)
    try:
        await t.start()
        port = int(t.local_address().rsplit(":", 1)[1])
        assert t.picks[0] == busy and port != busy and len(t.picks) == 2
        _, w = await asyncio.open_connection("127.0.0.1", port)   # TCP push-pull listens there
        w.close()
    finally:
        t.shutdown()
        tcp.close()


# ---- stream frames ------------------------------------------------------------------------

async def _receiver(keyring: Keyring = KEY, **kw) -> tuple[UdpTransport, list[bytes]]:
    t = UdpTransport("127.0.0.1", 0, keyring=keyring, replay_window_s=60.0, **kw)
    got: list[bytes] = []
    t.set_handlers(lambda d, a: None, lambda d, a: got.append(d))
    await t.start()
    return t, got


async def _connect(t: UdpTransport) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = t.local_address().rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _send_raw(t: UdpTransport, data: bytes) -> None:
    """Write `data` on a fresh connection and wait for the receiver to close it."""
    r, w = await _connect(t)
    w.write(data)
    await w.drain()
    w.write_eof()
    with contextlib.suppress(ConnectionResetError):   # closed with our bytes still unread
        await asyncio.wait_for(r.read(), 3.0)
    w.close()


def _frame(payload: bytes, key: Keyring = KEY, length: int | None = None,
           age_s: float = 0.0) -> bytes:
    sent_ms = int((time.time() - age_s) * 1000)
    return wire.frame_header(key, len(payload) if length is None else length, sent_ms) + payload


async def test_stream_header_is_checked_before_the_payload_is_read() -> None:
    t, got = await _receiver()
    payload = os.urandom(300)
    try:
        await _send_raw(t, _frame(payload))
        assert got == [payload]
        bad_version = bytearray(_frame(payload))
        bad_version[0] = 2
        cases = {
            "stream_auth": _frame(payload, key=Keyring(b"w" * 32)),
            "stream_version": bytes(bad_version),
            "stream_oversized": _frame(payload, length=t.max_stream + 1),  # authentic, too big
            "stream_stale_time": _frame(payload, age_s=120.0),             # replayed too late
            "stream_truncated": _frame(payload)[:20],                      # header cut short
        }
        for reason, data in cases.items():
            await _send_raw(t, data)
            assert t.stats[reason] == 1, (reason, dict(t.stats))
        await _send_raw(t, _frame(payload)[:wire.FRAME_HEADER + 10])        # payload cut short
        assert t.stats["stream_truncated"] == 2
        assert got == [payload]                 # none of the refused ones was delivered

        # rotation: a header signed with the secondary key is accepted, and a rotated sender's
        # streams (its primary is our secondary) arrive through send_stream
        old, new = Keyring(b"o" * 32), Keyring(b"n" * 32, (b"o" * 32,))
        t.keyring = new
        await _send_raw(t, _frame(b"old-key", key=old))
        sender = UdpTransport("127.0.0.1", 0, keyring=old)
        await sender.start()
        try:
            sender.send_stream(t.local_address(), b"via-send-stream")
            assert await _until(lambda: len(got) == 3, 3.0)
        finally:
            sender.shutdown()
        assert got[1:] == [b"old-key", b"via-send-stream"]
    finally:
        t.shutdown()


async def test_inbound_streams_are_capped_and_each_has_a_read_deadline() -> None:
    t, got = await _receiver(max_inbound_streams=2, stream_timeout_s=0.5)
    try:
        slow = [await _connect(t) for _ in range(2)]    # a few header bytes, then silence
        for _, w in slow:
            w.write(b"\x01\x00")
            await w.drain()
        await asyncio.sleep(0.1)
        r, w = await _connect(t)                        # over the cap: closed at once
        assert await asyncio.wait_for(r.read(), 0.3) == b""
        w.close()
        assert t.stats["stream_busy"] == 1
        for r, w in slow:                               # the deadline closes the slow ones
            assert await asyncio.wait_for(r.read(), 2.0) == b""
            w.close()
        assert t.stats["stream_timeouts"] == 2
        await _send_raw(t, _frame(b"after"))            # and the slots are free again
        assert got == [b"after"]
    finally:
        t.shutdown()
