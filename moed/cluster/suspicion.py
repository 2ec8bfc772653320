"""Lifeguard suspicion timers: the part of the protocol core that turns a suspect into a
dead member, or does not.

A suspect is declared dead after a timeout that shrinks from max to min as independent
suspecters confirm it (policy.suspicion_timeout). Two refinements of ours: a few members
re-probe a fresh suspect at once (confirmations within ~1 probe interval instead of a
round-robin), and an unconfirmed suspicion gets one last probe before it kills (a
refutation can be missed under loss; if the member answers we pull its state instead).

Like the Prober, this shares the core's member tables on purpose; member states still
change only in Membership._set_state.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import policy
from .members import Member, Suspicion
from .state import MemberState
from .wire import Dead

if TYPE_CHECKING:
    from .swim import Membership


class Suspicions:
    def __init__(self, core: Membership) -> None:
        self.core = core
        self._open: dict[str, Suspicion] = {}

    def get(self, name: str) -> Suspicion | None:
        return self._open.get(name)

    def open(self, name: str, incarnation: int, source: str, n: int) -> Suspicion:
        """A new suspicion of `name` among `n` members (ourselves included)."""
        cfg = self.core.cfg
        lo, hi = policy.suspicion_bounds(cfg.suspicion_mult, cfg.suspicion_max_mult,
                                         n, cfg.probe_interval_s)
        k = policy.expected_confirmations(cfg.suspicion_confirmations, n)
        s = Suspicion(incarnation, self.core.sched.now(), k, lo, hi, source)
        self._open[name] = s
        return s

    def rearm(self, name: str, s: Suspicion) -> None:
        if s.timer:
            s.timer.cancel()
        core = self.core
        left = policy.suspicion_remaining(s.confirmations, s.expected,
                                          core.sched.now() - s.start, s.min_s, s.max_s)
        s.timer = core.sched.call_later(left, lambda: self._expired(name, s))

    def reprobe_soon(self, m: Member, s: Suspicion, n: int) -> None:
        """Our refinement: about `suspicion_reprobes` members (each with probability
        reprobes / (n - 2)) probe a newly suspected member right away instead of waiting
        for their round-robin, so a dead node collects its k confirmations within about a
        probe interval. A live one just answers; load on it stays O(reprobes), not O(n)."""
        core = self.core
        if s.confirmers == {core.name} or core._leaving or core.cfg.suspicion_reprobes <= 0:
            return
        if core.rng.random() >= core.cfg.suspicion_reprobes / max(1, n - 2):
            return

        def reprobe() -> None:
            if not core._stopped and self._open.get(m.name) is s:
                core.stats["reprobes"] += 1
                core.prober.probe(m)
        core.sched.call_later(core.rng.random() * core.cfg.probe_timeout_s, reprobe)

    def _expired(self, name: str, s: Suspicion) -> None:
        core = self.core
        m = core._members.get(name)
        if core._stopped or self._open.get(name) is not s or m is None:
            return
        if m.state is not MemberState.SUSPECT or m.incarnation != s.incarnation:
            return
        if s.confirmations < s.expected and not s.verified and not core._leaving:
            # Unconfirmed: nobody else could reach it either? We probe it once ourselves.
            # If it answers, its refutation must have passed us by (gossip is probabilistic
            # under loss): pull its state instead of declaring a live node dead.
            s.verified = True
            core.stats["last_chance_probes"] += 1

            def verdict(acked: bool) -> None:
                if self._open.get(name) is not s:
                    return
                if acked:
                    core._send_push_pull(m.addr, join=False, reply=False)
                    s.timer = core.sched.call_later(s.min_s, lambda: self._expired(name, s))
                else:
                    self._expired(name, s)
            core.prober.probe(m, verdict)
            return
        core.stats["suspicion_timeouts"] += 1
        core._on_dead(Dead(name, m.incarnation, core.name))

    def clear(self, name: str) -> None:
        s = self._open.pop(name, None)
        if s is not None and s.timer:
            s.timer.cancel()

    def cancel_all(self) -> None:
        for s in self._open.values():
            if s.timer:
                s.timer.cancel()
