"""Real transport: UDP datagrams for probes and gossip, one-shot TCP streams for push-pull,
both on the same port number, both in the daemon's asyncio event loop.

Stream frame: 4-byte big-endian length, then the payload; one message per connection.
Network errors are counted in `stats`, never raised into the protocol.
"""
from __future__ import annotations

import asyncio
from collections import Counter

import structlog

from . import wire
from .transport import Handler, Transport

log = structlog.get_logger(__name__)


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{addr!r} is not host:port")
    return host.strip("[]"), int(port)


class _Datagrams(asyncio.DatagramProtocol):
    def __init__(self, owner: UdpTransport) -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.owner._deliver(data, f"{addr[0]}:{addr[1]}", stream=False)

    def error_received(self, exc: Exception) -> None:
        self.owner.stats["udp_errors"] += 1      # e.g. ICMP port unreachable from a dead peer


class UdpTransport(Transport):
    def __init__(self, bind_host: str, bind_port: int, advertise_host: str = "", *,
                 max_stream: int = wire.MAX_STREAM, stream_timeout_s: float = 5.0) -> None:
        self.bind_host, self.bind_port = bind_host, bind_port
        self.advertise_host = advertise_host or bind_host
        self.max_stream, self.stream_timeout_s = max_stream, stream_timeout_s
        self.stats: Counter[str] = Counter()
        self._udp: asyncio.DatagramTransport | None = None
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._on_packet: Handler = lambda d, a: None
        self._on_stream: Handler = lambda d, a: None
        self._port = bind_port

    async def start(self) -> None:
        # UDP and TCP share one port number. With bind_port 0 the kernel picks a free UDP
        # port whose TCP twin may be taken: pick again (bounded) rather than fail the node.
        attempts = 1 if self.bind_port else 20
        for attempt in range(attempts):
            await self._bind()
            try:
                self._server = await asyncio.start_server(self._accept, self.bind_host, self._port)
                return
            except OSError:
                self._udp.close()
                if attempt == attempts - 1:
                    raise
                log.debug("cluster_port_retry", port=self._port)

    async def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        self._udp, _ = await loop.create_datagram_endpoint(
            lambda: _Datagrams(self), local_addr=(self.bind_host, self.bind_port))
        self._port = self._udp.get_extra_info("sockname")[1]

    def local_address(self) -> str:
        return f"{self.advertise_host}:{self._port}"

    def set_handlers(self, on_packet: Handler, on_stream: Handler) -> None:
        self._on_packet, self._on_stream = on_packet, on_stream

    def _deliver(self, data: bytes, addr: str, stream: bool) -> None:
        try:
            (self._on_stream if stream else self._on_packet)(data, addr)
        except Exception:  # the protocol must never take the event loop down
            self.stats["handler_errors"] += 1
            log.exception("cluster_handler_error", peer=addr, stream=stream)

    def send_packet(self, addr: str, data: bytes) -> None:
        if self._udp is None or self._udp.is_closing():
            return
        try:
            self._udp.sendto(data, split_addr(addr))
        except (OSError, ValueError):
            self.stats["send_errors"] += 1

    def send_stream(self, addr: str, data: bytes) -> None:
        if self._udp is None or self._udp.is_closing():
            return
        task = asyncio.get_running_loop().create_task(self._send_stream(addr, data))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_stream(self, addr: str, data: bytes) -> None:
        writer = None
        try:
            host, port = split_addr(addr)
            async with asyncio.timeout(self.stream_timeout_s):
                _, writer = await asyncio.open_connection(host, port)
                writer.write(len(data).to_bytes(4, "big") + data)
                await writer.drain()
        except (OSError, ValueError, TimeoutError):
            self.stats["stream_send_errors"] += 1
        finally:
            if writer is not None:
                writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
        try:
            async with asyncio.timeout(self.stream_timeout_s):
                n = int.from_bytes(await reader.readexactly(4), "big")
                if n > self.max_stream:
                    self.stats["stream_oversized"] += 1
                    return
                data = await reader.readexactly(n)
            self._deliver(data, f"{peer[0]}:{peer[1]}", stream=True)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            self.stats["stream_recv_errors"] += 1
        finally:
            writer.close()

    def shutdown(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
