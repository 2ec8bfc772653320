"""What the MTP layer costs a decode step that does not draft, on the runner alone: a batch of
`--batch` one-token rows after a prompt of `--context` tokens each, timed call by call with the
variants interleaved (so a shared machine's load moves them alike), median of `--iters`:

    plain       forward(batch): what a plain engine's step runs
    hidden      forward(batch, hidden=True): the logits and every row's hidden state
    kv-only     hidden + draft_mtp(depth 0): the MTP layer's KV entries of the step's rows
                (the plain arm of speculative.method mtp before the deferral)
    flush-N     one KV-only pass over N deferred positions per row (the deferral's catch-up,
                moed/engine/drafts/mtp_kv.py), per position

    .venv/bin/python bench/mtp_kv_cost.py [--batch 16] [--context 128] [--iters 200] [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "stdlib-ds3-tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--flush", type=int, default=64, help="deferred positions per row of flush-N")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    import logging

    import structlog
    import torch

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(a.threads)
    from moed.model.batch import ForwardBatch
    from moed.model.mtp import mtp_inputs
    from moed.model.runner import ModelRunner

    bs, b, ctx = 16, a.batch, a.context
    per = -(-(ctx + a.flush + 2) // bs)
    r = ModelRunner(a.model, dtype=a.dtype, device="cpu", num_blocks=b * per + 1, block_size=bs,
                    mtp=True)
    gen = torch.Generator().manual_seed(0)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
    prompts = [torch.randint(3, r.spec.vocab_size, (ctx,), generator=gen).tolist() for _ in range(b)]
    pre = ForwardBatch(prompts, [0] * b, tables)
    _, hid = r.forward(pre, hidden=True)
    r.draft_mtp(mtp_inputs(pre, [7] * b)[0], hid, [0] * b)
    dec = ForwardBatch([[5]] * b, [ctx] * b, tables)
    mb = mtp_inputs(dec, [9] * b)[0]
    n = a.flush
    fl = ForwardBatch([[9] * n] * b, [ctx] * b, tables)
    fl_hid = torch.randn(b * n, r.spec.hidden_size).to(r.dtype)

    def plain() -> None:
        r.forward(dec)

    def hidden() -> None:
        r.forward(dec, hidden=True)

    def kv_only() -> None:
        _, h = r.forward(dec, hidden=True)
        r.draft_mtp(mb, h, [0] * b)

    def flush() -> None:
        r.draft_mtp(fl, fl_hid, [0] * b)

    fns = {"plain": plain, "hidden": hidden, "kv-only": kv_only, f"flush-{n}": flush}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(5):
        for f in fns.values():
            f()
    for _ in range(a.iters):
        for k, f in fns.items():
            t = time.thread_time()
            f()
            times[k].append(time.thread_time() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"batch {b}, context {ctx}, {a.dtype}, {a.threads} thread(s), median of {a.iters} "
          f"interleaved calls, thread CPU ms; load {load_average()}")
    for k, v in med.items():
        print(f"  {k:10s} {v:7.3f} ms  ({100 * v / med['plain']:5.1f}% of plain)")
    print(f"  the KV-only pass: {med['kv-only'] - med['hidden']:.3f} ms a step; hidden states "
          f"{med['hidden'] - med['plain']:+.3f} ms; a flush: {1e3 * med[f'flush-{n}'] / n:.1f} us "
          f"per deferred step of {b} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
