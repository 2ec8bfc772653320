"""balance.prefill.pick_prefill: breaker first, then fewest jobs in flight, never across KV
layouts."""
from __future__ import annotations

from moed.balance.breaker import PeerHealth, on_failure
from moed.balance.candidate import Candidate, layout_compatible
from moed.balance.prefill import pick_prefill


def _c(name: str, inflight: int = 0, health: PeerHealth | None = None,
       layout: str = "") -> Candidate:
    return Candidate(name, f"http://{name}", "prefill", layout, inflight=inflight,
                     health=health or PeerHealth())


def _pick(cands, exclude=(), now=1.0, cooldown=5.0, layout="") -> str | None:
    c = pick_prefill(cands, set(exclude), now, cooldown, layout)
    return None if c is None else c.name


def test_pick_prefers_idle_healthy_and_skips_excluded() -> None:
    failed = on_failure(PeerHealth(), 0.0)
    assert _pick([_c("a", 2), _c("b", 1), _c("c", 0, failed)]) == "b"
    assert _pick([_c("a"), _c("b"), _c("c", 0, failed)]) == "a"             # tie → name
    assert _pick([_c("a"), _c("b"), _c("c", 0, failed)], {"a", "b"}, now=6.0) == "c"  # trial
    # only cooling peers left: the oldest failure is tried rather than failing for sure
    assert _pick([_c("a"), _c("b"), _c("c", 0, failed)], {"a", "b"}) == "c"
    cooling = [_c("x", 0, on_failure(PeerHealth(), 3.0)), _c("y", 0, on_failure(PeerHealth(), 2.0))]
    assert _pick(cooling, now=4.0) == "y"
    assert _pick([_c("a"), _c("b")], {"a", "b"}) is None                    # all tried
    # a peer whose cooldown is over gets the next job as its trial, even when busier
    assert _pick([_c("a", 3, failed), _c("b")], now=10.0) == "a"
    assert _pick([_c("a", 0, failed), _c("b")], now=4.0) == "b"
    assert _pick([]) is None


def test_a_different_kv_layout_is_never_picked() -> None:
    cands = [_c("a", 0, layout="gqa-1"), _c("b", 5, layout="gqa-2"), _c("static", 9)]
    assert _pick(cands, layout="gqa-2") == "b"
    assert _pick(cands, {"b"}, layout="gqa-2") == "static"   # unknown: the handshake decides
    assert _pick([_c("a", layout="gqa-1")], layout="gqa-2") is None   # not even when cooling
    assert _pick(cands) == "a"                                # we do not advertise one
    assert layout_compatible("x", "x") and not layout_compatible("x", "y")
    assert layout_compatible("", "y") and layout_compatible("x", "")
