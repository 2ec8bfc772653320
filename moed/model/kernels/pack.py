"""The kernels' weight layout (CpuKernels.pack, "P32") written on the calling thread alone, a
round of cold-expert misses read from the page cache and packed by the OpenMP team (read_pack),
and few-row misses run by the team straight from the page cache (read_experts).

The cold-expert store packs an expert each time it reads one into a packed slot (a miss) or
stages one (a read-ahead, a prefetch). torch's copy_ splits that blocked transpose over its
OpenMP team, and the team waits for any core another thread holds (the store's reader
threads, other processes): one expert of the bench model took 1230 us at 2 threads under
load 2.7 against 85-112 us on one thread (docs/cold-experts.md, coldmiss); the kernels' C
transpose (moed_pack_p32) takes ~23 us where numpy's strided copy takes ~127 (AVX2 EPYC, 2026-12-06).
Same bytes as CpuKernels.pack.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from moed.model.kernels import BLOCK, CpuKernels


def pack_into(w: torch.Tensor, dst: torch.Tensor, kernels: CpuKernels | None = None) -> None:
    """CpuKernels.pack(w) written into dst ([N/32, K/2, 32, 2]) for bf16 w [N, K], N a multiple
    of BLOCK (no padding rows): by the kernels' C transpose when given (~5x faster), else by
    numpy, each bf16 pair moved as one int32 (~4x faster than a copy of a 2-element inner dim).
    Either runs on the calling thread only."""
    n, k = w.shape
    if kernels is not None:
        w = w.contiguous()
        if w.dtype != torch.bfloat16 or n % BLOCK or k % 2 or dst.dtype != torch.bfloat16 \
                or tuple(dst.shape) != (n // BLOCK, k // 2, BLOCK, 2) or not dst.is_contiguous():
            raise ValueError(f"pack_into: bf16 [N, K] (N % {BLOCK} == 0, K even) into its contiguous "
                             f"P32 shape, got {w.dtype} {tuple(w.shape)} -> {dst.dtype} {tuple(dst.shape)}")
        kernels.lib.moed_pack_p32(w.data_ptr(), n // BLOCK, k // 2, dst.data_ptr())
        return
    src = w.contiguous().view(torch.int32).reshape(n // BLOCK, BLOCK, k // 2)
    out = dst.view(torch.int32).view(n // BLOCK, k // 2, BLOCK)
    np.copyto(out.numpy(), src.numpy().transpose(0, 2, 1))


def pack_copy(w: torch.Tensor, kernels: CpuKernels | None = None) -> torch.Tensor:
    """CpuKernels.pack(w) for bf16 w [N, K]: by pack_into where no padding rows are needed."""
    n, k = w.shape
    if n % BLOCK or k % 2:
        return CpuKernels.pack(w)
    out = w.new_empty((n // BLOCK, k // 2, BLOCK, 2))
    pack_into(w, out, kernels)
    return out


# One plain bf16 matrix of whole 32-row blocks in a file, to be packed into a slot: (fd, byte
# offset in the file, 32-row blocks (N / 32), bf16 pairs a row (K / 2), address of its first
# packed block). A tuple: a cold step builds ~300 of them.
PackRead = tuple[int, int, int, int, int]


def read_pack(kernels: CpuKernels, reads: list[PackRead]) -> list[bool]:
    """Each read from the page cache and packed into its slot by the kernels' OpenMP team (all
    of torch's threads) in one call (moed_read_pack_p32) -> whether it was (False: not all
    cached, or the read failed; then nothing of that chunk was written, and the caller reads it
    the blocking way, which reports an error)."""
    n = len(reads)
    fd, off, blocks, pairs, dst = zip(*reads) if reads else ((),) * 5
    status = (ctypes.c_int * n)()
    rc = kernels.lib.moed_read_pack_p32(
        n, (ctypes.c_int * n)(*fd), (ctypes.c_int64 * n)(*off), (ctypes.c_int64 * n)(*blocks),
        (ctypes.c_int64 * n)(*pairs), (ctypes.c_uint64 * n)(*dst), status, torch.get_num_threads())
    return [rc == 0 and not st for st in status]


# One expert's three plain bf16 matrices in files, for read_experts: (fd, byte offset) of its
# gate [I, H], up [I, H] and down [H, I], in that order.
ExpertFiles = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


def read_experts(kernels: CpuKernels, experts: list[ExpertFiles], xs: torch.Tensor, first: list[int],
                 counts: list[int], intermediate: int, out: torch.Tensor,
                 dsts: list[tuple[int, int, int] | None] | None = None) -> list[bool]:
    """Experts run straight from the page cache (moed_read_experts_p32): expert i's rows
    xs[first[i] : first[i] + counts[i]] (bf16 [R, H]) -> the same rows of out, the bits a slot
    holding it gives -> whether each expert's were (False where the page cache did not hold all
    of its bytes or a read failed: its rows of out are not its output). dsts[i], where given:
    the addresses of a packed slot's gate, up and down blocks that expert i is installed into as
    it is read (whole only where it was computed)."""
    n, (r, h) = len(experts), xs.shape
    if xs.dtype != torch.bfloat16 or not xs.is_contiguous() or out.shape != xs.shape or out.dtype != xs.dtype \
            or not out.is_contiguous() or len(first) != n or len(counts) != n or h % BLOCK or intermediate % BLOCK \
            or any(f < 0 or c < 0 or f + c > r for f, c in zip(first, counts)):
        raise ValueError(f"read_experts: contiguous bf16 rows [R, H] and out alike, H and I multiples of {BLOCK}, "
                         f"each expert's rows inside; got {xs.dtype} {tuple(xs.shape)} -> {tuple(out.shape)}, "
                         f"I {intermediate}, first {first}, counts {counts}")
    flat = [m for e in experts for m in e]
    to = [a for d in (dsts or [None] * n) for a in (d or (0, 0, 0))]
    status = (ctypes.c_int * n)()
    rc = kernels.lib.moed_read_experts_p32(
        n, (ctypes.c_int * (3 * n))(*(f for f, _ in flat)), (ctypes.c_int64 * (3 * n))(*(o for _, o in flat)),
        (ctypes.c_uint64 * (3 * n))(*to), h, intermediate, xs.data_ptr(), (ctypes.c_int64 * n)(*first),
        (ctypes.c_int64 * n)(*counts), out.data_ptr(), status, torch.get_num_threads())
    return [rc == 0 and not st for st in status]
