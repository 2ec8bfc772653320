"""The prefill balancer on one colocated node: three schedulers, the same trace, one run.

    .venv/bin/python bench/balance.py [--preset bench|tiny] [--duration 24] [--util 0.6]

A slow CPU (issue 30 item 6: an AVX2 machine on torch's bf16 path), emulated: --slowdown 6
(each forward sleeps 5x its own time) with a fixed trace of the issue's shape, e.g.
--short-rate 0.5 --long-every 20 --short-tokens 64,64 --long-tokens 3000,3000 --itl-ms 100
--long-target-ms 2000 (the daemon's defaults).

Trace (seeded, open loop, scaled to this machine): short requests (128-256 prompt tokens, 16
generated) arrive as a Poisson stream; with the flood, a long prompt (bench: 2500-3000 tokens,
tiny: 1500-1900; 4 generated) also arrives every `--long-every` seconds. By default both rates
come from a short and a long request timed first (`measure_demand`) so that the node is busy
`--util` (60%) of the time, 60% of that on the long prompts: the node keeps up, so TTFT
measures scheduling, not a queue that never drains (on a machine shared with other work, load
average 8-12 on 2 cores, a fixed trace overloaded every scheduler). Each
scheduler serves the trace twice, without the flood and with it:

  fixed-2048  balance.policy "tokens", max_num_batched_tokens 2048, FCFS (vLLM's default shape)
  fixed-512   balance.policy "tokens", 512 (Sarathi-Serve's chunk)
  cost        balance.policy "cost": each step's time from the cost model fitted on this
              node (calibrated first), prompts ordered by slack to their bucket's TTFT target

Per scheduler: short-request TTFT p50/p99 without and with the flood (and their ratio; goal
≤ 1.5x), long-request TTFT, the p99 over shorts of their longest inter-token gap, shorts
served, throughput (prompt + generated tokens / makespan;
goal ≥ 95% of fixed-2048) and the cost model's error on that run's steps (median, p90; goal
median ≤ 10%). Writes bench/results/balance.json (with the fitted coefficients, which
bench/balance_sim.py reads) and bench/results/balance.png (short TTFT over time);
--dump-steps also keeps every step's features, predicted and measured time (step_log: the
cost model's residuals). The cost engine calibrates --calibration-steps (39) first.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine import _checkpoint  # noqa: E402  (bench/engine.py: the bench preset checkpoint)

from moed.config import BalanceConfig, EngineConfig  # noqa: E402
from moed.engine.engine import Engine  # noqa: E402
from moed.model.runner import ModelRunner  # noqa: E402
from moed.types import SamplingParams  # noqa: E402

SCHEDULERS = {
    "fixed-2048": dict(policy="tokens", cap=2048),
    "fixed-512": dict(policy="tokens", cap=512),
    "cost": dict(policy="cost", cap=8192),
}


LONG = {"bench": (2500, 3000), "tiny": (1500, 1900)}   # tiny's context is 2048 tokens


def make_trace(duration: float, short_rate: float, long_every: float, flood: bool, seed: int,
               long_range: tuple[int, int] = LONG["bench"],
               short_range: tuple[int, int] = (128, 256), short_new: int = 16
               ) -> list[tuple[float, str, int, int]]:
    """(arrival s, kind, prompt tokens, max tokens), sorted. The shorts are the same with and
    without the flood (same seed)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(short_rate)
        if t >= duration:
            break
        out.append((t, "short", rng.randint(*short_range), short_new))
    if flood:
        lr = random.Random(seed + 1)
        t = 0.5
        while t < duration:
            out.append((t, "long", lr.randint(*long_range), 4))
            t += long_every
    return sorted(out)


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(p / 100 * len(s) + 0.5)) - 1))]


def slow_down(runner: ModelRunner, factor: float) -> None:
    """Emulate a CPU `factor` times slower (--slowdown): each forward sleeps (factor - 1) x
    its own time, inside the step the engine times, so the cost model, the budgets and the
    trace all see the slow machine; the sleep leaves the shared cores to others."""
    if factor <= 1:
        return
    forward = runner.forward

    def slow(*args, **kwargs):
        t0 = time.perf_counter()
        out = forward(*args, **kwargs)
        time.sleep((factor - 1) * (time.perf_counter() - t0))
        return out
    runner.forward = slow


def measure_demand(runner: ModelRunner, vocab: int, long_len: int, short_len: int = 192,
                   short_new: int = 16) -> tuple[float, float]:
    """Seconds of node time one short and one long request cost, measured (fixed-2048): the
    prefill alone, plus the decode steps' share at a batch of 8."""
    eng = Engine(runner, None, EngineConfig(block_size=16, enable_prefix_caching=False,
                                            max_num_seqs=64, max_num_batched_tokens=2048))
    rng = random.Random(99)

    def timed(prompts: list[list[int]], new: int) -> float:
        t0 = time.perf_counter()
        eng.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
        return time.perf_counter() - t0

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    timed([ids(64)], 2)                                           # warm-up
    batch = [ids(32) for _ in range(8)]
    step8 = (timed(batch, 17) - timed([ids(32) for _ in range(8)], 1)) / 16
    return (timed([ids(short_len)], 1) + short_new * step8 / 8,
            timed([ids(long_len)], 1) + 4 * step8 / 8)


def build(runner: ModelRunner, name: str, args: argparse.Namespace) -> Engine:
    spec = SCHEDULERS[name]
    cfg = EngineConfig(block_size=16, enable_prefix_caching=False, max_num_seqs=64,
                       max_num_batched_tokens=spec["cap"])
    bal = BalanceConfig(policy=spec["policy"], itl_target_ms=args.itl_ms,
                        ttft_targets_ms=(args.short_target_ms, args.long_target_ms, 20000.0,
                                         60000.0), calibration_steps=args.calibration_steps)
    eng = Engine(runner, None, cfg, balance=bal)
    if spec["policy"] == "cost":
        eng.calibrate(bal.calibration_steps)
    else:   # the same warm-up work, untimed
        eng.generate([[1] * 64], SamplingParams(max_tokens=2, ignore_eos=True))
    return eng


async def serve(eng: Engine, trace: list, vocab: int, seed: int, drain_s: float) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for _, _, n, _ in trace]
    rows: list[dict] = []
    samples0 = eng.balance.cost.samples
    eng.balance.cost.reset_errors()      # this run's steps only (not the calibration's)
    steps: list[list[float]] = []        # (features..., predicted, measured) per step
    observe = eng.balance.cost.observe

    def recording(shape, seconds: float) -> None:    # the model's residuals, for --dump-steps
        steps.append([*shape.raw()[1:], eng.balance.cost.predict(shape), seconds])
        observe(shape, seconds)
    eng.balance.cost.observe = recording
    await eng.start()
    t0 = time.perf_counter()

    async def one(i: int, at: float, kind: str, n: int, new: int) -> None:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        start = time.perf_counter()
        stream = eng.add_request(f"r{i}", prompts[i], SamplingParams(max_tokens=new,
                                                                     ignore_eos=True))
        first = last = None
        toks = 0
        gaps: list[float] = []
        async for ev in stream:
            if ev.token_ids:
                now = time.perf_counter()
                if first is None:
                    first = now
                elif last is not None:
                    gaps.append((now - last) / len(ev.token_ids))
                last = now
            toks += len(ev.token_ids)
        rows.append({"kind": kind, "arrival": start - t0, "prompt": n, "tokens": toks,
                     "ttft": None if first is None else first - start,
                     "itl_max": max(gaps, default=None), "end": time.perf_counter() - t0})

    tasks = [asyncio.create_task(one(i, *e)) for i, e in enumerate(trace)]
    duration = max((e[0] for e in trace), default=0.0)
    done, pending = await asyncio.wait(tasks, timeout=duration + drain_s)
    for t in pending:
        t.cancel()
    await eng.shutdown()
    shorts = [r for r in rows if r["kind"] == "short" and r["ttft"] is not None]
    longs = [r for r in rows if r["kind"] == "long" and r["ttft"] is not None]
    finished = [r for r in rows if r["ttft"] is not None]
    makespan = max(r["end"] for r in finished) if finished else float("nan")
    tokens = sum(r["prompt"] + r["tokens"] for r in finished)
    err_p50, err_p90 = eng.balance.cost.error_quantiles()
    return {
        "short_ttft_p50": pct([r["ttft"] for r in shorts], 50),
        "short_ttft_p99": pct([r["ttft"] for r in shorts], 99),
        "long_ttft_p50": pct([r["ttft"] for r in longs], 50),
        "long_ttft_max": max((r["ttft"] for r in longs), default=float("nan")),
        "short_itl_max_p99": pct([r["itl_max"] for r in shorts if r["itl_max"] is not None], 99),
        "shorts_served": len(shorts), "longs_served": len(longs),
        "unfinished": len(pending), "throughput_tok_s": tokens / makespan,
        "makespan_s": makespan, "steps": eng.balance.cost.samples - samples0,
        "cost_error_p50": err_p50, "cost_error_p90": err_p90,
        "rows": sorted(rows, key=lambda r: r["arrival"]),
        "step_log": steps,
    }


def plot(results: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for name, res in results.items():
        rows = [r for r in res["flood"]["rows"] if r["kind"] == "short" and r["ttft"] is not None]
        ax.plot([r["arrival"] for r in rows], [r["ttft"] for r in rows], ".-", ms=3, lw=0.6,
                label=f"{name} (p99 {res['flood']['short_ttft_p99']:.2f}s)")
    longs = [r["arrival"] for r in next(iter(results.values()))["flood"]["rows"]
             if r["kind"] == "long"]
    for i, t in enumerate(longs):
        ax.axvline(t, color="grey", lw=0.5, ls=":", label="long prompt arrives" if i == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("arrival (s)")
    ax.set_ylabel("short-request TTFT (s)")
    ax.set_title("Short requests' TTFT under a stream of long prompts (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "mixtral"))
    ap.add_argument("--preset", default="bench", choices=("bench", "tiny"),
                    help="tiny: ~20x less compute (for a machine shared with other work)")
    ap.add_argument("--duration", type=float, default=24.0, help="trace length, s")
    ap.add_argument("--util", type=float, default=0.6,
                    help="size the trace so the node's busy this share of the time (from the "
                    "calibrated cost model: the same trace for every scheduler)")
    ap.add_argument("--long-share", type=float, default=0.6,
                    help="share of that work that is long prompts")
    ap.add_argument("--short-rate", type=float, default=0.0,
                    help="short requests per s (0 = from --util)")
    ap.add_argument("--long-every", type=float, default=0.0,
                    help="s between long prompts (0 = from --util)")
    ap.add_argument("--itl-ms", type=float, default=250.0,
                    help="cost policy: ITL target (the bench preset on 2 shared cores: 16 "
                    "decodes take 36 ms idle, 2-3x that under load)")
    ap.add_argument("--short-target-ms", type=float, default=500.0,
                    help="cost policy: TTFT target of the <=512-token bucket")
    ap.add_argument("--long-target-ms", type=float, default=8000.0,
                    help="cost policy: TTFT target of the 513-4096-token bucket")
    ap.add_argument("--calibration-steps", type=int, default=39,
                    help="cost policy: balance.calibration_steps (three rounds of the "
                    "calibration's shapes: 13 steps on 2 shared cores left fits off by 2-4x)")
    ap.add_argument("--short-tokens", default="128,256",
                    help="short prompts' length range (the issue's slow-CPU case: 64,64)")
    ap.add_argument("--short-new", type=int, default=16, help="tokens generated per short")
    ap.add_argument("--long-tokens", default="",
                    help="long prompts' length range (default: the preset's; e.g. 3000,3000)")
    ap.add_argument("--slowdown", type=float, default=1.0,
                    help="emulate a CPU this many times slower: every forward sleeps "
                    "(x - 1) times its own time (an AVX2 machine on the torch path)")
    ap.add_argument("--drain", type=float, default=60.0, help="s allowed after the trace")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", help="comma-separated schedulers (default: all)")
    ap.add_argument("--cache", default=os.environ.get("MOED_BENCH_CACHE",
                                                      str(ROOT / ".cache" / "bench")))
    ap.add_argument("--dump-steps", action="store_true",
                    help="keep every step's features, predicted and measured time in the JSON "
                    "(step_log: the cost model's residuals)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "balance.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.preset == "bench":
        model_dir = _checkpoint(a.arch, Path(a.cache))
    else:
        from moed.dev.checkpoint import init_checkpoint
        model_dir = Path(a.cache) / f"{a.arch}-tiny-0"
        if not (model_dir / "config.json").exists():
            init_checkpoint(arch=a.arch, out=model_dir, preset="tiny", seed=0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    runner = ModelRunner(model_dir, dtype="bfloat16", device="cpu", attention_backend="torch",
                         num_blocks=4096, block_size=16)
    slow_down(runner, a.slowdown)
    short_range = tuple(int(x) for x in a.short_tokens.split(","))
    long_range = (tuple(int(x) for x in a.long_tokens.split(",")) if a.long_tokens
                  else LONG[a.preset])
    names = [n for n in SCHEDULERS if not a.only or n in a.only.split(",")]
    if not a.short_rate or not a.long_every:     # scale the trace to this machine, now
        short_s, long_s = measure_demand(runner, vocab, sum(long_range) // 2,
                                         sum(short_range) // 2, a.short_new)
        a.short_rate = a.short_rate or a.util * (1 - a.long_share) / short_s
        a.long_every = a.long_every or long_s / (a.util * a.long_share)
        print(f"calibrated: a short request ~{short_s:.2f}s of work, a long one ~{long_s:.2f}s; "
              f"trace at {a.util:.0%} busy: {a.short_rate:.2f} shorts/s, a long prompt every "
              f"{a.long_every:.1f}s", flush=True)
    traces = {f: make_trace(a.duration, a.short_rate, a.long_every, f == "flood", a.seed,
                            long_range, short_range, a.short_new) for f in ("alone", "flood")}
    if not any(k == "short" for _, k, _, _ in traces["alone"]):
        # a slow machine's calibrated rate can leave no short request in the window: nothing
        # to measure (it used to fail later on an empty list)
        raise SystemExit(f"balance.py: the trace holds no short request in {a.duration:.0f}s "
                         f"at {a.short_rate:.3f} shorts/s: raise --duration or set --short-rate")
    print(f"{a.arch} {a.preset} preset, bf16, {torch.get_num_threads()} threads, slowdown "
          f"{a.slowdown:g}x; trace {a.duration:.0f}s: "
          f"{sum(k == 'short' for _, k, _, _ in traces['flood'])} shorts, "
          f"{sum(k == 'long' for _, k, _, _ in traces['flood'])} long prompts (flood); "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[str, dict] = {}
    coefficients = None
    for name in names:
        results[name] = {}
        for f in ("alone", "flood"):
            eng = build(runner, name, a)
            res = asyncio.run(serve(eng, traces[f], vocab, a.seed, a.drain))
            results[name][f] = res
            if name == "cost" and f == "flood":
                coefficients = eng.balance.cost.coefficients
            print(f"  {name:<10} {f:<5}: short TTFT p50 {res['short_ttft_p50']:.3f}s p99 "
                  f"{res['short_ttft_p99']:.3f}s  long TTFT p50 {res['long_ttft_p50']:.2f}s  "
                  f"{res['throughput_tok_s']:.0f} tok/s  err p50 {res['cost_error_p50']:.3f}",
                  flush=True)
    base = results.get("fixed-2048", {}).get("flood", {}).get("throughput_tok_s")
    print(f"\n{'scheduler':<10} | {'short p99':>9} {'w/ flood':>9} {'ratio':>5} | "
          f"{'long p50':>8} | {'ITL p99':>7} | {'shorts':>6} | {'tok/s':>6} {'vs 2048':>7} | "
          f"{'err p50':>7} {'p90':>5}")
    summary = {}
    for name, res in results.items():
        al, fl = res["alone"], res["flood"]
        ratio = fl["short_ttft_p99"] / al["short_ttft_p99"]
        rel = fl["throughput_tok_s"] / base if base else float("nan")
        summary[name] = {"short_p99_alone": al["short_ttft_p99"], "short_p99_flood": fl["short_ttft_p99"],
                         "ratio": ratio, "throughput_vs_2048": rel,
                         "short_itl_max_p99_flood": fl["short_itl_max_p99"],
                         "cost_error_p50": fl["cost_error_p50"], "cost_error_p90": fl["cost_error_p90"]}
        print(f"{name:<10} | {al['short_ttft_p99']:8.3f}s {fl['short_ttft_p99']:8.3f}s {ratio:5.2f} | "
              f"{fl['long_ttft_p50']:7.2f}s | {fl['short_itl_max_p99']:6.2f}s | {fl['shorts_served']:>6} | "
              f"{fl['throughput_tok_s']:6.0f} {rel:6.1%} | {fl['cost_error_p50']:7.3f} "
              f"{fl['cost_error_p90']:5.3f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"arch": a.arch, "preset": a.preset, "threads": a.threads, "args": vars(a),
           "load_average": os.getloadavg(), "summary": summary, "results": results,
           "cost_coefficients": coefficients.__dict__ if coefficients else None}
    if not a.dump_steps:
        for res in results.values():
            for r in res.values():
                r.pop("step_log", None)
    out.write_text(json.dumps(doc, indent=1, default=float))
    if len(results) > 0:
        plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
