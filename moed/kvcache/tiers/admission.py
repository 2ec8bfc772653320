"""What a load waits for before its request can run: the step in flight without it.

A load is collected at the step boundary after the step being planned, so on a busy engine
the loaded request runs one step later than a recomputed one would have (moed.kvcache.tiers
.cache.TieredCache.plan adds that wait). The scheduler (moed.engine.tier_admission,
`TierAdmission.try_load`) asks here for the wait, per request:

- the fitted cost model's prediction of the step of the *others*: running decodes, running
  prompt chunks, then the waiting prompts' chunks up to the token budget, inflated by the
  model's p90 relative error (predicting a load too fast is the costly mistake);
- a waiting prompt that would itself load (its next blocks below L1, loading them predicted
  faster on an idle engine) is not counted: deciding it, the engine sees this request loading,
  not running, so it plans idle and loads too, and no step runs before both are collected.
  Its entries are held until the next step boundary, so this load's L1 allocation (which
  pushes blocks down) cannot evict them in between;
- None before the cost model is fitted: the cache's measured average step then.

Reads the scheduler's state through `AdmissionView` (the scheduler, read-only: this package
sits below moed.engine, so the narrow interface is declared here); changes nothing but the
tiers' holds.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

from moed.balance.cost import CostModel, ExpertShape, shape_of
from moed.kvcache.manager import KVCacheManager, PrefixHit
from moed.kvcache.tiers.cache import TieredCache, TierMatch
from moed.kvcache.tiers.policy import LoadPlan
from moed.types import RequestState


class Prompt(Protocol):
    """What admission reads of a request (moed.engine.request.Request)."""
    @property
    def token_ids(self) -> Sequence[int]: ...
    @property
    def cache_root(self) -> int | None: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def remote_kv(self) -> bool: ...
    @property
    def prompt_logprobs_pending(self) -> bool: ...
    @property
    def state(self) -> RequestState: ...


class AdmissionView(Protocol):
    """What admission reads of the scheduler (moed.engine.scheduler.Scheduler)."""
    @property
    def kv(self) -> KVCacheManager: ...
    @property
    def tiers(self) -> TieredCache | None: ...
    @property
    def cost(self) -> CostModel | None: ...
    @property
    def experts(self) -> ExpertShape | None: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def running(self) -> Sequence[Prompt]: ...
    @property
    def waiting(self) -> Sequence[Prompt]: ...
    def predict_prefill_s(self, tokens: int, start: int) -> float: ...


def plan_for(sched: AdmissionView, req: Prompt, hit: PrefixHit, busy: bool
             ) -> tuple[TierMatch, LoadPlan] | None:
    """The tiers' match for `req` after its L1 prefix `hit` and the load-or-recompute plan
    (busy: others run in the step being planned); None when nothing of its prompt sits below
    L1. A load planned on the assumption that waiting prompts load too holds their entries
    until the next step boundary (TieredCache.hold): this load's own L1 allocation may push
    blocks down and evict them, and their recompute would then delay this load a step."""
    t, kv = sched.tiers, sched.kv
    if t is None:
        return None
    m = t.match(kv.hashes_after(req.token_ids, hit, req.cache_root))
    if not m.keys:
        return None
    bs, start = kv.block_size, hit.num_tokens
    rest = req.num_tokens - start
    step_s, coload = others_step(sched, req) if busy else (None, [])
    plan = t.plan(m, lambda k: sched.predict_prefill_s(rest - k * bs, start + k * bs),
                  busy=busy, step_s=step_s)
    if plan.num_load and coload:
        t.hold(coload)
    return m, plan


def would_load(sched: AdmissionView, req: Prompt) -> tuple[int, ...]:
    """The tier entries a waiting prompt loads when it is decided on an idle engine (none:
    it recomputes)."""
    if req.remote_kv or req.prompt_logprobs_pending:
        return ()
    got = plan_for(sched, req, sched.kv.prefix_hit(req.token_ids, req.cache_root), busy=False)
    return got[0].keys[:got[1].num_load] if got is not None else ()


def others_step(sched: AdmissionView, req: Prompt) -> tuple[float | None, list[int]]:
    """The predicted step in flight without `req` (see the module docstring), and the tier
    entries of the waiting prompts taken to load instead of running in it."""
    cost = sched.cost
    if cost is None or not cost.ready:
        return None, []
    budget = sched.max_num_batched_tokens
    chunks: list[tuple[int, int, bool]] = []
    coload: list[int] = []
    # only the waiting prompts that could join this step (free seats): bounds the scan, which
    # runs for every admission, whatever the queue's length
    seats = max(0, sched.max_num_seqs - len(sched.running))
    for r in (*sched.running, *itertools.islice(sched.waiting, seats + 1)):
        left = r.num_tokens - r.num_computed_tokens
        if r is req or r.remote_kv or left <= 0:
            continue
        running = r.state is RequestState.RUNNING
        if running and left <= 1:
            chunks.append((r.num_computed_tokens, 1, True))
        elif budget > 0:
            if not running:
                keys = would_load(sched, r)
                if keys:
                    coload.extend(keys)
                    continue
            n = min(left, budget)
            budget -= n
            chunks.append((r.num_computed_tokens, n, False))
        elif not running:
            break       # the budget is spent: later waiting prompts run in a later step
    if not chunks:
        return 0.0, coload
    _, p90 = cost.error_quantiles()
    return cost.coefficients.predict(shape_of(chunks, sched.experts)) * (1.0 + p90), coload
