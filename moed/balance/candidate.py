"""Candidate: one node as a placement policy sees it.

Built by the caller from what it knows — the membership view (role, addresses, KV layout id,
the load the node gossips about once a second), its own calls to the node still in flight
(they cover the gossip's lag) and its breaker state for the node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moed.balance.breaker import PeerHealth
from moed.cluster.state import LoadVector


@dataclass(frozen=True)
class Candidate:
    name: str                  # membership name, or the URL of a static peer
    url: str                   # base URL, no trailing slash
    role: str = ""
    layout: str = ""           # KV layout id ("" = not advertised: a static peer)
    transfer: str = ""         # transfer endpoint (agent name)
    load: LoadVector = field(default_factory=LoadVector)
    inflight: int = 0          # this node's own calls to it, not yet answered
    health: PeerHealth = field(default_factory=PeerHealth)


def layout_compatible(ours: str, theirs: str) -> bool:
    """KV written under one layout can be read under the other. An unknown side (a static
    peer, a node that does not advertise) is given the benefit of the doubt: the transfer
    handshake still refuses a real mismatch."""
    return not ours or not theirs or ours == theirs
