"""Engine throughput: moed vs transformers `generate` on the same bf16 checkpoint, one run.

    .venv/bin/python bench/engine.py [--arch qwen3_moe|mixtral|deepseek_v3] [--batches 1,8,32] [--prompt 128] [--new 64]

Both sides get the same random prompts (all the same length, so transformers needs no padding)
and generate greedily with EOS ignored. Per batch size:
  prefill tok/s = batch * prompt / time to the first token (generate with max_tokens=1)
  decode tok/s  = batch * (new - 1) / (time for `new` tokens - time for 1 token)
Prefix caching is off for moed so repeated runs recompute. Timings are best-of-N with the two
engines interleaved, so a busy machine slows both alike. transformers uses
experts_implementation="grouped_mm" (its fastest on this CPU per notes/models-and-baselines.md)
and attn_implementation="sdpa". Prints a table and writes bench/results/engine.json, with the
checkpoint's KV bytes per token beside a GQA and an MHA cache of the same width (DeepSeek-V3's
latent cache vs the per-head K/V it replaces).
moed uses its native CPU kernels when they load (moed/model/kernels; the JSON's
moed_cpu_kernels says which); MOED_CPU_KERNELS=0 measures the plain torch path instead.
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
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, str(ROOT))

from moed.config import EngineConfig  # noqa: E402
from moed.engine.engine import Engine  # noqa: E402
from moed.model.init import init_checkpoint  # noqa: E402
from moed.model.runner import ModelRunner  # noqa: E402
from moed.model.tokenizer import Tokenizer  # noqa: E402
from moed.types import SamplingParams  # noqa: E402


def _checkpoint(arch: str, cache: Path) -> Path:
    out = cache / f"{arch}-bench-0"
    if not (out / "config.json").exists():
        print(f"building the bench checkpoint in {out} ...", flush=True)
        init_checkpoint(arch=arch, out=out, preset="bench", seed=0)
    return out


class MoedSide:
    name = "moed"

    def __init__(self, model_dir: Path, max_batch: int, prompt_len: int, new: int) -> None:
        blocks = max_batch * (-(-(prompt_len + new) // 16)) + 8
        runner = ModelRunner(model_dir, dtype="bfloat16", device="cpu", attention_backend="torch",
                             num_blocks=blocks, block_size=16)
        cfg = EngineConfig(block_size=16, enable_prefix_caching=False, max_num_seqs=max_batch,
                           max_num_batched_tokens=2048)
        self.engine = Engine(runner, Tokenizer.from_dir(model_dir), cfg)
        self.cpu_kernels = runner.model.kernels is not None

    def run(self, prompts: list[list[int]], n: int) -> None:
        self.engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


class HFSide:
    name = "transformers"

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16, experts_implementation="grouped_mm",
            attn_implementation="sdpa").eval()

    def run(self, prompts: list[list[int]], n: int) -> None:
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)


def measure(sides: list, prompts: dict[int, list[list[int]]], new: int, repeats: int) -> dict:
    """Best-of-`repeats` timings, the sides interleaved so load changes hit both alike."""
    prompt_len = len(next(iter(prompts.values()))[0])
    for side in sides:                                          # warm-up
        side.run(prompts[min(prompts)], 4)
    res: dict[str, dict[int, dict]] = {s.name: {} for s in sides}
    for b, ps in prompts.items():
        t1 = {s.name: float("inf") for s in sides}
        tn = dict(t1)
        for _ in range(repeats):
            for s in sides:
                t1[s.name] = min(t1[s.name], _timed(lambda: s.run(ps, 1)))
                tn[s.name] = min(tn[s.name], _timed(lambda: s.run(ps, new)))
        for s in sides:
            r = {"prefill_tok_s": b * prompt_len / t1[s.name],
                 "decode_tok_s": b * (new - 1) / max(tn[s.name] - t1[s.name], 1e-9),
                 "ttft_s": t1[s.name], "total_s": tn[s.name]}
            res[s.name][b] = r
            print(f"  {s.name:<12} batch {b:>2}: {r['prefill_tok_s']:8.0f} prefill tok/s  "
                  f"{r['decode_tok_s']:7.1f} decode tok/s", flush=True)
    return res


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def kv_bytes_per_token(model_dir: Path) -> dict:
    """The checkpoint's KV bytes per token (all layers, bf16) beside a GQA and an MHA cache of
    the same width (hidden, heads, layers; GQA with the bench preset's KV heads)."""
    from moed.model import archs
    from moed.model.init import PRESETS
    from moed.model.kv_layout import KVLayout
    from moed.model.spec import load_spec

    spec = load_spec(model_dir)
    ours = archs.kv_layout(spec, 16, torch.bfloat16)
    d = spec.hidden_size // spec.num_heads
    gqa = KVLayout.gqa(spec.num_layers, PRESETS["bench"]["num_kv_heads"], d, 16, torch.bfloat16)
    mha = KVLayout.gqa(spec.num_layers, spec.num_heads, d, 16, torch.bfloat16)
    return {"kind": ours.kind, "bytes_per_token": ours.bytes_per_block // 16,
            "gqa_kv_heads": PRESETS["bench"]["num_kv_heads"], "gqa_head_dim": d,
            "gqa_bytes_per_token": gqa.bytes_per_block // 16, "mha_bytes_per_token": mha.bytes_per_block // 16}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "deepseek_v3"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--cache", default=os.environ.get("MOED_BENCH_CACHE", str(ROOT / ".cache" / "bench")))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine.json"))
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model_dir = _checkpoint(a.arch, Path(a.cache))
    batches = [int(x) for x in a.batches.split(",")]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, vocab, (max(batches), a.prompt), generator=g).tolist()
    prompts = {b: pool[:b] for b in batches}
    print(f"{a.arch} bench preset, bf16, prompt {a.prompt}, {a.new} new tokens, "
          f"{torch.get_num_threads()} torch threads", flush=True)
    sides = [MoedSide(model_dir, max(batches), a.prompt, a.new)]
    kernels = sides[0].cpu_kernels
    print(f"moed CPU kernels: {'on' if kernels else 'off (torch path; MOED_CPU_KERNELS or the log says why)'}",
          flush=True)
    if not a.skip_hf:
        sides.append(HFSide(model_dir))
    res = measure(sides, prompts, a.new, a.repeats)
    ours, theirs = res["moed"], res.get("transformers", {})
    rows = []
    print(f"\n{'batch':>5} | {'moed prefill':>12} {'hf prefill':>10} {'ratio':>5} | "
          f"{'moed decode':>11} {'hf decode':>9} {'ratio':>5}   (tok/s)")
    for b in batches:
        o, t = ours[b], theirs.get(b)
        row = {"batch": b, "moed": o, "transformers": t}
        if t:
            row["prefill_ratio"] = o["prefill_tok_s"] / t["prefill_tok_s"]
            row["decode_ratio"] = o["decode_tok_s"] / t["decode_tok_s"]
        rows.append(row)
        print(f"{b:>5} | {o['prefill_tok_s']:12.0f} {t['prefill_tok_s'] if t else 0:10.0f} "
              f"{row.get('prefill_ratio', 0):5.2f} | {o['decode_tok_s']:11.1f} "
              f"{t['decode_tok_s'] if t else 0:9.1f} {row.get('decode_ratio', 0):5.2f}")
    kv = kv_bytes_per_token(model_dir)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "arch": a.arch, "preset": "bench", "dtype": "bfloat16", "prompt_len": a.prompt,
        "new_tokens": a.new, "torch_threads": torch.get_num_threads(), "cpu": platform.processor(),
        "cpus": os.cpu_count(), "transformers_experts_implementation": "grouped_mm",
        "moed_cpu_kernels": kernels,
        "load_average": os.getloadavg(), "kv_cache": kv, "results": rows}, indent=2))
    print(f"\nKV cache bytes per token (all layers, bf16): {a.arch} {kv['bytes_per_token']}, "
          f"GQA of equal width ({kv['gqa_kv_heads']} KV heads x {kv['gqa_head_dim']}) {kv['gqa_bytes_per_token']}, "
          f"MHA {kv['mha_bytes_per_token']}")
    print(f"\nsaved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
