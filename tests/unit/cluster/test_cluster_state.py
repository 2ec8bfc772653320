"""Member state machine and the immutable cluster view."""
from __future__ import annotations

import json

import pytest

from moed.cluster.state import (ClusterView, Event, LoadVector, MemberInfo, MemberState,
                                NodeMeta, next_state)

A, S, D, L = MemberState.ALIVE, MemberState.SUSPECT, MemberState.DEAD, MemberState.LEFT


@pytest.mark.parametrize("cur,event,new", [
    (None, Event.ALIVE, A), (A, Event.SUSPECT, S), (S, Event.SUSPECT, S), (S, Event.DEAD, D),
    (A, Event.DEAD, D), (S, Event.ALIVE, A), (D, Event.ALIVE, A), (L, Event.ALIVE, A),
    (A, Event.LEAVE, L), (S, Event.LEAVE, L),
])
def test_allowed_transitions(cur, event, new) -> None:
    assert next_state(cur, event) is new


@pytest.mark.parametrize("cur,event", [
    (D, Event.SUSPECT), (L, Event.SUSPECT), (D, Event.DEAD), (L, Event.DEAD), (D, Event.LEAVE),
    (None, Event.SUSPECT), (None, Event.DEAD),
])
def test_refused_transitions(cur, event) -> None:
    assert next_state(cur, event) is None


def _info(name: str, state: MemberState, role: str, waiting: int = 0) -> MemberInfo:
    return MemberInfo(name, state, 3, f"{name}:1", NodeMeta(role=role, http=f"http://{name}"),
                      LoadVector(waiting=waiting), 1, 0.0)


def test_view_selects_by_role_and_state_and_serialises() -> None:
    view = ClusterView.build("p1", [_info("p1", A, "prefill"), _info("d1", A, "decode", 4),
                                    _info("d2", D, "decode"), _info("r", L, "router")], 7)
    assert [m.name for m in view.alive("decode")] == ["d1"]
    assert [m.name for m in view.select("decode", (A, D))] == ["d1", "d2"]
    assert view.get("d1").load.waiting == 4 and view.get("nope") is None
    assert view.counts() == {"alive": 2, "suspect": 0, "dead": 1, "left": 1}
    doc = json.loads(json.dumps(view.to_json()))
    assert doc["self"] == "p1" and doc["version"] == 7
    d1 = next(m for m in doc["members"] if m["name"] == "d1")
    assert d1["state"] == "alive" and d1["role"] == "decode" and d1["load"]["waiting"] == 4
    with pytest.raises(AttributeError):
        view.members[0].state = D     # frozen
