"""Cold experts: prefill and decode tok/s as the resident share of expert bytes goes from 100%
to ~25%, under a skewed (Zipf) routing trace and a drifting one, against the same model with
every expert resident (the peer, in the same run).

    .venv/bin/python bench/cold_experts.py [--shares 1,0.75,0.5,0.3,0.25,0.3p] [--batch 8]
                                           [--prompt 32] [--steps 48] [--zipf 1.2]

The model: a random DeepSeek-V3 checkpoint (one expert group, so the choice is plain top-k over
bias-corrected sigmoid scores), bf16, built once into the cache; `--layers` and `--expert-width`
(moe_intermediate_size) size it (`--layers 16 --expert-width 768`: 4.5 GiB of experts, grown
from a 2-layer build by bench/cold_checkpoint.py past 1.5 GiB). Forcing a routing trace on
random weights: DeepSeek-V3's `e_score_correction_bias` moves the *choice* of experts and not
their weights, so the bench sets each layer's bias (in memory, identically for every run) to
beta * log p, p a Zipf(s) popularity over a random permutation of the experts per layer; beta
is calibrated once so that the share of token-choices taken by the top 30% of experts matches
Zipf(s)'s (both printed). "drift": after half of the decode steps every layer's permutation is
redrawn (the hot set changes at once), and the per-step hit rate shows how fast the store
follows. The router's logits otherwise come from the model, so this is a real forward pass
under that skew, not a replay.

A share whose name ends in `p` (`--shares 1,0.3,0.3p`) runs with layer-ahead prefetch
(experts.prefetch_experts = --prefetch, -1 auto; moed/model/cold/prefetch.py): the prediction
works because the routing is the model's own, from the hidden state. "hit" is then an expert
read in memory when its layer needed it (resident or a completed prefetch); the table also
gives the resident share alone, the prefetches ready / waited for, the misses, the unused
prefetch reads and the prediction's recall and precision.

Per run: `prefills` prefills of `batch` prompts of `prompt` tokens (prefill tok/s from their
median), then `steps` decode steps of the batch (decode tok/s from the median step; the mean
is in the JSON; "pairs" is the median over steps of the all-resident step's time over this
run's for the same step, the ratio to trust on a busy machine). The runners of one trace (one per share) live side by side
and take their steps in turn, the order rotating, so a busy machine's noise falls on all alike. The greedy tokens of every run are compared with the
all-resident run of the same trace (they must be equal). Hit rate: expert reads (an expert run
by a layer call) that found it resident; rows: the same weighted by the tokens routed.

`--rss SHARE` runs one share alone and prints the process's RSS and decode tok/s: run it in a
memory cgroup to see what fits under a cap (docs/cold-experts.md has the commands and the
figures).

`--llama-cpp BUILD` (the peer under a memory cap; bench/cold_experts_llama.py): the checkpoint with the Zipf
bias written into it, converted to GGUF bf16 (bench/peers.py's converter), run by
`llama-batched-bench` with mmap on (its default) and by `--rss SHARE` moed, each in a fresh
memory cgroup capped at the same value: moed's peak RSS at SHARE (the budget + the non-expert
weights + moed's KV + its runtime), or the least cap moed completes under (--cap-search), or
--cap-mib. Decode tok/s of
both (batch x steps / the decode phase, like llama's S_TG), the ratio, the cgroups' peaks;
writes bench/results/cold_experts_llama.json and .png.

Prints a table; writes bench/results/cold_experts.json and bench/results/cold_experts.png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from moed.model.batch import ForwardBatch  # noqa: E402
from moed.model.cold import ColdSettings  # noqa: E402
from moed.model.runner import ModelRunner  # noqa: E402

MODEL = dict(hidden_size=512, num_layers=4, num_heads=8, num_experts=128, top_k=4,
             moe_intermediate_size=192, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
             qk_rope_head_dim=16, v_head_dim=32, n_group=1, topk_group=1, first_k_dense_replace=0,
             n_shared_experts=1)
BLOCK = 16
GROW_OVER = 3 << 29     # expert bytes past which checkpoint() grows a 2-layer build (1.5 GiB)


def checkpoint(cache: Path) -> Path:
    """MODEL's checkpoint, built once (MODEL["num_layers"] is --layers)."""
    from moed.dev.checkpoint import init_checkpoint
    width = MODEL["moe_intermediate_size"]
    out = cache / ("cold-deepseek_v3" + ("" if MODEL["num_layers"] == 4 else f"-L{MODEL['num_layers']}")
                   + ("" if width == 192 else f"-I{width}"))
    if (out / "model.safetensors").exists():
        return out
    if expert_bytes() <= GROW_OVER:
        init_checkpoint("deepseek_v3", out, preset="tiny", seed=0, **MODEL)
    else:       # init_checkpoint holds the model in fp32: grow it from a 2-layer one instead
        from cold_checkpoint import grow         # bench/cold_checkpoint.py
        template = cache / f"{out.name}-template2"
        if not (template / "model.safetensors").exists():
            init_checkpoint("deepseek_v3", template, preset="tiny", seed=0, **{**MODEL, "num_layers": 2})
        grow(template, out, MODEL["num_layers"])
        shutil.rmtree(template)
    return out


def expert_bytes() -> int:
    """MODEL's routed-expert bytes (bf16)."""
    moe = MODEL["num_layers"] - MODEL["first_k_dense_replace"]
    return MODEL["num_experts"] * moe * 3 * MODEL["hidden_size"] * MODEL["moe_intermediate_size"] * 2


def zipf_bias(experts: int, s: float, beta: float, g: torch.Generator) -> torch.Tensor:
    p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    logp = (p / p.sum()).log()
    return (beta * logp[torch.randperm(experts, generator=g)]).float()


def set_bias(r: ModelRunner, s: float, beta: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in r.model.layers:
        layer.mlp.router.bias.copy_(zipf_bias(r.spec.num_experts, s, beta, g))


def top_share(counts: torch.Tensor, share: float) -> float:
    """Share of the token-choices the top `share` of experts took, averaged over layers."""
    k = max(1, round(share * counts.shape[1]))
    top = counts.sort(dim=1, descending=True).values[:, :k].sum(1).double()
    return float((top / counts.sum(1).double().clamp(min=1)).mean())


def zipf_top_share(experts: int, s: float, share: float) -> float:
    p = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    return float(p[:max(1, round(share * experts))].sum() / p.sum())


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def calibrate(r: ModelRunner, s: float, a: argparse.Namespace) -> tuple[float, float, float]:
    """beta whose measured top-30% share is closest to Zipf(s)'s -> (beta, measured, target)."""
    target = zipf_top_share(r.spec.num_experts, s, 0.3)
    best = (0.0, 0.0)
    ps = prompts(a.batch, a.prompt, r.spec.vocab_size, 7)
    for beta in (0.0, 0.01, 0.02, 0.04, 0.06, 0.1, 0.15, 0.25, 0.4):
        set_bias(r, s, beta, 1)
        r.expert_load()
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(ps))]
        r.forward(ForwardBatch(token_ids=ps, start_pos=[0] * len(ps), block_tables=tables))
        got = top_share(r.expert_load(), 0.3)
        if beta == 0.0 or abs(got - target) < abs(best[1] - target):
            best = (beta, got)
    return best[0], best[1], target


class Run:
    """One runner (a resident share) going through a trace: its prefill, then its decode steps."""

    def __init__(self, ck: Path, share: float, beta: float, a: argparse.Namespace, total: int,
                 prefetch: bool = False) -> None:
        cold = None if share >= 1.0 else ColdSettings(int(share * total), a.move_mb << 20, a.half_life,
                                                      a.prefetch if prefetch else 0)
        self.prefetch = prefetch
        self.r = ModelRunner(ck, dtype="bfloat16", device="cpu", num_blocks=a.batch * 8 + 8,
                             block_size=BLOCK, cold=cold)
        self.share, self.a, self.beta, self.total = share, a, beta, total
        if beta is not None:        # None: the checkpoint has the trace's bias (skewed_checkpoint)
            set_bias(self.r, a.zipf, beta, 1)
        self.tables = [list(range(i * 8, i * 8 + 8)) for i in range(a.batch)]
        self.start = [a.prompt] * a.batch
        self.toks: list[list[int]] = []
        self.out: list[list[int]] = []
        self.step_s: list[float] = []
        self.hit_series: list[float] = []
        self.row_series: list[float] = []
        self.prefill_s: list[float] = []

    def prefill(self, seed: int) -> None:
        """One prefill of the batch (over the same blocks: the last one's prompts are decoded)."""
        ps = prompts(self.a.batch, self.a.prompt, self.r.spec.vocab_size, seed)
        t0 = time.perf_counter()
        logits = self.r.forward(ForwardBatch(token_ids=ps, start_pos=[0] * len(ps), block_tables=self.tables))
        self.prefill_s.append(time.perf_counter() - t0)
        self.toks = [[int(x)] for x in logits.argmax(-1)]

    def step(self, drift_now: bool) -> None:
        if drift_now:
            set_bias(self.r, self.a.zipf, self.beta, 2)         # the hot set changes at once
        st = self.r.cold.stats if self.r.cold is not None else None
        h0, m0, r0, q0 = (st.hits + st.prefetch_ready, st.misses + st.prefetch_waited,
                          st.hit_rows + st.prefetch_rows, st.miss_rows) if st else (0, 0, 0, 0)
        t0 = time.perf_counter()
        logits = self.r.forward(ForwardBatch(token_ids=self.toks, start_pos=list(self.start),
                                             block_tables=self.tables))
        self.step_s.append(time.perf_counter() - t0)
        if st:
            # in memory when the layer needed it: resident, or a completed prefetch
            dh, dm = st.hits + st.prefetch_ready - h0, st.misses + st.prefetch_waited - m0
            self.hit_series.append(dh / max(dh + dm, 1))
            dr, dq = st.hit_rows + st.prefetch_rows - r0, st.miss_rows - q0
            self.row_series.append(dr / max(dr + dq, 1))
        self.out.append([t[0] for t in self.toks])
        self.start = [x + 1 for x in self.start]
        self.toks = [[int(x)] for x in logits.argmax(-1)]

    def result(self, trace: str) -> dict:
        a, half = self.a, self.a.steps // 2
        # medians: a busy machine's bursts hit single steps; the mean is also kept
        res = {"share": self.share, "trace": trace, "prefetch": self.prefetch,
               "prefill_tok_s": a.batch * a.prompt / statistics.median(self.prefill_s),
               "decode_tok_s": a.batch / statistics.median(self.step_s),
               "decode_tok_s_mean": a.batch * a.steps / sum(self.step_s),
               "decode_tok_s_second_half": a.batch / statistics.median(self.step_s[half:]),
               "tokens": self.out, "resident_expert_bytes": self.r.resident_expert_bytes(),
               "total_expert_bytes": self.total}
        store = self.r.cold
        if store is not None:
            st = store.stats
            res.update(hit_rate=st.in_memory, resident_hit_rate=st.hits / max(
                           st.hits + st.misses + st.prefetch_ready + st.prefetch_waited, 1),
                       row_hit_rate=(st.hit_rows + st.prefetch_rows) / max(
                           st.hit_rows + st.prefetch_rows + st.miss_rows, 1),
                       prefetch_ready=st.prefetch_ready, prefetch_waited=st.prefetch_waited,
                       prefetch_wait_s=st.prefetch_wait_s, prefetch_reads=st.prefetch_reads,
                       prefetch_unused=st.prefetch_unused, hits=st.hits,
                       prediction_recall=st.recall, prediction_precision=st.precision,
                       prefetch_experts=store.prefetch.capacity if store.prefetch else 0,
                       hit_series=self.hit_series, row_hit_series=self.row_series, misses=st.misses, miss_stall_s=st.miss_stall_s,
                       promoted_mb=st.promoted_bytes / 2**20, miss_mb=st.miss_bytes / 2**20,
                       cached_reads=st.cached_reads, slots_per_layer=store.slots)
            store.close()
        return res


def run_trace(ck: Path, shares: list[str], trace: str, beta: float, a: argparse.Namespace,
              total: int) -> list[dict]:
    """Every share's runner through one trace, interleaved step by step (the order rotating),
    so a busy machine's noise falls on all of them alike."""
    runs = [Run(ck, float(s.rstrip("p")), beta, a, total, s.endswith("p")) for s in shares]
    for rep in range(a.prefills):
        for i in range(len(runs)):
            runs[(i + rep) % len(runs)].prefill(10 + rep)
    load0 = os.getloadavg()[0]
    for step in range(a.steps):
        for i in range(len(runs)):
            runs[(i + step) % len(runs)].step(trace == "drift" and step == a.steps // 2)
    load = [round(load0, 2), round(os.getloadavg()[0], 2)]
    base = next((r for r in runs if r.share >= 1.0), None)
    out = [r.result(trace) for r in runs]
    for r, res in zip(runs, out):
        res["loadavg_1m"] = load
        if base is not None:
            res["decode_pair_ratio"] = pair_ratio(base.step_s, r.step_s)
    return out


def pair_ratio(base_s: list[float], run_s: list[float]) -> float:
    """Decode speed relative to the all-resident run: the median over steps of the ratio of the
    two runners' times for the same step index. Both took that step in the same round (one
    after the other, the order rotating), so a burst of load that slows one round slows the
    pair; the ratio of two medians taken over different moments does not cancel it."""
    return statistics.median(b / r for b, r in zip(base_s, run_s))


def recovery_steps(series: list[float], at: int, level: float) -> int | None:
    """Steps after `at` until the hit rate is back at `level` (None: never in the run)."""
    for i, h in enumerate(series[at:]):
        if h >= level:
            return i
    return None


def plot(results: list[dict], path: Path, a: argparse.Namespace) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for trace, mark in (("zipf", "o-"), ("drift", "s--")):
        base = next(r for r in results if r["trace"] == trace and r["share"] >= 1.0)
        for pf in (False, True):
            rows = sorted((r for r in results if r["trace"] == trace and (r["prefetch"] == pf
                           or r["share"] >= 1.0)), key=lambda r: r["share"])
            if len(rows) < 2:
                continue
            xs, tag = [r["share"] * 100 for r in rows], f"{trace}{', prefetch' if pf else ''}"
            ax[0].plot(xs, [r["decode_tok_s"] / base["decode_tok_s"] for r in rows], mark,
                       label=f"decode, {tag}")
            ax[0].plot(xs, [r["prefill_tok_s"] / base["prefill_tok_s"] for r in rows], mark, alpha=0.5,
                       label=f"prefill, {tag}")
    ax[0].set_xlabel("resident share of expert bytes (%)")
    ax[0].set_ylabel("tok/s / all-resident")
    ax[0].legend()
    ax[0].grid(alpha=0.3)
    for r in results:
        if r["trace"] == "drift" and "hit_series" in r:
            ax[1].plot(r["hit_series"], label=f"{r['share'] * 100:.0f}% resident"
                       + (", prefetch" if r["prefetch"] else ""))
    ax[1].axvline(a.steps // 2, color="grey", ls=":")
    ax[1].set_xlabel("decode step (hot set redrawn at the dotted line)")
    ax[1].set_ylabel("expert reads in memory when needed")
    ax[1].legend()
    ax[1].grid(alpha=0.3)
    fig.suptitle(f"cold experts, DeepSeek-V3-shaped random model, Zipf({a.zipf}), batch {a.batch}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def rss_run(ck: Path, share: float, a: argparse.Namespace, total: int) -> None:
    """--rss SHARE: one runner through the Zipf trace alone, then this process's RSS (run it
    once per share, each in a fresh process, under a cgroup memory cap to see what fits), with
    layer-ahead prefetch as --prefetch says (-1 auto, the serving default; 0 off)."""
    r = Run(ck, share, None if a.checkpoint else a.rss_beta, a, total, prefetch=a.prefetch != 0)
    for rep in range(a.prefills):
        r.prefill(10 + rep)
    for _ in range(a.steps):
        r.step(False)
    st = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("VmRSS", "VmHWM")))
    hs = r.hit_series[a.steps // 2:]        # expert reads in memory when needed (cold only)
    hits = {"hit_rate": r.r.cold.stats.in_memory, "hit_rate_second_half": sum(hs) / len(hs)} if hs else {}
    print(json.dumps({"share": share, "resident_expert_mib": r.r.resident_expert_bytes() >> 20,
                      "total_expert_mib": total >> 20, "vm_rss": st["VmRSS"].strip(),
                      "vm_hwm": st["VmHWM"].strip(), "last_tokens": r.out[-1],
                      "decode_tok_s": a.batch * a.steps / sum(r.step_s),
                      "decode_tok_s_second_half": a.batch * (a.steps - a.steps // 2) / sum(r.step_s[a.steps // 2:]),
                      "decode_tok_s_median_step": a.batch / statistics.median(r.step_s),
                      "threads": torch.get_num_threads(), **hits}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shares", default="1,0.75,0.5,0.3,0.25,0.5p,0.3p,0.25p",
                    help="resident shares; a trailing p: with layer-ahead prefetch (--prefetch)")
    ap.add_argument("--prefetch", type=int, default=-1, help="experts.prefetch_experts of the "
                    "p shares (-1: auto)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--prefills", type=int, default=3, help="prefills of the batch per runner (timed)")
    ap.add_argument("--zipf", type=float, default=1.2)
    ap.add_argument("--move-mb", type=int, default=4, help="experts.move_bytes_per_step in MiB")
    ap.add_argument("--half-life", type=float, default=8.0, help="experts.heat_half_life_steps")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--layers", type=int, default=4, help="MoE layers of the model (4: 288 MiB of "
                    "experts; more layers, more expert bytes per byte of runtime)")
    ap.add_argument("--expert-width", type=int, default=192, help="moe_intermediate_size of the "
                    "model (192: 72 MiB of experts a layer; 768 with --layers 16: 4.5 GiB)")
    ap.add_argument("--cache", default=os.environ.get("MOED_BENCH_CACHE", str(ROOT / ".cache" / "bench")))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cold_experts.json"))
    ap.add_argument("--rss", type=float, default=None, help="only: one share through the Zipf "
                    "trace, then print this process's RSS (see rss_run)")
    ap.add_argument("--rss-beta", type=float, default=0.04, help="--rss: the routing bias scale "
                    "(the calibrated one of a full run)")
    ap.add_argument("--checkpoint", type=Path, help="--rss: this checkpoint, its bias as written "
                    "(llama_peer's skewed copy) instead of the cached one with the bias set")
    ap.add_argument("--llama-cpp", type=Path, help="only: moed vs llama.cpp (mmap) under one "
                    "memory cap (llama_peer); a llama.cpp build directory")
    ap.add_argument("--llama-cpp-src", type=Path, help="its source tree (default: found above)")
    ap.add_argument("--llama-share", type=float, default=0.3, help="--llama-cpp: moed's resident share")
    ap.add_argument("--cap-mib", type=int, default=0, help="--llama-cpp: the cap (0: the share's "
                    "budget + non-expert weights + KV + moed's runtime)")
    ap.add_argument("--rounds", type=int, default=2, help="--llama-cpp: capped runs of each")
    ap.add_argument("--cap-search", action="store_true", help="--llama-cpp: the cap is the least "
                    "under which moed's run completes (bisection, 16 MiB), not its peak RSS")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cache = Path(a.cache)
    cache.mkdir(parents=True, exist_ok=True)
    MODEL["num_layers"] = a.layers
    MODEL["moe_intermediate_size"] = a.expert_width
    ck = checkpoint(cache)
    total = expert_bytes()
    if a.rss is not None:
        rss_run(a.checkpoint or ck, a.rss, a, total)
        return
    if a.llama_cpp is not None:
        import cold_experts_llama       # bench/cold_experts_llama.py
        cold_experts_llama.llama_peer(ck, a, total)
        return
    full = ModelRunner(ck, dtype="bfloat16", device="cpu", num_blocks=a.batch * 8 + 8, block_size=BLOCK)
    assert full.resident_expert_bytes() == total
    beta, got, target = calibrate(full, a.zipf, a)
    del full
    print(f"routing skew: beta {beta}: top 30% of experts take {got:.1%} of token-choices "
          f"(Zipf({a.zipf}) over {MODEL['num_experts']}: {target:.1%})")
    shares = a.shares.split(",")
    results = []
    for trace in ("zipf", "drift"):
        results += run_trace(ck, shares, trace, beta, a, total)
    print(f"\n{'trace':6} {'share':>6} {'slots':>5} {'prefill':>9} {'decode':>8} {'ratio':>6} {'pairs':>6} "
          f"{'hit':>6} {'hit 2nd½':>8} {'rows hit':>8} {'rows 2nd½':>9} {'stall s':>8} {'same':>5} "
          f"{'resid':>6} {'pf rdy':>6} {'pf wait':>7} {'miss':>6} {'unused':>6} {'recall':>6} {'prec':>6}")
    for r in results:
        base = next(b for b in results if b["trace"] == r["trace"] and b["share"] >= 1.0)
        r["name"] = f"{r['share']:.2f}{'p' if r['prefetch'] else ' '}"
        r["decode_ratio"] = r["decode_tok_s"] / base["decode_tok_s"]
        r["prefill_ratio"] = r["prefill_tok_s"] / base["prefill_tok_s"]
        r["same_tokens"] = r["tokens"] == base["tokens"]
        hs = r.get("hit_series", [])
        r["hit_rate_second_half"] = sum(hs[a.steps // 2:]) / max(len(hs[a.steps // 2:]), 1) if hs else 1.0
        rs = r.get("row_hit_series", [])
        r["row_hit_rate_second_half"] = sum(rs[a.steps // 2:]) / max(len(rs[a.steps // 2:]), 1) if rs else 1.0
        if r["trace"] == "drift" and hs:
            before = sum(hs[a.steps // 4:a.steps // 2]) / max(a.steps // 4, 1)
            r["recovery_steps_to_90pct_of_before"] = recovery_steps(hs, a.steps // 2, 0.9 * before)
        print(f"{r['trace']:6} {r['name']:>6} {r.get('slots_per_layer', MODEL['num_experts']):>5} "
              f"{r['prefill_tok_s']:>9.1f} {r['decode_tok_s']:>8.1f} {r['decode_ratio']:>6.2f} "
              f"{r.get('decode_pair_ratio', 1.0):>6.2f} "
              f"{r.get('hit_rate', 1.0):>6.1%} {r['hit_rate_second_half']:>8.1%} "
              f"{r.get('row_hit_rate', 1.0):>8.1%} {r['row_hit_rate_second_half']:>9.1%} "
              f"{r.get('miss_stall_s', 0.0):>8.3f} "
              f"{'yes' if r['same_tokens'] else 'NO':>5} "
              + (f"{r['resident_hit_rate']:>6.1%} {r['prefetch_ready']:>6} {r['prefetch_waited']:>7} "
                 f"{r['misses']:>6} {r['prefetch_unused']:>6} {r['prediction_recall']:>6.1%} "
                 f"{r['prediction_precision']:>6.1%}" if "hits" in r else ""))
    for trace in ("zipf", "drift"):
        print(f"{trace}: load average (1 min) {next(r for r in results if r['trace'] == trace)['loadavg_1m']} "
              f"at the block's start and end")
    for r in results:
        if "recovery_steps_to_90pct_of_before" in r:
            print(f"drift, {r['name']} resident: hit rate back to 90% of its pre-drift level "
                  f"after {r['recovery_steps_to_90pct_of_before']} steps")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": MODEL, "batch": a.batch, "prompt": a.prompt, "steps": a.steps, "zipf": a.zipf,
            "prefills": a.prefills,
            "beta": beta, "top30_share_measured": got, "top30_share_zipf": target,
            "move_mb_per_step": a.move_mb, "half_life_steps": a.half_life,
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "loadavg": open("/proc/loadavg").read().split()[:3]}
    for r in results:
        r.pop("tokens")
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, out.with_suffix(".png"), a)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
