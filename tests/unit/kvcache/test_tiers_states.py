"""The waiting-for-KV states: remote (a prefill node writes) and tier (a host/disk load) share
one shape — entered from WAITING only, left for RUNNING or FINISHED only."""
from __future__ import annotations

import pytest

from moed.types import KV_WAIT_STATES, REQUEST_TRANSITIONS, RequestState, check_transition


def test_kv_wait_states_share_their_transitions() -> None:
    assert KV_WAIT_STATES == {RequestState.WAITING_REMOTE_KV, RequestState.WAITING_TIER_KV}
    for s in KV_WAIT_STATES:
        assert REQUEST_TRANSITIONS[s] == {RequestState.RUNNING, RequestState.FINISHED}
        check_transition(RequestState.WAITING, s)
        with pytest.raises(RuntimeError, match="illegal"):
            check_transition(RequestState.RUNNING, s)
        with pytest.raises(RuntimeError, match="illegal"):
            check_transition(s, RequestState.WAITING)
    assert set(REQUEST_TRANSITIONS) == set(RequestState)
