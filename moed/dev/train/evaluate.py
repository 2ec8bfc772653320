"""Held-out figures of a checkpoint with an MTP layer, from its files (fp32, transformers'
modules): perplexity, next-token top-1 and the MTP layer's next-next-token top-1.

    python -m moed.dev.train.evaluate --model models/stdlib-ds3-tiny [--windows N] [--threads 2]

Windows of the training sequence length (training.json) over split.json's held-out files, as
the card's figures; a held-out file this Python lacks is skipped and named.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    from tokenizers import Tokenizer

    from moed.dev.train.train import evaluate, from_checkpoint, heldout_chunks

    ap = argparse.ArgumentParser(prog="python -m moed.dev.train.evaluate")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--windows", type=int, help="only the first N windows (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    seq_len = json.loads((a.model / "training.json").read_text())["config"]["seq_len"]
    split = json.loads((a.model / "split.json").read_text())
    tok = Tokenizer.from_file(str(a.model / "tokenizer.json"))
    chunks, missing = heldout_chunks(tok, split["heldout"], seq_len, limit=a.windows)
    for rel in missing:
        print(f"skipped (not in this Python's stdlib): {rel}", file=sys.stderr)
    print(json.dumps({"windows": len(chunks), "missing": missing, **evaluate(from_checkpoint(a.model), chunks)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
