"""What model.quantization_activations = int8 costs in quality: the demo model's held-out windows
scored by decode-sized forwards (chunks of --chunk <= 64 tokens, every position's logits), so
every quantized matmul runs the few-row path the setting changes (a whole-window prefill would
take the blocked path, which the setting leaves alone). Per weight format: KL against the plain
bf16 checkpoint, top-1 agreement and perplexity, activations none vs int8.

    .venv/bin/python bench/act_quality.py [--model models/stdlib-ds3-tiny] [--files 2] [--windows 8] [--formats int8,int4]
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import structlog
import torch

sys.path.insert(0, str(Path(__file__).parent))
from quality import DEFAULT_MODEL, Divergence, heldout_windows    # noqa: E402


def chunked_logits(runner, w: list[int], chunk: int) -> torch.Tensor:  # noqa: ANN001
    """Every position's log-softmax (fp64) of window w, fed `chunk` tokens a forward."""
    from moed.model.batch import ForwardBatch

    table, out = list(range(-(-len(w) // 16))), []
    with torch.inference_mode():
        for s in range(0, len(w), chunk):
            out.append(runner.forward(ForwardBatch([w[s:s + chunk]], [s], [table], all_logits=(True,))).double())
    return torch.log_softmax(torch.cat(out), -1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--files", type=int, default=2)
    ap.add_argument("--windows", type=int, default=8, help="at most this many windows")
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--chunk", type=int, default=32, help="tokens a forward (<= 64: the few-row path)")
    a = ap.parse_args()
    from moed.model.runner import ModelRunner

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    windows = [w for _, w in heldout_windows(a.model, a.files)[0]][:a.windows]
    n = max(map(len, windows))

    def runner(fmt: str = "", act: str = "none") -> ModelRunner:
        return ModelRunner(a.model, dtype="bfloat16", device="cpu", num_blocks=-(-n // 16), block_size=16,
                           quantization=fmt, quantization_activations=act)
    ref = runner()
    runs = {(f, act): runner(f, act) for f in a.formats.split(",") for act in ("none", "int8")}
    acc = {k: Divergence() for k in runs}
    for w in windows:
        lr = chunked_logits(ref, w, a.chunk)
        for k, r in runs.items():
            acc[k].add(lr, chunked_logits(r, w, a.chunk), w)
    print(f"{a.model.name}: {len(windows)} windows, {sum(map(len, windows))} tokens, chunks of {a.chunk}")
    for (f, act), d in acc.items():
        r = d.figures()
        print(f"  {f} activations {act:4s}  KL(bf16 || it) {r['kl_mean']:.6f} nats/token  top-1 agreement "
              f"{100 * r['top1_agreement']:.2f}%  perplexity {r['ppl']:.3f} (bf16 {r['ppl_ref']:.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
