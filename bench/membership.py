"""Membership in simulation: failure detection time, false positives and message rate for
N = 10, 100, 1000 nodes, moed's defaults next to memberlist's LAN profile, same run.

Both profiles run the very same protocol code (moed.cluster.swim) on the discrete-event
simulator (virtual clock, in-memory network with packet loss); they differ only in timings:

  moed        probe 1 s / timeout 0.5 s / 3 indirect / gossip 200 ms to 3, suspicion_mult 1,
              k = 2 confirmations, 4 re-probes of a fresh suspect, last-chance probe
  memberlist  DefaultLANConfig: the same probe/gossip numbers, suspicion_mult 4 (k = 2),
              no re-probes (our addition), so its min suspicion is 4 * log10(N) * 1 s

Per N: a steady phase (false deaths = members declared dead that never crashed, packets per
node per second), then crash trials (time from the crash until every survivor marks the
node dead; median). memberlist's own documented expectation is printed next to it: detection
needs at least its min suspicion timeout, 4 * max(1, log10 N) s, plus about a probe interval.

    .venv/bin/python bench/membership.py [--loss 0.05] [--sizes 10,100,1000] [--quick]

Writes bench/results/membership.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moed.cluster.members import SwimConfig  # noqa: E402
from moed.cluster.sim import Simulation, median  # noqa: E402

PROFILES = {"moed": SwimConfig(), "memberlist-lan": SwimConfig.memberlist_lan()}


def run(n: int, cfg: SwimConfig, loss: float, steady_s: float, trials: int, seed: int) -> dict:
    t0 = time.perf_counter()
    sim = Simulation(n, cfg, loss=loss, seed=seed, codec="object")
    sim.run(steady_s)
    packets, streams = sim.messages()
    false_deaths = len(sim.false_deaths)
    detect, first = [], []
    step = max(1, n // (trials + 1))
    for i in range(trials):
        trial = sim.crash(f"n{(i + 1) * step:04d}")
        survivors = len(sim.live())
        sim.run(90.0, until=lambda: trial.time_to_all(survivors) is not None)
        t_all = trial.time_to_all(survivors)
        detect.append(t_all if t_all is not None else float("inf"))
        first.append(trial.time_to_first() or float("inf"))
        # the node restarts (new address, same name) so every trial sees N members
        sim.add(trial.name, seeds=(sim.nodes["n0000"].addr,), start=True)
        sim.run(10.0)
    return {
        "n": n, "loss": loss, "steady_s": steady_s, "trials": trials,
        "detect_all_median_s": round(median(detect), 3),
        "detect_first_median_s": round(median(first), 3),
        "detect_all_s": [round(x, 3) for x in detect],
        "false_deaths": false_deaths, "false_deaths_during_trials": len(sim.false_deaths) - false_deaths,
        "packets_per_node_s": round(packets / n / steady_s, 3),
        "bytes_per_node_s": round(sim.net.stats["bytes"] / n / sim.sched.now(), 1),
        "push_pulls_per_node_min": round(streams / n / steady_s * 60, 3),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="10,100,1000")
    ap.add_argument("--loss", type=float, default=0.05, help="packet loss (0..1)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="shorter phases (a smoke run)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    results = []
    print(f"loss {args.loss:.0%}; detection = crash -> dead on every survivor (simulated s)")
    print(f"{'N':>5} {'profile':<15} {'detect med':>10} {'first med':>9} {'false+':>6} "
          f"{'pkt/node/s':>10} {'B/node/s':>9} {'memberlist min':>14} {'wall':>6}")
    for n in sizes:
        steady = (60.0 if n >= 1000 else 300.0) / (4 if args.quick else 1)
        trials = 3 if n >= 1000 or args.quick else 7
        row = {}
        for name, cfg in PROFILES.items():
            r = run(n, cfg, args.loss, steady, trials, args.seed)
            r["profile"] = name
            row[name] = r
            results.append(r)
            ml_min = 4 * max(1.0, math.log10(n)) * 1.0
            print(f"{n:>5} {name:<15} {r['detect_all_median_s']:>10.2f} "
                  f"{r['detect_first_median_s']:>9.2f} {r['false_deaths']:>6} "
                  f"{r['packets_per_node_s']:>10.2f} {r['bytes_per_node_s']:>9.0f} "
                  f"{ml_min:>14.1f} {r['wall_s']:>6.1f}", flush=True)
        ratio = row["moed"]["detect_all_median_s"] / row["memberlist-lan"]["detect_all_median_s"]
        traffic = row["moed"]["packets_per_node_s"] / row["memberlist-lan"]["packets_per_node_s"]
        print(f"{n:>5} moed/memberlist: detection x{ratio:.2f}, packets x{traffic:.2f}")
    out = ROOT / "bench" / "results" / "membership.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"loss": args.loss, "seed": args.seed, "results": results},
                              indent=2))
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
