"""The step budget in time (pure): which prompt chunks run this step.

Glossary
    item        one prompt still being computed: `start` tokens already in the KV cache,
                `remaining` to go, `total` its length (its bucket), `age_s` since arrival,
                `partial` when it holds KV blocks already (a prefill under way)
    bucket      a length class (edges e.g. 512 / 4k / 32k / ∞), each with a TTFT target
    slack       target − age − predicted remaining prefill time: how long the item can still
                wait and meet its target. Smallest slack runs first
    budget_s    the step's time for chunks (`chunk_budget`): `prefill_step_s`, and at most
                the inter-token-latency target when decodes run (they are in `base`, so
                prefill fills what they leave)
    whole_s     the step's time for finishing prompts of the shortest target whole
                (`whole_budget`): the ITL target with decodes, half that target without
    late_s      the same for such prompts already past their target (`late_budget`): the
                decodes' predicted time plus the ITL target again; the one waiting longest
                of all urgent prompts, if a short, finishes whole whatever the step takes

Order = least slack first. Shorter buckets have smaller targets and less remaining work, so
this is shortest-remaining-first across buckets; age lowers the slack (aging). The step is
filled in two passes: first, in that order, the prompts that complete within what is left
(their first token comes this step) and the *urgent* ones (waited past their own bucket's
target: from then on they no longer yield; while one waits, the others — whole prompts,
then chunks — take at most half the step's prefill time before it, URGENT_SHARE; among
themselves shortest remaining first); then everything else gets chunks of what remains,
shortest remaining first. So a long prompt that can only make progress never holds back a
short one that could finish — measured: a plain one-pass fill let a long prompt predicted
to miss its own target (least slack) take every step, and the shorts behind it waited 12 s —
and its own wait is still bounded: it runs on the leftovers, and past its target on at
least half of each step that non-urgent prompts share with it. Each item gets the largest
chunk the cost model says still fits (`moed.balance.cost.max_chunk`); at most `max_partial`
prompts are under way at once (a new one starts only if it completes this step or a slot is
free).

A machine too slow for the budgets (issue 30 item 6: an AVX2 CPU on torch's bf16 path, a
step's fixed cost above the 125 ms prefill step and the 100 ms ITL target): no chunk fitted,
each step gave the head of the slack order — the long prompt, its slack the most negative —
`min_tokens`, and shorts, all past their target, queued behind it by slack. The budgets are
floored at `floor_budget` (the smallest step's time again: chunks sized from the fitted step
time), and urgent prompts go shortest remaining first. When still nothing fits (a token
cap), the head, shortest remaining first, gets `min_tokens`, so progress never stops.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from moed.balance.cost import Coefficients, ExpertShape, StepShape, add_chunk, bucket_of, \
    max_chunk


URGENT_SHARE = 0.5   # of a step's prefill time, kept for prompts past their target


@dataclass(frozen=True)
class Buckets:
    edges: tuple[int, ...] = (512, 4096, 32768)
    ttft_targets_s: tuple[float, ...] = (0.5, 2.0, 10.0, 60.0)   # one per bucket (edges + 1)

    def __post_init__(self) -> None:
        if len(self.ttft_targets_s) != len(self.edges) + 1:
            raise ValueError(f"{len(self.edges)} bucket edges need {len(self.edges) + 1} TTFT "
                             f"targets, got {len(self.ttft_targets_s)}")
        if list(self.edges) != sorted(set(self.edges)) or any(e < 1 for e in self.edges):
            raise ValueError("bucket edges must be positive and strictly increasing")
        if any(t <= 0 for t in self.ttft_targets_s):
            raise ValueError("TTFT targets must be positive")

    def bucket(self, tokens: int) -> int:
        return bucket_of(self.edges, tokens)

    def target(self, tokens: int) -> float:
        return self.ttft_targets_s[self.bucket(tokens)]


@dataclass(frozen=True)
class Item:
    key: str
    start: int
    remaining: int
    total: int
    age_s: float
    partial: bool = False


@dataclass(frozen=True)
class Pick:
    key: str
    num_tokens: int


def slack(item: Item, coef: Coefficients, buckets: Buckets) -> float:
    return (buckets.target(item.total) - item.age_s
            - coef.prefill_seconds(item.remaining, item.start))


def order(items: Sequence[Item], coef: Coefficients, buckets: Buckets) -> list[Item]:
    """Least slack first; ties: the older, then the key (deterministic)."""
    return sorted(items, key=lambda it: (slack(it, coef, buckets), -it.age_s, it.key))


def choose(items: Sequence[Item], base: StepShape, coef: Coefficients, budget_s: float,
           buckets: Buckets, *, max_partial: int, max_tokens: int, max_new: int = 1 << 30,
           min_tokens: int = 16, experts: ExpertShape | None = None,
           whole_s: float = 0.0, late_s: float = 0.0) -> list[Pick]:
    """This step's prefill chunks, in priority order. `base` = the step's decodes (always
    run); `max_tokens` = the hard cap on prefill tokens (activation memory); `max_new` = how
    many items that are not `partial` may start (free sequence seats). `budget_s` bounds the
    step for chunks (`chunk_budget`), `whole_s` for whole prompts and urgent ones
    (`whole_budget`; below `budget_s`: `budget_s`). Prompts of the shortest target past it
    finish whole while the step fits `late_s` (`late_budget`; below `whole_s`: `whole_s`), and
    the one that has waited longest of all urgent prompts, if it is such a short, whatever it
    costs (the bucket bounds it; a long one waiting longer keeps its turn)."""
    # a slow machine: a budget below what the smallest step costs would let no chunk fit
    # (every step then gave the least-slack prompt min_tokens); chunks get at least the
    # smallest step's time again (floor_budget), so their own work is worth its fixed cost
    floor_s = floor_budget(coef, base, min(min_tokens, max_tokens), experts)
    floored = floor_s > budget_s     # the machine is slower than the budgets
    budget_s = max(budget_s, floor_s)
    whole_s = max(whole_s, budget_s)
    late_s = max(late_s, whole_s)
    picks: list[Pick] = []
    shape, left, new = base, max_tokens, 0
    partials = sum(1 for it in items if it.partial)
    ranked = order(items, coef, buckets)

    def fit(it: Item, limit_s: float) -> int:
        if not it.partial and new >= max_new:
            return 0
        return max_chunk(coef, shape, it.start, min(it.remaining, left), limit_s, experts)

    def amortized(it: Item) -> int:
        """A chunk whose own cost is at most twice its unavoidable part (the step overhead and
        the cached context it reads): for a prompt whose context alone outgrows the budget,
        so it still moves in chunks worth their fixed cost, not min_tokens at a time."""
        one = coef.predict(add_chunk(shape, it.start, 1, experts)) - coef.predict(shape)
        return max_chunk(coef, shape, it.start, min(it.remaining, left),
                         coef.predict(shape) + 2 * one, experts)

    def whole(it: Item, limit_s: float) -> bool:
        """Does the whole rest of `it` fit under `limit_s` (one prediction, not a search)?"""
        return (it.remaining <= left and (it.partial or new < max_new) and coef.predict(
            add_chunk(shape, it.start, it.remaining, experts)) <= limit_s)

    def take(it: Item, n: int) -> None:
        nonlocal shape, left, new, partials
        if not it.partial and n < it.remaining:
            partials += 1
        new += not it.partial
        picks.append(Pick(it.key, n))
        if n == it.remaining:
            firsts.append(buckets.target(it.total))
        shape = add_chunk(shape, it.start, n, experts)
        left -= n
        taken.add(it.key)

    def fill(candidates: Sequence[Item], limit_s: float, chunks: bool,
             urgent_pass: bool = False) -> None:
        """Whole prompts (chunks=False) or the largest chunks (True) under `limit_s`."""
        for it in candidates:
            if left <= 0 or coef.predict(shape) >= limit_s:
                return
            if it.key in taken:
                continue
            if not chunks:
                # only a prompt of the shortest target may grow the step past the chunk
                # budget: a long one finishing a step later costs nothing against its
                # target, its longer step delays the shorts arriving meanwhile (measured: a
                # 230 ms last step of a long prompt, then three shorts, 0.54 s TTFT)
                lim = limit_s if buckets.target(it.total) <= shortest else min(limit_s,
                                                                               budget_s)
                if whole(it, lim):
                    take(it, it.remaining)
                continue
            if firsts and buckets.target(it.total) > min(firsts) and (floored or (
                    not urgent_pass and slack(it, coef, buckets) > 0)):
                continue    # the step gives a shorter-target prompt its first token: no
                #             delay for it from one not predicted to miss its own target —
                #             nor from any, on a machine slower than the budgets (every
                #             prompt misses there; a chunk rode each short's step: p99 2x)
            n = fit(it, limit_s)
            if not n and urgent_pass and it.partial and not picks:
                n = amortized(it)       # urgent, alone in the step, its context outgrew it
            if n and (it.partial or n == it.remaining or partials < max_partial):
                take(it, n)

    taken: set[str] = set()
    firsts: list[float] = []        # TTFT targets of the prompts completed whole this step
    shortest = min(buckets.ttft_targets_s)
    # shortest remaining first (ordered by slack, a long prompt predicted to miss its target
    # anyway would starve shorts that need two steps), for the urgent ones too: past its
    # target a prompt has no slack left to protect, and on a machine too slow for the
    # targets every prompt is past it — by slack the longest would go first, every step
    by_rest = sorted(ranked, key=lambda it: (coef.prefill_seconds(it.remaining, it.start),
                                             -it.age_s, it.key))
    urgent = [it for it in by_rest if it.age_s >= buckets.target(it.total)]
    srf = [it for it in by_rest if it.age_s < buckets.target(it.total)]
    if urgent:
        # first at most 1 - URGENT_SHARE of the prefill time for the others (whole prompts,
        # then chunks), then the urgent ones, so neither side stalls the other
        base_s = coef.predict(base)
        half = base_s + (whole_s - base_s) * (1 - URGENT_SHARE)
        fill(ranked, half, chunks=False)
        fill(srf, min(half, budget_s), chunks=True)
        late = [it for it in urgent if buckets.target(it.total) <= shortest]
        first = max(urgent, key=lambda it: (it.age_s, it.key))     # the longest waiting:
        if first in late and not any(it.key in taken for it in late) \
                and first.remaining <= left and (first.partial or new < max_new):
            take(first, first.remaining)    # a short finishes whole, whatever it then costs
        fill(late, late_s, chunks=False)    # more of them while they fit late_s
        fill(urgent, whole_s, chunks=True, urgent_pass=True)
    fill(ranked, whole_s, chunks=False)       # prompts that finish this step first
    fill(srf, budget_s, chunks=True)          # then progress for the rest
    if not picks and max_tokens > 0:
        head = next((it for it in by_rest
                     if it.partial or (max_new > 0 and (
                         partials < max_partial or it.remaining <= min(min_tokens, max_tokens)))),
                    None)
        if head is not None:
            n = amortized(head) if head.partial else 0
            picks.append(Pick(head.key, n or min(head.remaining, min_tokens, max_tokens)))
    return picks


def floor_budget(coef: Coefficients, base: StepShape, min_tokens: int,
                 experts: ExpertShape | None = None) -> float:
    """The least time a step with chunks is given: the predicted step of `base` plus one
    `min_tokens` chunk, plus that of a lone `min_tokens` chunk again (the chunks' work at
    least the fixed cost of a step; the decodes in `base` counted once, so their ITL grows by
    one small step at most, not twice). On a fast machine far below the ITL / prefill-step
    budgets; on one whose step overhead alone exceeds them (an AVX2 CPU on the torch path:
    0.4 s a step against a 125 ms budget) it is what sizes the chunks — from the fitted step
    time."""
    if min_tokens <= 0:
        return 0.0
    return (coef.predict(add_chunk(base, 0, min_tokens, experts))
            + coef.predict(add_chunk(StepShape(), 0, min_tokens, experts)))


def ttft_deadline(target_s: float, over_target: float, timeout_s: float | None) -> float:
    """The TTFT past which a request is refused at once (early rejection): its bucket's target
    times `over_target` (0 = not used), and never more than the request's own timeout."""
    limits = [t for t in (target_s * over_target if over_target > 0 else None, timeout_s)
              if t is not None and t > 0]
    return min(limits) if limits else float("inf")


def whole_budget(has_decodes: bool, budget_s: float, min_target_s: float) -> float:
    """How long a step may grow to finish whole prompts: a step with decodes keeps its ITL
    budget; one without may take half the smallest TTFT target — a prompt that arrives
    mid-step still has the other half, while chopping a lone short prompt into
    `prefill_step_s` chunks only delays it (measured: a 250-token prompt in three 125 ms
    steps)."""
    return budget_s if has_decodes else max(budget_s, min_target_s / 2)


def late_budget(has_decodes: bool, decodes_s: float, itl_target_s: float,
                whole_s: float) -> float:
    """How long a step with decodes may grow to finish short prompts already past their TTFT
    target: the decodes' own predicted time plus the ITL target again. Where the decodes take
    most of the ITL target (2 cores, 32 streams: a 66 ms decode step against 100 ms) the
    chunks that fit beside them are a few dozen tokens, prompts arrive faster than they finish,
    and the seats they hold idle: measured with 128-token prompts at 32 streams, 130-160 of
    ~200 steps carried chunks, the decode batch ran under-full and TTFT p50 grew to seconds
    (docs/benchmarks.md). Once a prompt has missed its target, its first token costs the
    running streams one longer step, not several. `choose` lets the longest-waiting short finish
    even past this (on this machine under load the decodes alone took the whole target and a
    128-token prompt never fit): the step grows by at most one prompt of the shortest bucket.
    Without decodes: `whole_s`."""
    return max(whole_s, decodes_s + itl_target_s) if has_decodes else whole_s


def chunk_budget(has_decodes: bool, itl_target_s: float, prefill_step_s: float) -> float:
    """The step's bound for chunks of prompts that do not finish in it: `prefill_step_s` even
    when the ITL target allows more — a short prompt that arrives mid-step waits for the rest
    of it (measured, ITL target 250 ms: shorts behind 250 ms chunk steps had 1.9x their p99
    TTFT without the long prompts)."""
    return min(itl_target_s, prefill_step_s) if has_decodes else prefill_step_s


def step_budget(has_decodes: bool, itl_target_s: float, prefill_step_s: float) -> float:
    """A step with decodes may take the ITL target (prefill fills what decodes leave); one
    without decodes (a prefill node, an idle colocated node) takes `prefill_step_s`."""
    return itl_target_s if has_decodes else prefill_step_s


def retry_after_s(predicted_s: float, limit_s: float) -> int:
    """Retry-After of an early rejection: about when the predicted excess will have drained
    (1 s to an hour)."""
    excess = predicted_s - limit_s if math.isfinite(limit_s) else predicted_s
    return int(min(3600, max(1, math.ceil(excess))))
