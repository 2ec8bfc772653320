"""Decode step time of an expert-parallel group at EP = 1/2/4 on this machine (gloo ranks on
127.0.0.1, one process each), with each rank's resident expert bytes and the KV blocks its
memory budget leaves room for.

    .venv/bin/python bench/ep_step.py [--sizes 1 2 4] [--batch 8] [--context 256] [--steps 40]
                                      [--arch qwen3_moe] [--preset bench] [--dtype bfloat16]
                                      [--rank-memory-mb 2048]

Each rank runs the same decode batch (`--batch` sequences of `--context` tokens, one new
token each) for `--steps` steps after warm-up, through ModelRunner.forward (so the MoE layers
dispatch and combine over the group). A step's time is the slowest rank's (they step
together); reported: median and p90 over steps, the part spent in collectives, and the
per-rank figures. Every rank gets `--threads` torch threads (default: cores // N), so EP=N
does not get more CPU than EP=1. `measure()` is importable (bench/eplb.py).

Prints a table; writes bench/results/ep_step.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _checkpoint(arch: str, preset: str, cache: Path) -> Path:
    from moed.dev.checkpoint import init_checkpoint

    out = cache / f"{arch}-{preset}-0"
    if not (out / "config.json").exists():
        init_checkpoint(arch=arch, out=out, preset=preset, seed=0)
    return out


def measure(model: Path, sizes=(1, 2, 4), batch: int = 8, context: int = 256, steps: int = 40,
            dtype: str = "bfloat16", threads: int = 0, rank_memory_mb: int = 2048,
            timeout_s: float = 170.0) -> list[dict]:
    """One row per EP size: step time (median/p90, slowest rank per step), collective share,
    resident expert bytes per rank and KV blocks that fit in rank_memory_mb."""
    rows = []
    cores = os.cpu_count() or 1
    for n in sizes:
        port, t = _port(), threads or max(1, cores // n)
        env = {**os.environ, "OMP_NUM_THREADS": str(t), "PYTHONPATH": str(ROOT)}
        argv = [sys.executable, __file__, "--worker", str(model), str(n), str(port), str(batch),
                str(context), str(steps), dtype, str(t), str(rank_memory_mb)]
        procs = [subprocess.Popen([*argv, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env=env, text=True) for r in range(n)]
        outs = []
        try:
            for p in procs:
                so, se = p.communicate(timeout=timeout_s)
                if p.returncode != 0:
                    raise RuntimeError(f"EP={n} rank failed: {se[-2000:]}")
                outs.append(json.loads(so.strip().splitlines()[-1]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        step = [max(o["step_s"][i] for o in outs) for i in range(steps)]
        coll = [statistics.median(o["collective_s"]) for o in outs]
        rows.append({"ep_size": n, "threads_per_rank": t, "batch_per_rank": batch,
                     "tokens_per_step": batch * n, "step_ms_median": 1e3 * statistics.median(step),
                     "step_ms_p90": 1e3 * sorted(step)[int(0.9 * (steps - 1))],
                     "collective_ms_median": 1e3 * statistics.median(coll),
                     "tokens_per_s": batch * n / statistics.median(step),
                     "resident_expert_mb": [round(o["resident_expert_bytes"] / 2**20, 2) for o in outs],
                     "kv_blocks_fit": [o["kv_blocks_fit"] for o in outs]})
    return rows


def _worker(model: str, n: int, port: int, batch: int, context: int, steps: int, dtype: str,
            threads: int, rank_memory_mb: int, rank: int) -> None:
    import torch

    from moed.config import ParallelConfig
    from moed.model.batch import ForwardBatch
    from moed.model.runner import ModelRunner
    from moed.model.hf_config import load_spec
    from moed.parallel.memory import rank_memory

    torch.set_num_threads(threads)
    spec = load_spec(model)
    block, per_seq = 16, -(-(context + 1) // 16)
    ep = None
    if n > 1:
        from moed.parallel.runtime import EPRuntime
        ep = EPRuntime.plan(ParallelConfig(ep_size=n, ep_rank=rank, ep_init=f"tcp://127.0.0.1:{port}",
                                           collective_timeout_s=120), spec.num_experts, torch.device("cpu"))
    runner = ModelRunner(model, dtype=dtype, device="cpu", num_blocks=batch * per_seq, block_size=block,
                         spec=spec, placement=None if ep is None else ep.placement)
    if ep is not None:
        ep.join()
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    g = torch.Generator().manual_seed(rank)
    toks = torch.randint(0, spec.vocab_size, (batch, context + 1), generator=g).tolist()
    for i in range(batch):     # fill the context (prefill), one sequence per step: same on every rank
        runner.forward(ForwardBatch([toks[i][:context]], [0], [tables[i]]))
    dec = ForwardBatch([[toks[i][context]] for i in range(batch)], [context] * batch, tables)
    for _ in range(5):
        runner.forward(dec)
    step_s, coll_s = [], []
    for _ in range(steps):
        if ep is not None:
            ep.stats.take()
        t0 = time.perf_counter()
        runner.forward(dec)
        step_s.append(time.perf_counter() - t0)
        coll_s.append(ep.stats.take().collective_s if ep is not None else 0.0)
    held = runner.resident_expert_bytes()
    b = rank_memory(spec, runner.dtype, n, rank, 0, block, rank_memory_mb)
    print(json.dumps({"step_s": step_s, "collective_s": coll_s, "resident_expert_bytes": held,
                      "kv_blocks_fit": b.kv_blocks_fit}))
    if ep is not None:
        ep.close()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        _worker(a[0], *map(int, a[1:6]), a[6], int(a[7]), int(a[8]), int(a[9]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--arch", default="qwen3_moe")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rank-memory-mb", type=int, default=2048)
    ap.add_argument("--cache", default=os.environ.get("MOED_BENCH_CACHE", str(ROOT / ".cache" / "bench")))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ep_step.json"))
    args = ap.parse_args()
    model = _checkpoint(args.arch, args.preset, Path(args.cache))
    rows = measure(model, args.sizes, args.batch, args.context, args.steps, args.dtype,
                   args.threads, args.rank_memory_mb)
    print(f"{'EP':>3} {'thr':>4} {'tok/step':>8} {'step ms p50':>11} {'p90':>7} {'coll ms':>8} "
          f"{'tok/s':>7}  resident expert MB / rank   KV blocks fit / rank ({args.rank_memory_mb} MB)")
    for r in rows:
        print(f"{r['ep_size']:>3} {r['threads_per_rank']:>4} {r['tokens_per_step']:>8} "
              f"{r['step_ms_median']:>11.2f} {r['step_ms_p90']:>7.2f} {r['collective_ms_median']:>8.2f} "
              f"{r['tokens_per_s']:>7.0f}  {r['resident_expert_mb']}   {r['kv_blocks_fit']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "args": {k: v for k, v in vars(args).items() if k not in ("cache", "out")},
        "load_average": os.getloadavg(), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
