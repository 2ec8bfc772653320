"""Failure detector half of the protocol core: SWIM probing with Lifeguard's local health.

One probe: ping the target; no ack within probe_timeout (x awareness) → ask
`indirect_checks` other members to ping it for us (they nack if it stays silent); still no
ack when the probe interval ends → the core suspects it. Missing nacks mean *we* are likely
the slow one: the awareness score rises and stretches our own timeouts and interval.

The Prober shares the core's member tables on purpose (it is the core's other half, not a
plugin); it only calls back into the core to send a packet and to suspect a member.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from . import policy, wire
from .members import Member
from .state import MemberState
from .wire import Ack, IndirectPing, Nack, Ping, Suspect

if TYPE_CHECKING:
    from .swim import Membership


class _Probe:
    __slots__ = ("target", "acked", "nacks", "expected_nacks", "on_done")

    def __init__(self, target: str, on_done: Callable[[bool], None] | None) -> None:
        self.target, self.acked, self.nacks, self.expected_nacks = target, False, 0, 0
        self.on_done = on_done         # instead of suspecting on failure


class _Relay:
    """An indirect ping we run on someone else's behalf."""
    __slots__ = ("seq", "source_addr", "nack")

    def __init__(self, seq: int, source_addr: str, nack: bool) -> None:
        self.seq, self.source_addr, self.nack = seq, source_addr, nack


class Prober:
    def __init__(self, core: Membership) -> None:
        self.core = core
        self.awareness = 0                       # Lifeguard local health: 0 = healthy
        self._pending: dict[int, _Probe | _Relay] = {}
        self._seq = 0
        self._order: list[str] = []
        self._idx = 0

    def interval(self) -> float:
        return policy.awareness_scale(self.awareness, self.core.cfg.probe_interval_s)

    def tick(self) -> None:
        """Probe the next member round-robin (a fresh shuffle each round)."""
        target = self._next_target()
        if target is not None:
            self.probe(target)

    def add_member(self, name: str) -> None:
        """New members join the current round at a random place."""
        self._order.insert(self.core.rng.randint(self._idx, len(self._order)), name)

    def adjust(self, delta: int) -> None:
        self.awareness = policy.awareness_apply(self.awareness, delta,
                                                self.core.cfg.awareness_max)

    def probe(self, m: Member, on_done: Callable[[bool], None] | None = None) -> None:
        """One probe of `m`; on failure the core suspects it, unless `on_done` is given
        (it then gets True/False instead)."""
        core = self.core
        seq = self._next_seq()
        probe = _Probe(m.name, on_done)
        self._pending[seq] = probe
        core._send(m.addr, [Ping(seq, m.name, core.name, core.addr)])
        timeout = policy.awareness_scale(self.awareness, core.cfg.probe_timeout_s)
        core.sched.call_later(timeout, lambda: self._indirect(seq, probe, m))
        core.sched.call_later(self.interval(), lambda: self._end(seq, probe))

    # ---- handlers ------------------------------------------------------------------------

    def on_ping(self, msg: Ping) -> None:
        core = self.core
        if msg.target != core.name:                  # an old address reused by someone else
            core.stats["dropped.wrong_target"] += 1
            return
        core._send(msg.source_addr, [Ack(msg.seq)])

    def on_indirect_ping(self, msg: IndirectPing) -> None:
        core = self.core
        seq = self._next_seq()
        relay = _Relay(msg.seq, msg.source_addr, msg.nack)
        self._pending[seq] = relay
        core._send(msg.target_addr, [Ping(seq, msg.target, core.name, core.addr)])

        def expire() -> None:
            if self._pending.pop(seq, None) is not None and relay.nack and not core._stopped:
                core._send(relay.source_addr, [Nack(relay.seq)])
        core.sched.call_later(core.cfg.probe_timeout_s, expire)

    def on_ack(self, msg: Ack) -> None:
        p = self._pending.get(msg.seq)
        if isinstance(p, _Probe):
            p.acked = True
        elif isinstance(p, _Relay):
            del self._pending[msg.seq]
            self.core._send(p.source_addr, [Ack(p.seq)])

    def on_nack(self, msg: Nack) -> None:
        p = self._pending.get(msg.seq)
        if isinstance(p, _Probe):
            p.nacks += 1

    # ---- internals -----------------------------------------------------------------------

    def _next_target(self) -> Member | None:
        live = self.core._live
        for _ in range(2):
            while self._idx < len(self._order):
                name = self._order[self._idx]
                self._idx += 1
                if name in live:
                    return self.core._members[name]
            self._order = list(live)
            self.core.rng.shuffle(self._order)
            self._idx = 0
        return None

    def _indirect(self, seq: int, probe: _Probe, m: Member) -> None:
        core = self.core
        if probe.acked or core._stopped:
            return
        helpers = core._live.sample(core.rng, core.cfg.indirect_checks, exclude=(m.name,))
        probe.expected_nacks = len(helpers)
        msg = IndirectPing(seq, m.name, m.addr, core.name, core.addr, True)
        for h in helpers:
            core._send(core._members[h].addr, [msg])

    def _end(self, seq: int, probe: _Probe) -> None:
        core = self.core
        self._pending.pop(seq, None)
        if core._stopped:
            return
        if probe.acked:
            self.adjust(-1)
        else:
            core.stats["probe_failures"] += 1
            self.adjust(policy.probe_failure_delta(probe.expected_nacks, probe.nacks))
        if probe.on_done is not None:
            probe.on_done(probe.acked)
        elif not probe.acked:
            m = core._members.get(probe.target)
            if m is not None and m.state in (MemberState.ALIVE, MemberState.SUSPECT):
                core._on_suspect(Suspect(m.name, m.incarnation, core.name))

    def _next_seq(self) -> int:
        self._seq = (self._seq + 1) & wire.MAX_INT
        return self._seq
