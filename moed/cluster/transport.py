"""Transport: how membership bytes move. Small interface, a real UDP/TCP implementation
(udp.py) and an in-memory twin here with controllable loss, delay and partitions.

Packets are best-effort datagrams (probes, acks, gossip); streams are reliable, larger,
one-shot messages (push-pull state). Both are delivered to handlers the protocol installs.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import Counter
from typing import Callable

from .clock import TimerScheduler

Handler = Callable[[bytes, str], None]      # (data, from_addr)


class Transport(ABC):
    @abstractmethod
    def local_address(self) -> str:
        """host:port that peers should send to."""

    @abstractmethod
    def set_handlers(self, on_packet: Handler, on_stream: Handler) -> None:
        """Receive packets and streams; handlers run in the protocol's thread of control."""

    @abstractmethod
    def send_packet(self, addr: str, data: bytes) -> None:
        """Best effort, never blocks, never raises for network errors."""

    @abstractmethod
    def send_stream(self, addr: str, data: bytes) -> None:
        """Reliable delivery attempt in the background (failures are counted, not raised)."""

    @abstractmethod
    def shutdown(self) -> None: ...


class InMemoryNetwork:
    """A simulated network on a TimerScheduler: every packet may be lost (loss), arrives after a
    random delay in [delay_min, delay_max], and never crosses a partition. Deterministic for
    a given seed."""

    def __init__(self, scheduler: TimerScheduler, *, loss: float = 0.0,
                 delay: tuple[float, float] = (0.0005, 0.002), seed: int = 0) -> None:
        self.scheduler = scheduler
        self.loss = loss
        self.delay = delay
        self.rng = random.Random(seed)
        self._nodes: dict[str, InMemoryTransport] = {}
        self._group: dict[str, int] = {}         # addr -> partition id (absent: 0)
        self.stats: Counter[str] = Counter()

    def attach(self, addr: str) -> InMemoryTransport:
        if addr in self._nodes:
            raise ValueError(f"address {addr} already in use")
        t = InMemoryTransport(self, addr)
        self._nodes[addr] = t
        return t

    def detach(self, addr: str) -> None:
        self._nodes.pop(addr, None)

    def partition(self, *groups: list[str]) -> None:
        """Split the network: addresses in different groups cannot talk; unlisted -> group 0."""
        self._group = {a: i + 1 for i, g in enumerate(groups) for a in g}

    def heal(self) -> None:
        self._group = {}

    def _deliver(self, src: str, dst: str, data: bytes, stream: bool) -> None:
        self.stats["packets" if not stream else "streams"] += 1
        self.stats["bytes"] += len(data)
        if self._group.get(src, 0) != self._group.get(dst, 0):
            self.stats["partitioned"] += 1
            return
        if not stream and self.loss and self.rng.random() < self.loss:
            self.stats["lost"] += 1
            return
        lo, hi = self.delay
        d = lo + (hi - lo) * self.rng.random()
        if stream:
            d *= 3                                  # connection setup

        def arrive() -> None:
            node = self._nodes.get(dst)
            if node is None or node.on_packet is None:
                self.stats["unreachable"] += 1
                return
            (node.on_stream if stream else node.on_packet)(data, src)
        self.scheduler.call_later(d, arrive)


class InMemoryTransport(Transport):
    def __init__(self, net: InMemoryNetwork, addr: str) -> None:
        self.net = net
        self.addr = addr
        self.on_packet: Handler | None = None
        self.on_stream: Handler = lambda d, a: None
        self.closed = False

    def local_address(self) -> str:
        return self.addr

    def set_handlers(self, on_packet: Handler, on_stream: Handler) -> None:
        self.on_packet, self.on_stream = on_packet, on_stream

    def send_packet(self, addr: str, data: bytes) -> None:
        if not self.closed:
            self.net._deliver(self.addr, addr, data, stream=False)

    def send_stream(self, addr: str, data: bytes) -> None:
        if not self.closed:
            self.net._deliver(self.addr, addr, data, stream=True)

    def shutdown(self) -> None:
        self.closed = True
        self.net.detach(self.addr)
