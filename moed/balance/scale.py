"""The scaling planner: how many prefill and decode nodes the load needs, and which node to
drain (policy pure; `Planner` is the small stateful loop around it, with no I/O and no clock).

Glossary
    NodeLoad    one member as the planner sees it: role, state, HTTP address and the load it
                gossips (built from any node's GET /cluster: scale_view.snapshot_of)
    Snapshot    every member's load at one instant
    demand      per role, what the nodes must carry:
                  prefill  prompt tokens arriving (tok/s) and the backlog (queued tokens)
                  decode   sequences generating at once (running + waiting)
    capacity    per node, from the cost coefficients it gossips (moed.balance.cost):
                  prefill  tokens/s of a typical prompt at the node's prefill share
                  decode   the largest batch whose predicted step stays under the ITL target
    need        node-equivalents (a float) the demand takes at a utilisation u; a colocated
                node carries both, so its need is the sum
    predictor   Holt's linear smoothing (level + trend, `Holt`) of each demand series, forecast
                `horizon` intervals ahead, floored at 0: it sees a ramp coming one interval
                early and, unlike a plain average, does not lag a steady rise

Capacity signals (docs/tracing.md): a node that gossips its measured prefill tokens per
second of engine step (`prefill_tps`) has that as its prefill capacity instead of the cost
model's; a measured decode step time (`decode_step_s`) corrects the model's decode step by
their ratio. -1 (not measured) reads as absent.

Arrival rate without a counter: prompt tokens that arrived in an interval = the backlog's
change + what the nodes served, and a node serves its capacity while it is busy (waiting,
running or queued work at the snapshot): at a random instant a node is busy with
probability equal to its utilisation, so the smoothed sample estimates it.

Need per role (node-equivalents at utilisation u; `need`):
    prefill  (arrivals + excess backlog / drain_s) / (u x capacity): the excess is the backlog
             beyond what the nodes may hold while a new prompt still meets the TTFT target
             (its predicted TTFT = backlog / (nodes x capacity) + its own prefill)
    decode   sequences / (u x the batch that keeps a step under the ITL target)

Decision per role (`decide`), count = alive + suspect members (a node told to drain is not
counted from then on, though it gossips until it has left):
    out   ceil(need at util_high) > count → that many (≤ max). For cooldown_out_s after a
          scale-out the nodes asked for count as there (they are loading): only more than
          that is asked for
    in    the most nodes any interval of the last cooldown_in_s needed at util_low (HPA's
          stabilisation window: a burst that came once is likely to come again) < count,
          for in_stable consecutive intervals, and no scale-out within cooldown_in_s →
          down to that (≥ min): the nodes with the least in-flight work (running + waiting,
          then queued tokens, then name) drain. One look at a quiet minute between bursts
          does not give back the capacity the bursts need (measured in bench/scale.py)
    hold  otherwise. The band between util_low and util_high is the hysteresis: a load that
          just crosses util_high scales out once and is not scaled back in by its own dip.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from moed.balance.cost import AdvertisedCost, Coefficients, queued_seconds
from moed.balance.scale_view import PLANNED_ROLES, NodeLoad, Snapshot

@dataclass(frozen=True)
class PlanConfig:
    """The planner's targets and damping (`moed plan` flags, docs/scaling.md)."""
    ttft_target_s: float = 2.0
    itl_target_s: float = 0.1
    util_high: float = 0.8             # scale out above this utilisation
    util_low: float = 0.5              # scale in only below this (at one node fewer)
    cooldown_out_s: float = 60.0       # a scale-out counts as done for this long (node loading)
    cooldown_in_s: float = 300.0       # no scale-in sooner than this after the role's last change
    in_stable: int = 3                 # consecutive intervals that must want the scale-in
    horizon: float = 1.0               # intervals ahead the predictor forecasts
    alpha: float = 0.5                 # Holt: level smoothing
    beta: float = 0.3                  # Holt: trend smoothing
    prompt_tokens: int = 512           # a typical prompt, when nothing is queued to say
    context_tokens: int = 1024         # a typical decode context (attention pairs per step)
    max_batch: int = 64                # a decode node's batch cap (engine.max_num_seqs)
    drain_timeout_s: float = 600.0     # a node told to drain is not counted for this long
    drain_s: float = 30.0              # a backlog past the TTFT target drains in this: about a
    #                                    node's load time (nodes asked for to drain it faster
    #                                    arrive after it has gone); 0 = the TTFT target
    min_nodes: Mapping[str, int] = field(default_factory=lambda: {r: 1 for r in PLANNED_ROLES})
    max_nodes: Mapping[str, int] = field(default_factory=lambda: {r: 64 for r in PLANNED_ROLES})

    def __post_init__(self) -> None:
        checks = [("ttft_target_s", self.ttft_target_s > 0),
                  ("itl_target_s", self.itl_target_s > 0),
                  ("util_high", 0 < self.util_high <= 1),
                  ("util_low", 0 < self.util_low < self.util_high),
                  ("cooldown_out_s", self.cooldown_out_s >= 0),
                  ("cooldown_in_s", self.cooldown_in_s >= 0), ("in_stable", self.in_stable >= 1),
                  ("horizon", self.horizon >= 0), ("alpha", 0 < self.alpha <= 1),
                  ("beta", 0 <= self.beta <= 1), ("prompt_tokens", self.prompt_tokens >= 1),
                  ("context_tokens", self.context_tokens >= 0), ("max_batch", self.max_batch >= 1),
                  ("drain_timeout_s", self.drain_timeout_s >= 0),
                  ("drain_s", self.drain_s >= 0)]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"plan: {name} = {getattr(self, name)!r} is out of range"
                                 + (" (must be below util_high)" if name == "util_low" else ""))
        for r in PLANNED_ROLES:
            lo, hi = self.min_nodes.get(r, 1), self.max_nodes.get(r, 64)
            if not 0 <= lo <= hi:
                raise ValueError(f"plan: {r} nodes: min {lo} must be in [0, max {hi}]")


# ---- the predictor -----------------------------------------------------------------------

@dataclass(frozen=True)
class Holt:
    """Holt's linear (double exponential) smoothing of one series; n = samples seen."""
    level: float = 0.0
    trend: float = 0.0
    n: int = 0

    def update(self, x: float, alpha: float, beta: float) -> Holt:
        if self.n == 0:
            return Holt(x, 0.0, 1)
        level = alpha * x + (1 - alpha) * (self.level + self.trend)
        trend = beta * (level - self.level) + (1 - beta) * self.trend
        return Holt(level, trend, self.n + 1)

    def forecast(self, horizon: float) -> float:
        return max(0.0, self.level + horizon * self.trend)


# ---- capacity per node (pure) --------------------------------------------------------------

def prefill_capacity(n: NodeLoad, prompt_tokens: int) -> float | None:
    """Prompt tokens/s the node prefills: measured (`prefill_tps`), else from its cost model
    for a typical prompt at its prefill share; None when it advertises neither."""
    if n.prefill_tps is not None:
        return n.prefill_tps
    if n.cost is None:
        return None
    adv = AdvertisedCost(n.cost, (), (prompt_tokens,), (1,), n.prefill_share, n.chunk_tokens)
    s = queued_seconds(adv, 0) / min(max(n.prefill_share, 0.05), 1.0)
    return prompt_tokens / s if s > 0 else None


def decode_step_s(c: Coefficients, batch: int, context: int) -> float:
    """A decode step of `batch` sequences at `context` tokens each; the experts term at its
    bound (every expert touched), so the estimate errs high."""
    return (max(c.overhead_s, 0) + max(c.per_expert_s, 0) + batch * max(c.per_decode_s, 0)
            + batch * (context + 1) * max(c.per_pair_s, 0))


def decode_capacity(n: NodeLoad, itl_s: float, context: int, cap: int) -> float | None:
    """The largest batch whose step stays within itl_s (≤ cap); None without a cost model.
    A measured step time corrects the model by its ratio to the prediction at that batch."""
    if n.cost is None:
        return None
    c = n.cost
    if n.decode_step_s is not None and n.running > 0:
        ratio = n.decode_step_s / max(decode_step_s(c, n.running, context), 1e-9)
        c = Coefficients(*(x * ratio for x in c.as_tuple()))
    fixed = max(c.overhead_s, 0) + max(c.per_expert_s, 0)
    per = max(c.per_decode_s, 0) + (context + 1) * max(c.per_pair_s, 0)
    if itl_s <= fixed:
        return 0.0
    return float(min(cap, (itl_s - fixed) / per if per > 0 else cap))


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


# ---- the decision ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Demand:
    """One role's predicted demand and its nodes' mean capacity (None: not advertised)."""
    prefill_tok_s: float = 0.0       # arrival rate of prompt tokens
    backlog_tokens: float = 0.0      # what every node holds: count × the least queued
    sequences: float = 0.0           # decode: running + count × the least waiting
    prefill_cap: float | None = None  # tok/s per node
    decode_cap: float | None = None   # batch per node
    own_prefill_s: float = 0.0       # a typical prompt's own prefill time
    decode_modelled: bool = True     # False: decode_cap is the batch cap (no cost model)
    count: int = 0                   # nodes serving now


def need(d: Demand, role: str, cfg: PlanConfig, util: float) -> tuple[float | None, str]:
    """Node-equivalents the demand takes at utilisation `util`, and why; None when the role's
    nodes advertise no capacity (the planner then holds)."""
    parts, why = [], []
    if role in ("prefill", "colocated"):
        if d.prefill_cap is None:
            return None, "no cost model advertised"
        # a new prompt waits for the backlog, then its own prefill: what the TTFT target
        # leaves for the wait is the backlog the nodes may hold; the excess must drain
        # within drain_s (default: the TTFT target) on top of the arrivals
        room = max(cfg.ttft_target_s - d.own_prefill_s, 0.1 * cfg.ttft_target_s)
        ttft = d.backlog_tokens / (max(d.count, 1) * d.prefill_cap) + d.own_prefill_s
        excess = max(d.backlog_tokens - max(d.count, 1) * d.prefill_cap * room, 0.0)
        window = cfg.drain_s or cfg.ttft_target_s
        nodes = (d.prefill_tok_s + excess / window) / (util * d.prefill_cap)
        parts.append(nodes)
        why.append(f"prompts {d.prefill_tok_s:.0f} tok/s, backlog {d.backlog_tokens:.0f} tok, "
                   f"predicted TTFT {ttft:.2f} s (node: {d.prefill_cap:.0f} tok/s) -> "
                   f"{nodes:.2f}")
    if role in ("decode", "colocated"):
        if not d.decode_cap:
            return None, "no cost model advertised" if d.decode_cap is None else \
                "ITL target below one decode step"
        seqs = d.sequences / (util * d.decode_cap)
        parts.append(seqs)
        under = (f"under ITL {cfg.itl_target_s * 1000:.0f} ms" if d.decode_modelled
                 else "batch cap, no cost model")
        why.append(f"{d.sequences:.0f} sequences (node: {d.decode_cap:.0f}, {under}) "
                   f"-> {seqs:.2f}")
    return sum(parts), "; ".join(why)


@dataclass(frozen=True)
class RoleState:
    """What the planner remembers of one role between intervals."""
    rate: Holt = Holt()
    backlog: Holt = Holt()
    seqs: Holt = Holt()
    last_backlog: float | None = None
    last_t: float | None = None
    last_change_t: float | None = None
    asked_out: int = 0                 # count asked for by the last scale-out
    asked_out_t: float | None = None
    in_streak: int = 0
    recent: tuple[tuple[float, int], ...] = ()     # (t, nodes needed at util_low) in window
    draining: tuple[tuple[str, float], ...] = ()   # (node, when) drained, not yet gone


@dataclass(frozen=True)
class Decision:
    role: str
    current: int
    desired: int
    action: str                        # "out" | "in" | "hold"
    reason: str
    need: float | None = None
    drain: tuple[NodeLoad, ...] = ()   # scale-in: the nodes to drain, least work first

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "current": self.current, "desired": self.desired,
                "action": self.action, "reason": self.reason,
                "need": None if self.need is None else round(self.need, 3),
                "drain": [{"name": n.name, "http": n.http, "inflight": n.inflight}
                          for n in self.drain]}


def _least_work(n: NodeLoad) -> tuple[bool, int, int, str]:
    return (n.state != "alive", n.inflight, n.queued_prefill_tokens, n.name)


def pick_drain(nodes: Sequence[NodeLoad]) -> NodeLoad | None:
    """The node with the least in-flight work (alive before suspect, then running + waiting,
    then queued prompt tokens, then name): draining it cuts nothing and finishes soonest."""
    return min(nodes, key=_least_work, default=None)


def drains(nodes: Sequence[NodeLoad], k: int) -> tuple[NodeLoad, ...]:
    """The k nodes `pick_drain` would take one after the other."""
    return tuple(sorted(nodes, key=_least_work)[:max(k, 0)])


def observe(st: RoleState, nodes: Sequence[NodeLoad], t: float, cfg: PlanConfig,
            prefill_cap: float | None) -> RoleState:
    """Feed one snapshot of a role's nodes into its predictors.

    Queued work belongs to the node that holds it (a prefill job, a decode node's request):
    an added node takes new arrivals, not that. So the backlog that asks for nodes is the
    one every node holds, count × the least queued (a new prompt is placed on the node that
    finishes it first, so its wait is the least loaded node's), and waiting sequences count
    the same way; the total backlog still measures arrivals. Counting the whole backlog
    asked for 2x the prefill nodes after a burst had queued on the first two, and the most
    decode nodes for a queue only one node could run (bench/scale.py)."""
    backlog = float(sum(n.queued_prefill_tokens for n in nodes))
    floor = float(len(nodes) * min((n.queued_prefill_tokens for n in nodes), default=0))
    served = 0.0
    for n in nodes:
        cap = n.prefill_tps if n.prefill_tps is not None else prefill_cap
        if cap is not None and n.busy:
            served += cap
    if st.last_t is not None and t > st.last_t and st.last_backlog is not None:
        rate = max(0.0, (backlog - st.last_backlog) / (t - st.last_t) + served)
    else:
        rate = served
    seqs = float(sum(n.running for n in nodes)
                 + len(nodes) * min((n.waiting for n in nodes), default=0))
    return replace(st, rate=st.rate.update(rate, cfg.alpha, cfg.beta),
                   backlog=st.backlog.update(floor, cfg.alpha, cfg.beta),
                   seqs=st.seqs.update(seqs, cfg.alpha, cfg.beta),
                   last_backlog=backlog, last_t=t)


def demand_of(st: RoleState, nodes: Sequence[NodeLoad], cfg: PlanConfig, role: str) -> Demand:
    if role == "colocated":      # its need is a sum of time shares: prefill at the whole step
        nodes = [replace(n, prefill_share=1.0) for n in nodes]
    queued = sum(n.queued_prefill_tokens for n in nodes)
    reqs = sum(n.queued_requests for n in nodes)
    prompt = int(queued / reqs) if reqs > 0 and queued > 0 else cfg.prompt_tokens
    pcap = _mean([c for n in nodes if (c := prefill_capacity(n, prompt)) is not None])
    dcap = _mean([c for n in nodes if (c := decode_capacity(
        n, cfg.itl_target_s, cfg.context_tokens, cfg.max_batch)) is not None])
    # without a cost model a decode node still cannot run more than its batch cap
    return Demand(st.rate.forecast(cfg.horizon), st.backlog.forecast(cfg.horizon),
                  st.seqs.forecast(cfg.horizon), pcap,
                  dcap if dcap is not None else (float(cfg.max_batch) if nodes else None),
                  prompt / pcap if pcap else 0.0, dcap is not None, len(nodes))


def decide(role: str, st: RoleState, nodes: Sequence[NodeLoad], t: float,
           cfg: PlanConfig) -> tuple[Decision, RoleState]:
    """One interval's decision for a role whose snapshot `observe` has just taken."""
    lo, hi = cfg.min_nodes.get(role, 1), cfg.max_nodes.get(role, 64)
    count = len(nodes)
    pending = st.asked_out_t is not None and t - st.asked_out_t < cfg.cooldown_out_s
    current = max(count, st.asked_out) if pending else count
    d = demand_of(st, nodes, cfg, role)
    n_high, why = need(d, role, cfg, cfg.util_high)
    n_low, _ = need(d, role, cfg, cfg.util_low)
    if count == 0:
        why = "no live node"
    if n_high is None or n_low is None or count == 0:
        want = min(max(current, lo), hi)
        action = "out" if want > current else "in" if want < current else "hold"
        gone = drains(nodes, current - want)
        if action == "out":
            st = replace(st, last_change_t=t, asked_out=want, asked_out_t=t)
        elif action == "in":
            st = replace(st, last_change_t=t,
                         draining=st.draining + tuple((n.name, t) for n in gone))
        return Decision(role, current, want, action, f"{why}: keeping {want} (bounds "
                        f"{lo}..{hi})", None, gone), st
    out = min(max(math.ceil(n_high - 1e-9), lo), hi)
    now_in = max(min(math.ceil(n_low - 1e-9), hi), lo)
    recent = tuple((at, k) for at, k in st.recent if t - at < cfg.cooldown_in_s) + ((t, now_in),)
    st = replace(st, recent=recent)
    inn = max(k for _, k in recent)
    if out > current:
        # while asked-for nodes load they count as there: only more than that is asked for
        return Decision(role, current, out, "out", f"{why}; {n_high:.2f} nodes at "
                        f"{cfg.util_high:.0%} > {current}", n_high), \
            replace(st, last_change_t=t, asked_out=out, asked_out_t=t, in_streak=0)
    if inn < current and count == current:
        streak = st.in_streak + 1
        cooled = st.asked_out_t is None or t - st.asked_out_t >= cfg.cooldown_in_s
        if streak >= cfg.in_stable and cooled:
            gone = drains(nodes, current - inn)
            return Decision(role, current, inn, "in", f"{why}; {n_low:.2f} nodes at "
                            f"{cfg.util_low:.0%} < {current} for {streak} intervals",
                            n_high, gone), \
                replace(st, last_change_t=t, in_streak=0, asked_out=0,
                        draining=st.draining + tuple((n.name, t) for n in gone))
        wait = "cool-down after the scale-out" if not cooled else \
            f"{streak}/{cfg.in_stable} intervals"
        return Decision(role, current, current, "hold", f"{why}; {inn} would do, waiting "
                        f"({wait})", n_high), replace(st, in_streak=streak)
    if now_in < current:
        return Decision(role, current, current, "hold", f"{why}; {now_in} would do now, the "
                        f"last {cfg.cooldown_in_s:.0f} s needed {inn} (cool-down window)",
                        n_high), replace(st, in_streak=0)
    return Decision(role, current, current, "hold", f"{why}; {current} within "
                    f"{cfg.util_low:.0%}..{cfg.util_high:.0%}", n_high), replace(st, in_streak=0)


class Planner:
    """The stateful loop: one `step(snapshot)` per interval → a Decision per role present.
    No I/O and no clock of its own (the snapshot's time), so a simulation drives it too."""

    def __init__(self, cfg: PlanConfig) -> None:
        self.cfg = cfg
        self.state: dict[str, RoleState] = {}

    def step(self, snap: Snapshot) -> list[Decision]:
        out = []
        roles = [r for r in PLANNED_ROLES if snap.counted(r) or r in self.state]
        for role in roles:
            st = self.state.get(role, RoleState())
            # a node told to drain still gossips "alive" until it leaves: not counted (nor
            # picked again) until it has gone or drain_timeout_s has passed
            present = {n.name for n in snap.counted(role)}
            draining = tuple((name, at) for name, at in st.draining if name in present
                             and snap.t - at < self.cfg.drain_timeout_s)
            st = replace(st, draining=draining)
            gone = {name for name, _ in draining}
            nodes = [n for n in snap.counted(role) if n.name not in gone]
            pcap = _mean([x for n in nodes if (x := prefill_capacity(n, self.cfg.prompt_tokens))
                          is not None])
            st = observe(st, nodes, snap.t, self.cfg, pcap if role != "decode" else None)
            decision, st = decide(role, st, nodes, snap.t, self.cfg)
            self.state[role] = st
            out.append(decision)
        return out
