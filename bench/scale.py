"""Elastic scaling in simulation: moed's planner (moed.balance.scale) vs a utilisation-threshold
scaler (Kubernetes HPA's rule), a bursty 1 <-> 24 req/s trace, one run.

Discrete-event (virtual clock, a heap of events), in the style of bench/balance_sim.py. The
cluster is disaggregated: prefill nodes (FCFS, chunks of CHUNK tokens per step) hand each
finished prompt to the decode node with the fewest sequences (continuous batching, at most
MAX_BATCH). Every step takes what this machine's cost model predicts (coefficients fitted by
bench/balance.py on the bench preset, bench/results/balance.json; the preset's measured
defaults otherwise) times a little noise, so per-node throughput is this machine's. A node
asked for starts serving --boot-s later (weights load); a node drained takes no new work,
finishes what it holds, then stops. Node-seconds count from the ask to the stop.

Scalers, each looking every --interval s at what the membership carries:
  moed           moed.balance.scale.Planner on the gossip fields that exist today (queued
                 prompt tokens and requests, waiting, running, cost coefficients): arrival rate
                 = backlog change + busy nodes x capacity
  moed+measured  the same planner also given each node's measured prefill tokens per second
                 of step and decode step time (the capacity signals, docs/tracing.md)
  utilisation    HPA's rule per role: desired = ceil(n x util / 0.7) outside a 10% tolerance,
                 up at most max(2n, n + 4) per look, down only to the highest recommendation
                 of the last 300 s (HPA's stabilisation window); util = busy share of the
                 interval (prefill), max(batch, KV) occupancy (decode)
  static-peak    no scaling: the most nodes moed's planner ever asked for, all the time

Goodput = the share of requests with TTFT <= --ttft-ms and mean ITL <= --itl-ms.

    .venv/bin/python bench/scale.py [--duration 1800] [--quick]

Writes bench/results/scale.json and scale.png.
"""
from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moed.balance.cost import Coefficients, ExpertShape, add_chunk, shape_of  # noqa: E402
from moed.balance.scale import PlanConfig, Planner  # noqa: E402
from moed.balance.scale_view import NodeLoad, Snapshot  # noqa: E402

DEFAULT_COEF = Coefficients(overhead_s=0.004, per_token_s=4.5e-4, per_pair_s=2.9e-7,
                            per_decode_s=1.5e-3, per_expert_s=0.0)
EXPERTS = ExpertShape(16, 2)                # the bench preset: 16 experts, top-2
CHUNK = 512
MAX_BATCH = 64
KV_TOKENS = MAX_BATCH * 1024                # a decode node's KV pool, in tokens
TRANSFER_S = 0.01                           # KV of one prompt, prefill -> decode node
SCALERS = ("moed", "moed+measured", "utilisation", "static-peak")
ROLES = ("prefill", "decode")


@dataclass
class Req:
    rid: int
    arrival: float
    prompt: int
    gen: int
    done: int = 0               # prompt tokens computed
    ttft: float = math.nan
    first_at: float = 0.0
    tokens: int = 0             # generated
    itl: float = math.nan


@dataclass
class Node:
    name: str
    role: str
    asked_at: float
    ready_at: float
    state: str = "booting"      # booting -> serving -> draining -> stopped
    stopped_at: float = math.inf
    queue: deque = field(default_factory=deque)      # prefill: Req; decode: waiting Req
    running: list = field(default_factory=list)      # decode
    busy: bool = False
    busy_s: float = 0.0         # busy time in the current look's window
    served_tokens: float = 0.0  # prefill tokens in the window
    last_step_s: float = 0.0
    tps: float | None = None    # measured prompt tokens per second of step (kept when idle)

    def inflight(self) -> int:
        return len(self.queue) + len(self.running) + int(self.busy and self.role == "prefill")

    def backlog(self) -> int:
        return sum(r.prompt - r.done for r in self.queue) if self.role == "prefill" else 0


def trace(duration: float, calm: float, burst: float, seed: int) -> list[tuple[float, int, int]]:
    """(arrival, prompt tokens, generated tokens): calm and burst phases (exponential lengths,
    means 120 s and 60 s), Poisson arrivals at `calm` or `burst` req/s within each."""
    rng = random.Random(seed)
    out, t, bursting = [], 0.0, False
    end = rng.expovariate(1 / 120)
    while t < duration:
        t += rng.expovariate(burst if bursting else calm)
        while t > end:
            bursting = not bursting
            end += rng.expovariate(1 / (60 if bursting else 120))
        if t < duration:
            out.append((t, rng.randint(256, 1024), rng.randint(64, 192)))
    return out


def prefill_step_s(coef: Coefficients, node: Node) -> tuple[float, list[tuple[Req, int]]]:
    left, picks, shape = CHUNK, [], shape_of(())
    for r in node.queue:
        if left <= 0:
            break
        n = min(left, r.prompt - r.done)
        picks.append((r, n))
        shape = add_chunk(shape, r.done, n, EXPERTS)
        left -= n
    return coef.predict(shape), picks


def decode_step_s(coef: Coefficients, node: Node) -> float:
    return coef.predict(shape_of([(r.prompt + r.tokens, 1, True) for r in node.running], EXPERTS))


class Sim:
    def __init__(self, coef: Coefficients, reqs: list[tuple[float, int, int]],
                 a: argparse.Namespace, seed: int) -> None:
        self.coef, self.a = coef, a
        self.rng = random.Random(seed)
        self.events: list = []
        self.seq = 0
        self.nodes: list[Node] = []
        self.reqs = [Req(i, t, p, g) for i, (t, p, g) in enumerate(reqs)]
        self.events_log: list[tuple[float, str, str, int]] = []     # (t, role, out|in, nodes)
        self.timeline: list[dict] = []

    def push(self, t: float, kind: str, data: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, data))

    def serving(self, role: str) -> list[Node]:
        return [n for n in self.nodes if n.role == role and n.state == "serving"]

    def counted(self, role: str) -> list[Node]:
        return [n for n in self.nodes if n.role == role and n.state in ("booting", "serving")]

    def launch(self, role: str, now: float, boot: float) -> None:
        k = sum(1 for n in self.nodes if n.role == role)
        node = Node(f"{role[0]}{k:03d}", role, now, now + boot)
        self.nodes.append(node)
        self.push(now + boot, "ready", node)

    def drain(self, node: Node, now: float) -> None:
        if node.state == "serving":
            node.state = "draining"
            self.maybe_stop(node, now)

    def maybe_stop(self, node: Node, now: float) -> None:
        if node.state == "draining" and not node.busy and not node.queue and not node.running:
            node.state, node.stopped_at = "stopped", now

    # ---- work ----
    def kick(self, node: Node, now: float) -> None:
        if node.busy or node.state not in ("serving", "draining"):
            return
        if node.role == "prefill":
            if not node.queue:
                return
            dur, picks = prefill_step_s(self.coef, node)
            self.start(node, now, dur, picks)
        else:
            while node.queue and len(node.running) < MAX_BATCH:
                node.running.append(node.queue.popleft())
            if not node.running:
                return
            self.start(node, now, decode_step_s(self.coef, node), None)

    def start(self, node: Node, now: float, dur: float, picks: object) -> None:
        dur *= 1 + self.rng.uniform(-0.05, 0.05)
        node.busy = True
        node.last_step_s = dur
        self.push(now + dur, "step", (node, now, picks))

    def step_done(self, node: Node, started: float, picks: object, now: float) -> None:
        node.busy = False
        node.busy_s += now - started
        if node.role == "prefill":
            for r, n in picks:          # type: ignore[union-attr]
                r.done += n
                node.served_tokens += n
                if r.done >= r.prompt:
                    node.queue.remove(r)
                    r.ttft, r.first_at, r.tokens = now + TRANSFER_S - r.arrival, now + TRANSFER_S, 1
                    self.push(now + TRANSFER_S, "to_decode", r)
        else:
            keep = []
            for r in node.running:
                r.tokens += 1
                if r.tokens >= r.gen:
                    r.itl = (now - r.first_at) / max(r.gen - 1, 1)
                else:
                    keep.append(r)
            node.running = keep
        self.maybe_stop(node, now)
        self.kick(node, now)

    def place(self, role: str, r: Req, now: float) -> None:
        cands = self.serving(role)
        if role == "prefill":
            node = min(cands, key=lambda n: (n.backlog(), n.name))
        else:
            node = min(cands, key=lambda n: (len(n.running) + len(n.queue), n.name))
        node.queue.append(r)
        self.kick(node, now)

    # ---- what a scaler sees ----
    def snapshot(self, now: float, measured: bool, window: float) -> Snapshot:
        out = []
        for n in self.nodes:
            if n.state != "serving":    # booting: not joined yet; draining: left
                continue
            if n.role == "prefill":
                out.append(NodeLoad(n.name, "prefill", waiting=len(n.queue) - int(n.busy),
                                    running=int(n.busy), queued_prefill_tokens=n.backlog(),
                                    queued_requests=len(n.queue), cost=self.coef,
                                    chunk_tokens=CHUNK,
                                    prefill_tps=n.tps if measured else None))
            else:
                out.append(NodeLoad(n.name, "decode", waiting=len(n.queue),
                                    running=len(n.running), cost=self.coef,
                                    decode_step_s=(n.last_step_s if measured and n.running
                                                   else None)))
        return Snapshot(now, tuple(out))

    def utilisation(self, role: str, window: float) -> float:
        nodes = self.serving(role)
        if not nodes:
            return 1.0
        if role == "prefill":
            return sum(min(n.busy_s / window, 1.0) for n in nodes) / len(nodes)
        occ = [max((len(n.running) + len(n.queue)) / MAX_BATCH,
                   sum(r.prompt + r.tokens for r in n.running) / KV_TOKENS) for n in nodes]
        return sum(min(o, 1.0) for o in occ) / len(nodes)

    def reset_window(self) -> None:
        for n in self.nodes:
            if n.role == "prefill" and n.busy_s > 0:
                n.tps = n.served_tokens / n.busy_s
            n.busy_s, n.served_tokens = 0.0, 0.0


def run(scaler: str, coef: Coefficients, reqs: list, a: argparse.Namespace,
        static: dict[str, int] | None = None) -> dict:
    sim = Sim(coef, reqs, a, a.seed)
    start_n = static or {"prefill": a.start_prefill, "decode": a.start_decode}
    for role in ROLES:
        for _ in range(start_n[role]):
            sim.launch(role, 0.0, 0.0)
    cfg = PlanConfig(ttft_target_s=a.ttft_ms / 1000, itl_target_s=a.itl_ms / 1000,
                     cooldown_in_s=a.cooldown_in, drain_s=a.drain_s, context_tokens=700,
                     max_batch=MAX_BATCH,
                     max_nodes={"prefill": a.max_nodes, "decode": a.max_nodes, "colocated": 1})
    planner = Planner(cfg)
    hpa_recs: dict[str, deque] = {r: deque() for r in ROLES}
    peak = {r: start_n[r] for r in ROLES}
    for r in sim.reqs:
        sim.push(r.arrival, "arrive", r)
    end = reqs[-1][0] if reqs else 0.0
    t = a.interval
    while t < end + 120:
        sim.push(t, "look", None)
        t += a.interval
    last_look, arrivals_since = 0.0, 0
    while sim.events:
        now, _, kind, data = heapq.heappop(sim.events)
        if kind == "arrive":
            arrivals_since += 1
            sim.place("prefill", data, now)
        elif kind == "to_decode":
            sim.place("decode", data, now)
        elif kind == "step":
            node, started, picks = data
            sim.step_done(node, started, picks, now)
        elif kind == "ready":
            if data.state == "booting":
                data.state = "serving"
        elif kind == "look":
            window = now - last_look
            if scaler in ("moed", "moed+measured"):
                for d in planner.step(sim.snapshot(now, scaler == "moed+measured", window)):
                    role = d.role
                    if d.action == "out":
                        add = d.desired - len(sim.counted(role))
                        for _ in range(max(add, 0)):
                            sim.launch(role, now, a.boot_s)
                        if add > 0:
                            sim.events_log.append((now, role, "out", add))
                    elif d.action == "in" and d.drain:
                        gone = {n.name for n in d.drain}
                        for node in [n for n in sim.nodes if n.name in gone]:
                            sim.drain(node, now)
                        sim.events_log.append((now, role, "in", len(gone)))
            elif scaler == "utilisation":
                for role in ROLES:
                    n = len(sim.counted(role))
                    util = sim.utilisation(role, window)
                    ratio = util / 0.7
                    rec = n if abs(ratio - 1) <= 0.1 else math.ceil(n * ratio)
                    rec = max(1, min(rec, max(2 * n, n + 4), a.max_nodes))
                    recs = hpa_recs[role]
                    recs.append((now, rec))
                    while recs and recs[0][0] < now - 300:
                        recs.popleft()
                    want = rec if rec > n else max(r for _, r in recs)
                    if want > n:
                        for _ in range(want - n):
                            sim.launch(role, now, a.boot_s)
                        sim.events_log.append((now, role, "out", want - n))
                    elif want < n:
                        nodes = sorted(sim.serving(role), key=lambda x: (x.inflight(), x.name))
                        k = min(n - want, len(nodes) - 1)      # one keeps serving
                        for node in nodes[:k]:
                            sim.drain(node, now)
                        if k > 0:
                            sim.events_log.append((now, role, "in", k))
            for role in ROLES:
                peak[role] = max(peak[role], len(sim.counted(role)))
            sim.timeline.append({"t": now, "rate": arrivals_since / window,
                                 **{role: len(sim.counted(role)) for role in ROLES}})
            arrivals_since, last_look = 0, now
            sim.reset_window()
    stop_t = max([now] + [r.arrival for r in sim.reqs])
    node_s = {role: sum(min(n.stopped_at, stop_t) - n.asked_at for n in sim.nodes
                        if n.role == role) for role in ROLES}
    done = [r for r in sim.reqs if not math.isnan(r.itl)]
    good = sum(1 for r in done if r.ttft <= a.ttft_ms / 1000 and r.itl <= a.itl_ms / 1000)
    ttfts = sorted(r.ttft for r in done)
    outs = [e for e in sim.events_log if e[2] == "out"]
    ins = [e for e in sim.events_log if e[2] == "in"]
    return {"scaler": scaler, "requests": len(sim.reqs), "finished": len(done),
            "goodput": good / len(sim.reqs) if sim.reqs else 0.0,
            "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
            "itl_p99_s": _pct(sorted(r.itl for r in done), 99),
            "node_seconds": {k: round(v, 1) for k, v in node_s.items()},
            "node_seconds_total": round(sum(node_s.values()), 1),
            "scale_events": {"out": len(outs), "in": len(ins),
                             "nodes_started": sum(e[3] for e in outs),
                             "nodes_drained": sum(e[3] for e in ins)},
            "peak": peak, "timeline": sim.timeline}


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return math.nan
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def load_coefficients(path: Path) -> tuple[Coefficients, str]:
    try:
        c = json.loads(path.read_text()).get("cost_coefficients")
        if c:
            return Coefficients(**c), f"fitted by bench/balance.py on this machine ({path})"
    except (OSError, ValueError, TypeError):
        pass
    return DEFAULT_COEF, "the bench preset's measured defaults (no bench/results/balance.json)"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    first = res["rows"][0]["timeline"]
    axes[0].plot([p["t"] for p in first], [p["rate"] for p in first], color="k", lw=0.8)
    axes[0].set_ylabel("arrivals, req/s")
    axes[0].set_title("bursty trace; nodes (asked for, incl. loading) per scaler")
    for ax, role in zip(axes[1:], ROLES):
        for row in res["rows"]:
            tl = row["timeline"]
            ax.step([p["t"] for p in tl], [p[role] for p in tl], where="post",
                    label=f"{row['scaler']} (goodput {row['goodput']:.0%}, "
                    f"{row['node_seconds_total'] / 3600:.1f} node-h)")
        ax.set_ylabel(f"{role} nodes")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left")
    axes[2].set_xlabel("virtual time, s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="virtual seconds of arrivals")
    ap.add_argument("--calm", type=float, default=1.0, help="req/s between bursts")
    ap.add_argument("--burst", type=float, default=24.0, help="req/s in a burst")
    ap.add_argument("--ttft-ms", type=float, default=2000.0)
    ap.add_argument("--itl-ms", type=float, default=100.0)
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between looks")
    ap.add_argument("--boot-s", type=float, default=30.0, help="a new node's load time")
    ap.add_argument("--cooldown-in", type=float, default=300.0,
                    help="moed's scale-in cool-down; the utilisation scaler's window is 300 s")
    ap.add_argument("--drain-s", type=float, default=0.0,
                    help="moed: excess backlog drains within this (0: the TTFT target)")
    ap.add_argument("--start-prefill", type=int, default=1)
    ap.add_argument("--start-decode", type=int, default=1)
    ap.add_argument("--max-nodes", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="600 s of arrivals")
    ap.add_argument("--coefficients", default=str(ROOT / "bench" / "results" / "balance.json"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "scale.json"))
    a = ap.parse_args()
    if a.quick:
        a.duration = 600.0
    coef, source = load_coefficients(Path(a.coefficients))
    probe = NodeLoad("p", "prefill", cost=coef, chunk_tokens=CHUNK)
    from moed.balance.scale import decode_capacity, prefill_capacity
    pcap = prefill_capacity(probe, 640)
    dcap = decode_capacity(NodeLoad("d", "decode", cost=coef), a.itl_ms / 1000, 700, MAX_BATCH)
    print(f"cost model: {source}\n  {coef}")
    print(f"per node: prefill {pcap:.0f} tok/s (640-token prompts), decode batch {dcap:.0f} "
          f"under ITL {a.itl_ms:.0f} ms at context 700; boot {a.boot_s:.0f} s")
    reqs = trace(a.duration, a.calm, a.burst, a.seed)
    print(f"trace: {len(reqs)} requests over {a.duration:.0f} s, {a.calm:g} <-> {a.burst:g} req/s, "
          f"prompts 256-1024, outputs 64-192; targets TTFT {a.ttft_ms:.0f} ms, ITL "
          f"{a.itl_ms:.0f} ms\n")
    rows = []
    t0 = time.perf_counter()
    for scaler in SCALERS:
        s0 = time.perf_counter()
        static = None
        if scaler == "static-peak":
            static = rows[0]["peak"]
        r = run(scaler, coef, reqs, a, static)
        r["sim_s"] = round(time.perf_counter() - s0, 1)
        rows.append(r)
    print(f"{'scaler':>14} | {'goodput':>7} | {'TTFT p50':>8} | {'TTFT p99':>8} | {'ITL p99':>7} | "
          f"{'node-s P':>8} | {'node-s D':>8} | {'out/in':>7} | {'started/drained':>15}")
    for r in rows:
        ev = r["scale_events"]
        print(f"{r['scaler']:>14} | {r['goodput']:7.1%} | {r['ttft_p50_s']:7.2f}s | "
              f"{r['ttft_p99_s']:7.2f}s | {r['itl_p99_s'] * 1000:5.0f}ms | "
              f"{r['node_seconds']['prefill']:8.0f} | {r['node_seconds']['decode']:8.0f} | "
              f"{ev['out']:>3}/{ev['in']:<3} | {ev['nodes_started']:>7}/{ev['nodes_drained']:<7}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"coefficients": coef.__dict__, "source": source, "args": vars(a),
           "per_node": {"prefill_tok_s": pcap, "decode_batch": dcap},
           "wall_s": round(time.perf_counter() - t0, 1), "rows": rows}
    out.write_text(json.dumps(doc, indent=1))
    png = out.with_suffix(".png")
    plot(doc, png)
    print(f"\nwrote {out} and {png} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
