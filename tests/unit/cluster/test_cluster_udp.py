"""The protocol core over real UDP/TCP sockets on 127.0.0.1, in one event loop."""
from __future__ import annotations

import asyncio
import os
import socket

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
    t = UdpTransport("127.0.0.1", 0)
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
        # garbage on the push-pull stream port too
        _, w = await asyncio.open_connection(host, int(port))
        w.write((50).to_bytes(4, "big") + os.urandom(50))
        await w.drain()
        w.close()
        assert await _until(lambda: seed.stats["dropped.truncated"] >= 2 and
                            seed.stats["dropped.auth"] >= 1 and
                            seed.stats["dropped.oversized"] >= 1 and
                            seed.stats["dropped.version"] + seed.stats["dropped.auth"] >= 2, 3.0)
        assert await _until(lambda: seed.stats["dropped.auth"] + seed.stats["dropped.version"]
                            >= 3, 3.0)     # the stream one

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

    t = ClashFirst("127.0.0.1", 0)
    try:
        await t.start()
        port = int(t.local_address().rsplit(":", 1)[1])
        assert t.picks[0] == busy and port != busy and len(t.picks) == 2
        _, w = await asyncio.open_connection("127.0.0.1", port)   # TCP push-pull listens there
        w.close()
    finally:
        t.shutdown()
        tcp.close()
