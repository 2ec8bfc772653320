"""An idle rank's view of its ring neighbour's heartbeat (moed.parallel.agree.Heartbeat): only
a counter that stands still for the timeout, on this rank's own clock, is a dead peer."""
from __future__ import annotations

from moed.parallel.agree import Heartbeat


def test_a_moving_counter_is_alive_a_still_one_dies_after_the_timeout() -> None:
    hb = Heartbeat(3.0)
    assert not hb.dead(5, 100.0)          # first sight: just moved
    assert not hb.dead(6, 101.0) and not hb.dead(7, 102.0)
    assert not hb.dead(7, 104.9)          # 2.9 s still
    assert hb.silent_for(7, 105.0) == 3.0 and not hb.dead(7, 105.0)
    assert hb.dead(7, 105.1)
    assert not hb.dead(8, 106.0)          # it moved again (a slow poll, not a death)


def test_only_this_ranks_clock_counts() -> None:
    # the counter's value says nothing about time: a peer that beat a million times long ago
    # and then stopped is dead after the timeout from when we first saw it stop
    hb = Heartbeat(1.0)
    assert not hb.dead(10**6, 0.0)
    assert hb.dead(10**6, 1.5)
