"""Unique node names: the third part of the protocol core (beside probe.Prober).

A node whose join is answered with a live member holding its name at another address asks
that holder whether it lives: an answer means a second process runs with our name (we are
refused: NameTaken through `Membership.on_join`, and we stop); silence means it is our own
previous life, killed before anyone declared it dead and restarted on a new address (we
outrank it). No member merges the state of a process that claims a live member's name from
elsewhere. A restart on the same address, or anywhere once the old entry is dead or left,
is not a conflict.

Like the Prober, the NameGuard shares the core's member tables on purpose; it calls back
into the core to send, to probe and to stop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from .members import Member
from .state import MemberState
from .wire import StateEntry

if TYPE_CHECKING:
    from .swim import Membership

log = structlog.get_logger(__name__)
LIVE = (MemberState.ALIVE, MemberState.SUSPECT)


class NameTaken(Exception):
    """Our name is held by a live member at another address: we must not join."""

    def __init__(self, name: str, holder: str) -> None:
        super().__init__(f"cluster: node name {name!r} is taken by a live member at {holder}; "
                         f"give this node a unique server.node_name")
        self.name, self.holder = name, holder


class NameGuard:
    def __init__(self, core: Membership) -> None:
        self.core = core
        self.asking: str | None = None       # the holder of our name we are pinging
        self.past_lives: set[str] = set()    # addresses of our silent previous lives

    def holder_of_our_name(self, states: tuple[StateEntry, ...]) -> StateEntry | None:
        """A live member's entry that holds our name elsewhere (at our own address it is our
        previous life: a restart)."""
        core = self.core
        for e in states:
            if e.name == core.name and e.addr != core.addr and e.state in LIVE:
                return e
        return None

    def ask_holder(self, seed: str, seed_addr: str, holder: StateEntry) -> None:
        """A live entry holds our name at another address. Ping it (directly, and through the
        members we know): an answer means a second process runs with our name, and we are
        refused; silence means it is our previous life, killed before anyone declared it dead
        and restarted on a new address (a new pod IP, a new port): we outrank it."""
        core = self.core
        if self.asking is not None or core._stopped:
            return                                 # one question at a time
        self.asking = holder.addr

        def verdict(acked: bool) -> None:
            self.asking = None
            if core._stopped:
                return
            if acked:
                self.refuse(seed, holder.addr)
                return
            self.past_lives.add(holder.addr)
            me = core._members[core.name]
            me.incarnation = max(me.incarnation, holder.incarnation) + 1
            core.stats["past_lives_outranked"] += 1
            log.warning("cluster_previous_life_outranked", node=core.name, addr=core.addr,
                        previous=holder.addr, incarnation=me.incarnation)
            core._changed()
            core._broadcast_self()
            core._send(seed_addr, [core._alive_msg(me)])   # the seed first: it still holds
            core._send_push_pull(seed_addr, join=True, reply=False)   # ... the old entry
        probe = Member(core.name, holder.addr, holder.incarnation, holder.meta, holder.load,
                       holder.load_seq, core._stamp())
        core.prober.probe(probe, verdict)

    def claims_taken_name(self, sender: str, addr: str) -> bool:
        """A push-pull from `sender` at `addr` while a live member holds that name elsewhere:
        a duplicate, whose state is not merged (its newer incarnation would move the entry)."""
        m = self.core._members.get(sender)
        if m is None or m.addr == addr or m.state not in LIVE:
            return False
        self.conflict(sender, m.addr, addr)
        return True

    def conflict(self, name: str, holder: str, intruder: str) -> None:
        """A second process claims a live member's name: logged every time it shows up."""
        self.core.stats["name_conflicts"] += 1
        log.warning("cluster_name_conflict", node=self.core.name, member=name, addr=holder,
                    intruder=intruder)

    def refuse(self, seed: str, holder: str) -> None:
        """Our name is taken: stop before any of our state spreads, and say why."""
        core = self.core
        core.stats["name_taken"] += 1
        log.error("cluster_name_taken", node=core.name, addr=core.addr, holder=holder,
                  seed=seed)
        if seed != core.name:      # the holder did not answer us itself: tell it (one packet)
            core.transport.send_packet(holder, core.codec.encode(core.name,
                                                                 core.sched.wall_ms(), []))
        core.stop()
        core.on_join(NameTaken(core.name, holder))
