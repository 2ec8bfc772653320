"""Memory and decode-step time of the weight formats (issue 29, acceptance 4).

For each of bf16, int8, int4 and fp8 (`model.quantization` on the bench-preset checkpoint), a
fresh process loads the ModelRunner (bf16 compute, CPU) and reports: the bytes the weights hold
by format (what model_runner_ready logs), the RSS the load added (after torch's import and the
kernels' load, so what is left is weights plus the small KV pool), and the median time of a
batch-1 decode step (the reference path dequantizes each touched matrix per call: slower than
bf16 until native kernels replace it; the figure says by how much).

    PYTHONPATH=. python bench/quant_memory.py [--cache DIR] [--steps N] [--experts E]

--experts changes the bench preset's expert count (16): the bench preset's bf16 embeddings and
lm_head are 23% of its weights, where the MoE models moed serves keep ~0.3% (DeepSeek-V3) to
~2% (Qwen3-30B-A3B) there; at 64 experts it is 7%. Both ratios are printed: the RSS the load
added and the weights held (model_runner_ready's weights_mb).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from common import rss_bytes  # noqa: E402


def child(model_dir: str, fmt: str, steps: int) -> None:
    import torch

    from moed.model.batch import ForwardBatch
    from moed.model.runner import ModelRunner

    torch.ones(1) @ torch.ones(1)
    base = rss_bytes()
    r = ModelRunner(model_dir, dtype="bfloat16", device="cpu", num_blocks=8, block_size=16,
                    quantization="" if fmt == "bf16" else fmt)
    added = rss_bytes() - base
    times = []
    with torch.inference_mode():
        r.forward(ForwardBatch(token_ids=[[1, 2, 3, 4]], start_pos=[0], block_tables=[[0]]))
        for i in range(steps):
            t0 = time.perf_counter()
            r.forward(ForwardBatch(token_ids=[[5 + i]], start_pos=[4 + i], block_tables=[[0, 1]]))
            times.append(time.perf_counter() - t0)
    times.sort()
    print(json.dumps({"fmt": fmt, "rss_added_mb": round(added / 2**20, 1),
                      "step_ms_median": round(1e3 * times[len(times) // 2], 2)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default=os.environ.get("MOED_BENCH_CACHE", str(ROOT / ".cache" / "bench")))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16, help="the checkpoint's expert count")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "quant_memory.json")
    ap.add_argument("--child", nargs=2, metavar=("DIR", "FMT"))
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.steps)
        return
    from moed.dev.checkpoint import init_checkpoint

    out = Path(a.cache) / ("qwen3_moe-bench-0" if a.experts == 16 else f"qwen3_moe-bench-0-e{a.experts}")
    if not (out / "config.json").exists():
        init_checkpoint(arch="qwen3_moe", out=out, preset="bench", seed=0, num_experts=a.experts)
    rows = []
    for fmt in ("bf16", "int8", "int4", "fp8"):
        r = subprocess.run([sys.executable, __file__, "--child", str(out), fmt, "--steps", str(a.steps)],
                           capture_output=True, text=True, timeout=900)
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{\"fmt\"")]
        ready = [ln for ln in (r.stdout + r.stderr).splitlines() if "model_runner_ready" in ln]
        if not lines:
            print(r.stdout[-2000:], r.stderr[-2000:])
            raise SystemExit(f"{fmt}: no result")
        row = json.loads(lines[0])
        row["ready"] = ready[-1] if ready else ""
        held = re.search(r"weights_mb=(\{[^}]*\})", row["ready"])
        row["weights_held_mb"] = round(sum(ast.literal_eval(held.group(1)).values()), 1) if held else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    bf16, bf16_held = rows[0]["rss_added_mb"], rows[0]["weights_held_mb"]
    print(f"checkpoint {out} ({a.experts} experts)")
    for row in rows:
        held = row["weights_held_mb"]
        print(f"{row['fmt']:5s} RSS added by the load {row['rss_added_mb']:8.1f} MiB "
              f"({row['rss_added_mb'] / bf16:.2f}x bf16), weights held {held} MiB "
              f"({held / bf16_held:.2f}x bf16), decode step (batch 1) {row['step_ms_median']} ms")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"checkpoint": str(out), "experts": a.experts, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
