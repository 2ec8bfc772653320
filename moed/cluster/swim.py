"""SWIM membership with Lifeguard refinements: the protocol core.

Driven entirely by a TimerScheduler and a Transport, so the daemon (asyncio + UDP) and the
simulator (virtual clock + in-memory network) run this same code. Single-threaded: every
entry point runs in the scheduler's thread of control; no locks.

Cycle of one node:
  probe tick (every probe_interval * awareness): see probe.Prober; a failed probe makes us
  suspect the member.
  gossip tick: send queued updates to `gossip_nodes` random members. Updates also ride on
  every ping and ack, each at most retransmit_mult * ceil(log10(n+1)) times.
  push-pull tick: full state exchange with one random member over a stream (anti-entropy);
  the same exchange is how a node joins through its seeds (retried while we know nobody).
  suspicion (Lifeguard): dead after a timeout that shrinks from max to min as independent
  suspecters confirm it (policy.suspicion_timeout); the suspect refutes by gossiping alive
  with a higher incarnation. Two refinements of ours: a few members re-probe a fresh suspect
  at once (confirmations within ~1 probe interval instead of a round-robin), and an
  unconfirmed suspicion gets one last probe before it kills (a refutation can be missed
  under loss; if the member answers we pull its state instead).
Names are unique: a node whose join is answered with a live member holding its name at
another address refuses to join (NameTaken through `on_join`; it stops), and no member
merges the state of a process that claims a live member's name from elsewhere. A restart on
the same address, or anywhere once the old entry is dead or left, is not a conflict.
Every handler opens with its incarnation guard; member states change only in _set_state.
"""
from __future__ import annotations

import random
from collections import Counter
from typing import Callable

import structlog

from . import policy, wire
from .broadcast import BroadcastQueue
from .clock import Timer, TimerScheduler
from .members import IndexedSet, Member, Suspicion, SwimConfig
from .probe import Prober
from .state import (ClusterView, Event, LoadVector, MemberEvent, MemberState, NodeMeta,
                    next_state)
from .transport import Transport
from .wire import Ack, Alive, Dead, IndirectPing, Load, Nack, Ping, PushPull, StateEntry, Suspect

Listener = Callable[[MemberEvent], None]
log = structlog.get_logger(__name__)
_LIVE = (MemberState.ALIVE, MemberState.SUSPECT)


class NameTaken(Exception):
    """Our name is held by a live member at another address: we must not join."""

    def __init__(self, name: str, holder: str) -> None:
        super().__init__(f"cluster: node name {name!r} is taken by a live member at {holder}; "
                         f"give this node a unique server.node_name")
        self.name, self.holder = name, holder


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
        self._suspicions: dict[str, Suspicion] = {}
        self.prober = Prober(self)
        self._updates = BroadcastQueue()     # alive/suspect/dead: first claim on space
        self._loads = BroadcastQueue()       # load vectors: what space is left
        self._listeners: list[Listener] = []
        self._timers: dict[str, Timer] = {}
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
        self._asking: str | None = None      # the holder of our name we are pinging
        self._past_lives: set[str] = set()   # addresses of our silent previous lives
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
        c = self.cfg
        # stagger first ticks so simulated nodes do not probe in lockstep
        self._every("probe", self.rng.random() * c.probe_interval_s, self._probe_tick)
        self._every("gossip", self.rng.random() * c.gossip_interval_s, self._gossip_tick)
        self._every("push_pull", c.push_pull_interval_s * (1 + self.rng.random()),
                    self._push_pull_tick)
        self._every("load", c.load_interval_s, self._load_tick)
        self._every("join", 0.0, self._join_tick)

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
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()
        for s in self._suspicions.values():
            if s.timer:
                s.timer.cancel()
        self.transport.shutdown()

    def bootstrap(self, others: list[Alive]) -> None:
        """Simulation/test helper: know these members as if already converged (no gossip)."""
        for a in others:
            if a.name not in self._members:
                m = Member(a.name, a.addr, a.incarnation, a.meta, a.load, a.load_seq,
                           self._stamp())
                self._members[a.name] = m
                self._set_state(m, Event.ALIVE, notify=False)

    # ---- timers -------------------------------------------------------------------------

    def _every(self, key: str, delay: float, fn: Callable[[], None]) -> None:
        def run() -> None:
            if not self._stopped:
                fn()
        self._timers[key] = self.sched.call_later(delay, run)

    def _probe_tick(self) -> None:
        self._every("probe", self.prober.interval(), self._probe_tick)
        if not self._leaving:
            self.prober.tick()

    def _gossip_tick(self) -> None:
        self._every("gossip", self.cfg.gossip_interval_s, self._gossip_tick)
        if not (len(self._updates) or len(self._loads)):
            return
        pool = len(self._live) + len(self._dead)
        if pool == 0:
            return
        for i in self.rng.sample(range(pool), min(self.cfg.gossip_nodes, pool)):
            m = self._members.get(self._live_or_dead(i))
            if m is None or m.state is MemberState.LEFT:
                continue
            if not self._send(m.addr, [], need_updates=True):
                break

    def _push_pull_tick(self) -> None:
        n = len(self._live) + 1
        self._every("push_pull", policy.push_pull_interval(self.cfg.push_pull_interval_s, n),
                    self._push_pull_tick)
        if self._leaving:
            return
        # Now and then exchange with a member we believe dead (until it is reclaimed): if a
        # partition has healed, it learns what we think, refutes, and the halves merge.
        pool = len(self._live) + len(self._dead)
        if pool == 0:
            return
        m = self._members[self._live_or_dead(self.rng.randrange(pool))]
        if m.state is not MemberState.LEFT:
            self._send_push_pull(m.addr, join=False, reply=False)

    def _live_or_dead(self, i: int) -> str:
        """The i-th of live members followed by not-yet-reclaimed dead ones."""
        n = len(self._live)
        return self._live.at(i) if i < n else self._dead.at(i - n)

    def _load_tick(self) -> None:
        self._every("load", self.cfg.load_interval_s, self._load_tick)
        load = self._pending_load
        me = self._members[self.name]
        if load is None or load == me.load:
            return
        me.load, me.load_seq = load, me.load_seq + 1
        self._changed()
        self._loads.add(self.name, self.codec.fragment(Load(self.name, me.load_seq, load)))

    def _join_tick(self) -> None:
        """Knock on every seed while we know nobody (seeds may come up after us)."""
        self._every("join", self.cfg.join_retry_s, self._join_tick)
        if not self._live and self.seeds and not self._leaving:
            self.stats["join_attempts"] += 1
            for seed in self.seeds:
                self._send_push_pull(seed, join=True, reply=False)

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
                self._conflict(self.name, self.addr, from_addr)
                # ...but a second process with our name may ask whether we live: answer
                # its ping, and take the answer to ours (see _ask_holder); nothing else
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
            holder = self._holder_of_our_name(pp.states)
            if holder is not None and holder.addr not in self._past_lives:
                self._ask_holder(sender, pp.source_addr, holder)
                return
            if holder is not None:                 # our previous life, already outranked
                pp = PushPull(pp.join, pp.reply, pp.source_addr,
                              tuple(e for e in pp.states if e.name != self.name))
        taken = self._claims_taken_name(sender, pp.source_addr)
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
        self._clear_suspicion(msg.name)
        self._set_state(m, Event.ALIVE)
        self._updates.add(msg.name, self.codec.fragment(msg))

    def _on_alive_self(self, msg: Alive) -> None:
        """Refute what is said about us, unless we are leaving (then the name is free)."""
        me = self._members[self.name]
        if self._leaving:
            return
        if msg.addr in self._past_lives and msg.incarnation < me.incarnation:
            return                            # gossip about our outranked previous life
        if msg.addr != me.addr:
            # Another process with our name got into someone's view. Outrank it, at most once
            # per push-pull interval, so that the two of us cannot start an incarnation war.
            self._conflict(self.name, me.addr, msg.addr)
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
        s = self._suspicions.get(msg.name)
        if m.state is MemberState.SUSPECT and s is not None:
            if s.confirm(msg.source):
                self._rearm(msg.name, s)
                self._updates.add(msg.name, self.codec.fragment(msg))
            return
        m.incarnation = msg.incarnation
        n = len(self._live) + 1
        lo, hi = policy.suspicion_bounds(self.cfg.suspicion_mult, self.cfg.suspicion_max_mult,
                                         n, self.cfg.probe_interval_s)
        k = policy.expected_confirmations(self.cfg.suspicion_confirmations, n)
        s = Suspicion(msg.incarnation, self.sched.now(), k, lo, hi, msg.source)
        self._suspicions[msg.name] = s
        self._set_state(m, Event.SUSPECT)
        self._rearm(msg.name, s)
        self._updates.add(msg.name, self.codec.fragment(msg))
        self._maybe_reprobe(m, s, n)

    def _maybe_reprobe(self, m: Member, s: Suspicion, n: int) -> None:
        """Our refinement: about `suspicion_reprobes` members (each with probability
        reprobes / (n - 2)) probe a newly suspected member right away instead of waiting
        for their round-robin, so a dead node collects its k confirmations within about a
        probe interval. A live one just answers; load on it stays O(reprobes), not O(n)."""
        if s.confirmers == {self.name} or self._leaving or self.cfg.suspicion_reprobes <= 0:
            return
        if self.rng.random() >= self.cfg.suspicion_reprobes / max(1, n - 2):
            return

        def reprobe() -> None:
            if not self._stopped and self._suspicions.get(m.name) is s:
                self.stats["reprobes"] += 1
                self.prober.probe(m)
        self.sched.call_later(self.rng.random() * self.cfg.probe_timeout_s, reprobe)

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
        self._clear_suspicion(msg.name)
        self._set_state(m, Event.LEAVE if msg.is_leave else Event.DEAD)
        self._updates.add(msg.name, self.codec.fragment(msg))

    def _on_load(self, msg: Load) -> None:
        m = self._members.get(msg.name)
        if m is None or msg.name == self.name or msg.load_seq <= m.load_seq:
            return
        m.load, m.load_seq = msg.load, msg.load_seq
        self._changed()
        self._loads.add(msg.name, self.codec.fragment(msg))

    # ---- suspicion, refutation, state ---------------------------------------------------

    def _rearm(self, name: str, s: Suspicion) -> None:
        if s.timer:
            s.timer.cancel()
        left = policy.suspicion_remaining(s.confirmations, s.expected,
                                          self.sched.now() - s.start, s.min_s, s.max_s)
        s.timer = self.sched.call_later(left, lambda: self._suspicion_expired(name, s))

    def _suspicion_expired(self, name: str, s: Suspicion) -> None:
        m = self._members.get(name)
        if self._stopped or self._suspicions.get(name) is not s or m is None:
            return
        if m.state is not MemberState.SUSPECT or m.incarnation != s.incarnation:
            return
        if s.confirmations < s.expected and not s.verified and not self._leaving:
            # Unconfirmed: nobody else could reach it either? We probe it once ourselves.
            # If it answers, its refutation must have passed us by (gossip is probabilistic
            # under loss): pull its state instead of declaring a live node dead.
            s.verified = True
            self.stats["last_chance_probes"] += 1

            def verdict(acked: bool) -> None:
                if self._suspicions.get(name) is not s:
                    return
                if acked:
                    self._send_push_pull(m.addr, join=False, reply=False)
                    s.timer = self.sched.call_later(s.min_s,
                                                    lambda: self._suspicion_expired(name, s))
                else:
                    self._suspicion_expired(name, s)
            self.prober.probe(m, verdict)
            return
        self.stats["suspicion_timeouts"] += 1
        self._on_dead(Dead(name, m.incarnation, self.name))

    def _clear_suspicion(self, name: str) -> None:
        s = self._suspicions.pop(name, None)
        if s is not None and s.timer:
            s.timer.cancel()

    # ---- duplicate names ----------------------------------------------------------------

    def _holder_of_our_name(self, states: tuple[StateEntry, ...]) -> StateEntry | None:
        """A live member's entry that holds our name elsewhere (at our own address it is our
        previous life: a restart)."""
        for e in states:
            if e.name == self.name and e.addr != self.addr and e.state in _LIVE:
                return e
        return None

    def _ask_holder(self, seed: str, seed_addr: str, holder: StateEntry) -> None:
        """A live entry holds our name at another address. Ping it (directly, and through the
        members we know): an answer means a second process runs with our name, and we are
        refused; silence means it is our previous life, killed before anyone declared it dead
        and restarted on a new address (a new pod IP, a new port): we outrank it."""
        if self._asking is not None or self._stopped:
            return                                 # one question at a time
        self._asking = holder.addr

        def verdict(acked: bool) -> None:
            self._asking = None
            if self._stopped:
                return
            if acked:
                self._refuse(seed, holder.addr)
                return
            self._past_lives.add(holder.addr)
            me = self._members[self.name]
            me.incarnation = max(me.incarnation, holder.incarnation) + 1
            self.stats["past_lives_outranked"] += 1
            log.warning("cluster_previous_life_outranked", node=self.name, addr=self.addr,
                        previous=holder.addr, incarnation=me.incarnation)
            self._changed()
            self._broadcast_self()
            self._send(seed_addr, [self._alive_msg(me)])   # the seed first: it still holds
            self._send_push_pull(seed_addr, join=True, reply=False)   # ... the old entry
        probe = Member(self.name, holder.addr, holder.incarnation, holder.meta, holder.load,
                       holder.load_seq, self._stamp())
        self.prober.probe(probe, verdict)

    def _claims_taken_name(self, sender: str, addr: str) -> bool:
        """A push-pull from `sender` at `addr` while a live member holds that name elsewhere:
        a duplicate, whose state is not merged (its newer incarnation would move the entry)."""
        m = self._members.get(sender)
        if m is None or m.addr == addr or m.state not in _LIVE:
            return False
        self._conflict(sender, m.addr, addr)
        return True

    def _conflict(self, name: str, holder: str, intruder: str) -> None:
        """A second process claims a live member's name: logged every time it shows up."""
        self.stats["name_conflicts"] += 1
        log.warning("cluster_name_conflict", node=self.name, member=name, addr=holder,
                    intruder=intruder)

    def _refuse(self, seed: str, holder: str) -> None:
        """Our name is taken: stop before any of our state spreads, and say why."""
        self.stats["name_taken"] += 1
        log.error("cluster_name_taken", node=self.name, addr=self.addr, holder=holder,
                  seed=seed)
        if seed != self.name:      # the holder did not answer us itself: tell it (one packet)
            self.transport.send_packet(holder, self.codec.encode(self.name,
                                                                 self.sched.wall_ms(), []))
        self.stop()
        self.on_join(NameTaken(self.name, holder))

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
