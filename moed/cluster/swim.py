"""SWIM membership with Lifeguard refinements: the protocol core.

Driven entirely by a TimerScheduler and a Transport, so the daemon (asyncio + UDP) and the
simulator (virtual clock + in-memory network) run this same code. Single-threaded: every
entry point runs in the scheduler's thread of control; no locks.

Its parts, each sharing the core's member tables on purpose:
  ticks.Ticks        the probe, gossip, push-pull, load and join ticks;
  probe.Prober       the failure detector (a failed probe makes us suspect the member);
  suspicion.Suspicions  Lifeguard's suspicion timers (the suspect refutes by gossiping
                     alive with a higher incarnation);
  names.NameGuard    unique names (a duplicate is refused: NameTaken through `on_join`).
This module keeps the member table, sending, receiving and the message handlers.
Every handler opens with its incarnation guard; member states change only in _set_state.
"""
from __future__ import annotations

import random
from collections import Counter
from typing import Callable

import structlog

from . import policy, wire
from .broadcast import BroadcastQueue
from .clock import TimerScheduler
from .members import IndexedSet, Member, SwimConfig
from .names import NameGuard, NameTaken
from .probe import Prober
from .suspicion import Suspicions
from .ticks import Ticks
from .state import (ClusterView, Event, LoadVector, MemberEvent, MemberState, NodeMeta,
                    next_state)
from .transport import Transport
from .wire import Ack, Alive, Dead, IndirectPing, Load, Nack, Ping, PushPull, StateEntry, Suspect

Listener = Callable[[MemberEvent], None]
log = structlog.get_logger(__name__)


class Membership:
    def __init__(self, name: str, transport: Transport, scheduler: TimerScheduler,
                 config: SwimConfig, codec: wire.Codec, *, meta: NodeMeta = NodeMeta(),
                 incarnation: int = 1, seeds: tuple[str, ...] = (),
                 rng: random.Random | None = None) -> None:
        if not name or len(name) > wire.MAX_NAME:
            raise ValueError(f"node name must be 1..{wire.MAX_NAME} characters")
        self.name, self.cfg, self.codec = name, config, codec
        self.transport, self.sched = transport, scheduler
        self.addr = transport.local_address()
        self.seeds = tuple(s for s in seeds if s != self.addr)
        self.rng = rng or random.Random()
        self.stats: Counter[str] = Counter()
        self._members: dict[str, Member] = {}
        self._live = IndexedSet()            # alive + suspect, not self
        self._dead = IndexedSet()            # dead/left not yet reclaimed (gossiped to)
        self.prober = Prober(self)
        self.suspicions = Suspicions(self)
        self.names = NameGuard(self)
        self.ticks = Ticks(self)
        self._updates = BroadcastQueue()     # alive/suspect/dead: first claim on space
        self._loads = BroadcastQueue()       # load vectors: what space is left
        self._listeners: list[Listener] = []
        self._view: ClusterView | None = None
        self._version = 0
        self._overhead = wire.packet_overhead(name)
        self._leaving = self._stopped = False
        self._pending_load: LoadVector | None = None
        self._limit_n = self._limit = 0
        self._conflict_until = self._skew_logged_at = float("-inf")
        # the join outcome, once: None when a first state exchange merged, else NameTaken
        # (a refusal can still follow a first merge: another seed's answer)
        self.on_join: Callable[[NameTaken | None], None] = lambda err: None
        self._joined = False
        me = Member(name, self.addr, incarnation, meta, LoadVector(), scheduler.wall_ms(),
                    self._stamp())
        self._members[name] = me
        self._set_state(me, Event.ALIVE)
        self._check_meta_fits()
        self._handlers: dict[type, Callable] = {
            Ping: self.prober.on_ping, IndirectPing: self.prober.on_indirect_ping,
            Ack: self.prober.on_ack, Nack: self.prober.on_nack, Alive: self._on_alive,
            Suspect: self._on_suspect,
            Dead: self._on_dead, Load: self._on_load}

    # ---- public API ---------------------------------------------------------------------

    @property
    def awareness(self) -> int:
        """Lifeguard local health score (0 = healthy)."""
        return self.prober.awareness

    @property
    def incarnation(self) -> int:
        return self._members[self.name].incarnation

    def start(self) -> None:
        self.transport.set_handlers(self._on_packet, self._on_stream)
        self.ticks.start()

    def subscribe(self, fn: Listener) -> Callable[[], None]:
        self._listeners.append(fn)
        return lambda: self._listeners.remove(fn) if fn in self._listeners else None

    def view(self) -> ClusterView:
        if self._view is None:
            self._view = ClusterView.build(
                self.name, [m.info() for m in self._members.values()], self._version)
        return self._view

    def set_meta(self, meta: NodeMeta) -> None:
        """New metadata: bump our incarnation and gossip it (no restart anywhere)."""
        me = self._members[self.name]
        old = me.meta
        me.meta = meta
        try:
            self._check_meta_fits()
        except ValueError:
            me.meta = old
            raise
        me.incarnation += 1
        self._changed()
        self._broadcast_self()

    def set_load(self, load: LoadVector) -> None:
        """Latest load; it is gossiped at the next load tick if it changed."""
        self._pending_load = load

    def leave(self) -> None:
        """Announce departure: peers mark us LEFT at once instead of suspecting us."""
        if self._leaving:
            return
        self._leaving = True
        me = self._members[self.name]
        msg = Dead(self.name, me.incarnation, self.name)
        self._set_state(me, Event.LEAVE)
        self._updates.add(self.name, self.codec.fragment(msg))
        for name in self._live.sample(self.rng, self.cfg.leave_fanout):
            self._send(self._members[name].addr, [msg])

    def stop(self) -> None:
        self._stopped = True
        self.ticks.cancel_all()
        self.suspicions.cancel_all()
        self.transport.shutdown()

    def bootstrap(self, others: list[Alive]) -> None:
        """Simulation/test helper: know these members as if already converged (no gossip)."""
        for a in others:
            if a.name not in self._members:
                m = Member(a.name, a.addr, a.incarnation, a.meta, a.load, a.load_seq,
                           self._stamp())
                self._members[a.name] = m
                self._set_state(m, Event.ALIVE, notify=False)

    # ---- sending ------------------------------------------------------------------------

    def _send(self, addr: str, msgs: list, need_updates: bool = False) -> bool:
        """One packet: `msgs` plus as many queued updates, then loads, as fit."""
        frags = [self.codec.fragment(m) for m in msgs]
        budget = self.cfg.max_packet - self._overhead - sum(len(f) + 1 for f in frags)
        n = len(self._live) + 1
        if n != self._limit_n:                     # log10 per packet adds up in simulations
            self._limit_n, self._limit = n, policy.retransmit_limit(self.cfg.retransmit_mult, n)
        limit = self._limit
        extra = self._updates.take(budget, limit)
        budget -= sum(len(f) + 1 for f in extra)
        extra += self._loads.take(budget, limit)
        if need_updates and not extra:
            return False
        data = self.codec.encode(self.name, self.sched.wall_ms(), frags + extra)
        self.stats["sent_packets"] += 1
        self.stats["sent_bytes"] += len(data)
        self.transport.send_packet(addr, data)
        return True

    def _broadcast_self(self) -> None:
        me = self._members[self.name]
        self._updates.add(self.name, self.codec.fragment(self._alive_msg(me)))

    @staticmethod
    def _alive_msg(m: Member) -> Alive:
        return Alive(m.name, m.incarnation, m.addr, m.meta, m.load_seq, m.load)

    def _send_push_pull(self, addr: str, join: bool, reply: bool) -> None:
        states = tuple(StateEntry(m.name, m.incarnation, m.state, m.addr, m.meta, m.load_seq,
                                  m.load)
                       for m in self._members.values() if m.state is not None)
        msg = PushPull(join, reply, self.addr, states)
        data = self.codec.encode(self.name, self.sched.wall_ms(), [self.codec.fragment(msg)])
        self.stats["sent_streams"] += 1
        self.transport.send_stream(addr, data)

    # ---- receiving ----------------------------------------------------------------------

    def _decode(self, data: bytes, max_size: int) -> tuple[str, list] | None:
        try:
            sender, sent_ms, msgs = self.codec.decode(data, max_size)
        except wire.DecodeError as e:
            self.stats[f"dropped.{e.reason}"] += 1
            return None
        window = self.cfg.replay_window_s * 1000
        if window and abs(self.sched.wall_ms() - sent_ms) > window:
            self.stats["dropped.stale_time"] += 1
            now = self.sched.now()
            if now >= self._skew_logged_at + 60.0:    # a replay, or clocks that drifted apart
                self._skew_logged_at = now
                log.warning("cluster_packet_out_of_window", node=self.name, sender=sender,
                            skew_s=round((self.sched.wall_ms() - sent_ms) / 1000, 1))
            return None
        return sender, msgs

    def _on_packet(self, data: bytes, from_addr: str) -> None:
        if self._stopped:
            return
        got = self._decode(data, self.cfg.max_packet)
        if got is None:
            return
        sender, msgs = got
        if sender == self.name:                # no process sends to itself
            if from_addr != self.addr:
                self.names.conflict(self.name, self.addr, from_addr)
                # ...but a second process with our name may ask whether we live: answer
                # its ping, and take the answer to ours (see NameGuard.ask_holder); nothing else
                for msg in msgs:
                    if isinstance(msg, Ping):
                        self.prober.on_ping(msg)
                    elif isinstance(msg, Ack):
                        self.prober.on_ack(msg)
            return
        self.stats["recv_packets"] += 1
        for msg in msgs:
            handler = self._handlers.get(type(msg))
            if handler is None:                      # a PushPull inside a datagram
                self.stats["dropped.malformed"] += 1
                return
            handler(msg)

    def _on_stream(self, data: bytes, from_addr: str) -> None:
        if self._stopped:
            return
        got = self._decode(data, wire.MAX_STREAM)
        if got is None:
            return
        sender, msgs = got
        if len(msgs) != 1 or not isinstance(msgs[0], PushPull):
            self.stats["dropped.malformed"] += 1
            return
        pp = msgs[0]
        self.stats["recv_streams"] += 1
        if pp.join and pp.reply:                   # a seed's answer to our join
            holder = self.names.holder_of_our_name(pp.states)
            if holder is not None and holder.addr not in self.names.past_lives:
                self.names.ask_holder(sender, pp.source_addr, holder)
                return
            if holder is not None:                 # our previous life, already outranked
                pp = PushPull(pp.join, pp.reply, pp.source_addr,
                              tuple(e for e in pp.states if e.name != self.name))
        taken = self.names.claims_taken_name(sender, pp.source_addr)
        if not pp.reply and not self._leaving:     # (our state tells a duplicate it is one)
            self._send_push_pull(pp.source_addr, join=pp.join, reply=True)
        if taken:
            return
        self._merge(sender, pp.states)
        if not self._joined:
            self._joined = True
            self.on_join(None)

    def _merge(self, sender: str, states: tuple[StateEntry, ...]) -> None:
        for e in states:
            if e.state is MemberState.ALIVE:
                self._on_alive(Alive(e.name, e.incarnation, e.addr, e.meta, e.load_seq, e.load))
            elif e.state is MemberState.LEFT:
                self._on_dead(Dead(e.name, e.incarnation, e.name))
            else:    # someone else's dead is only a suspicion here: we may still reach it
                self._on_suspect(Suspect(e.name, e.incarnation, sender))
            m = self._members.get(e.name)
            if m is not None and e.name != self.name and e.load_seq > m.load_seq:
                m.load, m.load_seq = e.load, e.load_seq
                self._changed()

    # ---- handlers: each opens with its guard --------------------------------------------

    def _on_alive(self, msg: Alive) -> None:
        if msg.name == self.name:
            self._on_alive_self(msg)
            return
        m = self._members.get(msg.name)
        if m is not None and msg.incarnation <= m.incarnation:
            self.stats["stale_updates"] += 1
            return
        if m is None:
            m = Member(msg.name, msg.addr, msg.incarnation, msg.meta, msg.load,
                       msg.load_seq, self._stamp())
            self._members[msg.name] = m
            # new members join the probe round at a random place
            self.prober.add_member(msg.name)
        m.incarnation, m.addr, m.meta = msg.incarnation, msg.addr, msg.meta
        if msg.load_seq > m.load_seq:
            m.load, m.load_seq = msg.load, msg.load_seq
        self.suspicions.clear(msg.name)
        self._set_state(m, Event.ALIVE)
        self._updates.add(msg.name, self.codec.fragment(msg))

    def _on_alive_self(self, msg: Alive) -> None:
        """Refute what is said about us, unless we are leaving (then the name is free)."""
        me = self._members[self.name]
        if self._leaving:
            return
        if msg.addr in self.names.past_lives and msg.incarnation < me.incarnation:
            return                            # gossip about our outranked previous life
        if msg.addr != me.addr:
            # Another process with our name got into someone's view. Outrank it, at most once
            # per push-pull interval, so that the two of us cannot start an incarnation war.
            self.names.conflict(self.name, me.addr, msg.addr)
            now = self.sched.now()
            if msg.incarnation >= me.incarnation and now >= self._conflict_until:
                self._conflict_until = now + self.cfg.push_pull_interval_s
                self._refute(msg.incarnation)
            return
        if msg.incarnation > me.incarnation or (
                msg.incarnation == me.incarnation and msg.meta != me.meta):
            self._refute(msg.incarnation)     # our previous life on this address

    def _on_suspect(self, msg: Suspect) -> None:
        m = self._accused(msg)
        if m is None:
            return
        s = self.suspicions.get(msg.name)
        if m.state is MemberState.SUSPECT and s is not None:
            if s.confirm(msg.source):
                self.suspicions.rearm(msg.name, s)
                self._updates.add(msg.name, self.codec.fragment(msg))
            return
        m.incarnation = msg.incarnation
        n = len(self._live) + 1
        s = self.suspicions.open(msg.name, msg.incarnation, msg.source, n)
        self._set_state(m, Event.SUSPECT)
        self.suspicions.rearm(msg.name, s)
        self._updates.add(msg.name, self.codec.fragment(msg))
        self.suspicions.reprobe_soon(m, s, n)

    def _accused(self, msg: Suspect | Dead) -> Member | None:
        """Incarnation guard shared by suspect and dead: the member to act on, or None when the
        accusation is stale, the member is already gone, or it is about us (refuted here)."""
        m = self._members.get(msg.name)
        if m is None or msg.incarnation < m.incarnation:
            self.stats["stale_updates"] += 1 if m is not None else 0
            return None
        if m.state in (MemberState.DEAD, MemberState.LEFT):
            return None
        if msg.name == self.name:
            if not self._leaving:
                self._refute(msg.incarnation)
            return None
        return m

    def _on_dead(self, msg: Dead) -> None:
        m = self._accused(msg)
        if m is None:
            return
        m.incarnation = msg.incarnation
        self.suspicions.clear(msg.name)
        self._set_state(m, Event.LEAVE if msg.is_leave else Event.DEAD)
        self._updates.add(msg.name, self.codec.fragment(msg))

    def _on_load(self, msg: Load) -> None:
        m = self._members.get(msg.name)
        if m is None or msg.name == self.name or msg.load_seq <= m.load_seq:
            return
        m.load, m.load_seq = msg.load, msg.load_seq
        self._changed()
        self._loads.add(msg.name, self.codec.fragment(msg))

    # ---- refutation, state ----------------------------------------------------------------

    def _refute(self, incarnation: int) -> None:
        me = self._members[self.name]
        me.incarnation = max(me.incarnation, incarnation) + 1
        self.stats["refutes"] += 1
        self.prober.adjust(1)           # being suspected hints that we are the slow one
        self._changed()
        self._broadcast_self()

    def _check_meta_fits(self) -> None:
        frag = self.codec.fragment(self._alive_msg(self._members[self.name]))
        if len(frag) + 1 > self.cfg.max_packet - self._overhead - 64:
            raise ValueError(f"node metadata too large for a packet ({len(frag)} bytes)")

    def _set_state(self, m: Member, event: Event, notify: bool = True) -> bool:
        """The one place a member's state changes (transitions: state.next_state)."""
        new = next_state(m.state, event)
        if new is None:
            return False
        old, m.state, m.since = m.state, new, self._stamp()
        if m.name != self.name:
            if new in (MemberState.ALIVE, MemberState.SUSPECT):
                self._live.add(m.name)
                self._dead.discard(m.name)
            else:
                self._live.discard(m.name)
                self._dead.add(m.name)
                since = m.since
                self.sched.call_later(self.cfg.dead_reclaim_s,
                                      lambda: self._reclaim(m.name, since))
        self._changed()
        if notify and (old is not new or event is Event.ALIVE):
            ev = MemberEvent(m.name, old, new, m.incarnation, m.since)
            for fn in list(self._listeners):
                fn(ev)
        return True

    def _reclaim(self, name: str, since: float) -> None:
        m = self._members.get(name)
        if m is not None and m.since == since and m.state in (MemberState.DEAD,
                                                              MemberState.LEFT):
            del self._members[name]
            self._dead.discard(name)
            self._updates.discard(name)
            self._loads.discard(name)
            self._changed()

    def _stamp(self) -> float:
        """Wall-clock seconds for state changes (what /cluster shows)."""
        return self.sched.wall_ms() / 1000.0

    def _changed(self) -> None:
        self._view = None
        self._version += 1
