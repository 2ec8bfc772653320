"""Member states, node metadata and the immutable cluster view the rest of the daemon reads.

Member lifecycle (transitions live only in `next_state`):

    (unknown) --alive--> ALIVE --suspect--> SUSPECT --timeout/dead--> DEAD
                           ^                   |                        |
                           +----alive(inc+)----+------alive(inc+)-------+
    ALIVE/SUSPECT --leave--> LEFT --alive(inc+)--> ALIVE   (a restarted node)

Which message wins is decided by incarnation numbers in the handlers (swim.py); this table
only says which state an accepted message leads to.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable


class MemberState(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"
    LEFT = "left"


class Event(enum.Enum):
    ALIVE = "alive"        # an alive message with a newer incarnation
    SUSPECT = "suspect"    # a failed probe or a suspect message
    DEAD = "dead"          # suspicion timed out, or a dead message
    LEAVE = "leave"        # the member announced its own departure


_TRANSITIONS: dict[tuple[MemberState | None, Event], MemberState] = {
    (None, Event.ALIVE): MemberState.ALIVE,
    (MemberState.ALIVE, Event.ALIVE): MemberState.ALIVE,
    (MemberState.SUSPECT, Event.ALIVE): MemberState.ALIVE,
    (MemberState.DEAD, Event.ALIVE): MemberState.ALIVE,
    (MemberState.LEFT, Event.ALIVE): MemberState.ALIVE,
    (MemberState.ALIVE, Event.SUSPECT): MemberState.SUSPECT,
    (MemberState.SUSPECT, Event.SUSPECT): MemberState.SUSPECT,
    (MemberState.ALIVE, Event.DEAD): MemberState.DEAD,
    (MemberState.SUSPECT, Event.DEAD): MemberState.DEAD,
    (MemberState.ALIVE, Event.LEAVE): MemberState.LEFT,
    (MemberState.SUSPECT, Event.LEAVE): MemberState.LEFT,
}


def next_state(current: MemberState | None, event: Event) -> MemberState | None:
    """The state an accepted event leads to, or None when the event does not apply
    (a dead member cannot become suspect; only a newer alive brings it back)."""
    return _TRANSITIONS.get((current, event))


@dataclass(frozen=True)
class LoadVector:
    """A node's load, refreshed about once a second (see MembershipConfig.load_interval_s)."""
    waiting: int = 0
    running: int = 0
    free_kv_blocks: int = 0
    queued_prefill_tokens: int = 0

    def to_list(self) -> list[int]:
        return [self.waiting, self.running, self.free_kv_blocks, self.queued_prefill_tokens]

    def to_dict(self) -> dict[str, int]:
        return {"waiting": self.waiting, "running": self.running,
                "free_kv_blocks": self.free_kv_blocks,
                "queued_prefill_tokens": self.queued_prefill_tokens}


@dataclass(frozen=True)
class NodeMeta:
    """What a node says about itself; versioned by its incarnation. `layout` is a hash of
    the model's KV layout so a decode node never pairs with an incompatible prefill node."""
    role: str = ""
    http: str = ""
    model: str = ""
    layout: str = ""
    transfer: str = ""

    def to_list(self) -> list[str]:
        return [self.role, self.http, self.model, self.layout, self.transfer]

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "http": self.http, "model": self.model,
                "layout": self.layout, "transfer": self.transfer}


@dataclass(frozen=True)
class MemberInfo:
    name: str
    state: MemberState
    incarnation: int
    addr: str                      # gossip address host:port
    meta: NodeMeta
    load: LoadVector
    load_seq: int
    state_since: float             # wall-clock seconds of the last state change

    @property
    def role(self) -> str:
        return self.meta.role

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state.value, "incarnation": self.incarnation,
                "addr": self.addr, **self.meta.to_dict(), "load": self.load.to_dict(),
                "state_since": round(self.state_since, 3)}


@dataclass(frozen=True)
class MemberEvent:
    """A membership change: old is None for a member seen for the first time."""
    name: str
    old: MemberState | None
    new: MemberState
    incarnation: int
    at: float


@dataclass(frozen=True)
class ClusterView:
    """An immutable snapshot; cheap to hold, never changes under the reader."""
    self_name: str
    members: tuple[MemberInfo, ...] = ()
    version: int = 0
    _by_name: dict[str, MemberInfo] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(cls, self_name: str, members: Iterable[MemberInfo], version: int) -> ClusterView:
        ms = tuple(sorted(members, key=lambda m: m.name))
        return cls(self_name, ms, version, {m.name: m for m in ms})

    def get(self, name: str) -> MemberInfo | None:
        return self._by_name.get(name)

    def select(self, role: str | None = None,
               states: tuple[MemberState, ...] = (MemberState.ALIVE,)) -> list[MemberInfo]:
        """Members with this role (any when None) in one of these states."""
        return [m for m in self.members
                if m.state in states and (role is None or m.meta.role == role)]

    def alive(self, role: str | None = None) -> list[MemberInfo]:
        return self.select(role)

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in MemberState}
        for m in self.members:
            out[m.state.value] += 1
        return out

    def to_json(self) -> dict[str, Any]:
        return {"self": self.self_name, "version": self.version, "counts": self.counts(),
                "members": [m.to_dict() for m in self.members]}
