"""The protocol core's periodic work: the probe, gossip, push-pull, load and join ticks.

  probe tick (every probe_interval * awareness): see probe.Prober; a failed probe makes us
  suspect the member.
  gossip tick: send queued updates to `gossip_nodes` random members. Updates also ride on
  every ping and ack, each at most retransmit_mult * ceil(log10(n+1)) times.
  push-pull tick: full state exchange with one random member over a stream (anti-entropy);
  the same exchange is how a node joins through its seeds (retried while we know nobody).
  load tick: gossip our latest load vector if it changed.

Each tick re-arms itself first, through the core's TimerScheduler, so a tick that raises does not
stop the cycle. Like the Prober, this shares the core's member tables on purpose.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from . import policy
from .clock import Timer
from .state import MemberState
from .wire import Load

if TYPE_CHECKING:
    from .swim import Membership


class Ticks:
    def __init__(self, core: Membership) -> None:
        self.core = core
        self._timers: dict[str, Timer] = {}

    def start(self) -> None:
        core, c = self.core, self.core.cfg
        # stagger first ticks so simulated nodes do not probe in lockstep
        self._every("probe", core.rng.random() * c.probe_interval_s, self._probe_tick)
        self._every("gossip", core.rng.random() * c.gossip_interval_s, self._gossip_tick)
        self._every("push_pull", c.push_pull_interval_s * (1 + core.rng.random()),
                    self._push_pull_tick)
        self._every("load", c.load_interval_s, self._load_tick)
        self._every("join", 0.0, self._join_tick)

    def cancel_all(self) -> None:
        for t in self._timers.values():
            t.cancel()
        self._timers.clear()

    def _every(self, key: str, delay: float, fn: Callable[[], None]) -> None:
        def run() -> None:
            if not self.core._stopped:
                fn()
        self._timers[key] = self.core.sched.call_later(delay, run)

    def _probe_tick(self) -> None:
        core = self.core
        self._every("probe", core.prober.interval(), self._probe_tick)
        if not core._leaving:
            core.prober.tick()

    def _gossip_tick(self) -> None:
        core = self.core
        self._every("gossip", core.cfg.gossip_interval_s, self._gossip_tick)
        if not (len(core._updates) or len(core._loads)):
            return
        pool = len(core._live) + len(core._dead)
        if pool == 0:
            return
        for i in core.rng.sample(range(pool), min(core.cfg.gossip_nodes, pool)):
            m = core._members.get(self._live_or_dead(i))
            if m is None or m.state is MemberState.LEFT:
                continue
            if not core._send(m.addr, [], need_updates=True):
                break

    def _push_pull_tick(self) -> None:
        core = self.core
        n = len(core._live) + 1
        self._every("push_pull", policy.push_pull_interval(core.cfg.push_pull_interval_s, n),
                    self._push_pull_tick)
        if core._leaving:
            return
        # Now and then exchange with a member we believe dead (until it is reclaimed): if a
        # partition has healed, it learns what we think, refutes, and the halves merge.
        pool = len(core._live) + len(core._dead)
        if pool == 0:
            return
        m = core._members[self._live_or_dead(core.rng.randrange(pool))]
        if m.state is not MemberState.LEFT:
            core._send_push_pull(m.addr, join=False, reply=False)

    def _live_or_dead(self, i: int) -> str:
        """The i-th of live members followed by not-yet-reclaimed dead ones."""
        live, dead = self.core._live, self.core._dead
        return live.at(i) if i < len(live) else dead.at(i - len(live))

    def _load_tick(self) -> None:
        core = self.core
        self._every("load", core.cfg.load_interval_s, self._load_tick)
        load = core._pending_load
        me = core._members[core.name]
        if load is None or load == me.load:
            return
        me.load, me.load_seq = load, me.load_seq + 1
        core._changed()
        core._loads.add(core.name, core.codec.fragment(Load(core.name, me.load_seq, load)))

    def _join_tick(self) -> None:
        """Knock on every seed while we know nobody (seeds may come up after us)."""
        core = self.core
        self._every("join", core.cfg.join_retry_s, self._join_tick)
        if not core._live and core.seeds and not core._leaving:
            core.stats["join_attempts"] += 1
            for seed in core.seeds:
                core._send_push_pull(seed, join=True, reply=False)
