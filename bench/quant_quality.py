"""What a weight format costs in quality: KL(bf16 || format) per token, top-1 agreement and
perplexity, on the same text through the same ModelRunner (issue 29; a first version: no
lm-eval tasks, no llama.cpp comparison).

The text (default: this repository's docs/*.md, a fixed ~`--tokens` tokens) is cut into windows
of `--window` tokens; each window runs as one prefill with every position's logits. The
reference is the checkpoint as it is (bf16 compute); each format is `model.quantization` on the
same checkpoint (a plain one). The noise floor row is the same plain weights in fp32 against the
compute dtype: what rounding alone does. Random-weight checkpoints are chaotic (their routers'
near-ties flip on any perturbation: on the bench preset bf16 rounding alone gives KL ~0.3 and
66% top-1 agreement), so their figures only compare formats; point --model at a real checkpoint
for real numbers.

    PYTHONPATH=. python bench/quant_quality.py --model DIR [--formats int8,int4,fp8] [--group-size 128]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _windows(model_dir: Path, text_files: list[Path], tokens: int, window: int) -> list[list[int]]:
    from moed.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    text = "\n\n".join(p.read_text(errors="replace") for p in text_files)
    ids = tok.encode(text, add_special_tokens=False)[:tokens]
    return [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]


def _logits(model_dir: Path, windows: list[list[int]], dtype: str, fmt: str, group: int) -> list[torch.Tensor]:
    from moed.model.batch import ForwardBatch
    from moed.model.runner import ModelRunner

    block = 16
    n = max(len(w) for w in windows)
    r = ModelRunner(model_dir, dtype=dtype, device="cpu", attention_backend="torch", num_blocks=-(-n // block),
                    block_size=block, quantization=fmt, quantization_group_size=group)
    out = []
    with torch.inference_mode():
        for w in windows:
            table = list(range(-(-len(w) // block)))
            out.append(r.forward(ForwardBatch([w], [0], [table], all_logits=(True,))).float())
    return out


def compare(ref: list[torch.Tensor], got: list[torch.Tensor], windows: list[list[int]]) -> dict[str, float]:
    kl, agree, nll_ref, nll_got, n = 0.0, 0, 0.0, 0.0, 0
    for a, b, w in zip(ref, got, windows):
        lp, lq = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl += float((lp.exp() * (lp - lq)).sum())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        nxt = torch.tensor(w[1:])
        nll_ref -= float(lp[:-1].gather(1, nxt[:, None]).sum())
        nll_got -= float(lq[:-1].gather(1, nxt[:, None]).sum())
        n += a.shape[0]
    m = sum(len(w) - 1 for w in windows)
    return {"kl_mean": kl / n, "top1_agreement": agree / n, "ppl_ref": math.exp(nll_ref / m),
            "ppl": math.exp(nll_got / m), "tokens": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="a plain (bf16/fp32) checkpoint")
    ap.add_argument("--formats", default="int8,int4,fp8")
    ap.add_argument("--group-size", type=int, default=128, help="int4 group size")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--text", nargs="*", type=Path, default=sorted((ROOT / "docs").glob("*.md")))
    ap.add_argument("--json", type=Path, help="write the figures here too")
    a = ap.parse_args()
    windows = _windows(a.model, a.text, a.tokens, a.window)
    if not windows:
        sys.exit("no text to score")
    t0 = time.monotonic()
    ref = _logits(a.model, windows, a.dtype, "", a.group_size)
    rows = {}
    if a.dtype != "float32":    # the noise floor: the same weights, fp32 against this dtype's rounding
        r = rows["noise_floor"] = compare(_logits(a.model, windows, "float32", "", a.group_size), ref, windows)
        print(f"noise floor KL(fp32||{a.dtype}, plain weights) {r['kl_mean']:.5f} nats/token  top-1 "
              f"agreement {100 * r['top1_agreement']:.1f}%", flush=True)
    for fmt in [f for f in a.formats.split(",") if f]:
        rows[fmt] = compare(ref, _logits(a.model, windows, a.dtype, fmt, a.group_size), windows)
        r = rows[fmt]
        print(f"{fmt:5s} KL(bf16||{fmt}) {r['kl_mean']:.5f} nats/token  top-1 agreement "
              f"{100 * r['top1_agreement']:.1f}%  ppl {r['ppl']:.3f} (bf16 {r['ppl_ref']:.3f})  "
              f"{r['tokens']} tokens", flush=True)
    result = {"model": str(a.model), "dtype": a.dtype, "group_size": a.group_size, "formats": rows,
              "seconds": round(time.monotonic() - t0, 1)}
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
