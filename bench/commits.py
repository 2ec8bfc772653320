"""Two commits, one run: a refactor's before/after on the same machine, interleaved.

    .venv/bin/python bench/commits.py BEFORE AFTER [--rounds 2] [--engine-args "..."] [--itl-args "..."]

Each commit is checked out (detached) under .cache/commits/<sha>, and each commit's own
bench/engine.py and bench/itl_gap.py run on its own code (PYTHONPATH = that tree), so an import
path a refactor moved does not matter. Rounds alternate the order (before, after / after,
before) so a load change hits both alike. Figures compared:
  engine    moed decode tok/s (median of the engine's StepStats) per batch; prefill tok/s
  itl_gap   the client's inter-token latency (mean, median) through HTTP, and the server's
            decode step time in the same window
Prints before, after and after/before per figure (median over rounds), and saves
bench/results/commits.json. The checkpoints are random (bench preset) and the same for both
sides (same seed, same cache dir); transformers is skipped (only moed vs moed matters here).

Mind the kernel choices: each kernel build (named by its source's hash, so a commit that only
edits a comment in cpu_bf16.c is another build) races native vs oneDNN per weight shape once and
caches the answer (moed/model/kernels/choice.py). A near tie decided differently on the two
sides (the bench preset's lm_head at one row is one: oneDNN 1.6-1.9 ms vs native 2.0-2.2 ms on
the 2-core Xeon) turns the native decode step off on one side and moves batch-1 decode by ~10%
whatever the commits changed; compare the `moed_kernel_choice-*.json` files of the two builds
in ~/.cache/moed when a figure moves.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import cpu_model, load_average  # noqa: E402


def checkout(rev: str) -> tuple[str, Path]:
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = ROOT / ".cache" / "commits" / sha[:12]
    if not (tree / "moed").is_dir():
        tree.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=ROOT,
                       check=True, capture_output=True)
    return sha, tree


def run_bench(tree: Path, script: str, args: list[str], out: Path, timeout_s: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(tree / "bench" / script), *args, "--out", str(out)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    if p.returncode != 0:
        raise SystemExit(f"{script} at {tree.name} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    print(f"  {script} at {tree.name}: {time.monotonic() - t0:.0f} s", flush=True)
    return json.loads(out.read_text())


def engine_figures(d: dict) -> dict[str, float]:
    f: dict[str, float] = {}
    for row in d["results"]:
        m = row["moed"]
        f[f"decode tok/s, batch {row['batch']}"] = m["decode_tok_s"]["median"]
        f[f"prefill tok/s, batch {row['batch']}"] = m["prefill_tok_s"]["median"]
    return f


def itl_figures(d: dict) -> dict[str, float]:
    f: dict[str, float] = {}
    for r in d["runs"]:
        f[f"client ITL mean ms (threads {r['threads_setting']})"] = r["itl_ms"]["mean"]
        f[f"client ITL median ms (threads {r['threads_setting']})"] = r["itl_ms"]["median"]
        if r.get("engine_decode_step_ms") is not None:
            f[f"server decode step ms (threads {r['threads_setting']})"] = r["engine_decode_step_ms"]
    return f


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--engine-args", default="--batches 1,8 --new 32 --long 0 --repeats 2 --skip-hf")
    ap.add_argument("--itl-args", default="-n 6 --max-tokens 48 --no-peer")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per bench run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "commits.json"))
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    sides = {"before": checkout(a.before), "after": checkout(a.after)}
    benches = [("engine.py", shlex.split(a.engine_args), engine_figures),
               ("itl_gap.py", shlex.split(a.itl_args), itl_figures)]
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs, load {load_average()}\n"
          f"before {sides['before'][0][:12]}  after {sides['after'][0][:12]}", flush=True)
    figs: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    loads = []
    for r in range(a.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for script, args, pick in benches:
            for side in order:
                sha, tree = sides[side]
                out = tree.parent / f"{sha[:12]}-{script[:-3]}-r{r}.json"
                for k, v in pick(run_bench(tree, script, args, out, a.timeout)).items():
                    figs[side].setdefault(k, []).append(v)
        loads.append(load_average())
    rows = []
    print(f"\n{'figure':<44} {'before':>9} {'after':>9} {'after/before':>12}   (median of {a.rounds} rounds)")
    for k in figs["before"]:
        if k not in figs["after"]:
            continue
        b, n = statistics.median(figs["before"][k]), statistics.median(figs["after"][k])
        rows.append({"figure": k, "before": b, "after": n, "ratio": n / b if b else None,
                     "before_rounds": figs["before"][k], "after_rounds": figs["after"][k]})
        print(f"{k:<44} {b:9.2f} {n:9.2f} {n / b if b else float('nan'):12.3f}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "commits", "cpu": cpu_model(), "cpus": os.cpu_count(),
                               "before": sides["before"][0], "after": sides["after"][0],
                               "rounds": a.rounds, "engine_args": a.engine_args,
                               "itl_args": a.itl_args, "load_average_after_rounds": loads,
                               "figures": rows}, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
