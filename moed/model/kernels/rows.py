"""The cold-expert executor's row bookkeeping in one C call each (cpu_bf16.c): a layer call's
rows grouped by unit (moed_group_rows_bf16), an expert call over rows where the caller has them
(moed_experts_rows_bf16) and the combine of each token's k outputs (moed_combine_rows_bf16).
The layer call ran ~10 torch ops around its kernel calls for these (~0.15 ms a call on a 2-core
EPYC, 16 calls a decode step). The same bits and indices as the torch ops they replace
(tests/unit/model/test_kernel_rows.py).
"""
from __future__ import annotations

import ctypes

import torch

from moed.model.kernels import CpuKernels

_p, _l, _i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


def _fn(kernels: CpuKernels, name: str, argtypes: list) -> ctypes._CFuncPtr:
    fn = getattr(kernels.lib, name)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = argtypes, _i
    return fn


def experts_rows(kernels: CpuKernels, xs: torch.Tensor, rows: list[int], counts: list[int],
                 gate_up: torch.Tensor, down: torch.Tensor, intermediate: int, out: torch.Tensor) -> None:
    """CpuKernels.experts_bf16 of the rows xs[rows] (grouped by slot: counts[e] rows of slot e, in
    slot order) written to out[rows]: no gather into slot order, no scatter back. xs, out
    contiguous bf16 [R, H]; rows distinct."""
    r, h = xs.shape
    if xs.dtype != torch.bfloat16 or out.dtype != xs.dtype or out.shape != xs.shape or not xs.is_contiguous() \
            or not out.is_contiguous() or sum(counts) != len(rows) or len(counts) != gate_up.shape[0] \
            or any(not 0 <= i < r for i in rows):
        raise ValueError(f"experts_rows: contiguous bf16 xs and out alike, rows inside, one count a slot; got "
                         f"{xs.dtype} {tuple(xs.shape)} -> {tuple(out.shape)}, {len(rows)} rows, counts {counts}")
    n = len(rows)
    fn = _fn(kernels, "moed_experts_rows_bf16", [_p, _p, _l, _l, _p, _p, _p, _l, _l, _p, _i])
    rc = fn(xs.data_ptr(), (ctypes.c_int64 * n)(*rows), n, h, (ctypes.c_int64 * len(counts))(*counts),
            gate_up.data_ptr(), down.data_ptr(), gate_up.shape[0], intermediate, out.data_ptr(),
            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("moed_experts_rows_bf16: " + ("out of memory" if rc == -1 else "row counts do not add up"))


def group_rows(kernels: CpuKernels, phys: torch.Tensor, x: torch.Tensor,
               units: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer call's routed rows grouped by unit, in one C call: phys [T, k] (int64, each in
    [0, units)) and x [T, H] (contiguous bf16) -> (order: a stable argsort of phys's flat ids,
    per-unit row counts [units], x[order // k]), what ColdExecutor computed in torch."""
    t, k = phys.shape
    h = x.shape[1]
    p = phys.contiguous()
    if p.dtype != torch.long or x.dtype != torch.bfloat16 or not x.is_contiguous() or x.shape[0] != t:
        raise ValueError(f"group_rows: int64 ids [T, k] and contiguous bf16 x [T, H], got {p.dtype} "
                         f"{tuple(p.shape)}, {x.dtype} {tuple(x.shape)}")
    order, count = torch.empty(t * k, dtype=torch.long), torch.empty(units, dtype=torch.long)
    xs = x.new_empty((t * k, h))
    fn = _fn(kernels, "moed_group_rows_bf16", [_p, _l, _l, _l, _p, _l, _p, _p, _p])
    rc = fn(p.data_ptr(), t, k, units, x.data_ptr(), h, order.data_ptr(), count.data_ptr(), xs.data_ptr())
    if rc != 0:
        raise ValueError("group_rows: an expert id outside the layer's units" if rc == -2 else "group_rows: out of memory")
    return order, count, xs


def serves_combine(ys: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether combine_rows computes executor.combine_sorted's bits for these (bf16 outputs,
    bf16 or fp32 weights, on the CPU)."""
    return ys.dtype == torch.bfloat16 and weights.dtype in (torch.bfloat16, torch.float32) \
        and ys.device.type == "cpu" and ys.is_contiguous()


def combine_rows(kernels: CpuKernels, ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """executor.combine_sorted(ys, order, weights, ...) for the fused order (each token's weighted
    outputs summed from a zero in fp32 in row order, rounded once), in one C call: ys [T * k, H]
    in expert order, order [T * k] (row i is choice order[i]), weights [T, k] (serves_combine)."""
    t, k = weights.shape
    h = ys.shape[1]
    order = order.contiguous()
    if order.dtype != torch.long or order.numel() != t * k or ys.shape[0] != t * k:
        raise ValueError(f"combine_rows: {t * k} rows and an int64 order, got {tuple(ys.shape)}, {order.dtype}")
    w = weights.reshape(-1).float().contiguous()
    out = ys.new_empty((t, h))
    fn = _fn(kernels, "moed_combine_rows_bf16", [_p, _p, _p, _l, _l, _l, _i, _p, _i])
    if fn(ys.data_ptr(), order.data_ptr(), w.data_ptr(), t, k, h, int(weights.dtype == torch.bfloat16),
          out.data_ptr(), torch.get_num_threads()) != 0:
        raise RuntimeError("moed_combine_rows_bf16: out of memory")
    return out
