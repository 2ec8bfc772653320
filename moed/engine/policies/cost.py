"""balance.policy = "cost": each step gets a *time* budget and the fitted cost model picks the
prompt chunks that fit it (moed.balance.step_time; docs/balance.md).

Decodes first (preempting as the token policy does when KV runs out); remote-KV requests park
in (priority, arrival) order; then prompts, under way or waiting, get the chunks
`moed.balance.step_time.choose` picks for the step's time, from the most urgent priority
that has prompt work (`_by_priority`). The token policy runs instead while
the model is unfitted, and after an empty draft (e.g. partial prompts fill the KV pool: that
path preempts).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from moed.balance.step_time import (Buckets, Item, Pick, choose, chunk_budget, late_budget,
                                    step_budget, whole_budget)
from moed.balance.cost import (AdvertisedCost, CostModel, StepShape, bucket_of, max_chunk,
                               shape_of)
from moed.config import BalanceConfig
from moed.engine.policies.base import SchedulerView, StepDraft, StepPolicy
from moed.engine.policies.tokens import TokenPolicy
from moed.engine.request import Request
from moed.types import RequestState


@dataclass(frozen=True)
class StepTimeBudget:
    """One step's time (not a rank's memory budget, moed.parallel.budget, nor a prefill node's
    queue, moed.balance): the ITL target with decodes, `prefill_step_s` without; the length
    buckets and their TTFT targets order the prompts; at most `max_partial` under way."""
    buckets: Buckets
    itl_target_s: float
    prefill_step_s: float
    max_partial: int

    @classmethod
    def from_config(cls, b: BalanceConfig) -> StepTimeBudget | None:
        """None for policy "tokens"."""
        if b.policy != "cost":
            return None
        targets = tuple(t / 1000 for t in b.ttft_targets_ms)
        step = b.prefill_step_ms / 1000 or min(targets) / 4
        return cls(Buckets(tuple(b.bucket_edges), targets), b.itl_target_ms / 1000, step,
                   b.max_partial_prefills)


@dataclass(frozen=True)
class CostPolicy:
    budget: StepTimeBudget
    fallback: StepPolicy = field(default_factory=TokenPolicy)

    def fill(self, view: SchedulerView, step: StepDraft) -> None:
        cost = view.cost
        if cost is None or not cost.ready:
            self.fallback.fill(view, step)
            return
        tb, kv = self.budget, view.kv
        decodes: list[tuple[int, int, bool]] = []
        decoding: list[Request] = []
        for req in [r for r in view.running if r.num_tokens - r.num_computed_tokens <= 1]:
            n, start = req.num_tokens - req.num_computed_tokens, req.num_computed_tokens
            if n > 0 and step.extend(req, n, preempt=True):
                decodes.append((start, 1, True))
                decoding.append(req)
        seats = view.max_num_seqs - view.seated
        items = [Item(r.request_id, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens,
                      r.num_tokens, _age(r), True)
                 for r in view.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in list(view.waiting) if not step.preempted else []:
            if step.refuse_too_long(req):
                continue
            if req.remote_kv:
                if seats > 0 and step.park_remote(req):
                    seats -= 1
            else:
                items.append(Item(req.request_id, 0, req.num_tokens, req.num_tokens, _age(req)))
        base = shape_of(decodes, view.experts)
        has_decodes = bool(decodes)
        step_s = step_budget(has_decodes, tb.itl_target_s, tb.prefill_step_s)
        picks = _by_priority(view, items, base, cost, tb, has_decodes, step_s,
                             view.max_num_batched_tokens - len(decodes), seats)
        planned = list(decodes)
        for p in picks:
            req = view.requests[p.key]
            if req.state is RequestState.RUNNING:
                if step.extend(req, p.num_tokens, preempt=False):
                    planned.append((req.num_computed_tokens, p.num_tokens, False))
                continue
            hit = view.prefix_hit(req)
            if not step.load_from_tiers(req, hit):
                n = min(p.num_tokens, req.num_tokens - hit.num_tokens)
                if step.admit(req, hit, n):
                    planned.append((hit.num_tokens, n, False))
        if view.num_speculative_tokens:
            _drafts(view, step, cost, decoding, planned, step_s)
        if not step.num_chunks and not step.preempted:
            self.fallback.fill(view, step)

    def advertised(self, view: SchedulerView) -> AdvertisedCost | None:
        """This node's prefill cost state (what it would advertise; what early rejection
        predicts from): prompt work queued per bucket, the share of a step prefill gets.
        None before the cost model is fitted."""
        cost = view.cost
        if cost is None or not cost.ready:
            return None
        tb = self.budget
        edges = tb.buckets.edges
        toks, reqs = [0] * (len(edges) + 1), [0] * (len(edges) + 1)
        decodes = []
        for r in [*view.running, *(w for w in view.waiting if not w.remote_kv)]:
            left = r.num_tokens - r.num_computed_tokens
            if r.state is RequestState.RUNNING and left <= 1:
                decodes.append((r.num_computed_tokens, 1, True))
                continue
            b = bucket_of(edges, r.num_tokens)
            toks[b] += left
            reqs[b] += 1
        base = shape_of(decodes, view.experts)
        budget = step_budget(bool(decodes), tb.itl_target_s, tb.prefill_step_s)
        coef = cost.coefficients
        share = max(budget - coef.predict(base), 0.0) / budget if decodes else 1.0
        chunk = max_chunk(coef, base, 0, view.max_num_batched_tokens, budget, view.experts)
        return AdvertisedCost(coef, edges, tuple(toks), tuple(reqs), share,
                              chunk or view.kv.block_size)


def _by_priority(view: SchedulerView, items: list[Item], base: StepShape, cost: CostModel,
                 tb: StepTimeBudget, has_decodes: bool, step_s: float, max_tokens: int,
                 seats: int) -> list[Pick]:
    """`choose` for the most urgent priority (vLLM's `priority`, lower first) that has prompt
    work that can run; a less urgent one only in a step the more urgent ones take nothing of:
    a batch flood never lengthens the step that gives an interactive prompt its first token
    (bench/priority.py, 2 interactive streams beside 20 batch ones on the demo model, 8 s
    phases on a busy machine: with the batch prompts filling what the interactive one left of
    the chunk budget, interactive TTFT p50 was 2.3x its value alone and p99 1.5x; 40 s phases
    with this rule: 1.87x and 1.48x, docs/benchmarks.md)."""
    prio = {it.key: view.requests[it.key].params.priority for it in items}
    budget = chunk_budget(has_decodes, tb.itl_target_s, tb.prefill_step_s)
    whole = whole_budget(has_decodes, step_s, min(tb.buckets.ttft_targets_s))
    late = late_budget(has_decodes, cost.coefficients.predict(base), tb.itl_target_s, whole)
    partial = 0         # prompts under way in more urgent priorities hold max_partial's slots
    for level in sorted(set(prio.values())):
        group = [it for it in items if prio[it.key] == level]
        got = choose(group, base, cost.coefficients, budget, tb.buckets,
                     max_partial=max(tb.max_partial - partial, 0), max_tokens=max_tokens,
                     max_new=seats, min_tokens=view.kv.block_size, experts=view.experts,
                     whole_s=whole, late_s=late)
        if got:
            return got
        partial += sum(1 for it in group if it.partial)
    return []


def _drafts(view: SchedulerView, step: StepDraft, cost: CostModel, decoding: list[Request],
            planned: list[tuple[int, int, bool]], step_s: float) -> None:
    """Speculative decoding's drafts, last: each decoding request (admission order) takes the
    most drafts, at most k, that keep the predicted step within its time budget and the step
    within max_num_batched_tokens. planned: the step's chunks so far as (start, n, decode),
    decodes first in `decoding`'s order."""
    coef = cost.coefficients
    tokens = sum(n for _, n, _ in planned)
    for j, req in enumerate(decoding):
        start = planned[j][0]
        for d in range(min(view.num_speculative_tokens,
                           view.max_num_batched_tokens - tokens), 0, -1):
            trial = [*planned[:j], (start, 1 + d, True), *planned[j + 1:]]
            if coef.predict(shape_of(trial, view.experts)) <= step_s:
                got = step.speculate(req, d)
                if got:     # a decode with `got` verified positions (cost.verified_positions)
                    planned[j] = (start, 1 + got, True)
                    tokens += got
                break


def _age(req: Request) -> float:
    return time.monotonic() - req.arrival_time
