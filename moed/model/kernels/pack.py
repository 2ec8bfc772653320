"""The kernels' weight layout (CpuKernels.pack, "P32") written on the calling thread alone.

The cold-expert store packs an expert each time it reads one into a packed slot (a miss) or
stages one (a read-ahead, a prefetch). torch's copy_ splits that blocked transpose over its
OpenMP team, and the team waits for any core another thread holds (the store's reader
threads, other processes): one expert of the bench model took 1230 us at 2 threads under
load 2.7 against 85-112 us on one thread (docs/cold-experts.md, coldmiss). Same bytes as
CpuKernels.pack.
"""
from __future__ import annotations

import numpy as np
import torch

from moed.model.kernels import BLOCK, CpuKernels


def pack_into(w: torch.Tensor, dst: torch.Tensor) -> None:
    """CpuKernels.pack(w) written into dst ([N/32, K/2, 32, 2]) for bf16 w [N, K], N a multiple
    of BLOCK (no padding rows). Each bf16 pair moves as one int32 (~4x faster than a copy of a
    2-element inner dim); numpy's copy runs on the calling thread only."""
    n, k = w.shape
    src = w.contiguous().view(torch.int32).reshape(n // BLOCK, BLOCK, k // 2)
    out = dst.view(torch.int32).view(n // BLOCK, k // 2, BLOCK)
    np.copyto(out.numpy(), src.numpy().transpose(0, 2, 1))


def pack_copy(w: torch.Tensor) -> torch.Tensor:
    """CpuKernels.pack(w) for bf16 w [N, K]: by pack_into where no padding rows are needed."""
    n, k = w.shape
    if n % BLOCK or k % 2:
        return CpuKernels.pack(w)
    out = w.new_empty((n // BLOCK, k // 2, BLOCK, 2))
    pack_into(w, out)
    return out
