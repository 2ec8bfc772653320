"""KV tiers on a multi-turn conversation trace: tiers off / L2 / L2+L3, one run.

    .venv/bin/python bench/kv_tiers.py [--sessions 16] [--turns 4] [--user 48] [--new 8]

The trace: `sessions` conversations, each turn resending the whole history (earlier turns'
prompts and answers) plus a new `user`-token message; turns go round-robin over the sessions
(turn t of every session, then turn t + 1), two requests in flight, so the working set (every
session's history) exceeds L1 several times and a recency cache alone mostly misses. Greedy,
`new` tokens per answer. The engine (qwen3_moe `bench` preset, bf16, block size 16) is driven
on this thread; a request's TTFT is from its arrival (when the previous one freed its seat) to
its first token.

Per configuration: TTFT p50/p99, throughput (generated tokens/s and requests/s), the share of
prompt blocks served from L1 and loaded from each tier, each tier's hit rate next to the best
possible at the same capacity (Belady's MIN replayed offline on the trace's block reference
stream: L1, L1+L2, L1+L2+L3 blocks), the load-or-recompute decisions and the count of loads
slower than recomputing (goal: 0). Prints a table; writes bench/results/kv_tiers.json and
kv_tiers.png. No timed asserts.

"Slower than recomputing", per load: what its request waited for the blocks (from the
decision until the engine collected them at a step boundary, where the request may run: queue,
I/O, verification and the wait for the step in flight) against recomputing the same blocks,
twice: as the decision predicted (the engine's cost model), and as measured on this machine in
the same run (the marginal prefill time per token fitted, least squares, on the "off" run's
steps: step seconds = a + b x prefill tokens + c x decode tokens), so a prediction that
flatters recomputing cannot hide a slow load.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moed.config import EngineConfig, TiersConfig  # noqa: E402
from moed.engine.engine import Engine  # noqa: E402
from moed.kvcache.pool import hash_block  # noqa: E402
from moed.model.identity import model_id  # noqa: E402
from moed.dev.checkpoint import init_checkpoint  # noqa: E402
from moed.model.runner import ModelRunner  # noqa: E402
from moed.types import SamplingParams  # noqa: E402

BS = 16


def checkpoint(cache: Path) -> Path:
    out = cache / "qwen3_moe-bench-0"
    if not (out / "config.json").exists():
        print(f"building the bench checkpoint in {out} ...", flush=True)
        init_checkpoint(arch="qwen3_moe", out=out, preset="bench", seed=0)
    return out


def run(model: Path, l1_blocks: int, tiers: TiersConfig | None, a: argparse.Namespace) -> dict:
    runner = ModelRunner(str(model), dtype="bfloat16", device="cpu", num_blocks=l1_blocks,
                         block_size=BS)
    eng = Engine(runner, None, EngineConfig(block_size=BS, max_num_batched_tokens=512,
                                            max_num_seqs=a.inflight, enable_prefix_caching=True),
                 tiers=tiers, model_id=model_id(model))
    s = eng.scheduler
    rng = random.Random(0)
    vocab = runner.spec.vocab_size
    history = [[rng.randrange(10, vocab) for _ in range(a.user)] for _ in range(a.sessions)]
    order = [(t, i) for t in range(a.turns) for i in range(a.sessions)]
    sp = SamplingParams(max_tokens=a.new, temperature=0.0, ignore_eos=True)
    live: dict[str, tuple] = {}     # request id -> (session, arrival, request)
    ttft, refs, lookups = [], [], 0
    steps: list[tuple[int, int, float]] = []    # (prefill tokens, decode tokens, forward s)
    n_gen, t_start = 0, time.perf_counter()
    while order or live:
        while order and len(live) < a.inflight:
            t, i = order.pop(0)
            prompt = list(history[i])
            r = eng._new_request(f"s{i}t{t}", prompt, sp)
            s.add(r)
            live[r.request_id] = (i, time.perf_counter(), r, False)
            hs, parent = [], None
            for b in range((len(prompt) - 1) // BS):
                parent = hash_block(parent, prompt[b * BS:(b + 1) * BS])
                hs.append(parent)
            lookups += len(hs)
            refs.extend((h, True) for h in hs)
        eng._collect_tier_loads()
        t0 = time.perf_counter()
        plan = eng._schedule()
        if plan is None:
            if not (s.loading and eng.tiers is not None and eng.tiers.wait(30.0)):
                raise RuntimeError("the engine made no progress")
            continue
        res, fwd_s, plps = eng._execute(plan)
        steps.append((plan.num_prefill_tokens, plan.num_decode_tokens, fwd_s))
        eng._finish_step(plan, res, t0, fwd_s, plps)
        now = time.perf_counter()
        for rid, (i, arr, r, seen) in list(live.items()):
            if not seen and r.num_output_tokens > 0:
                ttft.append(now - arr)
                live[rid] = (i, arr, r, True)
            if r.finished:
                n_gen += r.num_output_tokens
                seq = r.prompt_token_ids + r.output_token_ids
                parent = None
                for b in range(len(seq) // BS):       # the blocks this request computed
                    parent = hash_block(parent, seq[b * BS:(b + 1) * BS])
                    refs.append((parent, False))
                history[i] = seq + [rng.randrange(10, vocab) for _ in range(a.user)]
                del live[rid]
    wall = time.perf_counter() - t_start
    st = eng.kv.stats()
    out = {"ttft_p50_s": _q(ttft, 0.5), "ttft_p99_s": _q(ttft, 0.99), "wall_s": wall,
           "gen_tok_per_s": n_gen / wall, "req_per_s": len(ttft) / wall,
           "requests": len(ttft), "prompt_blocks": lookups,
           "l1_hit_blocks": st.prefix_hit_tokens // BS, "preemptions": s.num_preemptions}
    if eng.tiers is not None:
        t = eng.tiers
        for name in ("host", "disk"):
            c = t.counters[name]
            if t.capacity[name]:
                out[f"{name}_hit_blocks"] = c.hits
                out[f"{name}_loaded_blocks"] = c.loads
                out[f"{name}_hit_rate"] = c.hits / max(c.hits + c.misses, 1)
        out.update(decisions=dict(t.decisions), slower_than_recompute=t.slower_than_recompute,
                   bandwidth_bytes_per_s={k: b.value for k, b in t.bandwidth.items()},
                   latency_s=t.latency.value,
                   loads=[dataclasses.asdict(x) for x in t.recent_loads])
        t.close()
    out["served_share"] = (out["l1_hit_blocks"] + out.get("host_loaded_blocks", 0)
                           + out.get("disk_loaded_blocks", 0)) / max(lookups, 1)
    out["refs"] = refs
    out["steps"] = steps
    return out


def marginal_prefill_s_per_token(steps: list[tuple[int, int, float]]) -> float:
    """b of step seconds = a + b x prefill tokens + c x decode tokens (least squares)."""
    x = torch.tensor([[1.0, p, d] for p, d, _ in steps], dtype=torch.float64)
    y = torch.tensor([[s] for _, _, s in steps], dtype=torch.float64)
    return float(torch.linalg.lstsq(x, y).solution[1, 0])


def belady(refs: list[tuple[int, bool]], capacity: int) -> float:
    """Hit share of the counted references under Belady's MIN (evict the block used farthest
    in the future; a block never used again is not kept)."""
    nxt, last = [0] * len(refs), {}
    for j in range(len(refs) - 1, -1, -1):
        nxt[j] = last.get(refs[j][0], 1 << 60)
        last[refs[j][0]] = j
    cache: dict[int, int] = {}      # block -> its next use
    heap: list[tuple[int, int]] = []
    hits = counted = 0
    for j, (b, counts) in enumerate(refs):
        counted += counts
        if b in cache:
            hits += counts
        elif len(cache) >= capacity:
            while heap and cache.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)         # stale
            if heap and -heap[0][0] > nxt[j]:
                _, v = heapq.heappop(heap)
                del cache[v]
            else:
                continue                    # bypass: the newcomer is needed last
        cache[b] = nxt[j]
        heapq.heappush(heap, (-nxt[j], b))
    return hits / max(counted, 1)


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--user", type=int, default=48)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--inflight", type=int, default=2)
    ap.add_argument("--l1", type=int, default=48, help="L1 blocks")
    ap.add_argument("--l2", type=int, default=64, help="L2 blocks")
    ap.add_argument("--l3", type=int, default=512, help="L3 blocks")
    ap.add_argument("--cache", default=os.environ.get("MOED_BENCH_CACHE",
                                                      str(ROOT / ".cache" / "bench")))
    a = ap.parse_args()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model = checkpoint(Path(a.cache))
    from moed.model.archs import kv_layout
    from moed.model.hf_config import load_spec
    bpb = kv_layout(load_spec(str(model)), BS, torch.bfloat16).bytes_per_block
    load_at_start = os.getloadavg()
    d = tempfile.mkdtemp(prefix="moed-kv-tiers-")
    configs = {"off": None,
               "L2": TiersConfig(host_bytes=a.l2 * bpb),
               "L2+L3": TiersConfig(host_bytes=a.l2 * bpb, disk_bytes=a.l3 * bpb, disk_dir=d)}
    res = {name: run(model, a.l1, t, a) for name, t in configs.items()}
    refs = res["off"].pop("refs")
    per_tok = marginal_prefill_s_per_token(res["off"]["steps"])
    for r in res.values():
        r.pop("refs", None)
        r.pop("steps", None)
        loads = r.get("loads", [])
        for x in loads:
            x["measured_recompute_s"] = x["blocks"] * BS * per_tok
        r["slower_than_measured_recompute"] = sum(x["load_s"] > x["measured_recompute_s"]
                                                  for x in loads)
        r["num_loads"] = len(loads)
    ws = len({h for h, _ in refs})
    opt = {"L1": belady(refs, a.l1), "L1+L2": belady(refs, a.l1 + a.l2),
           "L1+L2+L3": belady(refs, a.l1 + a.l2 + a.l3)}
    print(f"trace: {a.sessions} sessions x {a.turns} turns, working set {ws} blocks "
          f"({ws / a.l1:.1f}x L1 of {a.l1}); block {bpb} bytes")
    print(f"measured marginal prefill: {per_tok * 1e3:.3f} ms/token ({per_tok * BS * 1e3:.2f} ms "
          f"a block); load average {load_at_start} at start, {os.getloadavg()} at the end")
    print(f"{'config':8} {'TTFT p50':>9} {'p99':>8} {'tok/s':>7} {'req/s':>6} {'served':>7} "
          f"{'L2 hit':>7} {'L3 hit':>7} {'loads':>5} {'slower (pred/meas)':>18}")
    for name, r in res.items():
        print(f"{name:8} {r['ttft_p50_s'] * 1e3:8.1f}ms {r['ttft_p99_s'] * 1e3:6.1f}ms "
              f"{r['gen_tok_per_s']:7.1f} {r['req_per_s']:6.2f} {r['served_share']:7.2%} "
              f"{r.get('host_hit_rate', float('nan')):7.2%} "
              f"{r.get('disk_hit_rate', float('nan')):7.2%} {r.get('num_loads', 0):5} "
              f"{r.get('slower_than_recompute', 0):>9}/{r['slower_than_measured_recompute']}")
    print("optimal (Belady) share of prompt blocks held:",
          ", ".join(f"{k} {v:.2%}" for k, v in opt.items()))
    out = {"args": vars(a), "block_bytes": bpb, "working_set_blocks": ws, "configs": res,
           "optimal_hit_share": opt, "measured_prefill_s_per_token": per_tok,
           "loadavg_start": load_at_start, "loadavg_end": os.getloadavg(), "host": platform.node(), "torch": torch.__version__}
    rdir = ROOT / "bench" / "results"
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "kv_tiers.json").write_text(json.dumps(out, indent=1))
    _plot(res, opt, rdir / "kv_tiers.png")
    print(f"wrote {rdir / 'kv_tiers.json'} and kv_tiers.png")


def _plot(res: dict, opt: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(res)
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [res[n]["ttft_p50_s"] * 1e3 for n in names], 0.4, label="p50")
    ax1.bar([i + 0.2 for i in x], [res[n]["ttft_p99_s"] * 1e3 for n in names], 0.4, label="p99")
    ax1.set_xticks(list(x), names)
    ax1.set_ylabel("TTFT (ms)")
    ax1.legend()
    served = [res[n]["served_share"] for n in names]
    ax2.bar(list(x), served, 0.4, label="served (measured)")
    ax2.scatter(list(x), [opt["L1"], opt["L1+L2"], opt["L1+L2+L3"]], color="k", zorder=3,
                label="optimal at the same capacity")
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("prompt blocks served from cache")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
