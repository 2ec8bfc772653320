"""moed on a CUDA GPU: engine throughput with FlashInfer and with torch attention, against
transformers `generate` on the same bf16 checkpoint and GPU, one run.

    python bench/gpu.py [--arch qwen3_moe|deepseek_v3] [--batches 1,8,32,128] [--prompt 128] [--new 64] [--long 2048] [--repeats 3]

The timing rules are bench/engine.py's (each engine's own steps; the engines interleaved, the
order flipping each round): moed's step time ends when the step's sampled tokens reach the host,
transformers' clock synchronizes the device before it reads. Prefill is also given as a fraction
of the GPU's bf16 matmul rate (an 8192^3 torch matmul, best of 5 after warm-up). Writes
bench/results/gpu.json (or --out) and a PNG beside it. Needs torch with CUDA and, for the
FlashInfer side, flashinfer-python (the `gpu` extra); without it that side is left out and the
JSON says why.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from engine import HFSide, MoedSide, _checkpoint, bench_prompts, measure, plot, print_table  # noqa: E402
from ceiling import flops_per_token  # noqa: E402
from common import load_average  # noqa: E402

from moed.model.hf_config import load_spec  # noqa: E402


def gpu_matmul_rate(n: int = 8192, repeats: int = 5) -> float:
    """bf16 FLOP/s of an n^3 matmul on the current GPU, best of `repeats` after a warm-up."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    torch.matmul(a, b)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "mixtral", "deepseek_v3"))
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--long", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu.json"))
    ap.add_argument("--skip-hf", action="store_true")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    model_dir = _checkpoint(a.arch, Path(a.cache))
    batches = [int(x) for x in a.batches.split(",")]
    prompts, long_job = bench_prompts(model_dir, batches, a.prompt, a.long)
    kv_tokens = max(max(batches) * (a.prompt + a.new), a.long + 2)
    sides, left_out = [], {}
    if importlib.util.find_spec("flashinfer") is not None:
        try:
            sides.append(MoedSide(model_dir, max(batches), a.prompt, a.new, kv_tokens, device="cuda",
                                  attention="flashinfer", name="moed-flashinfer"))
        except ValueError as e:     # e.g. MLA sizes FlashInfer's kernels are not built for
            left_out["moed-flashinfer"] = str(e)
            print(f"moed-flashinfer left out: {e}", flush=True)
    else:
        left_out["moed-flashinfer"] = "flashinfer-python is not installed"
    sides.append(MoedSide(model_dir, max(batches), a.prompt, a.new, kv_tokens, device="cuda",
                          attention="torch", name="moed-torch"))
    if not a.skip_hf:
        hf = HFSide(model_dir, device="cuda")
        hf.name = "transformers"
        sides.append(hf)
    print(f"{a.arch} bench preset, bf16, prompt {a.prompt}, {a.new} new, {a.repeats} rounds, GPU: {gpu}",
          flush=True)
    rate = gpu_matmul_rate()
    res = measure(sides, prompts, a.new, a.repeats, new_for={long_job: 2})
    summary = res["summary"]
    fpt = flops_per_token(load_spec(model_dir))
    rows = []
    for first in [s.name for s in sides if s.name.startswith("moed")]:
        print(f"\n== {first} (ratio against transformers) ==")
        view = {"moed": summary[first]}
        if "transformers" in summary:
            view["transformers"] = summary["transformers"]
        rows.append({"side": first, "rows": print_table(batches, view)})
    prefill = {name: {str(job): by[job]["prefill_tok_s"]["median"] for job in prompts}
               for name, by in summary.items()}
    print(f"\nGPU bf16 matmul {rate / 1e12:.0f} TFLOP/s; model {fpt / 1e6:.1f} MFLOP/token")
    for name, by in prefill.items():
        print(f"  {name:<16} prefill " + ", ".join(
            f"{job}: {v:.0f} tok/s ({100 * v * fpt / rate:.2f}% of matmul rate)" for job, v in by.items()))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(batches, summary, out.with_suffix(".png"), f"{a.arch} bench preset, {gpu}")
    out.write_text(json.dumps({
        "arch": a.arch, "gpu": gpu, "torch": torch.__version__, "prompt_len": a.prompt,
        "new_tokens": a.new, "rounds": a.repeats, "matmul_flop_s": rate, "flops_per_token": fpt,
        "left_out": left_out, "load_average": load_average(), "round_log": res["rounds"],
        "summary": {n: {str(k): v for k, v in by.items()} for n, by in summary.items()},
        "tables": rows, "png": png}, indent=2))
    print(f"\nsaved {out}; plot: {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
