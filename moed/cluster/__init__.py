"""Gossip membership: SWIM failure detection with Lifeguard refinements, over UDP (+ TCP
push-pull) in the daemon's event loop, or over an in-memory network in simulation.

What the rest of the daemon uses (see service.MembershipComponent, registered by moed.app when
cluster.enabled):
    view() -> ClusterView            immutable snapshot: members by role/state, meta and load
    subscribe(fn) -> unsubscribe     MemberEvent on every state change / metadata update
    update_meta(transfer=..., ...)   change our metadata; gossiped at once (new incarnation)
    set_load(LoadVector)             our load; gossiped every cluster.load_update_interval_ms
GET /cluster returns view().to_json().

Modules: state (states, transitions, view), policy (pure timing functions), wire (HMAC'd
codec), broadcast (piggyback queue), members (records, config), probe (failure detector),
swim (the protocol core) with its parts ticks, suspicion and names, clock (real and simulated time), transport + udp (in-memory and
real networks), sim (discrete-event simulation), service (the daemon component).
"""
from .state import ClusterView, LoadVector, MemberEvent, MemberInfo, MemberState, NodeMeta

__all__ = ["ClusterView", "LoadVector", "MemberEvent", "MemberInfo", "MemberState", "NodeMeta"]
