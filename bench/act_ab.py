"""moed decode with model.quantization_activations none vs int8, in one process, the two
interleaved per round (the order flips each round) so a load change on a shared machine hits
both alike: tok/s per batch (median decode step) and the int8/none ratio, the load average
beside each round.

    .venv/bin/python bench/act_ab.py [--quant int4] [--batches 1,8,32] [--new 16] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import engine as eb    # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("/work/main/.cache/bench/qwen3_moe-bench-0"))
    ap.add_argument("--quant", default="int4", choices=("int8", "int4"))
    ap.add_argument("--lm-head", default="int8", choices=("none", "int8", "model"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch
    torch.set_num_threads(a.threads)
    batches = [int(b) for b in a.batches.split(",")]
    sides = {act: eb.MoedSide(a.model, max(batches), a.prompt, a.new, quantization=a.quant, lm_head=a.lm_head,
                              activations=act) for act in ("none", "int8")}
    g = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 1000, (max(batches), a.prompt), generator=g).tolist()
    for s in sides.values():
        s.run([pool[0]], 4)                     # warm-up
    got: dict[tuple[str, int], list[float]] = {}
    for rnd in range(a.rounds):
        before = os.getloadavg()[0]
        order = ["none", "int8"] if rnd % 2 == 0 else ["int8", "none"]
        for b in batches:
            for act in order:
                tok_s = sides[act].run(pool[:b], a.new).summary()["decode_tok_s"]["median"]
                got.setdefault((act, b), []).append(tok_s)
        print(f"round {rnd + 1}: load {before:.2f} -> {os.getloadavg()[0]:.2f}: " + ", ".join(
            f"b{b} {got[('none', b)][-1]:.1f} / {got[('int8', b)][-1]:.1f}" for b in batches), flush=True)
    print(f"{a.model.name} {a.quant} (lm_head {a.lm_head}), {torch.get_num_threads()} threads: decode tok/s, "
          f"median of rounds, activations none / int8 (ratio)")
    for b in batches:
        n, i = (sorted(got[(k, b)])[len(got[(k, b)]) // 2] for k in ("none", "int8"))
        print(f"  batch {b:3d}  {n:8.1f} {i:8.1f}  {i / n:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
