"""Discrete-event simulation of a cluster: N protocol cores (the real swim.Membership) on a
virtual clock and an in-memory network with loss, delay and partitions. Used by the tests
and bench/membership.py; one process, deterministic for a seed."""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from .clock import SimScheduler
from .members import SwimConfig
from .state import MemberEvent, MemberState, NodeMeta
from .swim import Membership
from .transport import InMemoryNetwork
from . import wire
from .wire import Alive, Keyring


class _Frag:
    """A message plus its real encoded size (so packets fill exactly as on the wire)."""
    __slots__ = ("msg", "size")

    def __init__(self, msg: wire.Message) -> None:
        self.msg, self.size = msg, len(wire.fragment(msg))

    def __len__(self) -> int:
        return self.size


class _Payload:
    __slots__ = ("sender", "sent_ms", "msgs", "size")

    def __init__(self, sender: str, sent_ms: int, msgs: list, size: int) -> None:
        self.sender, self.sent_ms, self.msgs, self.size = sender, sent_ms, msgs, size

    def __len__(self) -> int:
        return self.size


class ObjectCodec(wire.Codec):
    """Simulation codec: hands message objects across the in-memory network instead of
    signed bytes (same sizes and limits; the byte codec is tested on its own). It makes
    long, large simulations several times cheaper; the protocol code is unchanged."""

    def fragment(self, m: wire.Message) -> _Frag:  # type: ignore[override]
        return _Frag(m)

    def __init__(self) -> None:
        self._overhead: dict[str, int] = {}

    def encode(self, sender: str, sent_at_ms: int, fragments: list) -> _Payload:  # type: ignore[override]
        over = self._overhead.get(sender)
        if over is None:
            over = self._overhead[sender] = wire.packet_overhead(sender)
        size = over + sum(f.size + 1 for f in fragments)
        return _Payload(sender, sent_at_ms, [f.msg for f in fragments], size)

    def decode(self, data, max_size: int) -> tuple[str, int, list[wire.Message]]:
        if not isinstance(data, _Payload):
            raise wire.DecodeError("malformed", "not a simulated payload")
        if data.size > max_size:
            raise wire.DecodeError("oversized", f"{data.size} > {max_size}")
        return data.sender, data.sent_ms, data.msgs


@dataclass
class Trial:
    """One crash: when it happened, and when each survivor first marked the node dead."""
    name: str
    crashed_at: float
    detected: dict[str, float] = field(default_factory=dict)

    def time_to_all(self, observers: int) -> float | None:
        if len(self.detected) < observers:
            return None
        return max(self.detected.values()) - self.crashed_at

    def time_to_first(self) -> float | None:
        return min(self.detected.values()) - self.crashed_at if self.detected else None


class Simulation:
    def __init__(self, n: int, config: SwimConfig = SwimConfig(), *, loss: float = 0.0,
                 delay: tuple[float, float] = (0.0005, 0.002), seed: int = 0,
                 keyring: Keyring | None = None, converged: bool = True,
                 codec: str = "wire") -> None:
        """codec="wire": signed bytes as on the network; "object": skip the bytes."""
        self.cfg = config
        self.sched = SimScheduler()
        self.net = InMemoryNetwork(self.sched, loss=loss, delay=delay, seed=seed)
        self.keyring = keyring or Keyring(b"sim-key")
        self.codec: wire.Codec = (ObjectCodec() if codec == "object"
                                  else wire.WireCodec(self.keyring))
        self.rng = random.Random(seed)
        self.nodes: dict[str, Membership] = {}
        self.crashed: set[str] = set()
        self.false_deaths: list[tuple[float, str, str]] = []   # (t, observer, victim)
        self.trials: list[Trial] = []
        self._next_addr = 0
        for i in range(n):
            self.add(f"n{i:04d}", seeds=() if converged or i == 0 else (self.addr_of(0),))
        if converged:
            alive = [Alive(m.name, m.incarnation, m.addr, NodeMeta(), 0, m.view().get(m.name).load)
                     for m in self.nodes.values()]
            for m in self.nodes.values():
                m.bootstrap(alive)
        for m in self.nodes.values():
            m.start()

    @staticmethod
    def addr_of(i: int) -> str:
        return f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}:7946"

    def add(self, name: str, seeds: tuple[str, ...] = (), incarnation: int = 1,
            start: bool = False, addr: str | None = None,
            keyring: Keyring | None = None) -> Membership:
        """A new node (a restart when `name` crashed before: it gets a new address)."""
        if addr is None:
            addr = self.addr_of(self._next_addr)
            self._next_addr += 1
        codec = wire.WireCodec(keyring) if keyring is not None else self.codec
        self.crashed.discard(name)
        core = Membership(name, self.net.attach(addr), self.sched, self.cfg, codec,
                          incarnation=incarnation, seeds=seeds,
                          rng=random.Random(self.rng.random()))
        core.subscribe(lambda ev, obs=name: self._on_event(obs, ev))
        self.nodes[name] = core
        if start:
            core.start()
        return core

    def _on_event(self, observer: str, ev: MemberEvent) -> None:
        if ev.new is not MemberState.DEAD:
            return
        if ev.name not in self.crashed:
            self.false_deaths.append((self.sched.now(), observer, ev.name))
        for t in self.trials:
            if t.name == ev.name and observer not in t.detected:
                t.detected[observer] = self.sched.now()

    def run(self, seconds: float, until=None) -> float:
        return self.sched.run_for(seconds, until)

    def live(self) -> list[Membership]:
        return [m for name, m in self.nodes.items() if name not in self.crashed]

    def crash(self, name: str) -> Trial:
        """Kill a node without a word (kill -9): it stops answering and sending."""
        self.crashed.add(name)
        self.nodes[name].stop()
        trial = Trial(name, self.sched.now())
        self.trials.append(trial)
        return trial

    def everyone_sees(self, name: str, states: tuple[MemberState, ...]) -> bool:
        for m in self.live():
            if m.name == name:
                continue
            info = m.view().get(name)
            if info is None or info.state not in states:
                return False
        return True

    def converged(self) -> bool:
        """Every live node sees every other live node alive."""
        names = {m.name for m in self.live()}
        for m in self.live():
            alive = {i.name for i in m.view().alive()}
            if not names <= alive:
                return False
        return True

    def messages(self) -> tuple[int, int]:
        """(packets, streams) sent by all nodes so far."""
        return (sum(m.stats["sent_packets"] for m in self.nodes.values()),
                sum(m.stats["sent_streams"] for m in self.nodes.values()))


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
