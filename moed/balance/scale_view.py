"""What the scaling planner (moed.balance.scale) sees: each member's gossiped load, read from
any node's GET /cluster (`snapshot_of`). A value that is missing, not a number or not finite
reads as its default; the measured capacity signals read -1 (not measured) as absent.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from moed.balance.cost import Coefficients, FEATURES

PLANNED_ROLES = ("prefill", "decode", "colocated")
COUNTED_STATES = ("alive", "suspect")


@dataclass(frozen=True)
class NodeLoad:
    """A member's gossiped load. The measured fields are None when the node does not
    advertise them (a node of a release before the capacity signals)."""
    name: str
    role: str
    state: str = "alive"
    http: str = ""
    waiting: int = 0
    running: int = 0
    free_kv_blocks: int = 0
    queued_prefill_tokens: int = 0
    queued_requests: int = 0
    cost: Coefficients | None = None        # fitted step-time model, None = not advertised
    prefill_share: float = 1.0
    chunk_tokens: int = 0
    prefill_tps: float | None = None        # measured prompt tokens per second of step
    decode_step_s: float | None = None      # measured decode step time

    @property
    def inflight(self) -> int:
        return self.running + self.waiting

    @property
    def busy(self) -> bool:
        return self.inflight > 0 or self.queued_prefill_tokens > 0


@dataclass(frozen=True)
class Snapshot:
    t: float
    nodes: tuple[NodeLoad, ...] = ()

    def counted(self, role: str) -> list[NodeLoad]:
        return [n for n in self.nodes if n.role == role and n.state in COUNTED_STATES]


def _num(d: Mapping[str, Any], key: str, default: float = 0.0) -> float:
    v = d.get(key, default)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else default


def _opt(d: Mapping[str, Any], key: str) -> float | None:
    v = d.get(key)
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def snapshot_of(cluster: Mapping[str, Any], t: float) -> Snapshot:
    """GET /cluster's JSON (moed.cluster.state.ClusterView.to_json) as a Snapshot; members of
    other roles (routers) are left out. ValueError when it is not that shape."""
    members = cluster.get("members")
    if not isinstance(members, list):
        raise ValueError("not a /cluster answer: no members list")
    out = []
    for m in members:
        if not isinstance(m, dict) or m.get("role") not in PLANNED_ROLES:
            continue
        load = m.get("load") if isinstance(m.get("load"), dict) else {}
        cost = load.get("cost") or ()
        coef = (Coefficients(*(float(c) for c in cost))
                if isinstance(cost, list) and len(FEATURES) - 2 <= len(cost) <= len(FEATURES)
                else None)      # fewer terms: a node of a release before the last ones (0)
        reqs = load.get("queued_requests") or ()
        out.append(NodeLoad(
            name=str(m.get("name", "")), role=str(m["role"]), state=str(m.get("state", "")),
            http=str(m.get("http", "")), waiting=int(_num(load, "waiting")),
            running=int(_num(load, "running")),
            free_kv_blocks=int(_num(load, "free_kv_blocks")),
            queued_prefill_tokens=int(_num(load, "queued_prefill_tokens")),
            queued_requests=int(sum(r for r in reqs if isinstance(r, int))),
            cost=coef, prefill_share=_num(load, "prefill_share", 1.0),
            chunk_tokens=int(_num(load, "chunk_tokens")),
            prefill_tps=_opt(load, "prefill_tps"),
            decode_step_s=_opt(load, "decode_step_s")))
    return Snapshot(t, tuple(out))
