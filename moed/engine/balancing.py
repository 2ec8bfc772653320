"""The engine's side of the prefill balancer: the cost model it fits, the scheduler's time
budget, early-rejection predictions and the calibration run before /ready.

The step loop (one writer) feeds `observe(batch, seconds)` after every step with the forward
pass's measured time; `apply` swaps the scheduler's step policy (call it at a step boundary);
`ttft_over_deadline` is read by the API handler on the same event-loop thread (reads only).
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog

from moed.balance.step_time import ttft_deadline
from moed.balance.cost import FEATURES, CostModel, ExpertShape, predict_ttft, shape_of
from moed.config import BalanceConfig
from moed.engine.policies import TokenPolicy, from_config
from moed.engine.scheduler import Scheduler
from moed.types import SamplingParams

if TYPE_CHECKING:
    from moed.engine.engine import Engine

log = structlog.get_logger(__name__)

CALIBRATION_CHUNK = 512     # tokens per calibration step: seconds on a CPU, not minutes


class EngineBalance:
    def __init__(self, scheduler: Scheduler, spec: Any, cfg: BalanceConfig | None) -> None:
        """cfg None (engines built by hand, tests): the token policy, the model still fitted."""
        self.scheduler = scheduler
        self.cfg = cfg
        self.cost = CostModel(forgetting=cfg.forgetting if cfg is not None else 0.995)
        experts = int(getattr(spec, "num_experts", 0) or 0)
        shape = ExpertShape(experts, int(getattr(spec, "top_k", 0) or 0)) if experts else None
        scheduler.use_cost_model(self.cost, shape)
        scheduler.set_policy(from_config(cfg))

    def observe(self, batch: Any, seconds: float, drafts: Sequence[int] = ()) -> None:
        """One executed step: its ForwardBatch (a 1-token chunk counts as a decode, and so does
        a chunk with drafts[i] > 0 speculative drafts: a decode plus verified positions) and the
        forward + sample time."""
        if batch is None:
            return
        drafts = drafts or [0] * batch.num_seqs
        chunks = ((s, len(t), len(t) == 1 or d > 0)
                  for s, t, d in zip(batch.start_pos, batch.token_ids, drafts))
        self.cost.observe(shape_of(chunks, self.scheduler.experts), seconds)

    def fixed_step_s(self) -> float:
        """The seconds of a decode step that do not grow with its rows: the fitted model's
        intercept between one and two decoding rows (0 until it is fitted). What each step of a
        draining batch's tail pays (moed.engine.drafts.gate.spread_cost)."""
        if not self.cost.ready:
            return 0.0
        one, two = (self.cost.predict(shape_of(((0, 1, True),) * n, self.scheduler.experts)) for n in (1, 2))
        return max(2 * one - two, 0.0)

    def apply(self, cfg: BalanceConfig) -> None:
        self.cfg = cfg
        self.scheduler.set_policy(from_config(cfg))

    def ttft_over_deadline(self, prompt_tokens: int, timeout_s: float | None
                           ) -> tuple[float, float] | None:
        """(predicted TTFT, deadline) in seconds when a new prompt of this length is predicted
        to miss its deadline (early rejection); None when it is not, or the cost policy does
        not run (no fitted model to predict from)."""
        adv = self.scheduler.advertised()
        tb = self.scheduler.time_budget
        if adv is None or tb is None or self.cfg is None:
            return None
        predicted = predict_ttft(adv, prompt_tokens)
        limit = ttft_deadline(tb.buckets.target(prompt_tokens), self.cfg.reject_over_target,
                              timeout_s)
        return (predicted, limit) if predicted > limit else None

    def extra(self) -> dict[str, float]:
        """For EngineStats.extra (→ /metrics): coefficients, error quantiles, queued tokens."""
        med, p90 = self.cost.error_quantiles()
        out = {f"cost_coef_{name}": c
               for name, c in zip(FEATURES, self.cost.coefficients.as_tuple())}
        out.update(cost_samples=float(self.cost.samples), cost_error_p50=med, cost_error_p90=p90)
        adv = self.scheduler.advertised()
        if adv is not None:
            for b, toks in enumerate(adv.queued_tokens):
                out[f"cost_queued_tokens_b{b}"] = float(toks)
        return out


def calibrate(engine: Engine, steps: int) -> int:
    """Run synthetic steps before the node is ready (the loop not started), so the first
    requests are budgeted from a fitted model: one short prompt, a batch of short ones (a
    prefill step, then decode steps of 8), and a long prompt in CALIBRATION_CHUNK chunks
    (the attention term). The token policy runs them (chunks capped at CALIBRATION_CHUNK).
    -> steps run. Random token ids: nothing about the node's real traffic is assumed."""
    if steps <= 0:
        return 0
    s = engine.scheduler
    saved = (s.policy, s.max_num_seqs, s.max_num_batched_tokens)
    rng = random.Random(0)
    vocab = engine.spec.vocab_size
    room = min(engine.max_model_len, engine.kv.capacity_tokens) - 8
    long_len = max(1, min(4 * CALIBRATION_CHUNK, room // 2))
    rounds = [(1, 32, 4), (8, 64, 4), (1, long_len, 2)]
    start = engine.steps
    s.set_policy(TokenPolicy())
    s.set_limits(max(saved[1], 8), min(saved[2], CALIBRATION_CHUNK))
    try:
        while engine.steps - start < steps:
            for n, length, new in rounds:
                if engine.steps - start >= steps:
                    break
                length = max(1, min(length, room // max(n, 1)))
                prompts = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]
                engine.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True,
                                                        temperature=0.0))
    finally:
        s.set_policy(saved[0])
        s.set_limits(saved[1], saved[2])
    med, p90 = engine.balance.cost.error_quantiles()
    c = engine.balance.cost.coefficients
    log.info("cost_model_calibrated", steps=engine.steps - start,
             overhead_ms=round(c.overhead_s * 1e3, 3), per_token_us=round(c.per_token_s * 1e6, 3),
             per_kpair_us=round(c.per_pair_s * 1e9, 3), per_decode_ms=round(c.per_decode_s * 1e3, 3),
             error_p50=round(med, 3), error_p90=round(p90, 3))
    return engine.steps - start

