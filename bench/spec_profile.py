"""Where a speculative engine's time goes, per step, beside a plain engine's (bench/spec.py's
engines and prompts): steps per arm of the per-step switch (and why: warm-up, winner,
exploration), seconds per step by arm, and inside a step the scheduling, the main forward,
the MTP layer's pass (drafting or KV entries only), verification, sampling and the update.

    .venv/bin/python bench/spec_profile.py [--batch 16] [--methods ngram,mtp] [--repeats 3]
                                           [--workload edit|heldout] [--threads 2] [--adaptive on]

The engines run alternately (`--repeats` rounds, order reversed every other round, after one
warm-up run each); every figure is a sum over the rounds' decode steps, reported per step
(ms) and per emitted token (us). Wall clock (perf_counter), or
--clock cpu: the thread's CPU time, for a shared machine.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average  # noqa: E402
from spec import DEFAULT_MODEL, make_engine, prompts_for  # noqa: E402

CLOCK = time.perf_counter     # --clock cpu: time.thread_time (the step runs on this thread)
PARTS = ("schedule", "forward", "mtp", "verify", "sample", "finish")


class Probe:
    """Times the parts of each step of one engine (wrapping its bound methods)."""
    active: "Probe | None" = None

    def __init__(self, engine) -> None:
        import moed.engine.step as step_mod

        self.e, self.rec, self.on = engine, [], False
        self.cur: dict = {}
        e, runner = engine, engine.runner

        def timed(name, fn):
            def w(*a, **k):
                t = CLOCK()
                try:
                    return fn(*a, **k)
                finally:
                    self.cur[name] = self.cur.get(name, 0.0) + CLOCK() - t
            return w

        e._schedule = timed("schedule", e._schedule)
        e._finish_step = timed("finish", e._finish_step)
        runner.forward = timed("forward", runner.forward)
        if hasattr(runner, "draft_mtp"):
            inner = runner.draft_mtp

            def draft_mtp(batch, hidden, depth, passes=0, kept=None):
                self.cur["mtp_kind"] = "draft" if any(depth) else "kv"
                return inner(batch, hidden, depth, passes, kept)
            runner.draft_mtp = timed("mtp", draft_mtp)
        # module functions: wrapped once, timed into the probe of the engine stepping now
        if not hasattr(step_mod, "_probe_orig"):
            step_mod._probe_orig = (step_mod.verify_rows, step_mod.sample)

            def current(name, fn):
                def w(*a, **k):
                    p = Probe.active
                    t = CLOCK()
                    try:
                        return fn(*a, **k)
                    finally:
                        if p is not None:
                            p.cur[name] = p.cur.get(name, 0.0) + CLOCK() - t
                return w
            step_mod.verify_rows = current("verify", step_mod.verify_rows)
            step_mod.sample = current("sample", step_mod.sample)
        gate = e._gate
        if gate is not None:
            choose = gate.choose

            def ch(rows):
                d, why = choose(rows)
                self.cur["why"] = why.value
                return d, why
            gate.choose = ch
        orig_step = e.step

        async def step(driver):
            self.cur = {}
            Probe.active = self
            t = CLOCK()
            go = await orig_step(driver)
            self.cur["total"] = CLOCK() - t
            if self.on:
                self.cur["drafting"] = e.scheduler.drafting
                self.rec.append(self.cur)
            return go
        e.step = step
        fs = e._finish_step

        def finish(plan, res, *a, **k):
            self.cur["prefill"] = plan.num_prefill_tokens
            self.cur["drafts"] = sum(len(c.draft) for c in plan.chunks)
            self.cur["rows"] = len(plan.chunks)
            fin = [c.request for c in plan.chunks]
            before = sum(r.num_output_tokens for r in fin)
            out = fs(plan, res, *a, **k)
            self.cur["emitted"] = sum(r.num_output_tokens for r in fin) - before
            return out
        e._finish_step = finish


def lockstep(engines: list, probes: list, prompts: list[list[int]], sp, round_: int) -> None:
    """The engines' runs of the same prompts interleaved step by step (each engine one step in
    turn, while it has work): the machine's load moves them alike."""
    from moed.engine.drivers import SyncDriver, run_sync

    driver = SyncDriver()
    for e in engines:
        for i, p in enumerate(prompts):
            e.scheduler.add(e._new_request(f"ls{round_}-{i}", p, sp))
    for p in probes:
        p.on = True
    while any(e.scheduler.has_unfinished() for e in engines):
        for e in engines:
            if e.scheduler.has_unfinished():
                run_sync(e.step(driver))
    for p in probes:
        p.on = False


def summary(name: str, rec: list[dict], batch: int, base_us: float | None) -> float:
    """Print the engine's figures; -> its us per emitted token over its decode steps. base_us:
    the plain engine's, for each group's excess (its time minus its tokens at that rate)."""
    dec = [r for r in rec if r.get("prefill") == 0]
    groups = defaultdict(list)
    for r in dec:
        arm = "plain-engine" if "why" not in r and name == "plain" else \
            ("draft" if r.get("drafts") else ("mayDraft-nodraft" if r.get("drafting") else "plain"))
        size = "full" if r["rows"] >= batch else "tail"
        groups[(arm, r.get("why", "-"), size)].append(r)
    tot_t = sum(r["total"] for r in dec)
    tot_tok = sum(r["emitted"] for r in dec)
    print(f"== {name}: {len(dec)} decode steps, {tot_tok} tokens, {1e3 * tot_t:.0f} ms, "
          f"{1e6 * tot_t / max(tot_tok, 1):.1f} us/token ({tot_tok / tot_t:.0f} tok/s); "
          f"+{len(rec) - len(dec)} prefill steps {1e3 * sum(r['total'] for r in rec if r not in dec):.0f} ms")
    for (arm, why, size), rs in sorted(groups.items()):
        n = len(rs)
        t = sum(r["total"] for r in rs)
        tok = sum(r["emitted"] for r in rs)
        parts = " ".join(f"{p} {1e3 * sum(r.get(p, 0.0) for r in rs) / n:.2f}" for p in PARTS)
        other = (t - sum(r.get(p, 0.0) for r in rs for p in PARTS)) / n
        kinds = defaultdict(int)
        for r in rs:
            kinds[r.get("mtp_kind", "-")] += 1
        excess = "" if base_us is None else f" excess {1e3 * (t - tok * base_us * 1e-6):+7.1f} ms"
        print(f"  {arm:16s} {why:7s} {size} steps {n:4d} ({100 * n / max(len(dec), 1):4.1f}%) "
              f"{1e3 * t / n:6.2f} ms/step {sum(r['rows'] + r['drafts'] for r in rs) / n:5.1f} pos/step "
              f"{tok / n:5.2f} tok/step {1e6 * t / max(tok, 1):6.1f} us/tok "
              f"share {100 * t / tot_t:4.1f}%{excess} | {parts} other {1e3 * other:.2f} | mtp {dict(kinds)}")
    return 1e6 * tot_t / max(tot_tok, 1)


def main() -> int:  # noqa: C901
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--methods", default="ngram,mtp")
    ap.add_argument("--workload", default="edit")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--adaptive", default="on", choices=("on", "off"))
    ap.add_argument("--mtp-k", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lockstep", action="store_true",
                    help="interleave the engines step by step instead of run by run")
    ap.add_argument("--force-plain", action="store_true",
                    help="the switch always says plain: what the speculative engine's plain arm "
                         "costs beside the plain engine, without warm-up and exploration")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU seconds (with --threads 1), for the parts and "
                         "for the per-step switch's own measurements (engine._clock)")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.thread_time if a.clock == "cpu" else time.perf_counter
    import logging

    import structlog
    import torch

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(a.threads)
    from moed.types import SamplingParams

    prompts = prompts_for(a.model, a.workload, a.batch)
    sp = SamplingParams(max_tokens=a.new, temperature=0.0, ignore_eos=True)
    names = ["plain", *[m for m in a.methods.split(",") if m]]
    engines = {m: make_engine(a.model, m, a.dtype, a.batch, a.new, a.mtp_k, a.adaptive == "on")
               for m in names}
    for e in engines.values():
        e._clock = CLOCK
        if a.force_plain and e._gate is not None:
            from moed.engine.drafts.gate import Why
            e._gate.choose = lambda rows: (False, Why.WINNER)
    probes = {m: Probe(e) for m, e in engines.items()}
    print(f"load {load_average()}, {os.cpu_count()} CPUs, {a.threads} threads, batch {a.batch}, "
          f"{a.workload}, {a.new} tokens, {a.repeats} rounds, {a.clock} clock", flush=True)
    for e in engines.values():
        e.generate(prompts, sp)
    for r in range(a.repeats):
        order = names if r % 2 == 0 else names[::-1]
        if a.lockstep:
            lockstep([engines[m] for m in order], [probes[m] for m in order], prompts, sp, r)
            continue
        for m in order:
            probes[m].on = True
            engines[m].generate(prompts, sp)
            probes[m].on = False
    base = None
    for m in names:
        us = summary(m, probes[m].rec, a.batch, base)
        base = us if base is None else base
        if m != "plain":
            print(f"  -> {base / us:.3f}x plain's tok/s over decode steps")
    print(f"load {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
