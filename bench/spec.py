"""Speculative decoding's speed: decode tok/s with and without drafts, and the acceptance rate,
at batch 1, 4 and 16 on the trained demo model, one run (issue 32).

    .venv/bin/python bench/spec.py [--model models/stdlib-ds3-tiny] [--batches 1,4,16]
                                   [--methods ngram,mtp] [--new 64] [--repeats 3] [--min-seconds 3] [--threads 2]
                                   [--prompts 8] [--mtp-k 1] [--clock wall|cpu]
                                   [--batch-invariant]

Workloads (greedy, the prompts cut from the demo model's held-out split, split.json):
  edit      edit-style: a held-out window W (96 tokens), a line "# the same again:", then W's
            first 16 tokens; the continuation is a copy of W, ngram's case (rewrite this code,
            repeat it with a change)
  heldout   a held-out window's first 128 tokens, continued: plain code, nothing to copy
For each (workload, batch) the same max(batch, --prompts) prompts run, `batch` at a time
(max_num_seqs), through a plain engine and one engine per method, alternated `--repeats`
times, after one warm-up run each (kernels, and the per-step switch's first measurements);
decode tok/s = the tokens after the first over the time `--new` tokens took minus the time
one token took (the prefill), median of the rounds. Batch 1 runs several prompts one after
the other: how often a prompt's own text repeats varies a lot between prompts. A cell runs
more rounds than `--repeats` until every engine has `--min-seconds` of measured decoding (a
batch-16 round is ~0.4 s: three of them moved the ratio by 0.3 between runs). The
acceptance rate is accepted / drafted tokens from the moed_spec_decode_* counters. The ratio
is the median over rounds of the method's tok/s over the plain engine's in the same round
(each round runs the engines back to back); per position (mtp with
--mtp-k > 1: its chained drafts), the accepted tokens at that position over the drafts. Outputs equal to the plain
engine's are counted too (bf16: a step's batch shape may move a near tie, docs/speculative.md).

Saves bench/results/spec.json and, when matplotlib is installed, spec.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, load_average  # noqa: E402
from quality import heldout_windows  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "stdlib-ds3-tiny"
MAX_ROUNDS = 25


def prompts_for(model_dir: Path, workload: str, count: int) -> list[list[int]]:
    from moed.model.tokenizer import Tokenizer

    windows = [w for _, w in heldout_windows(model_dir)[0] if len(w) >= 128]
    step = max(1, len(windows) // count)
    picked = windows[::step][:count]
    if workload == "heldout":
        return [w[:128] for w in picked]
    sep = Tokenizer.from_dir(model_dir).encode("\n\n# the same again:\n", add_special_tokens=False)
    return [w[:96] + sep + w[:16] for w in picked]


def make_engine(model_dir: Path, method: str, dtype: str, batch: int, new: int, mtp_k: int = 1,
                adaptive: bool = True, batch_invariant: bool = False):
    from moed.config import EngineConfig, SpeculativeConfig
    from moed.engine.engine import Engine
    from moed.model.runner import ModelRunner
    from moed.model.tokenizer import Tokenizer

    spec = None
    if method == "ngram":
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2,
                                 prompt_lookup_max=4, adaptive=adaptive)
    elif method == "mtp":
        spec = SpeculativeConfig(method="mtp", num_speculative_tokens=mtp_k, adaptive=adaptive)
    per_seq = -(-(160 + new + 8) // 16)
    runner = ModelRunner(model_dir, dtype=dtype, device="cpu", num_blocks=batch * per_seq + 8,
                         block_size=16, mtp=method == "mtp", batch_invariant=batch_invariant)
    cfg = EngineConfig(block_size=16, enable_prefix_caching=False, max_num_seqs=batch,
                       max_num_batched_tokens=2048)
    return Engine(runner, Tokenizer.from_dir(model_dir), cfg, speculative=spec)


def counters() -> tuple[float, float]:
    from moed.obs import metrics

    return metrics.SPEC_DRAFT_TOKENS._value.get(), metrics.SPEC_ACCEPTED._value.get()


def position_counters() -> dict[str, float]:
    """Drafts verified ("drafts") and accepted tokens per draft position."""
    from moed.obs import metrics

    out = {s.labels["position"]: s.value for s in metrics.SPEC_ACCEPTED_POS.collect()[0].samples
           if s.name.endswith("_total")}
    return {**out, "drafts": metrics.SPEC_DRAFTS._value.get()}


CLOCK = time.perf_counter      # --clock cpu: time.process_time


def timed(engine, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    from moed.types import SamplingParams

    t0 = CLOCK()
    out = engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return CLOCK() - t0, out


def run_cell(model_dir: Path, workload: str, batch: int, methods: list[str], a) -> dict:
    prompts = prompts_for(model_dir, workload, max(batch, a.prompts))
    n = len(prompts)
    engines = {m: make_engine(model_dir, m, a.dtype, batch, a.new, a.mtp_k, a.adaptive == "on",
                              a.batch_invariant)
               for m in ["plain", *methods]}
    for e in engines.values():  # the per-step switch measures with the bench's clock
        e._clock = CLOCK
    for e in engines.values():  # warm-up: kernels, allocator, and the per-step switch's classes
        timed(e, prompts, a.new)
    tok_s: dict[str, list[float]] = {m: [] for m in engines}
    spent = {m: 0.0 for m in engines}
    drafted = {m: 0.0 for m in engines}
    accepted = {m: 0.0 for m in engines}
    per_pos: dict[str, dict[str, float]] = {m: {} for m in engines}
    outputs: dict[str, list[list[int]]] = {}
    r = 0
    while r < a.repeats or (min(spent.values()) < a.min_seconds and r < MAX_ROUNDS):
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        r += 1
        for m in order:
            e = engines[m]
            t1, _ = timed(e, prompts, 1)
            d0, a0 = counters()
            p0 = position_counters()
            tn, out = timed(e, prompts, a.new)
            d1, a1 = counters()
            drafted[m] += d1 - d0
            accepted[m] += a1 - a0
            for key, v in position_counters().items():
                per_pos[m][key] = per_pos[m].get(key, 0.0) + v - p0.get(key, 0.0)
            outputs[m] = out
            spent[m] += tn - t1
            tok_s[m].append(n * (a.new - 1) / max(tn - t1, 1e-9))
    plain = statistics.median(tok_s["plain"])
    row = {"workload": workload, "batch": batch, "rounds": r, "plain_tok_s": plain,
           "plain_rounds": tok_s["plain"]}
    for m in methods:
        med = statistics.median(tok_s[m])
        same = sum(o == p for o, p in zip(outputs[m], outputs["plain"]))
        # each round's pair ran back to back: their ratio cancels what moved the machine
        # between rounds, which a ratio of medians over rounds of ~0.4 s (batch 16) does not
        pairs = [x / y for x, y in zip(tok_s[m], tok_s["plain"])]
        row[m] = {"tok_s": med, "rounds": tok_s[m], "ratio": statistics.median(pairs),
                  "ratio_of_medians": med / plain,
                  "acceptance": accepted[m] / drafted[m] if drafted[m] else None,
                  "draft_tokens": drafted[m], "outputs_equal_plain": f"{same}/{n}",
                  "accepted_per_position": [per_pos[m].get(str(i), 0.0) / per_pos[m]["drafts"]
                                            for i in range(a.mtp_k if m == "mtp" else 4)]
                  if per_pos[m].get("drafts") else None}
    return row


def plot(rows: list[dict], methods: list[str], path: Path) -> str:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed in this environment"
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.6), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        rs = [r for r in rows if r["workload"] == w]
        xs = range(len(rs))
        width = 0.8 / max(1, len(methods))
        for i, m in enumerate(methods):
            ax.bar([x + i * width for x in xs], [r[m]["ratio"] for r in rs], width, label=m)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in xs])
        ax.set_xticklabels([f"batch {r['batch']}" for r in rs])
        ax.set_ylabel("decode tok/s, speculative / plain")
        ax.set_title(f"{w} prompts")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--methods", default="ngram,mtp")
    ap.add_argument("--workloads", default="edit,heldout")
    ap.add_argument("--new", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=3, help="rounds a cell runs at least")
    ap.add_argument("--min-seconds", type=float, default=3.0,
                    help="and more rounds (up to %d) until every engine has this many seconds "
                         "of measured decoding in the cell" % MAX_ROUNDS)
    ap.add_argument("--prompts", type=int, default=8, help="at least this many prompts a cell")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU seconds instead of wall seconds, for the bench "
                         "and the per-step switch's measurements (with --threads 1, a shared "
                         "machine's other load barely moves it; indicative only)")
    ap.add_argument("--adaptive", default="on", choices=("on", "off"),
                    help="speculative.adaptive (the per-step switch); off: every step may draft")
    ap.add_argument("--mtp-k", type=int, default=1, help="mtp's num_speculative_tokens (1..4, "
                    "chained past the first)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-invariant", action="store_true", help="model.batch_invariant for "
                    "every engine (bf16: each row's bits its own, so outputs equal plain's)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "spec.json")
    a = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    import structlog
    import logging
    import torch

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(a.threads)
    methods = [m for m in a.methods.split(",") if m]
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs, {a.threads} threads, load {load_average()}; "
          f"{a.model.name}, {a.dtype}{', batch-invariant' if a.batch_invariant else ''}, {a.new} tokens, rounds: at least {a.repeats} and {a.min_seconds:g} s an engine, {a.clock} clock", flush=True)
    rows = []
    for w in [x for x in a.workloads.split(",") if x]:
        for b in [int(x) for x in a.batches.split(",")]:
            row = run_cell(a.model, w, b, methods, a)
            rows.append(row)
            line = f"{w:8s} batch {b:3d}  plain {row['plain_tok_s']:8.1f} tok/s"
            for m in methods:
                x = row[m]
                acc = "n/a" if x["acceptance"] is None else f"{100 * x['acceptance']:.0f}%"
                pos = "" if not x["accepted_per_position"] else \
                    " per position " + "/".join(f"{100 * q:.0f}" for q in x["accepted_per_position"])
                line += (f" | {m} {x['tok_s']:8.1f} tok/s {x['ratio']:.2f}x acceptance {acc}{pos}"
                         f" equal {x['outputs_equal_plain']}")
            print(line, flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(rows, methods, a.out.with_suffix(".png"))
    a.out.write_text(json.dumps({"bench": "spec", "cpu": cpu_model(), "threads": a.threads,
                                 "model": str(a.model), "dtype": a.dtype, "new": a.new,
                                 "batch_invariant": a.batch_invariant,
                                 "repeats": a.repeats, "min_seconds": a.min_seconds, "prompts": a.prompts, "mtp_k": a.mtp_k,
                                 "load_average": load_average(), "clock": a.clock,
                                 "rows": rows, "png": png}, indent=1))
    print(f"saved {a.out} ({png})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
