"""Prefill node choice at cluster scale, in simulation: moed's cost-model choice vs
least-queued vs round-robin, 8 to 64 prefill nodes, bursty arrivals, one run.

Discrete-event (virtual clock, a heap of events), in the style of bench/membership.py: the
node-local scheduler is moed's own (moed.balance.step_time.choose under the prefill node's
time budget), every step takes what the cost model of this machine predicts (coefficients
from bench/results/balance.json's cost run when present, else the bench preset's measured
defaults below) times a little noise; the three policies differ only in which prefill node
gets each job:

  moed          moed.balance.prefill.pick_prefill_cost: predicted finish time from the
                node's advertised AdvertisedCost (queued tokens per bucket, coefficients),
                power of two choices
  least-queued  the fewest advertised queued prompt tokens (ties at random)
  round-robin   each decode node cycles through the prefill nodes

Every decode node (one per prefill node) sees the advertisements as gossip carries them:
refreshed every --gossip s, plus its own jobs sent since (what moed's `inflight_tokens`
covers). A share of the prefill nodes is slower (--slow-share, --slow-factor: an older
hardware generation), which their advertised coefficients say and a token count does not.
Arrivals are a two-state Markov-modulated Poisson process (calm, and bursts at 3x the rate)
sized so the cluster's mean utilization is --util.

Goodput = the share of requests that meet their bucket's TTFT target and the ITL target.
A request's ITL is its decode node's predicted step time with its batch when it joins (decode
placement is the same for all three: least running sequences; phase 2 of the issue changes it).

    .venv/bin/python bench/balance_sim.py [--sizes 8,16,32,64] [--duration 60] [--quick]

Writes bench/results/balance_sim.json.
"""
from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moed.balance.step_time import Buckets, Item, choose  # noqa: E402
from moed.balance.candidate import Candidate  # noqa: E402
from moed.balance.cost import AdvertisedCost, Coefficients, add_chunk, shape_of  # noqa: E402
from moed.balance.prefill import CostCandidate, pick_prefill_cost  # noqa: E402

# the bench preset on this machine (2 threads, bf16): 256 tokens 0.12 s at context 0 and
# 0.40 s at 3840; 16 decodes 36 ms (moed/balance/cost.py's docstring)
DEFAULT_COEF = Coefficients(overhead_s=0.004, per_token_s=4.5e-4, per_pair_s=2.9e-7,
                            per_decode_s=1.5e-3, per_expert_s=0.0)
BUCKETS = Buckets((512, 4096, 32768), (1.0, 6.0, 30.0, 120.0))
ITL_TARGET_S = 0.15
STEP_S = 0.25                  # a prefill node's step budget
GEN_TOKENS = 32
POLICIES = ("moed", "least-queued", "round-robin")


@dataclass
class Job:
    rid: int
    tokens: int
    arrival: float
    done: int = 0


@dataclass
class Node:
    name: str
    coef: Coefficients
    queue: dict[int, Job] = field(default_factory=dict)
    partial: set[int] = field(default_factory=set)
    busy: bool = False

    def advertise(self) -> AdvertisedCost:
        toks, reqs = [0] * 4, [0] * 4
        for j in self.queue.values():
            b = BUCKETS.bucket(j.tokens)
            toks[b] += j.tokens - j.done
            reqs[b] += 1
        return AdvertisedCost(self.coef, BUCKETS.edges, tuple(toks), tuple(reqs), 1.0, 0)


def prompt_length(rng: random.Random) -> int:
    u = rng.random()
    if u < 0.80:
        return rng.randint(128, 512)
    if u < 0.95:
        return rng.randint(1000, 3000)
    return rng.randint(6000, 9000)


def mean_service_s(coef: Coefficients, rng: random.Random, n: int = 4000) -> float:
    return sum(coef.prefill_seconds(prompt_length(rng), 0, 512) for _ in range(n)) / n


def simulate(n_nodes: int, policy: str, coef: Coefficients, args: argparse.Namespace,
             seed: int) -> dict:
    rng = random.Random(seed)
    arrivals_rng = random.Random(seed + 1)      # the same trace for every policy
    slow = set(random.Random(seed + 2).sample(range(n_nodes), int(n_nodes * args.slow_share)))
    nodes = [Node(f"p{i:02d}", Coefficients(*(c * (args.slow_factor if i in slow else 1.0)
                                               for c in coef.as_tuple())))
             for i in range(n_nodes)]
    speed = sum(1.0 / (args.slow_factor if i in slow else 1.0) for i in range(n_nodes))
    service = mean_service_s(coef, random.Random(seed + 3))
    mean_rate = args.util * speed / service
    calm, burst = mean_rate / 1.5, 3 * mean_rate / 1.5     # 15 s calm, 5 s bursts: mean 1.5x
    decode_batch = [0] * n_nodes
    # what each decode node believes: the last advertisement + its own jobs since
    adverts = [n.advertise() for n in nodes]
    sent_since = [[0] * n_nodes for _ in range(n_nodes)]
    rr = [rng.randrange(n_nodes) for _ in range(n_nodes)]
    events: list = []
    seq = 0

    def push(t: float, kind: str, data: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, data))

    # the arrival trace (MMPP), then the gossip ticks
    t, bursting, switch = 0.0, False, arrivals_rng.expovariate(1 / 15)
    rid = 0
    while t < args.duration:
        t += arrivals_rng.expovariate(burst if bursting else calm)
        while t > switch:
            bursting = not bursting
            switch += arrivals_rng.expovariate(1 / (5 if bursting else 15))
        push(t, "arrive", Job(rid, prompt_length(arrivals_rng), t))
        rid += 1
    g = 0.0
    while g < args.duration + 60:
        push(g, "gossip", None)
        g += args.gossip
    results: dict[int, tuple[float, float, int]] = {}   # rid -> (ttft, itl, tokens)
    cands_base = [Candidate(n.name, "", "prefill", "L") for n in nodes]

    def start_step(i: int, now: float) -> None:
        node = nodes[i]
        if node.busy or not node.queue:
            return
        items = [Item(str(j.rid), j.done, j.tokens - j.done, j.tokens, now - j.arrival,
                      j.rid in node.partial) for j in node.queue.values()]
        picks = choose(items, shape_of(()), node.coef, STEP_S, BUCKETS, max_partial=4,
                       max_tokens=16384)
        shape = shape_of(())
        for p in picks:
            j = node.queue[int(p.key)]
            shape = add_chunk(shape, j.done, p.num_tokens)
        dur = node.coef.predict(shape) * (1 + rng.uniform(-0.05, 0.05))
        node.busy = True
        push(now + dur, "step", (i, [(int(p.key), p.num_tokens) for p in picks]))

    def pick(d: int, job: Job) -> int:
        if policy == "round-robin":
            rr[d] = (rr[d] + 1) % n_nodes
            return rr[d]
        if policy == "least-queued":
            load = [sum(adverts[i].queued_tokens) + sent_since[d][i] for i in range(n_nodes)]
            best = min(load)
            return rng.choice([i for i in range(n_nodes) if load[i] == best])
        cands = [CostCandidate(cands_base[i], adverts[i], True, sent_since[d][i])
                 for i in range(n_nodes)]
        chosen = pick_prefill_cost(cands, job.tokens, (), 0.0, 5.0, rng, "L")
        assert chosen is not None
        return int(chosen.node.name[1:])

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            job = data
            d = rng.randrange(n_nodes)                 # the decode node the client reached
            i = pick(d, job)
            sent_since[d][i] += job.tokens
            nodes[i].queue[job.rid] = job
            start_step(i, now)
        elif kind == "gossip":
            adverts = [n.advertise() for n in nodes]
            sent_since = [[0] * n_nodes for _ in range(n_nodes)]
        elif kind == "leave":
            decode_batch[data] -= 1
        else:
            i, picks = data
            node = nodes[i]
            node.busy = False
            for r, n in picks:
                job = node.queue[r]
                job.done += n
                if job.done >= job.tokens:
                    del node.queue[r]
                    node.partial.discard(r)
                    dn = min(range(n_nodes), key=lambda k: decode_batch[k])
                    decode_batch[dn] += 1
                    itl = coef.predict(shape_of([(job.tokens, 1, True)] * decode_batch[dn]))
                    push(now + GEN_TOKENS * itl, "leave", dn)
                    results[r] = (now - job.arrival, itl, job.tokens)
                else:
                    node.partial.add(r)
            start_step(i, now)
    total = rid
    good = sum(1 for ttft, itl, n in results.values()
               if ttft <= BUCKETS.target(n) and itl <= ITL_TARGET_S)
    by_bucket: dict[int, list[float]] = {}
    for ttft, _, n in results.values():
        by_bucket.setdefault(BUCKETS.bucket(n), []).append(ttft)
    return {"nodes": n_nodes, "policy": policy, "requests": total, "finished": len(results),
            "goodput": good / total if total else 0.0,
            "ttft_p99_by_bucket": {b: _pct(v, 99) for b, v in sorted(by_bucket.items())},
            "ttft_p50_short": _pct(by_bucket.get(0, []), 50)}


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def load_coefficients(path: Path) -> tuple[Coefficients, str]:
    try:
        doc = json.loads(path.read_text())
        c = doc.get("cost_coefficients")
        if c:
            return Coefficients(**c), f"fitted by bench/balance.py ({path})"
    except (OSError, ValueError, TypeError):
        pass
    return DEFAULT_COEF, "the bench preset's measured defaults (no bench/results/balance.json)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8,16,32,64")
    ap.add_argument("--duration", type=float, default=60.0, help="virtual seconds of arrivals")
    ap.add_argument("--util", type=float, default=0.75, help="mean cluster utilization")
    ap.add_argument("--gossip", type=float, default=1.0, help="advertisement refresh, s")
    ap.add_argument("--slow-share", type=float, default=0.25)
    ap.add_argument("--slow-factor", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="sizes 8,16, 20 s")
    ap.add_argument("--coefficients", default=str(ROOT / "bench" / "results" / "balance.json"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "balance_sim.json"))
    a = ap.parse_args()
    if a.quick:
        a.sizes, a.duration = "8,16", 20.0
    coef, source = load_coefficients(Path(a.coefficients))
    print(f"cost model: {source}: {coef}")
    print(f"util {a.util}, bursts 3x, gossip {a.gossip}s, {a.slow_share:.0%} of nodes "
          f"{a.slow_factor}x slower, {a.duration:.0f}s of arrivals")
    rows = []
    print(f"\n{'nodes':>5} | " + " | ".join(f"{p:>22}" for p in POLICIES)
          + "   (goodput; short TTFT p99)")
    for n in [int(x) for x in a.sizes.split(",")]:
        line = []
        for pol in POLICIES:
            t0 = time.perf_counter()
            r = simulate(n, pol, coef, a, a.seed)
            r["sim_s"] = round(time.perf_counter() - t0, 2)
            rows.append(r)
            line.append(f"{r['goodput']:6.1%} {r['ttft_p99_by_bucket'].get(0, float('nan')):7.2f}s "
                        f"({r['sim_s']:4.1f}s)")
        print(f"{n:>5} | " + " | ".join(f"{x:>22}" for x in line), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"coefficients": coef.__dict__, "source": source,
                               "args": vars(a), "rows": rows}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
