"""Canary routing and its verdict (pure): which side a request goes to, and whether the canary
is healthy next to the baseline. No clocks, no I/O: callers pass `now` and the random draw.

Glossary
    label      a node's version label (release.version_label, gossiped as NodeMeta.label)
    canary     the nodes whose label is canary.label; baseline: every other serving node
    side       CANARY or BASELINE: where one request is sent
    pin        a request header that chooses the side itself (tests, a tenant trying the canary)
    outcome    one backend attempt as the router saw it: failed or not, its time to first
               token and mean inter-token gap (streams only: a whole response has no tokens
               to time)
    figures    attempts, errors, error rate and latency quantiles of one side over the window

Retries count per attempt: a canary that answers 503 and is retried on the baseline still
counts one error against the canary, or a failing canary would look healthy behind the
router's retries.
"""
from __future__ import annotations

import dataclasses
import enum
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from moed.balance.candidate import Candidate


class Side(str, enum.Enum):
    CANARY = "canary"
    BASELINE = "baseline"


_PIN = {"1": Side.CANARY, "true": Side.CANARY, "canary": Side.CANARY,
        "0": Side.BASELINE, "false": Side.BASELINE, "baseline": Side.BASELINE}


def parse_pin(value: str | None) -> Side | None:
    """The side a request header asks for; None when absent. ValueError for anything else
    (a typo must not silently route by share)."""
    if value is None:
        return None
    side = _PIN.get(value.strip().lower())
    if side is None:
        raise ValueError(f"expected 1/canary or 0/baseline, got {value[:40]!r}")
    return side


def choose_side(share: float, draw: float, pin: Side | None = None) -> Side:
    """The pin if there is one, else CANARY with probability `share` (draw uniform in [0, 1))."""
    if pin is not None:
        return pin
    return Side.CANARY if draw < share else Side.BASELINE


def side_of(label: str, canary_label: str) -> Side:
    return Side.CANARY if canary_label and label == canary_label else Side.BASELINE


def candidates_for(cands: Sequence[Candidate], canary_label: str, side: Side,
                   pinned: bool) -> list[Candidate]:
    """The chosen side's candidates. A side chosen by share that has no node left falls back
    to every candidate (availability first: the share is a target, not a promise); a pinned
    request gets only its side (empty: the caller answers 503)."""
    if not canary_label:
        return list(cands)
    mine = [c for c in cands if side_of(c.label, canary_label) is side]
    return mine if mine or pinned else list(cands)


# ---- outcomes and figures -------------------------------------------------------------------

@dataclass(frozen=True)
class Outcome:
    at: float                     # when the attempt ended (the caller's clock)
    error: bool                   # connect failure, 5xx, or cut mid-stream
    ttft: float | None = None     # seconds to the first token of a stream
    itl: float | None = None      # mean seconds between a stream's later tokens


class Window:
    """The last outcomes per version label, at most `max_per_version` each (memory is bounded
    whatever the rate; the time window is applied when figures are read)."""

    def __init__(self, max_per_version: int = 20000) -> None:
        self.max = max_per_version
        self._by_label: dict[str, deque[Outcome]] = {}

    def add(self, label: str, o: Outcome) -> None:
        q = self._by_label.get(label)
        if q is None:
            q = self._by_label[label] = deque(maxlen=self.max)
        q.append(o)

    def labels(self) -> list[str]:
        return sorted(self._by_label)

    def recent(self, label: str, now: float, window_s: float) -> list[Outcome]:
        q = self._by_label.get(label)
        if not q:
            return []
        while q and q[0].at < now - window_s:      # old ones are never needed again
            q.popleft()
        return list(q)


def quantile(xs: Sequence[float], q: float) -> float | None:
    """The q-quantile by the nearest-rank method; None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


@dataclass(frozen=True)
class Figures:
    requests: int = 0
    errors: int = 0
    error_rate: float = 0.0
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    itl_p50: float | None = None
    itl_p95: float | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        r = lambda v: None if v is None else round(v, 6)   # noqa: E731
        return {"requests": self.requests, "errors": self.errors,
                "error_rate": round(self.error_rate, 6), "ttft_p50_s": r(self.ttft_p50),
                "ttft_p95_s": r(self.ttft_p95), "itl_p50_s": r(self.itl_p50),
                "itl_p95_s": r(self.itl_p95)}


def figures(outcomes: Iterable[Outcome]) -> Figures:
    os_ = list(outcomes)
    errors = sum(1 for o in os_ if o.error)
    ttft = [o.ttft for o in os_ if o.ttft is not None]
    itl = [o.itl for o in os_ if o.itl is not None]
    return Figures(len(os_), errors, errors / len(os_) if os_ else 0.0,
                   quantile(ttft, 0.5), quantile(ttft, 0.95), quantile(itl, 0.5),
                   quantile(itl, 0.95))


# ---- verdict -------------------------------------------------------------------------------

class Health(str, enum.Enum):
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    INSUFFICIENT = "insufficient_data"     # too few canary attempts to say


@dataclass(frozen=True)
class Thresholds:
    min_requests: int = 20
    max_error_rate_increase: float = 0.02
    max_ttft_ratio: float = 1.5
    max_itl_ratio: float = 1.5

    @classmethod
    def of(cls, cc: object) -> Thresholds:
        """From a moed.config.CanaryConfig."""
        return cls(cc.min_requests, cc.max_error_rate_increase,    # type: ignore[attr-defined]
                   cc.max_ttft_ratio, cc.max_itl_ratio)            # type: ignore[attr-defined]


@dataclass(frozen=True)
class Verdict:
    health: Health
    reasons: tuple[str, ...] = ()


def verdict(canary: Figures, baseline: Figures, th: Thresholds) -> Verdict:
    """UNHEALTHY when any threshold is crossed (every crossing is a reason); latency is
    compared only when both sides have streams to time; INSUFFICIENT below min_requests."""
    if canary.requests < th.min_requests:
        return Verdict(Health.INSUFFICIENT, (f"{canary.requests} canary attempts in the window, "
                                             f"{th.min_requests} needed",))
    reasons = []
    if canary.error_rate > baseline.error_rate + th.max_error_rate_increase:
        reasons.append(f"error rate {canary.error_rate:.3f} > baseline "
                       f"{baseline.error_rate:.3f} + {th.max_error_rate_increase:g}")
    for name, c, b, limit in (("TTFT", canary.ttft_p50, baseline.ttft_p50, th.max_ttft_ratio),
                              ("ITL", canary.itl_p50, baseline.itl_p50, th.max_itl_ratio)):
        if c is not None and b is not None and b > 0 and c > limit * b:
            reasons.append(f"median {name} {c * 1000:.1f} ms > {limit:g} x baseline "
                           f"{b * 1000:.1f} ms")
    return Verdict(Health.UNHEALTHY if reasons else Health.HEALTHY, tuple(reasons))


def report(window: Window, cc: Any, now: float) -> dict[str, Any]:
    """The canary (version label cc.label) vs the baseline (every other label) over the last
    cc.window_s, each version's own figures, the thresholds and the verdict (none without a
    canary label). `cc` is a moed.config.CanaryConfig; JSON-ready (GET /admin/canary)."""
    per = {lb: window.recent(lb, now, cc.window_s) for lb in window.labels()}
    is_canary = {lb: side_of(lb, cc.label) is Side.CANARY for lb in per}
    fc = figures(o for lb, os_ in per.items() if is_canary[lb] for o in os_)
    fb = figures(o for lb, os_ in per.items() if not is_canary[lb] for o in os_)
    th = Thresholds.of(cc)
    body: dict[str, Any] = {
        "label": cc.label, "share": cc.share, "header": cc.header, "window_s": cc.window_s,
        "canary": fc.to_dict(), "baseline": fb.to_dict(),
        "versions": {lb: figures(os_).to_dict() for lb, os_ in per.items()},
        "thresholds": dataclasses.asdict(th)}
    if cc.label:
        v = verdict(fc, fb, th)
        body["verdict"] = {"health": v.health.value, "reasons": list(v.reasons)}
    return body
