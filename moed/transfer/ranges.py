"""Pure helpers: block ids → merged runs → byte ranges. No torch, no NIXL.

A KV region is `[num_layers, num_blocks, ...]`, so block b of layer l starts at
`l * layer_stride + b * block_bytes`, and a run of n consecutive blocks is one byte range.
Merging runs where *both* source and destination ids are consecutive halves the descriptor
count for contiguous allocations and roughly doubles small-block throughput (notes/nixl-on-cpu).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def merge_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pair src[i] → dst[i] and merge consecutive pairs into (src_start, dst_start, count).

    Order is kept: a run only grows while src and dst both advance by exactly one.
    >>> merge_runs([4, 5, 6, 9], [0, 1, 2, 3])
    [(4, 0, 3), (9, 3, 1)]
    """
    if len(src) != len(dst):
        raise ValueError(f"src has {len(src)} block ids but dst has {len(dst)}")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((int(s), int(d), 1))
    return runs


def check_ids(ids: Sequence[int], num_blocks: int, side: str) -> None:
    """Every id in [0, num_blocks) and no id twice (a duplicate destination is a race)."""
    if not ids:
        return
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= num_blocks:
        raise ValueError(f"{side} block id out of range [0, {num_blocks}): {lo if lo < 0 else hi}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"{side} block ids contain duplicates")


def byte_ranges(runs: Sequence[tuple[int, int, int]], num_layers: int, base: int,
                layer_stride: int, block_bytes: int, side: int) -> np.ndarray:
    """(num_layers * len(runs), 2) uint64 array of (address, length), layer-major.

    side=0 uses each run's source start, side=1 its destination start; both sides of a transfer
    get the same row order, so row i of the local list pairs with row i of the remote list.
    """
    if not runs:
        return np.zeros((0, 2), dtype=np.uint64)
    r = np.asarray(runs, dtype=np.int64)
    starts, counts = r[:, side], r[:, 2]
    layer_off = np.arange(num_layers, dtype=np.int64)[:, None] * layer_stride
    addr = base + layer_off + (starts * block_bytes)[None, :]
    length = np.broadcast_to(counts * block_bytes, addr.shape)
    return np.stack([addr.reshape(-1), length.reshape(-1)], axis=1).astype(np.uint64)
