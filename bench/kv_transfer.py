"""KV transfer throughput: NIXL WRITE between two processes vs an in-process memcpy.

Paged-KV-sized blocks ([layers, blocks, 2, block_size, kv_heads, head_dim], bf16); a prompt's
block list is written scattered (random ids on both sides) and contiguous (one run, merged into
one descriptor per layer). The memcpy peer copies the same bytes in one process: a strided slice
copy for the contiguous case, an index gather/scatter for the scattered one. Prints GB/s and
the ratio NIXL / memcpy; saves bench/results/kv_transfer.json.

    .venv/bin/python bench/kv_transfer.py [--layers 16 --blocks 512 --prompt-blocks 128 --reps 10]
                                          [--no-thp]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if "--no-thp" not in sys.argv:
    # Transparent huge pages for torch's CPU allocations (read at allocation time; spawned
    # children inherit it): cma's page pinning and memcpy's TLB both gain (notes in report).
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moed.transfer import TransferState, create_backend  # noqa: E402


def _shape(a: argparse.Namespace) -> tuple[int, ...]:
    return (a.layers, a.blocks, 2, a.block_size, a.kv_heads, a.head_dim)


def _target(conn: Any, shape: tuple[int, ...]) -> None:
    """Owns the destination region and keeps progress going (no NIXL progress thread)."""
    torch.set_num_threads(1)
    b = create_backend("nixl", "bench-target")
    kv = torch.zeros(shape, dtype=torch.bfloat16)
    b.register_kv(kv)
    conn.send(b.local_metadata())
    got = 0
    while True:
        if conn.poll(0):
            msg = conn.recv()
            if msg == "exit":
                b.close()
                return
            if msg == "count":
                conn.send(got)
        got += len(b.get_notifs())
        time.sleep(0.0002)


def _nixl_once(b: Any, src: list[int], dst: list[int]) -> float:
    t0 = time.perf_counter()
    h = b.write_blocks("t", src, dst, b"x")
    st = b.poll(h)
    while not st.terminal:
        b.get_notifs()
        st = b.poll(h)
    dt = time.perf_counter() - t0
    if st.state is not TransferState.DONE:
        raise RuntimeError(f"transfer {st}")
    return dt


def _memcpy_once(src_kv: torch.Tensor, dst_kv: torch.Tensor, src: list[int], dst: list[int],
                 contiguous: bool) -> float:
    t0 = time.perf_counter()
    if contiguous:
        n = len(src)
        dst_kv[:, dst[0]:dst[0] + n].copy_(src_kv[:, src[0]:src[0] + n])
    else:
        dst_kv[:, dst] = src_kv[:, src]
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--prompt-blocks", type=int, default=128, help="blocks per transfer")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--no-thp", action="store_true",
                    help="leave THP_MEM_ALLOC_ENABLE unset (4 KiB pages for the KV tensors)")
    ap.add_argument("--out", default="bench/results/kv_transfer.json")
    a = ap.parse_args()
    torch.set_num_threads(1)   # notes/nixl-on-cpu.md: 2 intra-op threads slow copies down here
    shape = _shape(a)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, shape), daemon=True)
    proc.start()
    b = create_backend("nixl", "bench-init")
    try:
        src_kv = torch.randn(shape).to(torch.bfloat16)
        dst_kv = torch.zeros(shape, dtype=torch.bfloat16)   # the memcpy peer's destination
        lay = b.register_kv(src_kv)
        b.add_peer("t", conn.recv(), 1)
        n = a.prompt_blocks
        g = torch.Generator().manual_seed(0)
        cases = {
            "contiguous": (list(range(n)), list(range(a.blocks - n, a.blocks)), True),
            "scattered": (torch.randperm(a.blocks, generator=g)[:n].tolist(),
                          torch.randperm(a.blocks, generator=g)[:n].tolist(), False),
        }
        nbytes = n * lay.block_bytes * a.layers
        results: dict[str, Any] = {"shape": list(shape), "block_bytes": lay.block_bytes,
                                   "prompt_blocks": n, "bytes_per_transfer": nbytes,
                                   "reps": a.reps, "cases": {},
                                   "thp": os.environ.get("THP_MEM_ALLOC_ENABLE") == "1"}
        print(f"{n} blocks x {a.layers} layers x {lay.block_bytes // 1024} KiB = "
              f"{nbytes / 2**20:.0f} MiB per transfer, {a.reps} reps (median), "
              f"THP {'on' if results['thp'] else 'off'}")
        print(f"{'case':<11} {'descs':>6} {'nixl GB/s':>10} {'memcpy GB/s':>12} {'ratio':>6}")
        for name, (src, dst, contig) in cases.items():
            _nixl_once(b, src, dst)                       # warm-up: connection, page faults
            _memcpy_once(src_kv, dst_kv, src, dst, contig)
            tn, tc = [], []
            for _ in range(a.reps):        # interleaved: load drift hits both sides alike
                tn.append(_nixl_once(b, src, dst))
                tc.append(_memcpy_once(src_kv, dst_kv, src, dst, contig))
            t_nixl, t_cpy = statistics.median(tn), statistics.median(tc)
            descs = b.write_blocks("t", src, dst).num_descs
            g_nixl, g_cpy = nbytes / t_nixl / 1e9, nbytes / t_cpy / 1e9
            results["cases"][name] = {"descs": descs, "nixl_gbps": g_nixl, "memcpy_gbps": g_cpy,
                                      "ratio": g_nixl / g_cpy, "nixl_s": t_nixl, "memcpy_s": t_cpy}
            print(f"{name:<11} {descs:>6} {g_nixl:>10.2f} {g_cpy:>12.2f} {g_nixl / g_cpy:>6.2f}")
        out = Path(a.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2))
        print(f"saved {out}")
    finally:
        b.close()
        conn.send("exit")
        proc.join(5)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    main()
