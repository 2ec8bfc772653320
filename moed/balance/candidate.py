"""Candidate: one node as a placement policy sees it, and the compatibility rule every
policy applies before it chooses.

Built by the caller from what it knows — the membership view (role, addresses, KV layout id,
release fields, the load the node gossips about once a second), its own calls to the node
still in flight (they cover the gossip's lag) and its breaker state for the node.

Compatibility (`incompatibility`, defined beside NodeMeta in moed.cluster.state so the
membership's own metric uses the same rule): two nodes may work together when their node-to-node
protocol ranges overlap; a prefill/decode pair must also run the same checkpoint (model id)
and KV layout, since KV written by one model is garbage to another even when the shapes agree.
A field a node does not advertise (a static peer, a node of the release before) is given the
benefit of the doubt: a rolling upgrade must not cut every pair, and the transfer handshake
still refuses a real layout mismatch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moed.balance.breaker import PeerHealth
from moed.cluster.state import (PD_ROLES, LoadVector, NodeMeta, incompatibility,
                                incompatible_counts, layout_compatible, protocol_compatible,
                                protocol_range)

__all__ = ["Candidate", "PD_ROLES", "incompatibility", "incompatible_counts",
           "layout_compatible", "protocol_compatible", "protocol_range"]


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
    label: str = ""            # version label (canary routing); "" = not advertised

    @classmethod
    def of_member(cls, name: str, url: str, meta: NodeMeta, load: LoadVector) -> Candidate:
        return cls(name, url, meta.role, meta.layout, meta.transfer, load, label=meta.label)
