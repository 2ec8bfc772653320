"""Which prefill node takes a decode node's next job (pure).

`pick_prefill`: the breaker first, then the fewest jobs in flight (what moed.roles.decode uses
today). `pick_prefill_cost`: the prefill balancer's choice — the same breaker and layout
rules, then the predicted finish time of the job on each node from what it advertises
(`AdvertisedCost`: queued tokens per length bucket, fitted cost coefficients), power of two
choices. bench/balance_sim.py compares the two at cluster scale.
"""
from __future__ import annotations

import math
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from moed.balance.breaker import PeerState, available
from moed.balance.candidate import Candidate, layout_compatible
from moed.balance.cost import FEATURES, AdvertisedCost, Coefficients, predict_ttft
from moed.cluster.state import LoadVector


def pick_prefill(cands: Sequence[Candidate], exclude: Collection[str], now: float,
                 cooldown_s: float, layout: str = "") -> Candidate | None:
    """A peer whose cooldown is over gets the next job (its half-open trial: otherwise a
    lightly loaded cluster would never try it again); else the available peer with the fewest
    jobs in flight (ties: by name). When every remaining peer is cooling down, the one that
    failed longest ago is tried anyway: the alternative is failing the request for sure.
    Peers whose KV layout differs from `layout` are never picked. None when none is left."""
    left = [c for c in cands if c.name not in exclude and layout_compatible(layout, c.layout)]
    ready = [c for c in left if available(c.health, now, cooldown_s)]
    if not ready:
        return min(left, key=lambda c: (c.health.opened_at, c.name)) if left else None
    return min(ready, key=lambda c: (c.health.state is PeerState.CLOSED, c.inflight, c.name))


@dataclass(frozen=True)
class CostCandidate:
    """A prefill node with what it advertises for the cost model (None: nothing advertised,
    e.g. a static peer) and this decode node's own jobs to it that its advertisement may not
    show yet (gossip lags by up to a second)."""
    node: Candidate
    cost: AdvertisedCost | None = None
    alive: bool = True                 # membership: alive (not suspect, dead or left)
    inflight_tokens: int = 0


def predicted_finish(c: CostCandidate, prompt_tokens: int) -> float:
    """Seconds until a job of `prompt_tokens` would finish its prefill on this node: its
    queue of the job's bucket and shorter ones (SRF), our unreported jobs, then the job
    itself (`moed.balance.cost.predict_ttft`). inf when it advertises no cost state."""
    adv = c.cost
    if adv is None:
        return math.inf
    if c.inflight_tokens > 0:
        b = min(adv.bucket(prompt_tokens), len(adv.queued_tokens) - 1)
        toks, reqs = list(adv.queued_tokens), list(adv.queued_requests)
        toks[b] += c.inflight_tokens
        reqs[b] += 1
        adv = replace(adv, queued_tokens=tuple(toks), queued_requests=tuple(reqs))
    return predict_ttft(adv, prompt_tokens)


def pick_prefill_cost(cands: Sequence[CostCandidate], prompt_tokens: int,
                      exclude: Collection[str], now: float, cooldown_s: float,
                      rng: random.Random, layout: str = "", choices: int = 2
                      ) -> CostCandidate | None:
    """The prefill node for a job by predicted finish time, power of `choices` choices: that
    many eligible nodes drawn at random, the one predicted to finish first wins (ties: the
    first drawn, i.e. at random). Sampling, not the global minimum, because every decode node
    sees the same second-old advertisements: all would pile onto the same "best" node.

    Eligible: alive, KV layout compatible, not excluded, breaker available (`pick_prefill`'s
    rules: a peer past its cooldown gets the job as its half-open trial; when every peer is
    cooling down, the one that failed longest ago). None when no node is left."""
    left = [c for c in cands if c.alive and c.node.name not in exclude
            and layout_compatible(layout, c.node.layout)]
    ready = [c for c in left if available(c.node.health, now, cooldown_s)]
    if not ready:
        return min(left, key=lambda c: (c.node.health.opened_at, c.node.name)) if left else None
    trial = [c for c in ready if c.node.health.state is not PeerState.CLOSED]
    if trial:
        return min(trial, key=lambda c: c.node.name)
    drawn = rng.sample(ready, min(max(choices, 1), len(ready)))
    return min(drawn, key=lambda c: predicted_finish(c, prompt_tokens))


def advertised_of(load: LoadVector) -> AdvertisedCost | None:
    """The cost state a node gossips (moed.cluster.state.LoadVector's cost fields) as an
    AdvertisedCost; None when it advertises none (no fitted model, a node of the release
    before) or the fields do not agree with each other."""
    n = len(load.bucket_edges) + 1
    # fewer terms: a node from before `prefill_context` or `verified_positions` (they read as 0)
    if len(load.cost) not in (len(FEATURES) - 2, len(FEATURES) - 1, len(FEATURES)) \
            or len(load.queued_tokens) != n \
            or len(load.queued_requests) != n:
        return None
    return AdvertisedCost(Coefficients(*load.cost), tuple(load.bucket_edges),
                          tuple(load.queued_tokens), tuple(load.queued_requests),
                          load.prefill_share, load.chunk_tokens)
