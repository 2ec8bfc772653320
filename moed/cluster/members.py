"""Internal bookkeeping for the protocol core: mutable member records, a sampleable set, the
Lifeguard suspicion record, and the core's timing config. Nothing here sends packets."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from .clock import Timer
from .state import LoadVector, MemberInfo, MemberState, NodeMeta


@dataclass(frozen=True)
class SwimConfig:
    """Protocol timings in seconds. Defaults follow memberlist's LAN profile except where
    noted; `from_cluster` maps the daemon's ClusterConfig (milliseconds) onto this."""
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 0.5
    indirect_checks: int = 3
    gossip_interval_s: float = 0.2
    gossip_nodes: int = 3
    push_pull_interval_s: float = 30.0
    suspicion_mult: float = 1.0            # memberlist LAN: 4 (see ClusterConfig)
    suspicion_max_mult: float = 6.0
    suspicion_confirmations: int = 2       # memberlist: suspicion_mult - 2
    suspicion_reprobes: int = 4            # members that re-probe a fresh suspect at once
    retransmit_mult: int = 4
    awareness_max: int = 8
    load_interval_s: float = 1.0
    join_retry_s: float = 1.0
    dead_reclaim_s: float = 30.0           # forget dead/left members after this
    replay_window_s: float = 120.0         # drop packets stamped further off; 0 = off
    max_packet: int = 1400
    leave_fanout: int = 32                 # members told directly on leave

    @classmethod
    def from_cluster(cls, cc: Any) -> SwimConfig:
        """From moed.config.ClusterConfig (milliseconds)."""
        return cls(
            probe_interval_s=cc.probe_interval_ms / 1000, probe_timeout_s=cc.probe_timeout_ms / 1000,
            indirect_checks=cc.indirect_checks, gossip_interval_s=cc.gossip_interval_ms / 1000,
            gossip_nodes=cc.gossip_nodes, push_pull_interval_s=cc.push_pull_interval_ms / 1000,
            suspicion_mult=cc.suspicion_mult, suspicion_max_mult=cc.suspicion_max_timeout_mult,
            suspicion_confirmations=cc.suspicion_confirmations,
            suspicion_reprobes=cc.suspicion_reprobes, retransmit_mult=cc.retransmit_mult,
            awareness_max=cc.awareness_max_multiplier,
            load_interval_s=cc.load_update_interval_ms / 1000,
            join_retry_s=cc.join_retry_ms / 1000, dead_reclaim_s=cc.dead_reclaim_ms / 1000,
            replay_window_s=cc.replay_window_ms / 1000)

    @classmethod
    def memberlist_lan(cls) -> SwimConfig:
        """memberlist's DefaultLANConfig timings, for comparison in bench/membership.py."""
        return cls(suspicion_mult=4, suspicion_confirmations=2, suspicion_reprobes=0)


class Member:
    """One member as this node sees it (mutable; the view copies it into MemberInfo)."""
    __slots__ = ("name", "addr", "incarnation", "state", "meta", "load", "load_seq", "since")

    def __init__(self, name: str, addr: str, incarnation: int, meta: NodeMeta,
                 load: LoadVector, load_seq: int, since: float) -> None:
        self.name, self.addr, self.incarnation = name, addr, incarnation
        self.state: MemberState | None = None
        self.meta, self.load, self.load_seq, self.since = meta, load, load_seq, since

    def info(self) -> MemberInfo:
        assert self.state is not None
        return MemberInfo(self.name, self.state, self.incarnation, self.addr, self.meta,
                          self.load, self.load_seq, self.since)


class IndexedSet:
    """A set with O(1) add/discard and uniform random sampling (gossip and probe targets)."""

    def __init__(self) -> None:
        self._items: list[str] = []
        self._pos: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, x: object) -> bool:
        return x in self._pos

    def __iter__(self):
        return iter(list(self._items))

    def at(self, i: int) -> str:
        return self._items[i]

    def add(self, x: str) -> None:
        if x not in self._pos:
            self._pos[x] = len(self._items)
            self._items.append(x)

    def discard(self, x: str) -> None:
        i = self._pos.pop(x, None)
        if i is None:
            return
        last = self._items.pop()
        if i < len(self._items):
            self._items[i] = last
            self._pos[last] = i

    def sample(self, rng: random.Random, k: int, exclude: tuple[str, ...] = ()) -> list[str]:
        n = len(self._items)
        want = min(k, n)
        out: list[str] = []
        for i in rng.sample(range(n), min(n, want + len(exclude))):
            x = self._items[i]
            if x not in exclude:
                out.append(x)
                if len(out) == want:
                    break
        return out


class Suspicion:
    """Lifeguard suspicion: who has independently suspected the member, since when, and the
    timer that declares it dead. The timeout itself comes from policy.suspicion_timeout."""
    __slots__ = ("incarnation", "start", "expected", "min_s", "max_s", "confirmers", "timer",
                 "verified")

    def __init__(self, incarnation: int, start: float, expected: int, min_s: float,
                 max_s: float, first: str) -> None:
        self.incarnation, self.start, self.expected = incarnation, start, expected
        self.min_s, self.max_s = min_s, max_s
        self.confirmers = {first}
        self.timer: Timer | None = None
        self.verified = False          # the last-chance probe before an unconfirmed death

    def confirm(self, source: str) -> bool:
        """True when `source` is a new, independent suspecter (the first one does not
        count as a confirmation)."""
        if source in self.confirmers or len(self.confirmers) > self.expected:
            return False
        self.confirmers.add(source)
        return True

    @property
    def confirmations(self) -> int:
        return len(self.confirmers) - 1
