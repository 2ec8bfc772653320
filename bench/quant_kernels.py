"""The native quantized matmul (moed/model/kernels/cpu_quant.c) against the reference path, per
format and row count, in weight bytes read per second beside the machine's read bandwidth.

    .venv/bin/python bench/quant_kernels.py [--rows 1,8,32] [--shape 4096,2048] [--threads 2]
                                            [--isa avx512,avx2] [--repeats 20] [--activations int8]

For each format (int8 per row, int4 group 128, fp8 block 128) a [rows, K] bf16 x [N, K] product:
native (each variant this CPU runs) and the reference (quant/linear.py: dequantize, then
F.linear / ATen's gemv, what Linear ran before the kernel); --activations int8 runs the native
side on int8 activations (cpu_qdot.c, model.quantization_activations = "int8"). Each figure is
the best of --repeats calls. GB/s counts the weight's bytes (codes + scales) once per call; the bandwidth is a
streaming read of a 1 GiB buffer (torch.sum over fp32, all threads; bench/ceiling.py's
`bandwidth`). A 4096x2048 weight (4-8 MB) stays in a server CPU's L3, which no decode step's
weights do: so the native calls cycle through copies of it that add up to --stream-mb (default
1024; 0: one copy, the cache-resident figure), each call reading the next, and a figure is the
best of --repeats passes over all copies divided by their number. Prints the load average beside the table (a shared machine's figures are only
comparable at a like load); JSON to bench/results/quant_kernels.json.

--engine int8,int4: also the bench checkpoint (bench/engine.py's) quantized at load, decode tok/s
at --engine-batches (default 1,8) on each of --engine-sides: fused (moed_moe_q, one native call
per MoE layer), per_expert (the native matmul per expert matrix: before moed_moe_q), reference
(dequantize per call: before the kernels); each batch run on every side, interleaved,
--engine-rounds times; median of each one's decode steps, then of the rounds.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ceiling import bandwidth, best_of  # noqa: E402
from common import cpu_model, load_average  # noqa: E402

from moed.model import kernels as K  # noqa: E402
from moed.model.kernels import quant as kq  # noqa: E402
from moed.model.layers import gemv  # noqa: E402
from moed.model.quant.linear import qlinear  # noqa: E402
from moed.model.quant.quantize import quantize  # noqa: E402
from moed.model.quant.weight import QuantWeight  # noqa: E402

GROUPS = {"int8": 0, "int4": 128, "fp8": 128}     # 0: one group per row (the online int8 layout)


def reference(x: torch.Tensor, w) -> torch.Tensor:  # noqa: ANN001
    """What Linear ran for a quantized weight before the native kernel (layers.Linear)."""
    if x.shape[0] <= 2:
        return gemv(x, w.dequantize(x.dtype))
    return qlinear(x, w)


SIDES = ("fused", "per_expert", "reference")


def engine_ab(formats: list[str], batches: list[int], rounds: int, new: int,
              sides: tuple[str, ...] = SIDES) -> list[dict]:
    """Decode tok/s of the bench checkpoint per format, per side: fused (moed_moe_q, one call
    per MoE layer: what runs now), per_expert (the native matmul per expert matrix, torch's
    SiLU and sums: what ran before it), reference (dequantize per call: before the kernels)."""
    import statistics

    import engine as eb     # bench/engine.py: the moed side and its step timing
    from moed.model import layers
    from moed.model.moe import MoELayer

    model_dir = eb._checkpoint("qwen3_moe", Path(ROOT / ".cache" / "bench"))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = torch.randint(0, vocab, (max(batches), 32), generator=torch.Generator().manual_seed(0)).tolist()
    out = []
    for fmt in formats:
        built = {}
        for side in sides:
            max_rows = 0 if side == "reference" else layers.QUANT_MAX_ROWS
            saved, layers.QUANT_MAX_ROWS = layers.QUANT_MAX_ROWS, max_rows     # read at construction
            try:
                built[side] = eb.MoedSide(model_dir, max(batches), 32, new, quantization=fmt)
            finally:
                layers.QUANT_MAX_ROWS = saved
            moe = [ly.mlp for ly in built[side].engine.runner.model.layers if isinstance(ly.mlp, MoELayer)]
            if side == "per_expert":
                for m in moe:
                    m.experts.qkernels = None
            fused = sum(m.experts.qkernels is not None for m in moe)
            print(f"engine {fmt} {side}: {fused} of {len(moe)} MoE layers on moed_moe_q", flush=True)
            built[side].run([prompts[0]], 2)           # warm-up
        for b in batches:
            got: dict[str, list[float]] = {p: [] for p in built}
            loads = [load_average()]
            for r in range(rounds):
                for p in (list(built) if r % 2 == 0 else list(built)[::-1]):
                    got[p].append(built[p].run(prompts[:b], new).summary()["decode_tok_s"]["median"])
            loads.append(load_average())
            row = {"format": fmt, "batch": b, "load": loads,
                   **{f"{p}_tok_s": statistics.median(v) for p, v in got.items()}}
            print(f"engine {fmt} batch {b}: decode tok/s " + ", ".join(f"{p} {row[p + '_tok_s']:.1f}" for p in built)
                  + f"; load {loads[0]} -> {loads[1]}", flush=True)
            out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--shape", default="4096,2048", help="N,K of the weight")
    ap.add_argument("--formats", default="int8,int4,fp8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--isa", default=",".join(K.runnable_isas()))
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--ref-repeats", type=int, default=3)
    ap.add_argument("--stream-mb", type=int, default=1024, help="copies of the weight to cycle through")
    ap.add_argument("--engine", default="", help="formats for the engine A/B (e.g. int8,int4)")
    ap.add_argument("--engine-batches", default="1,8")
    ap.add_argument("--engine-rounds", type=int, default=2)
    ap.add_argument("--engine-sides", default=",".join(SIDES), help="engine A/B sides (of " + ",".join(SIDES) + ")")
    ap.add_argument("--new", type=int, default=16, help="engine A/B: tokens generated per run")
    ap.add_argument("--activations", choices=("none", "int8"), default="none",
                    help="int8: the native side on int8 activations (cpu_qdot.c; int8 and int4 only)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quant_kernels.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n, k = (int(v) for v in args.shape.split(","))
    rows = [int(r) for r in args.rows.split(",")]
    isas = [i for i in args.isa.split(",") if i]
    if args.activations == "int8" and "fp8" in args.formats.split(","):
        ap.error("--activations int8 serves int8 and int4 weights (drop fp8 from --formats)")
    kern = {i: kq.with_act(K.load(i), args.activations) for i in isas}
    load0 = load_average()
    bw = bandwidth(5)
    print(f"{cpu_model()}, {args.threads} threads; read bandwidth {bw / 1e9:.1f} GB/s; load {load0}; "
          f"activations {args.activations} (the reference: dequantize, then F.linear in bf16)")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).bfloat16()
    results = []
    print(f"{'format':6} {'rows':>4} {'path':>11} {'ms':>8} {'GB/s':>6} {'of bw':>6} {'vs ref':>7}")
    for fmt in [f for f in args.formats.split(",") if f]:
        qw = quantize(w, fmt, GROUPS[fmt] or k)
        nbytes = qw.nbytes
        copies = [qw] + [QuantWeight(qw.fmt, qw.data.clone(), qw.scale.clone(), qw.zero, qw.group, qw.in_features)
                         for _ in range(args.stream_mb * 2**20 // nbytes - 1)]
        for r in rows:
            x = torch.randn(r, k, generator=g).bfloat16()
            t_ref = best_of(lambda: reference(x, qw), args.ref_repeats)
            row = {"format": fmt, "rows": r, "weight_bytes": nbytes, "reference_s": t_ref}
            print(f"{fmt:6} {r:4} {'reference':>11} {t_ref * 1e3:8.2f} {nbytes / t_ref / 1e9:6.1f} "
                  f"{nbytes / t_ref / bw:6.0%} {'':>7}")
            for isa, kk in kern.items():
                t = best_of(lambda: [kq.qlinear(kk, x, c) for c in copies], args.repeats) / len(copies)
                row[f"{isa}_s"] = t
                print(f"{fmt:6} {r:4} {isa:>11} {t * 1e3:8.2f} {nbytes / t / 1e9:6.1f} {nbytes / t / bw:6.0%} "
                      f"{t_ref / t:6.1f}x")
            results.append(row)
    load1 = load_average()
    print(f"load average before {load0}, after {load1}: figures indicative on a shared machine")
    engine = engine_ab([f for f in args.engine.split(",") if f], [int(b) for b in args.engine_batches.split(",")],
                       args.engine_rounds, args.new, tuple(v for v in args.engine_sides.split(",") if v)) \
        if args.engine else []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "shape": [n, k],
                               "stream_mb": args.stream_mb, "activations": args.activations,
                               "bandwidth_bytes_s": bw, "load": [load0, load1], "results": results,
                               "engine": engine}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
