"""Expert load balancer (EPLB): balancedness before/after and expert bytes moved, one run.

    .venv/bin/python bench/eplb.py [--layers 16] [--experts 128] [--ranks 8] [--nodes 2]
                                   [--windows 20] [--sigma 0.1] [--skip-model]

balancedness = mean rank load / max rank load of a layer (1.0 perfect), averaged over layers; a
rank's load is the tokens its slots serve, a replicated expert's tokens split evenly
(moed/balance/experts.py). "before" is the checkpoint's layout (slot e = expert e, E / G
contiguous experts per rank, no redundant slots).

1. Zipf traces: per layer, a Zipf(s) popularity over a random permutation of the experts,
   `--tokens` routed tokens sampled per window. After = the first placement for 0, E/4 and E/2
   redundant slots, global (one node) and hierarchical (`--nodes`, replicas stay in a node).
   The first placement is the same greedy for both balancers (there is no map to keep).
2. Drifting loads: the log-popularities random-walk (step `--sigma`) over `--windows` windows;
   each window rebalances ours (migration-aware, from its previous map; also with min_gain
   `--min-gain`) and the peer (DeepSeek's greedy from scratch; its slots reordered within each
   rank to keep what a rank already holds, which is free and only helps it). Moved slots are
   those whose expert changes; bytes = moved × `--expert-bytes` (default: one Qwen3-30B-A3B
   expert in bf16, 3 × 2048 × 768 × 2 B). "fit" balancedness is on the window a map was
   computed from, "served" on the next window (what the ranks get).
3. The model's real routing trace: the bench checkpoint (random weights) routes random prompts;
   the runner's per-(layer, expert) counter (the one the engine's expert-load subscribers
   read) gives one window per batch; the same tables on it (E = 16, `--model-ranks` ranks).
   Random-weight routers spread tokens fairly evenly, so the Zipf traces are the skewed case.
4. Time per call at 64 layers × 256 experts × 64 ranks (320 slots).
5. The EP runtime on this machine (gloo ranks on 127.0.0.1, one process each, the bench
   checkpoint, bf16): decode step time at EP = 1/2/4 (bench/ep_step.py's measure(): the slowest
   rank's forward per step, `--ep-batch` sequences per rank), and the step-time p99 during a
   rebalance vs outside one at EP = 2 with `--ep-redundant` redundant slots per rank: each rank
   runs decode steps, then `--ep-rebalances` rebalances (the Rebalancer of moed/parallel/
   rebalance.py, one layer per step, driven by alternating skewed windows so every one moves
   weights); a step "during" one is its forward plus the controller's work after it (the
   decision, or one layer's weight moves and map switch), as the engine runs them back to back.

Prints tables; writes bench/results/eplb.json and bench/results/eplb.png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moed.balance.experts import (ExpertMap, align, balancedness, moved_slots, rebalance,  # noqa: E402
                                  rebalance_from_scratch)

MIB = 2 ** 20


def zipf_logits(layers: int, experts: int, s: float, g: torch.Generator) -> torch.Tensor:
    """[L, E] log-popularities: -s·log(rank), ranks permuted per layer."""
    base = -s * torch.log(torch.arange(1, experts + 1, dtype=torch.float64))
    return torch.stack([base[torch.randperm(experts, generator=g)] for _ in range(layers)])


def sample(logits: torch.Tensor, tokens: int, g: torch.Generator) -> torch.Tensor:
    """One window: `tokens` routed tokens per layer drawn from softmax(logits) → [L, E] counts."""
    p = torch.softmax(logits, 1)
    return torch.stack([torch.multinomial(row, tokens, replacement=True, generator=g)
                        .bincount(minlength=p.shape[1]) for row in p])


def first_placement(load: torch.Tensor, ranks: int, nodes: int) -> dict:
    """Balancedness before (checkpoint layout) and after the first placement, per redundancy."""
    n_layers, n_exp = load.shape
    out = {"before": float(balancedness(load, ExpertMap.identity(n_layers, n_exp, ranks)).mean())}
    for extra in redundancies(n_exp, ranks):
        m = rebalance(load, None, num_physical=n_exp + extra, num_ranks=ranks, num_nodes=nodes).map
        out[str(extra)] = float(balancedness(load, m).mean())
    return out


def redundancies(n_exp: int, ranks: int) -> list[int]:
    """0, E/4 and E/2 redundant slots, each rounded up so the slots split evenly over ranks."""
    return [-(-(n_exp + x) // ranks) * ranks - n_exp for x in (0, n_exp // 4, n_exp // 2)]


def drift(windows: list[torch.Tensor], n_phys: int, ranks: int, nodes: int, min_gain: float) -> dict:
    """Rebalance every window: ours (from its previous map), ours with min_gain ("gated"), the
    peer. fit = balancedness on the window a map was computed from; served = the balancedness
    that map then gives on the next window (what the ranks see: fitting one window's sampling
    noise buys nothing there)."""
    maps = dict.fromkeys(("ours", "gated", "peer"),
                         rebalance(windows[0], None, num_physical=n_phys, num_ranks=ranks,
                                   num_nodes=nodes).map)
    rec: dict[str, list] = {f"{k}_{n}": [] for k in ("moved", "fit", "served") for n in maps}
    rec.update(moved_peer_raw=[], layers_changed_gated=[])
    for load in windows[1:]:
        for name, m in maps.items():
            rec[f"served_{name}"].append(float(balancedness(load, m).mean()))
        r = rebalance(load, maps["ours"], num_nodes=nodes)
        rg = rebalance(load, maps["gated"], num_nodes=nodes, min_gain=min_gain)
        fresh = rebalance_from_scratch(load, n_phys, ranks, nodes)
        aligned = align(fresh, maps["peer"])
        rec["moved_peer_raw"].append(int(moved_slots(maps["peer"], fresh).sum()))
        rec["layers_changed_gated"].append(int(rg.changed.sum()))
        for name, new in (("ours", r.map), ("gated", rg.map), ("peer", aligned)):
            rec[f"moved_{name}"].append(int(moved_slots(maps[name], new).sum()))
            rec[f"fit_{name}"].append(float(balancedness(load, new).mean()))
            maps[name] = new
    # served[i] was measured with the map fitted on window i: drop the first (initial map)
    for name in maps:
        rec[f"served_{name}"] = rec[f"served_{name}"][1:]
    return rec


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def print_first(title: str, rows: dict[str, dict], reds: list[int]) -> None:
    heads = " ".join(f"{'+' + str(x) + ' slots':>10}" for x in reds)
    print(f"\n{title}\n{'trace':<22} {'before':>7} {heads}")
    for name, r in rows.items():
        print(f"{name:<22} {r['before']:7.3f} " + " ".join(f"{r[str(x)]:10.3f}" for x in reds))


def print_drift(title: str, res: dict[str, dict], expert_bytes: int, min_gain: float) -> None:
    names = ("ours", "gated", "peer")
    print(f"\n{title}\n{'':<24} {'served balancedness':^20} | {'fit balancedness':^20} | "
          f"{'slots moved per rebalance':^27} | {'MiB moved per rebalance':^23}")
    print(f"{'trace':<24} " + " | ".join([" ".join(f"{n:>6}" for n in names)] * 2) + " | "
          + " ".join(f"{n:>6}" for n in names) + f" {'raw':>6} | " + " ".join(f"{n:>7}" for n in names))
    for key, d in res.items():
        served = " ".join(f"{mean(d['served_' + n]):6.3f}" for n in names)
        fit = " ".join(f"{mean(d['fit_' + n]):6.3f}" for n in names)
        moved = [mean(d["moved_" + n]) for n in names]
        print(f"{key:<24} {served} | {fit} | " + " ".join(f"{m:6.1f}" for m in moved)
              + f" {mean(d['moved_peer_raw']):6.1f} | "
              + " ".join(f"{m * expert_bytes / MIB:7.1f}" for m in moved))
    print(f"  ours = migration-aware, min_gain 0; gated = ours, min_gain {min_gain}; peer = DeepSeek "
          f"from scratch, slots reordered within ranks (raw: not reordered)")


def timing(repeats: int = 3) -> dict:
    """Seconds per call at 64 layers × 256 experts × 64 ranks, 320 slots (best of `repeats`),
    with one torch thread and with the default count (small ops: extra threads can cost more
    than they give, badly so on a busy machine)."""
    g = torch.Generator().manual_seed(7)
    z = zipf_logits(64, 256, 1.0, g)
    w0 = sample(z, 65536, g)
    w1 = sample(z + 0.1 * torch.randn(z.shape, generator=g, dtype=torch.float64), 65536, g)
    out, default = {}, torch.get_num_threads()
    for threads in sorted({1, default}):
        torch.set_num_threads(threads)
        for nodes in (1, 8):
            cur = rebalance(w0, None, num_physical=320, num_ranks=64, num_nodes=nodes).map
            for name, fn in (("from_scratch", lambda: rebalance_from_scratch(w1, 320, 64, nodes)),
                             ("migration_aware", lambda: rebalance(w1, cur, num_nodes=nodes))):
                best = float("inf")
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - t0)
                out[f"{name}_nodes{nodes}_threads{threads}_s"] = best
    torch.set_num_threads(default)
    return out


def model_trace(cache: Path, batches: int, batch: int, prompt: int,
                new: int) -> tuple[list[torch.Tensor], dict]:
    """Routing windows [L, E] of the bench checkpoint, one per batch of random prompts."""
    from moed.config import EngineConfig
    from moed.engine.engine import Engine
    from moed.dev.checkpoint import init_checkpoint
    from moed.model.runner import ModelRunner
    from moed.model.tokenizer import Tokenizer
    from moed.types import SamplingParams

    model_dir = cache / "qwen3_moe-bench-0"
    if not (model_dir / "config.json").exists():
        print(f"building the bench checkpoint in {model_dir} ...", flush=True)
        init_checkpoint(arch="qwen3_moe", out=model_dir, preset="bench", seed=0)
    cfg = json.loads((model_dir / "config.json").read_text())
    blocks = batch * (-(-(prompt + new) // 16)) + 8
    runner = ModelRunner(model_dir, dtype="bfloat16", device="cpu", attention_backend="torch",
                         num_blocks=blocks, block_size=16)
    engine = Engine(runner, Tokenizer.from_dir(model_dir),
                    EngineConfig(block_size=16, enable_prefix_caching=False, max_num_seqs=batch,
                                 max_num_batched_tokens=2048))
    g = torch.Generator().manual_seed(0)
    runner.expert_load()                                    # start from an empty window
    windows = []
    for _ in range(batches):
        prompts = torch.randint(0, cfg["vocab_size"], (batch, prompt), generator=g).tolist()
        engine.generate(prompts, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
        windows.append(runner.expert_load().to(torch.long))
    spec = runner.spec
    info = {"layers": spec.num_layers, "experts": spec.num_experts, "top_k": spec.top_k,
            "expert_bytes": 3 * spec.hidden_size * spec.moe_intermediate_size * 2,    # bf16
            "model_dir": str(model_dir), "load_shape": list(windows[0].shape)}
    return windows, info


def ep_runtime(cache: Path, batch: int, steps: int, redundant: int, rebalances: int,
               decode: bool = True, step_mb: float = 2.0) -> dict:
    """Section 5: decode step time at EP = 1/2/4 (unless not `decode`), and step-time p99 during
    vs outside a rebalance."""
    import subprocess
    sys.path.insert(0, str(ROOT / "bench"))
    from ep_step import _checkpoint, _port, measure

    model = _checkpoint("qwen3_moe", "bench", cache)
    out: dict = {"decode": measure(model, (1, 2, 4), batch=batch, context=128, steps=steps) if decode else []}
    n, port = 2, _port()
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n)), "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, __file__, "--rebalance-worker", str(model), str(port), str(batch),
            str(steps), str(redundant), str(rebalances), str(step_mb)]
    procs = [subprocess.Popen([*argv, str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              text=True) for r in range(n)]
    ranks = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=170)
            if p.returncode != 0:
                raise RuntimeError(f"rebalance worker failed: {se[-2000:]}")
            ranks.append(json.loads(so.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    res = {"ep_size": n, "redundant_slots_per_rank": redundant, "rebalances": rebalances,
           "eplb_step_mb": step_mb,
           "bytes_moved_per_rank": [r["bytes_moved"] for r in ranks],
           "balancer_ms_p50_per_rank": [r["balancer_ms_p50"] for r in ranks]}
    for phase in ("outside", "during"):
        step = [max(r[phase][i] for r in ranks) for i in range(len(ranks[0][phase]))]
        res[phase] = {"steps": len(step), "p50_ms": 1e3 * _quantile(step, 0.5),
                      "p99_ms": 1e3 * _quantile(step, 0.99), "max_ms": 1e3 * max(step)}
    res["p99_ratio"] = res["during"]["p99_ms"] / res["outside"]["p99_ms"]
    # where the during-steps' time goes: by what the balancer did in the step (rank 0's view)
    during = [max(r["during"][i] for r in ranks) for i in range(len(ranks[0]["during"]))]
    by: dict[str, list[float]] = {}
    for ph, t in zip(ranks[0]["phases"], during):
        by.setdefault(ph, []).append(t)
    res["during_by_phase"] = {ph: {"steps": len(ts), "p50_ms": 1e3 * _quantile(ts, 0.5),
                                   "max_ms": 1e3 * max(ts)} for ph, ts in by.items()}
    out["rebalance"] = res
    return out


def _quantile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * (len(ys) - 1) + 0.5))]


def _rebalance_worker(model: str, port: int, batch: int, steps: int, redundant: int, rebalances: int,
                      step_mb: float, rank: int) -> None:
    """One rank of section 5's rebalance run: `steps` decode steps outside a rebalance, then
    rebalances, each after `steps // rebalances` more outside steps (interleaved, so a change
    in the machine's load falls on both sides)."""
    from moed.config import ParallelConfig
    from moed.model.batch import ForwardBatch
    from moed.model.runner import ModelRunner
    from moed.model.hf_config import load_spec
    from moed.parallel.runtime import EPRuntime

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    spec = load_spec(model)
    cfg = ParallelConfig(ep_size=2, ep_rank=rank, ep_init=f"tcp://127.0.0.1:{port}", collective_timeout_s=120,
                         redundant_experts=redundant, eplb_interval_s=7 * 86400, eplb_min_gain=0.0,
                         eplb_step_mb=step_mb)
    ep = EPRuntime.plan(cfg, spec.num_experts, torch.device("cpu"))
    context, block = 128, 16
    per_seq = -(-(context + 1) // block)
    runner = ModelRunner(model, dtype="bfloat16", device="cpu", num_blocks=batch * per_seq, block_size=block,
                         spec=spec, placement=ep.placement)
    ep.join()
    ep.attach(runner.model)
    rb = ep.rebalancer
    assert rb is not None
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    g = torch.Generator().manual_seed(rank)
    toks = torch.randint(0, spec.vocab_size, (batch, context + 1), generator=g).tolist()
    for i in range(batch):
        runner.forward(ForwardBatch([toks[i][:context]], [0], [tables[i]]))
    dec = ForwardBatch([[toks[i][context]] for i in range(batch)], [context] * batch, tables)
    for _ in range(5):
        runner.forward(dec)
    runner.expert_load()

    phases: list[str] = []
    balancer: list[float] = []      # the balancer's own time in a step (after the forward)

    def step() -> float:
        """A step as the engine runs it: forward, the agreement (rank 0's word to the balancer),
        the balancer's work when there is any. Its phase (what the balancer did in it) is kept."""
        t0 = time.perf_counter()
        solving = rb._decision is not None
        runner.forward(dec)
        word = torch.tensor([rb.wanted()], dtype=torch.long)
        torch.distributed.all_reduce(word)
        w = int(word.item())
        phases.append({1: "collect", 2: "publish"}.get(w, "apply" if rb.busy else
                                                          "solve" if solving else "idle"))
        if w or rb.busy:
            t1 = time.perf_counter()
            rb.step(w)
            balancer.append(time.perf_counter() - t1)
        return time.perf_counter() - t0

    outside = [step() for _ in range(steps)]
    kinds = ["outside"] * steps
    during: list[float] = []
    zg = torch.Generator().manual_seed(7)          # the same skewed windows on both ranks
    skews = [zipf_logits(len(rb.layers), spec.num_experts, 1.2, zg) for _ in range(2)]
    for k in range(rebalances):
        for _ in range(max(1, steps // rebalances)):
            outside.append(step())
            kinds.append("outside")
        rb.add_load(torch.zeros((spec.num_layers, spec.num_experts), dtype=torch.long).index_copy_(
            0, torch.tensor(rb.index), sample(skews[k % 2], 4096, zg)))
        rb.last = time.monotonic() - rb.interval_s           # due now (rank 0's clock)
        decided = rb.decisions
        for _ in range(20 * len(rb.layers) + 100):           # collect, decide, publish, apply
            during.append(step())
            kinds.append("during")
            if rb.decisions > decided and not rb.busy:
                break
    print(json.dumps({"outside": outside, "during": during, "phases": [ph for ph, k in zip(phases, kinds) if k == "during"],
                      "balancer_ms_p50": 1e3 * _quantile(balancer, 0.5) if balancer else 0.0,
                      "bytes_moved": dict(rb.bytes_moved), "rebalances": rb.rebalances}))
    ep.close()


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, rows in res["first_placement"].items():
        src = res["model"] if name.startswith("model") else res
        reds = src["redundant_slots"]
        for trace, r in rows.items():
            xs = [x / src["experts"] for x in reds]
            line, = a.plot(xs, [r[str(x)] for x in reds], marker="o", label=f"{name} {trace}")
            a.scatter([0], [r["before"]], marker="x", color=line.get_color())    # checkpoint layout
    a.set_xlabel("redundant slots / experts")
    a.set_ylabel("balancedness (mean / max rank load)")
    a.set_title("balancedness after the first placement (x: before)")
    a.legend(fontsize=7)
    a.grid(alpha=0.3)
    key = res["drift_plot_key"]
    d = res["drift"][key]
    eb = res["expert_bytes"] / MIB
    xs = list(range(1, len(d["moved_ours"]) + 1))
    for k, label in (("moved_peer", "peer (DeepSeek, from scratch)"),
                     ("moved_ours", "ours (migration-aware)"),
                     ("moved_gated", f"ours, min_gain {res['min_gain']}")):
        b.plot(xs, [m * eb for m in d[k]], marker=".", label=label)
    b.set_xlabel("rebalance (window)")
    b.set_ylabel("expert MiB moved (all layers)")
    b.set_title(f"drifting Zipf loads: {key}")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sections_2_to_4(a: argparse.Namespace, res: dict, g: torch.Generator, topo: dict,
                    reds: list[int]) -> None:
    """Drifting loads, the checkpoint's routing trace, the balancers' time per call."""
    z = zipf_logits(a.layers, a.experts, 1.0, g)
    windows = []
    for _ in range(a.windows + 1):
        windows.append(sample(z, a.tokens, g))
        z = z + a.sigma * torch.randn(z.shape, generator=g, dtype=torch.float64)
    for tname, nodes in topo.items():
        for extra in reds:
            key = f"zipf 1.0 {tname} +{extra}"
            res["drift"][key] = drift(windows, a.experts + extra, a.ranks, nodes, a.min_gain)
    res["drift_plot_key"] = f"zipf 1.0 global +{reds[1]}"
    print_drift(f"2. drifting Zipf 1.0 loads, sigma {a.sigma}, {a.windows} rebalances; "
                f"expert = {a.expert_bytes / MIB:.1f} MiB", res["drift"], a.expert_bytes, a.min_gain)

    if not a.skip_model:
        print("\n3. the bench checkpoint's routing trace ...", flush=True)
        # prefill-heavy windows (8 prompts x (192 + 8) tokens): more routed tokens per second
        mw, info = model_trace(Path(a.cache), a.model_batches, 8, 192, 8)
        mreds = redundancies(info["experts"], a.model_ranks)
        total = torch.stack(mw).sum(0)
        skew = float((total.max(1).values / total.double().mean(1)).mean())
        info.update(redundant_slots=mreds, ranks=a.model_ranks, max_over_mean_expert_load=skew)
        rows = {"model (all windows)": first_placement(total, a.model_ranks, 1)}
        res["first_placement"]["model global"] = rows
        zskew = float((windows[0].max(1).values / windows[0].double().mean(1)).mean())
        print(f"random-weight router: max/mean expert load per layer {skew:.2f} (Zipf 1.0 on "
              f"{a.experts} experts: {zskew:.2f}); near-uniform, so the Zipf traces are the skewed case")
        print_first(f"balancedness, first placement ({info['experts']} experts, {a.model_ranks} ranks)",
                    rows, mreds)
        mdrift = {f"model +{x}": drift(mw, info["experts"] + x, a.model_ranks, 1, a.min_gain) for x in mreds}
        print_drift(f"rebalance per window ({a.model_batches} windows of 8 prompts x (192 + 8) tokens)",
                    mdrift, info["expert_bytes"], a.min_gain)
        info["drift"] = mdrift
        res["model"] = info

    print("\n4. time per call, 64 layers x 256 experts x 64 ranks, 320 slots (best of 3) ...", flush=True)
    res["timing"] = timing()
    for k, v in res["timing"].items():
        print(f"  {k:<40} {v:6.3f} s")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rebalance-worker":
        a = sys.argv[2:]
        _rebalance_worker(a[0], *map(int, a[1:6]), float(a[6]), int(a[7]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=2, help="nodes of the hierarchical variant")
    ap.add_argument("--tokens", type=int, default=32768, help="routed tokens per layer per window")
    ap.add_argument("--zipf", default="0.8,1.0,1.2", help="Zipf exponents of the skewed traces")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--sigma", type=float, default=0.1, help="log-popularity random-walk step per window")
    ap.add_argument("--min-gain", type=float, default=0.01)
    ap.add_argument("--expert-bytes", type=int, default=3 * 2048 * 768 * 2)
    ap.add_argument("--skip-model", action="store_true", help="no real routing trace")
    ap.add_argument("--model-ranks", type=int, default=4)
    ap.add_argument("--model-batches", type=int, default=4, help="windows of the real trace")
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--skip-ep", action="store_true", help="no section 5 (EP processes)")
    ap.add_argument("--ep-batch", type=int, default=8, help="decode sequences per rank (section 5)")
    ap.add_argument("--ep-steps", type=int, default=240,
                    help="decode steps measured per phase (section 5; p99 needs hundreds)")
    ap.add_argument("--ep-redundant", type=int, default=2, help="redundant slots per rank (section 5)")
    ap.add_argument("--ep-rebalances", type=int, default=6, help="rebalances measured (section 5)")
    ap.add_argument("--ep-step-mb", type=float, default=2.0,
                    help="parallel.eplb_step_mb of the rebalance run (0 = whole layers)")
    ap.add_argument("--rebalance-only", action="store_true",
                    help="only the step time during vs outside a rebalance (section 5's end)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "eplb.json"))
    a = ap.parse_args()
    t_start = time.perf_counter()
    g = torch.Generator().manual_seed(0)
    reds = redundancies(a.experts, a.ranks)
    exps = [float(x) for x in a.zipf.split(",")]
    topo = {"global": 1, f"{a.nodes} nodes": a.nodes}
    print(f"EPLB bench: {a.layers} layers x {a.experts} experts on {a.ranks} ranks, {a.tokens} "
          f"routed tokens per layer per window; redundant slots {reds}")
    res: dict = {"layers": a.layers, "experts": a.experts, "ranks": a.ranks, "nodes": a.nodes,
                 "tokens": a.tokens, "redundant_slots": reds, "min_gain": a.min_gain,
                 "expert_bytes": a.expert_bytes, "sigma": a.sigma, "windows": a.windows,
                 "first_placement": {}, "drift": {}}
    for tname, nodes in ({} if a.rebalance_only else topo).items():
        rows = {}
        for s in exps:
            rows[f"zipf {s}"] = first_placement(sample(zipf_logits(a.layers, a.experts, s, g), a.tokens, g),
                                                a.ranks, nodes)
        res["first_placement"][tname] = rows
        print_first(f"1. balancedness, first placement ({tname})", rows, reds)

    if a.rebalance_only:
        a.skip_model = True
    else:
        sections_2_to_4(a, res, g, topo, reds)
    if not a.skip_ep:
        print("\n5. the EP runtime: decode step time at EP=1/2/4, step-time p99 during a rebalance ...",
              flush=True)
        ep = res["ep_runtime"] = ep_runtime(Path(a.cache), a.ep_batch, a.ep_steps, a.ep_redundant,
                                            a.ep_rebalances, decode=not a.rebalance_only,
                                            step_mb=a.ep_step_mb)
        print(f"  {'EP':>3} {'thr':>4} {'tok/step':>8} {'step ms p50':>11} {'p90':>7} {'coll ms':>8} {'tok/s':>7}")
        for r in ep["decode"]:
            print(f"  {r['ep_size']:>3} {r['threads_per_rank']:>4} {r['tokens_per_step']:>8} "
                  f"{r['step_ms_median']:>11.2f} {r['step_ms_p90']:>7.2f} {r['collective_ms_median']:>8.2f} "
                  f"{r['tokens_per_s']:>7.0f}")
        rb = ep["rebalance"]
        print(f"  EP=2, +{rb['redundant_slots_per_rank']} slots/rank, {rb['rebalances']} rebalances "
              f"(eplb_step_mb {rb['eplb_step_mb']}, one layer per step at most), bytes moved per "
              f"rank {rb['bytes_moved_per_rank']}, balancer ms per step p50 "
              f"{[round(x, 2) for x in rb['balancer_ms_p50_per_rank']]}")
        for phase in ("outside", "during"):
            r = rb[phase]
            print(f"  step time {phase:<8} a rebalance: p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  "
                  f"max {r['max_ms']:7.2f} ms  ({r['steps']} steps)")
        print(f"  p99 during / outside: {rb['p99_ratio']:.2f}x (goal <= 1.1x)")
        for ph, r in rb["during_by_phase"].items():
            print(f"    during, {ph:<8} steps {r['steps']:>4}  p50 {r['p50_ms']:7.2f} ms  max {r['max_ms']:7.2f} ms")
    res.update(cpu=platform.processor(), cpus=os.cpu_count(), torch_threads=torch.get_num_threads(),
               load_average=os.getloadavg(), wall_s=time.perf_counter() - t_start)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    png = out.with_suffix(".png")
    if a.rebalance_only:            # the plots are of sections 1-2
        print(f"\nsaved {out} ({res['wall_s']:.0f} s)")
        return 0
    plot(res, png)
    print(f"\nsaved {out} and {png} ({res['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
