"""Capacity signals, measured and predicted: what an autoscaler (moed plan, a Kubernetes
HPA/KEDA) reads to decide how many prefill and decode nodes the load needs. Exported on
/metrics (moed_capacity_*) and in the gossip load vector (moed.cluster.state.LoadVector: any
node's /cluster has every node's); docs/metrics.md and docs/tracing.md say what each means.

Glossary (one node):
    prefill_tps       measured prompt tokens computed per second of engine step, over recent
                      steps that computed prompt tokens (a decaying sum: tokens / seconds)
    decode_step_s     measured mean time of a recent engine step that decoded
    queue_s           recent requests' mean wait from arrival to first scheduled (queue time)
    compute_s         their mean first scheduled → first token (prefill compute; on a decode
                      node: the remote prefill, transfer included)
    predicted_ttft_s  TTFT the cost model predicts for a new prompt of the reference length
                      (balance.bucket_edges[0] tokens) given the queued work
                      (moed.balance.cost.predict_ttft); without a fitted model, the queued
                      prompt tokens plus the reference prompt at the measured prefill_tps
    capacity_tokens   prompt tokens this node can still take now and keep that prediction
                      within its TTFT target (balance.ttft_targets_ms[0]):
                          max(0, target_s - predicted_ttft_s) * prefill_tps
                      (queued work drains at about prefill_tps; 0 = at or past the SLO)
    itl_headroom      1 - decode_step_s / balance.itl_target_ms: the share of the ITL target
                      a decode step leaves unused (negative = steps slower than the target)
"Not measured yet" is -1 for the rates and times (a fresh node; an autoscaler skips it).

Everything here is on the event loop: one update per engine step and per finished request,
never per token. The formulas are pure functions (below) so they are tested without a node.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moed.balance.cost import AdvertisedCost, predict_ttft

if TYPE_CHECKING:
    from moed.config import BalanceConfig
    from moed.engine.client import EngineClient

UNKNOWN = -1.0
STEP_DECAY = 0.98        # per step: ~50 steps of memory (a second or two of a busy node)
REQUEST_DECAY = 0.9      # per finished request: ~10 requests of memory
DEFAULT_REF_TOKENS = 512


@dataclass(frozen=True)
class Capacity:
    prefill_tps: float = UNKNOWN
    decode_step_s: float = UNKNOWN
    queue_s: float = UNKNOWN
    compute_s: float = UNKNOWN
    predicted_ttft_s: float = UNKNOWN
    capacity_tokens: int = 0
    itl_headroom: float = 1.0


def predicted_ttft_s(adv: AdvertisedCost | None, ref_tokens: int, queued_tokens: int,
                     prefill_tps: float) -> float:
    """The cost model's prediction when fitted; else queued + reference tokens at the measured
    rate; UNKNOWN when neither is known."""
    if adv is not None:
        return predict_ttft(adv, ref_tokens)
    if prefill_tps > 0:
        return (queued_tokens + ref_tokens) / prefill_tps
    return UNKNOWN


def capacity_tokens(target_s: float, predicted_s: float, prefill_tps: float) -> int:
    """max(0, target - predicted) x prefill_tps: prompt tokens that fit under the TTFT SLO."""
    if predicted_s < 0 or prefill_tps <= 0:
        return 0
    return round(max(0.0, target_s - predicted_s) * prefill_tps)


def itl_headroom(decode_step_s: float, itl_target_s: float) -> float:
    """1 - step / target (1.0 while no decode step was measured)."""
    if decode_step_s < 0 or itl_target_s <= 0:
        return 1.0
    return 1.0 - decode_step_s / itl_target_s


class CapacityMeter:
    """Decaying sums of this node's steps and finished requests (the one writer: the loop)."""

    def __init__(self) -> None:
        self._pf_tokens = self._pf_s = 0.0
        self._dec_s = self._dec_n = 0.0
        self._queue = self._compute = self._req_n = 0.0
        self._compute_n = 0.0

    def on_step(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        if prefill_tokens > 0 and seconds > 0:
            self._pf_tokens = STEP_DECAY * self._pf_tokens + prefill_tokens
            self._pf_s = STEP_DECAY * self._pf_s + seconds
        if decode_tokens > 0 and seconds > 0:
            self._dec_s = STEP_DECAY * self._dec_s + seconds
            self._dec_n = STEP_DECAY * self._dec_n + 1.0

    def on_finish(self, timings: Any) -> None:
        """A finished request's moed.types.RequestTimings (None fields: it never got there)."""
        if timings is None or timings.queue_s is None:
            return
        self._queue = REQUEST_DECAY * self._queue + timings.queue_s
        self._req_n = REQUEST_DECAY * self._req_n + 1.0
        if timings.prefill_s is not None:
            self._compute = REQUEST_DECAY * self._compute + timings.prefill_s
            self._compute_n = REQUEST_DECAY * self._compute_n + 1.0

    @property
    def prefill_tps(self) -> float:
        return self._pf_tokens / self._pf_s if self._pf_s > 0 else UNKNOWN

    @property
    def decode_step_s(self) -> float:
        return self._dec_s / self._dec_n if self._dec_n > 0 else UNKNOWN

    def report(self, adv: AdvertisedCost | None, queued_tokens: int, balance: Any) -> Capacity:
        """The signals now, for `balance` (moed.config.BalanceConfig: reference length and
        targets) and the scheduler's advertised cost state (None: no fitted model)."""
        ref = balance.bucket_edges[0] if balance.bucket_edges else DEFAULT_REF_TOKENS
        target = balance.ttft_targets_ms[0] / 1000.0
        tps, step = self.prefill_tps, self.decode_step_s
        ttft = predicted_ttft_s(adv, ref, queued_tokens, tps)
        return Capacity(
            prefill_tps=tps, decode_step_s=step,
            queue_s=self._queue / self._req_n if self._req_n > 0 else UNKNOWN,
            compute_s=self._compute / self._compute_n if self._compute_n > 0 else UNKNOWN,
            predicted_ttft_s=ttft, capacity_tokens=capacity_tokens(target, ttft, tps),
            itl_headroom=itl_headroom(step, balance.itl_target_ms / 1000.0))


METER = CapacityMeter()      # this process's engine (one per node), like the metric registries


def of_engine(engine: EngineClient, balance: BalanceConfig) -> Capacity:
    """The signals of a node's engine now (its scheduler's advertised cost state, if any)."""
    return METER.report(engine.advertised(), engine.stats().queued_prompt_tokens, balance)
