"""The layer-by-layer path vs the native decode step (moed/model/decode_step.py) on one model,
interleaved call by call.

    .venv/bin/python bench/step_ab.py [--quant int4] [--activations int8] [--lm-head int8]
                                      [--batches 1,8,32] [--calls 300] [--threads 2]

One runner (the bench checkpoint, quantized at load per --quant), one decode batch per size
(each sequence at position 130), and runner.forward + the greedy argmax called alternately with
the native step and without it (A B B A ...: neither always goes first), so a change of the
host's load or memory bandwidth, which on a shared 2-core VM moves a step by tens of percent
within seconds, falls on both alike (as bench/kernel_ab.py does for two builds). The layered
side is what a quantized model ran before the step served quantized weights. Prints the median
forward time per path, tok/s and native/layered speed per batch size, with the load average;
JSON to bench/results/step_ab.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import cpu_model, load_average  # noqa: E402
from engine import _checkpoint  # noqa: E402

from moed.model.batch import ForwardBatch  # noqa: E402
from moed.model.runner import ModelRunner  # noqa: E402
from moed.model.sampler import argmax_rows  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default="int4", choices=("none", "int8", "int4", "fp8"))
    ap.add_argument("--activations", default="int8", choices=("none", "int8"))
    ap.add_argument("--lm-head", default="int8", choices=("none", "int8", "model"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--calls", type=int, default=300, help="decode steps per batch size, both paths")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "step_ab.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    batches = [int(x) for x in a.batches.split(",")]
    quant = "" if a.quant == "none" else a.quant
    head, acts = ("none", "none") if not quant else (a.lm_head, a.activations)
    runner = ModelRunner(_checkpoint("qwen3_moe", Path(a.cache)), dtype="bfloat16", device="cpu",
                         attention_backend="torch", num_blocks=10 * max(batches) + 8, block_size=16,
                         quantization=quant, quantization_lm_head=head, quantization_activations=acts)
    step = runner.native_decode
    if step is None:
        raise SystemExit(f"the native decode step does not serve here: {runner.native_decode_off}")
    print(f"{a.quant} (lm_head {head}, activations {acts}); {a.threads} threads; CPU: {cpu_model()}; "
          f"load {load_average()[0]:.2f}", flush=True)
    rows = []
    for batch in batches:
        fb = ForwardBatch([[5]] * batch, [130] * batch, [list(range(i * 10, i * 10 + 10)) for i in range(batch)])
        if not step.serves(fb):
            raise SystemExit(f"the native step does not serve batch {batch}")
        before = load_average()
        times: dict[int, list[float]] = {0: [], 1: []}
        for i in range(a.calls + 10):
            v = (i + i // 2) % 2               # 0 layered, 1 native: A B B A A B B A ...
            runner.native_decode = step if v else None
            t = time.perf_counter()
            argmax_rows(runner.forward(fb)).tolist()
            if i >= 10:                        # warm-up
                times[v].append(time.perf_counter() - t)
        lay, nat = statistics.median(times[0]), statistics.median(times[1])
        rows.append({"batch": batch, "layered_ms": lay * 1e3, "native_ms": nat * 1e3, "speedup": lay / nat,
                     "layered_tok_s": batch / lay, "native_tok_s": batch / nat,
                     "load_before": before, "load_after": load_average()})
        print(f"batch {batch:>2}: layered {lay * 1e3:.2f} ms ({batch / lay:.1f} tok/s)  native {nat * 1e3:.2f} ms "
              f"({batch / nat:.1f} tok/s)  native/layered speed {lay / nat:.2f}x  "
              f"(load {before[0]:.2f} -> {load_average()[0]:.2f})", flush=True)
    runner.native_decode = step
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "step_ab", "quant": a.quant, "lm_head": head, "activations": acts,
                               "cpu": cpu_model(), "threads": a.threads, "calls": a.calls, "runs": rows}, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
