"""A layer call's misses of few rows run straight from the page cache (packread.run_direct), the
hotter of them installed into slots as they are read (policy.installs).

Why: a decode step's misses are one or two rows each. Read into a slot, a miss's bytes cross
memory three times (the page-cache copy, the slot's write, the kernel's read of the slot); run
from the page cache, once (each 32-row block packed in an L1-sized buffer and run there). On the
bench model at 30% resident that was ~120 misses a step (docs/cold-experts.md, 2026-12-06).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moed.model.cold import packread, policy

if TYPE_CHECKING:
    from moed.model.cold.store import ColdExperts


def run_misses(layer: ColdExperts, xs: torch.Tensor, ys: torch.Tensor, units: list[int], n_rows: list[int],
               start: list[int], keep: set[int], heat: list[float]) -> set[int]:
    """Units (misses of at most policy.DIRECT_ROWS rows, rows xs[start[u] : start[u] + n_rows[u]])
    run into the same rows of ys -> those it ran; the others (not all cached, a failed read, a
    file packread cannot read) are left to the slot path, whose read reports an error. Those
    hotter (counting this call) than the coldest slots that hold none of `keep` are installed
    there as they are read (policy.installs); a slot is emptied first, so one whose read failed
    holds no stale expert."""
    files, store = layer.files, layer.store
    for u in units:
        if u not in files:
            files[u] = packread.expert_files(store.index, layer.layer, store.units[u])
    units = [u for u in units if files[u] is not None]
    if not units:
        return set()
    slots = policy.installs(layer.expert_in, heat, keep, units, n_rows)
    for s in slots:
        if s >= 0:
            layer.assign(s, -1)
    ok = packread.run_direct(layer.local, [files[u] for u in units], xs, [start[u] for u in units],
                             [n_rows[u] for u in units], ys, slots)
    ran = {u for u, done in zip(units, ok) if done}     # a failed one's rows are written again by its slot
    for u, s in zip(units, slots):
        if s >= 0 and u in ran:
            layer.assign(s, u)
    store.stats.cached_reads += len(ran)
    store.stats.direct += len(ran)
    return ran
