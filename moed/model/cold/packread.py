"""A round's misses read from the page cache and packed into their slots by the kernels' OpenMP
team, in one call (kernels/pack.py read_pack, cpu_quant.c moed_read_pack_p32).

Why: a read from the page cache is a memory copy and the pack into the slot another; the step
thread did both alone, one expert after another, while the other cores waited (~200 us a miss
of the bench model's expert with the store's Python: ~20 ms of a step at 30% resident;
docs/cold-experts.md). The team splits the round's matrices into ~256 KB chunks, each read with
RWF_NOWAIT (never waiting for the disk) into a per-thread buffer and packed from there.

A miss of few rows (a decode step's: policy.DIRECT_ROWS) need not be read into a slot at all
(run_direct): each 32-row block is read, packed into an L1-sized buffer and run there, one pass
over the expert's bytes in memory where a slot costs three (the copy, the slot's write, the
kernel's read of it); policy.installs says which of them are also streamed into a slot as they go.

It serves packed bf16 slots read from bf16 files whose matrices are whole 32-row blocks (gate
and up I rows each, down H rows); the store reads anything else itself. A miss whose bytes the
page cache did not hold, or whose read failed, is left to the store's blocking read, which also
gives a failed read its error (store.py read_slots).
"""
from __future__ import annotations

import os

import torch

from moed.model.cold.reader import ExpertIndex
from moed.model.kernels import BLOCK
from moed.model.kernels.pack import ExpertFiles, PackRead, read_experts, read_pack
from moed.model.moe import LocalExperts


def serves(index: ExpertIndex, local: LocalExperts) -> bool:
    """Whether read_packed can read this layer's misses: packed contiguous bf16 slots, whole
    32-row blocks, a bf16 file (its first expert's matrices; read_packed checks each)."""
    s = index.spec
    layer = next(i for i in range(s.num_layers) if i not in s.dense_layers)
    return local.gate_up_p is not None and local.down_p is not None and local.kernels is not None \
        and local.quant is None and local.gate_up_p.is_contiguous() and local.down_p.is_contiguous() \
        and index.dtype == torch.bfloat16 and hasattr(os, "RWF_NOWAIT") \
        and s.moe_intermediate_size % BLOCK == 0 and s.hidden_size % BLOCK == 0 \
        and all(index.where[(layer, 0, r)].dtype == torch.bfloat16 for r in ("gate", "up", "down"))


def read_packed(index: ExpertIndex, local: LocalExperts, layer: int,
                reads: list[tuple[int, int]]) -> set[tuple[int, int]] | None:
    """reads (expert, slot) into their emptied packed slots -> the reads left for the blocking
    read (not cached, failed), or None where a file's matrix is not plain bf16 of the spec's
    shape (the store reads them all itself). No reads: no call (no OpenMP region)."""
    if not reads:
        return set()
    i, h = index.spec.moe_intermediate_size, index.spec.hidden_size
    gu0, gus = local.gate_up_p.data_ptr(), local.gate_up_p.stride(0) * 2     # bytes a slot
    dn0, dns = local.down_p.data_ptr(), local.down_p.stride(0) * 2
    plan: list[PackRead] = []
    for e, slot in reads:
        files = expert_files(index, layer, e)
        if files is None:
            return None
        gate_up, down = gu0 + slot * gus, dn0 + slot * dns
        for (fd, off), dst, (n, k) in zip(files, (gate_up, gate_up + i * h * 2, down), ((i, h), (i, h), (h, i))):
            plan.append((fd, off, n // BLOCK, k // 2, dst))
    ok = read_pack(local.kernels, plan)
    done = [all(ok[3 * j:3 * j + 3]) for j in range(len(reads))]
    for (_, slot), whole in zip(reads, done):
        if whole:
            local.mark_stale(slot)      # as fill_slot: its oneDNN copies, if any, are old
    return {r for r, whole in zip(reads, done) if not whole}


def expert_files(index: ExpertIndex, layer: int, expert: int) -> ExpertFiles | None:
    """(fd, byte offset) of an expert's gate, up and down in its files, or None where one is not
    plain bf16 of the spec's shape (run_direct cannot read it)."""
    i, h = index.spec.moe_intermediate_size, index.spec.hidden_size
    where = []
    for role, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        ext = index.where[(layer, expert, role)]
        if ext.dtype != torch.bfloat16 or ext.shape != shape:
            return None
        where.append((index.fds[ext.file], ext.offset))
    return where[0], where[1], where[2]


def run_direct(local: LocalExperts, files: list[ExpertFiles], xs: torch.Tensor, first: list[int],
               counts: list[int], out: torch.Tensor, slots: list[int]) -> list[bool]:
    """Non-resident experts (files: expert_files) run straight from the page cache
    (kernels/pack.py read_experts): expert i's rows xs[first[i] : first[i] + counts[i]] into the
    same rows of out -> whether each expert's were computed (False where the page cache lacked
    its bytes or a read failed: the caller runs it through a slot). slots[i] >= 0: expert i is
    installed into that (emptied) slot as it is read, whole where it was computed."""
    i, h = local.intermediate, xs.shape[1]
    gu0, gus = local.gate_up_p.data_ptr(), local.gate_up_p.stride(0) * 2     # bytes a slot
    dn0, dns = local.down_p.data_ptr(), local.down_p.stride(0) * 2
    dsts = [None if s < 0 else (gu0 + s * gus, gu0 + s * gus + i * h * 2, dn0 + s * dns) for s in slots]
    ok = read_experts(local.kernels, files, xs, first, counts, i, out, dsts)
    for s, whole in zip(slots, ok):
        if s >= 0 and whole:
            local.mark_stale(s)         # as fill_slot: its oneDNN copies, if any, are old
    return ok
