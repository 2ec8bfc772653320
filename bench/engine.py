"""Engine throughput: moed vs transformers `generate` on the same bf16 checkpoint, one run.

    .venv/bin/python bench/engine.py [--arch qwen3_moe|mixtral|deepseek_v3] [--batches 1,8,32] [--prompt 128] [--new 64] [--long 2048] [--repeats 3]

Both sides get the same random prompts (all the same length, so transformers needs no padding)
and generate greedily with EOS ignored. Timing comes from each engine's own steps, not from
differences of separately chosen end-to-end minima (that once printed 2.5e11 tok/s):
  moed          the engine's StepStats (step_seconds of each step, in the step loop);
  transformers  a logits processor's clock, called once per generated token (prefill = start
                to the first call, each decode step = the gap between two calls).
  prefill tok/s = prompt tokens / time of the steps that computed prompt tokens
  decode tok/s  = batch / decode step time; median and p10/p90 over every decode step
Each of --repeats rounds runs every batch size on both engines, then one prompt of --long tokens
(prefill only: 2 new tokens), the engines interleaved (the order flips each round) so a load change hits both alike; the spread of the per-round medians
is printed and the load average before/after each round goes to the JSON. Prefix caching is off
for moed so rounds recompute. transformers uses experts_implementation="grouped_mm" and
attn_implementation="sdpa". Prefill is also stated as a fraction of the machine's bf16 compute
ceiling (the higher of a 4096^3 bf16 matmul through torch and a 1024 x 4096 x 4096 call of moed's
native kernel, best of 5 each, measured before and after the rounds; the model's matmul FLOPs
per token from bench/ceiling.py, attention scores not counted). RSS after load: moed's process before transformers loads, and what
loading transformers added. Writes bench/results/engine.json (with the checkpoint's KV bytes
per token beside a GQA and an MHA cache of the same width) and engine.png (tok/s vs batch,
p10-p90 bars) when matplotlib is installed.
moed uses its native CPU kernels when they load (moed/model/kernels; the JSON's
moed_cpu_kernels says which); MOED_CPU_KERNELS=0 measures the plain torch path instead.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ceiling import ceiling, flops_per_token  # noqa: E402
from common import cpu_model, load_average, rss_bytes, spread  # noqa: E402

from moed.config import EngineConfig  # noqa: E402
from moed.engine.engine import Engine  # noqa: E402
from moed.engine.stream import StepStats  # noqa: E402
from moed.dev.checkpoint import init_checkpoint  # noqa: E402
from moed.model.kernels import cpu_kernels  # noqa: E402
from moed.model.runner import ModelRunner  # noqa: E402
from moed.model.hf_config import load_spec  # noqa: E402
from moed.model.tokenizer import Tokenizer  # noqa: E402
from moed.types import SamplingParams  # noqa: E402


def _checkpoint(arch: str, cache: Path) -> Path:
    out = cache / f"{arch}-bench-0"
    if not (out / "config.json").exists():
        print(f"building the bench checkpoint in {out} ...", flush=True)
        init_checkpoint(arch=arch, out=out, preset="bench", seed=0)
    return out


class Timing:
    """One generate call's per-step record: prefill (tokens, seconds) and decode step times
    (with the batch each decoded)."""

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.prefill_s = 0.0
        self.decode: list[tuple[int, float]] = []      # (tokens decoded, seconds) per step

    def summary(self) -> dict:
        steps = [b / s for b, s in self.decode if s > 0]
        return {"prefill_tok_s": self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0,
                "prefill_s": self.prefill_s,
                "decode_step_ms": spread([s * 1e3 for _, s in self.decode]),
                "decode_tok_s": spread(steps)}


class MoedSide:
    name = "moed"

    def __init__(self, model_dir: Path, max_batch: int, prompt_len: int, new: int,
                 kv_tokens: int | None = None, device: str = "cpu", attention: str = "torch",
                 name: str = "moed", quantization: str = "", lm_head: str = "none",
                 activations: str = "none") -> None:
        """kv_tokens: the KV cache's size (default: max_batch sequences of prompt + new);
        device/attention: where it runs and the attention backend (bench/gpu.py: cuda);
        quantization: model.quantization (int8, int4, fp8: quantized at load); lm_head:
        model.quantization_lm_head (none, int8, model); activations:
        model.quantization_activations (none, int8)."""
        self.name = name
        per_seq = -(-(prompt_len + new) // 16)
        blocks = (-(-kv_tokens // 16) if kv_tokens else max_batch * per_seq) + 8
        runner = ModelRunner(model_dir, dtype="bfloat16", device=device, attention_backend=attention,
                             num_blocks=blocks, block_size=16, quantization=quantization,
                             quantization_lm_head=lm_head, quantization_activations=activations)
        cfg = EngineConfig(block_size=16, enable_prefix_caching=False, max_num_seqs=max_batch,
                           max_num_batched_tokens=max(2048, prompt_len))
        self.engine = Engine(runner, Tokenizer.from_dir(model_dir), cfg)
        self.cpu_kernels = runner.model.kernels is not None
        self._timing: Timing | None = None
        self.engine.subscribe_step(self._on_step)

    def _on_step(self, st: StepStats) -> None:
        t = self._timing
        if t is None:
            return
        if st.num_prefill_tokens:      # a step with prompt tokens is prefill time, whole
            t.prefill_tokens += st.num_prefill_tokens
            t.prefill_s += st.step_seconds
        elif st.num_decode_tokens:
            t.decode.append((st.num_decode_tokens, st.step_seconds))

    def run(self, prompts: list[list[int]], n: int) -> Timing:
        self._timing = t = Timing()
        try:
            self.engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0,
                                                         ignore_eos=True))
        finally:
            self._timing = None
        return t


class HFSide:
    name = "transformers"

    def __init__(self, model_dir: Path, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, experts_implementation="grouped_mm",
            attn_implementation="sdpa").eval().to(device)

    def run(self, prompts: list[list[int]], n: int) -> Timing:
        from transformers import LogitsProcessor, LogitsProcessorList

        stamps: list[float] = []

        class Clock(LogitsProcessor):   # called once per generated token, after its forward
            def __call__(self, input_ids, scores):  # noqa: ANN001
                if scores.is_cuda:      # the clock reads when the step's kernels are done
                    torch.cuda.synchronize()
                stamps.append(time.perf_counter())
                return scores

        ids = torch.tensor(prompts, device=self.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0, logits_processor=LogitsProcessorList([Clock()]))
        t = Timing()
        t.prefill_tokens, t.prefill_s = ids.numel(), stamps[0] - t0
        t.decode = [(len(prompts), b - a) for a, b in zip(stamps, stamps[1:])]
        return t


def measure(sides: list, prompts: dict[int | str, list[list[int]]], new: int, rounds: int,
            new_for: dict[int | str, int] | None = None) -> dict:
    """`rounds` rounds; in each, every job (a batch size, or a named long prompt) on every side
    (the order flips each round); new_for: new tokens per job where not `new`.
    -> {"rounds": [...], "summary": {side: {job: {...}}}}."""
    new_for = new_for or {}
    for side in sides:                                          # warm-up
        side.run(prompts[next(iter(prompts))][:1], 4)
    per: dict[str, dict[int | str, list[Timing]]] = {s.name: {b: [] for b in prompts} for s in sides}
    log = []
    for r in range(rounds):
        order = sides if r % 2 == 0 else sides[::-1]
        before = load_average()
        t0 = time.perf_counter()
        for b, ps in prompts.items():
            for s in order:
                per[s.name][b].append(s.run(ps, new_for.get(b, new)))
        log.append({"round": r, "order": [s.name for s in order], "load_before": before,
                    "load_after": load_average(), "seconds": time.perf_counter() - t0})
        print(f"  round {r + 1}/{rounds}: load {before[0]:.2f} -> {log[-1]['load_after'][0]:.2f}, "
              f"{log[-1]['seconds']:.1f} s", flush=True)
    return {"rounds": log, "summary": {name: {b: summarize(ts) for b, ts in by_b.items()}
                                       for name, by_b in per.items()}}


def summarize(ts: list[Timing]) -> dict:
    """Per batch size over rounds: prefill tok/s per round, decode over all steps of all
    rounds (median, p10/p90) and the spread of each round's median."""
    rounds = [t.summary() for t in ts]
    all_steps = Timing()
    all_steps.decode = [d for t in ts for d in t.decode]
    total = all_steps.summary()
    return {"prefill_tok_s": spread([r["prefill_tok_s"] for r in rounds]),
            "decode_tok_s": total["decode_tok_s"], "decode_step_ms": total["decode_step_ms"],
            "decode_round_medians": [r["decode_tok_s"]["median"] for r in rounds]}


def kv_bytes_per_token(model_dir: Path) -> dict:
    """The checkpoint's KV bytes per token (all layers, bf16) beside a GQA and an MHA cache of
    the same width (hidden, heads, layers; GQA with the bench preset's KV heads)."""
    from moed.model import archs
    from moed.dev.checkpoint import PRESETS
    from moed.model.kv_layout import KVLayout

    spec = load_spec(model_dir)
    ours = archs.kv_layout(spec, 16, torch.bfloat16)
    d = spec.hidden_size // spec.num_heads
    gqa = KVLayout.gqa(spec.num_layers, PRESETS["bench"]["num_kv_heads"], d, 16, torch.bfloat16)
    mha = KVLayout.gqa(spec.num_layers, spec.num_heads, d, 16, torch.bfloat16)
    return {"kind": ours.kind, "bytes_per_token": ours.bytes_per_block // 16,
            "gqa_kv_heads": PRESETS["bench"]["num_kv_heads"], "gqa_head_dim": d,
            "gqa_bytes_per_token": gqa.bytes_per_block // 16, "mha_bytes_per_token": mha.bytes_per_block // 16}


def print_ceiling(summary: dict, jobs: list[tuple[int | str, int]], ceil: dict, fpt: float) -> list[dict]:
    """Each prefill (job, prompt tokens per sequence) as tok/s, fraction of the bf16 ceiling and
    moed / transformers."""
    native = f", native kernel {ceil['native_flop_s'] / 1e9:.0f}" if "native_flop_s" in ceil else ""
    print(f"\nprefill vs the bf16 ceiling {ceil['flop_s'] / 1e9:.0f} GFLOP/s (4096^3 torch matmul "
          f"{ceil['torch_flop_s'] / 1e9:.0f}{native}; the higher, before or after the rounds), model "
          f"{fpt / 1e6:.1f} MFLOP/token -> {ceil['flop_s'] / fpt:.0f} tok/s at the ceiling")
    rows = []
    for job, plen in jobs:
        o = summary["moed"][job]["prefill_tok_s"]["median"]
        t = summary.get("transformers", {}).get(job)
        row = {"job": job, "prompt": plen, "moed_tok_s": o, "fraction_of_ceiling": o * fpt / ceil["flop_s"],
               "transformers_tok_s": t["prefill_tok_s"]["median"] if t else None}
        row["ratio"] = o / row["transformers_tok_s"] if row["transformers_tok_s"] else None
        rows.append(row)
        name = f"{job} x {plen}" if isinstance(job, int) else job
        hf = f", transformers {row['transformers_tok_s']:.0f} tok/s, ratio {row['ratio']:.2f}" if t else ""
        print(f"  prefill {name:>10}: moed {o:6.0f} tok/s = {100 * row['fraction_of_ceiling']:3.0f}% of the ceiling{hf}")
    return rows


def print_table(batches: list[int], summary: dict) -> list[dict]:
    ours, theirs = summary["moed"], summary.get("transformers", {})
    rows = []
    print(f"\n{'batch':>5} | {'moed prefill':>12} {'hf prefill':>10} {'ratio':>5} | "
          f"{'moed decode (p10-p90)':>22} {'hf decode (p10-p90)':>20} {'ratio':>5}   (tok/s, medians)")
    for b in batches:
        o, t = ours[b], theirs.get(b)
        row = {"batch": b, "moed": o, "transformers": t}
        if t:
            row["prefill_ratio"] = o["prefill_tok_s"]["median"] / t["prefill_tok_s"]["median"]
            row["decode_ratio"] = o["decode_tok_s"]["median"] / t["decode_tok_s"]["median"]
        rows.append(row)

        def dec(x: dict | None) -> str:
            if not x:
                return "-"
            d = x["decode_tok_s"]
            return f"{d['median']:.0f} ({d['p10']:.0f}-{d['p90']:.0f})"
        print(f"{b:>5} | {o['prefill_tok_s']['median']:12.0f} "
              f"{t['prefill_tok_s']['median'] if t else 0:10.0f} {row.get('prefill_ratio', 0):5.2f} | "
              f"{dec(o):>22} {dec(t):>20} {row.get('decode_ratio', 0):5.2f}")
    print("round-to-round spread (min-max of each round's median):")
    for name, by_b in summary.items():
        for b in batches:
            x = by_b[b]
            p, d = x["prefill_tok_s"], x["decode_round_medians"]
            print(f"  {name:<12} batch {b:>2}: prefill {p['min']:.0f}-{p['max']:.0f}  "
                  f"decode {min(d):.0f}-{max(d):.0f}")
    return rows


def plot(batches: list[int], summary: dict, path: Path, title: str) -> str:
    """tok/s vs batch, prefill and decode, one line per engine with p10-p90 bars.
    -> the path written, or why not."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed in this environment"
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "prefill_tok_s", "prefill"), (axes[1], "decode_tok_s", "decode")):
        for name, by_b in summary.items():
            med = [by_b[b][key]["median"] for b in batches]
            lo = [m - by_b[b][key]["p10"] for b, m in zip(batches, med)]
            hi = [by_b[b][key]["p90"] - m for b, m in zip(batches, med)]
            ax.errorbar(batches, med, yerr=[lo, hi], marker="o", capsize=3, label=name)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch")
        ax.set_ylabel("tok/s")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def bench_prompts(model_dir: Path, batches: list[int], prompt: int, long: int
                  ) -> tuple[dict[int | str, list[list[int]]], str]:
    """The same seeded random prompts for every engine: per batch size b, the first b of a pool
    of `prompt`-token prompts; with `long`, one prompt of that many tokens under the job
    "1 x {long}". -> (prompts by job, the long job's name)."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, vocab, (max(batches), prompt), generator=g).tolist()
    prompts: dict[int | str, list[list[int]]] = {b: pool[:b] for b in batches}
    long_job = f"1 x {long}"
    if long:
        prompts[long_job] = torch.randint(0, vocab, (1, long), generator=g).tolist()
    return prompts, long_job


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "deepseek_v3"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--long", type=int, default=2048,
                    help="a batch-1 prompt of this many tokens, prefill only, each round (0: none)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (each: every batch, both engines)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--cache", default=os.environ.get("MOED_BENCH_CACHE", str(ROOT / ".cache" / "bench")))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine.json"))
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()
    if a.new < 2 or a.repeats < 1 or a.long < 0:
        ap.error("--new must be >= 2 (decode steps to time), --repeats >= 1 and --long >= 0")
    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = _checkpoint(a.arch, Path(a.cache))
    batches = [int(x) for x in a.batches.split(",")]
    prompts, long_job = bench_prompts(model_dir, batches, a.prompt, a.long)
    cpu = cpu_model()
    print(f"{a.arch} bench preset, bf16, prompt {a.prompt}, {a.new} new tokens, "
          f"{torch.get_num_threads()} torch threads, {a.repeats} rounds\nCPU: {cpu}", flush=True)
    rss0 = rss_bytes()
    sides = [MoedSide(model_dir, max(batches), a.prompt, a.new,
                      kv_tokens=max(max(batches) * (a.prompt + a.new), a.long + 2))]
    rss_moed = rss_bytes()
    kernels = sides[0].cpu_kernels
    print(f"moed CPU kernels: {'on' if kernels else 'off (torch path; MOED_CPU_KERNELS or the log says why)'}"
          f"; RSS after load {rss_moed / 2**20:.0f} MiB", flush=True)
    rss_hf = None
    if not a.skip_hf:
        sides.append(HFSide(model_dir))
        rss_hf = rss_bytes() - rss_moed
        print(f"transformers: loading added {rss_hf / 2**20:.0f} MiB RSS", flush=True)
    kern = cpu_kernels() if kernels else None
    ceil, fpt = ceiling(5, kern), flops_per_token(load_spec(model_dir))
    res = measure(sides, prompts, a.new, a.repeats, new_for={long_job: 2})
    after = ceiling(5, kern)            # again after the rounds: the higher of the two
    if after["flop_s"] > ceil["flop_s"]:
        ceil = after
    rows = print_table(batches, res["summary"])
    jobs = [(b, a.prompt) for b in batches] + ([(long_job, a.long)] if a.long else [])
    vs_ceiling = print_ceiling(res["summary"], jobs, ceil, fpt)
    kv = kv_bytes_per_token(model_dir)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(batches, res["summary"], out.with_suffix(".png"),
               f"{a.arch} bench preset, prompt {a.prompt}, {torch.get_num_threads()} threads, {cpu}")
    out.write_text(json.dumps({
        "arch": a.arch, "preset": "bench", "dtype": "bfloat16", "prompt_len": a.prompt,
        "new_tokens": a.new, "rounds": a.repeats, "torch_threads": torch.get_num_threads(),
        "cpu": cpu, "cpus": os.cpu_count(), "transformers_experts_implementation": "grouped_mm",
        "moed_cpu_kernels": kernels,
        "rss_bytes": {"before_load": rss0, "moed_after_load": rss_moed,
                      "transformers_added": rss_hf},
        "load_average": load_average(), "round_log": res["rounds"], "kv_cache": kv,
        "results": rows, "ceiling": ceil, "flops_per_token": fpt, "prefill_vs_ceiling": vs_ceiling,
        "long_prompt": a.long, "png": png}, indent=2))
    print(f"\nKV cache bytes per token (all layers, bf16): {a.arch} {kv['bytes_per_token']}, "
          f"GQA of equal width ({kv['gqa_kv_heads']} KV heads x {kv['gqa_head_dim']}) {kv['gqa_bytes_per_token']}, "
          f"MHA {kv['mha_bytes_per_token']}")
    print(f"\nsaved {out}; plot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
