"""The logits head bf16 vs quantized (model.quantization_lm_head), A/B in one process.

    .venv/bin/python bench/quant_head.py [--quant int4] [--lm-head int8,model] [--batches 1,8,32]
                                         [--rounds 4] [--new 32] [--threads 2]

One runner of the bench checkpoint quantized at load (--quant), its head swapped between the
checkpoint's plain bf16 lm_head (the native bf16 kernel: model.quantization_lm_head none) and
that head quantized per each --lm-head value (int8, model: what the loader makes of it, on the
native quantized matmul). In each round, for each batch, the engine decodes --new tokens once
with each head (the order reversed every other round), so all see the same machine: on a shared, noisy machine an interleaved
A/B in one process is what holds, where two peers.py runs minutes apart do not. Prints per batch
the median over rounds of decode tok/s with each head and their ratio, and the head alone
(best of 20 calls of a [batch, hidden] input), with the load average. JSON to
bench/results/quant_head.json.
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
from engine import MoedSide, _checkpoint  # noqa: E402


def plain_head(model_dir: Path, runner) -> object:  # noqa: ANN001
    """The checkpoint's lm_head as moed serves it by default (bf16, packed for the kernels)."""
    from safetensors import safe_open

    from moed.model.layers import Linear
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        w = f.get_tensor("lm_head.weight").to(runner.dtype).contiguous()
    return Linear(w, pack=runner.ctx.pack, kernels=runner.ctx.kernels), w


def quantized_head(w: torch.Tensor, value: str, runner) -> object:  # noqa: ANN001
    """w as model.quantization_lm_head `value` makes it at load, on the runner's kernels."""
    from moed.model.layers import Linear
    from moed.model.quant.formats import with_head
    from moed.model.quant.quantize import quantize
    fmt, group = with_head(runner.quant_plan, value).head_format(w.shape[1])
    q = quantize(w, fmt, group)
    return Linear(q, kernels=runner.ctx.for_weight(q))


def head_us(head, batch: int, hidden: int) -> float:  # noqa: ANN001
    x = torch.randn(batch, hidden).bfloat16()
    best = float("inf")
    with torch.inference_mode():
        for _ in range(20):
            t0 = time.perf_counter()
            head(x)
            best = min(best, time.perf_counter() - t0)
    return best * 1e6


def decode_tok_s(side: MoedSide, prompts: list[list[int]], new: int) -> float:
    t = side.run(prompts, new)
    secs = sum(s for _, s in t.decode)
    return sum(b for b, _ in t.decode) / secs if secs else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quant", default="int4", choices=("int8", "int4", "fp8"))
    ap.add_argument("--lm-head", default="int8,model", help="model.quantization_lm_head values")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant_head.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",")]
    model_dir = _checkpoint("qwen3_moe", Path(a.cache))
    side = MoedSide(model_dir, max(batches), 128, a.new, quantization=a.quant)
    runner = side.engine.runner
    plain, w = plain_head(model_dir, runner)
    heads = {"bf16": plain}
    for v in a.lm_head.split(","):
        heads[v] = quantized_head(w, v, runner)
    print(f"{model_dir.name}, {a.quant}, heads: " + ", ".join(
        f"{k} ({'bf16' if h.quant is None else h.quant.describe() + ', ' + h.qpath})" for k, h in heads.items())
        + f"; {a.threads} threads; CPU: {cpu_model()}; load {load_average()[0]:.2f}", flush=True)
    vocab, hidden = runner.spec.vocab_size, runner.spec.hidden_size
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, vocab, (max(batches), 128), generator=g).tolist()
    side.run([pool[0]], 4)                                          # warm-up
    us = {b: {k: head_us(h, b, hidden) for k, h in heads.items()} for b in batches}
    print("the head alone, best of 20 calls: " + "; ".join(
        f"batch {b} " + " / ".join(f"{k} {v:.0f} us" for k, v in u.items()) for b, u in us.items()), flush=True)
    got: dict[int, dict[str, list[float]]] = {b: {k: [] for k in heads} for b in batches}
    loads = []
    for r in range(a.rounds):
        before = load_average()[0]
        for b in batches:
            for name in (list(heads) if r % 2 == 0 else list(heads)[::-1]):
                runner.model.lm_head = heads[name]
                got[b][name].append(decode_tok_s(side, pool[:b], a.new))
        loads.append((before, load_average()[0]))
        print(f"  round {r + 1}/{a.rounds}: load {before:.2f} -> {loads[-1][1]:.2f}; " + "; ".join(
            f"batch {b} " + " / ".join(f"{k} {v[-1]:.1f}" for k, v in got[b].items()) for b in batches)
            + " tok/s", flush=True)
    rows = []
    print(f"\ndecode tok/s, median of {a.rounds} rounds (x: / the bf16 head's); the head alone, best of 20")
    for b in batches:
        m = {k: statistics.median(v) for k, v in got[b].items()}
        rows.append({"batch": b, "tok_s": m, "rounds": got[b], "head_us": us[b]})
        print(f"batch {b:>2}: " + "; ".join(f"{k} {v:.1f} ({v / m['bf16']:.2f}x), head {us[b][k]:.0f} us"
                                          for k, v in m.items()))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"bench": "quant_head", "cpu": cpu_model(), "threads": a.threads,
                               "quant": a.quant, "lm_head": a.lm_head, "new": a.new, "loads": loads,
                               "runs": rows}, indent=2))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
