"""Real transport: UDP datagrams for probes and gossip, one-shot TCP streams for push-pull,
both on the same port number, both in the daemon's asyncio event loop.

Streams: one frame per connection (wire.frame_header, then the packet). A receiver reads the
fixed header and checks version, length, MAC and age before it reads the packet, so an
unauthenticated peer gets no more buffered than the stream reader's own small buffer, and an
authenticated one no more than it announced; at most `max_inbound_streams` are read at once
(more are closed at once), each within `stream_timeout_s`. Network errors and refused streams
are counted in `stats` (mirrored to moed_cluster_protocol_events), never raised into the
protocol.
"""
from __future__ import annotations

import asyncio
import time
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
    """`keyring` signs and checks stream headers and `replay_window_s` (0 = off) bounds their
    age: both are plain attributes, so a reload swaps them with the codec's."""

    def __init__(self, bind_host: str, bind_port: int, advertise_host: str = "", *,
                 keyring: wire.Keyring, replay_window_s: float = 0.0,
                 max_stream: int = wire.MAX_STREAM, stream_timeout_s: float = 5.0,
                 max_inbound_streams: int = 16) -> None:
        self.bind_host, self.bind_port = bind_host, bind_port
        self.advertise_host = advertise_host or bind_host
        self.keyring, self.replay_window_s = keyring, replay_window_s
        self.max_stream, self.stream_timeout_s = max_stream, stream_timeout_s
        self.max_inbound_streams = max_inbound_streams
        self._inbound = 0
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
        if len(data) > self.max_stream:          # the receiver would refuse it unread
            self.stats["stream_send_oversized"] += 1
            return
        writer = None
        try:
            host, port = split_addr(addr)
            async with asyncio.timeout(self.stream_timeout_s):
                _, writer = await asyncio.open_connection(host, port)
                writer.write(wire.frame_header(self.keyring, len(data), _now_ms()) + data)
                await writer.drain()
        except (OSError, ValueError, TimeoutError):
            self.stats["stream_send_errors"] += 1
        finally:
            if writer is not None:
                writer.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._inbound >= self.max_inbound_streams:
            self.stats["stream_busy"] += 1
            writer.close()
            return
        peer = writer.get_extra_info("peername") or ("?", 0)
        self._inbound += 1
        try:
            async with asyncio.timeout(self.stream_timeout_s):
                data = await self._read_frame(reader)
            if data is not None:
                self._deliver(data, f"{peer[0]}:{peer[1]}", stream=True)
        except asyncio.IncompleteReadError:
            self.stats["stream_truncated"] += 1
        except TimeoutError:
            self.stats["stream_timeouts"] += 1
        except OSError:
            self.stats["stream_recv_errors"] += 1
        finally:
            self._inbound -= 1
            writer.close()

    async def _read_frame(self, reader: asyncio.StreamReader) -> bytes | None:
        """The packet of one frame, or None when its header is refused (counted by reason)."""
        head = await reader.readexactly(wire.FRAME_HEADER)
        try:
            n = wire.check_frame_header(self.keyring, head, self.max_stream, _now_ms(),
                                        int(self.replay_window_s * 1000))
        except wire.DecodeError as e:
            self.stats[f"stream_{e.reason}"] += 1
            return None
        return await reader.readexactly(n)

    def shutdown(self) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()


def _now_ms() -> int:
    return int(time.time() * 1000)
