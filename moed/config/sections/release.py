"""[release] and [canary]: version labels, config history and the canary split."""
from __future__ import annotations

from dataclasses import dataclass

from moed.config.schema import ConfigError, _check_bounds, _f, _short

LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-")


def _label(name: str, value: str) -> None:
    """A version label travels in gossip and in metric labels: short, plain characters."""
    if len(value) > 64 or not set(value) <= LABEL_CHARS:
        raise ConfigError(f"{name}: {_short(value)} is not a version label (at most 64 of "
                          f"A-Z a-z 0-9 . _ + -)")


@dataclass(frozen=True)
class ReleaseConfig:
    """What this node says about its release (membership, per-version metrics) and how much
    config history it keeps (moed/ops/history.py)."""
    version_label: str = _f("", doc="this node's version in membership, canary routing and "
                            "per-version metrics; default: the moed version. Set it to tell "
                            "two processes of one build apart (canary vs baseline)")
    config_history: int = _f(20, live=True, bounds=(1, 1000),
                             doc="applied configs kept (start, reloads, rollbacks), newest last")

    def label(self) -> str:
        """The version label this node advertises."""
        from moed import __version__
        return self.version_label or __version__

    def __post_init__(self) -> None:
        _check_bounds("release", self)
        _label("release.version_label", self.version_label)


CANARY_HEADER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")


@dataclass(frozen=True)
class CanaryConfig:
    """The router role's canary split (moed/balance/canary.py): a share of requests, or those
    that ask with a header, go to the nodes whose version label is `label`; the rest to the
    others (the baseline). /admin/canary and `moed canary` compare the two over `window_s`."""
    label: str = _f("", live=True, doc="version label of the canary nodes; empty = no canary")
    share: float = _f(0.0, live=True, bounds=(0.0, 1.0),
                      doc="fraction of requests sent to the canary (0..1)")
    header: str = _f("X-Moed-Canary", live=True,
                     doc="request header that picks the side: 1/canary or 0/baseline "
                     "(anything else: 400); empty = not read")
    window_s: float = _f(300.0, live=True, bounds=(1.0, 86400.0),
                         doc="canary figures cover the requests of this last stretch")
    min_requests: int = _f(20, live=True, bounds=(1, 1 << 20),
                           doc="canary attempts in the window before a verdict is given")
    max_error_rate_increase: float = _f(0.02, live=True, bounds=(0.0, 1.0),
                                        doc="unhealthy when the canary's error rate exceeds "
                                        "the baseline's by more than this")
    max_ttft_ratio: float = _f(1.5, live=True, bounds=(1.0, 1000.0),
                               doc="unhealthy when the canary's median TTFT exceeds the "
                               "baseline's by this factor")
    max_itl_ratio: float = _f(1.5, live=True, bounds=(1.0, 1000.0),
                              doc="unhealthy when the canary's median inter-token latency "
                              "exceeds the baseline's by this factor")

    def __post_init__(self) -> None:
        _check_bounds("canary", self)
        _label("canary.label", self.label)
        if self.header and (len(self.header) > 64 or not set(self.header) <= CANARY_HEADER_CHARS):
            raise ConfigError(f"canary.header: {_short(self.header)} is not a header name")
