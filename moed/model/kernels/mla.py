"""The native absorbed MLA attention (cpu_mla.c, in the kernels' .so) from Python.

One call per layer computes every absorbed row of a step (decode tokens, and each row of a
speculative verify chunk over its own causal history), reading the latent cache through the
block tables; each row's bits depend only on its own query and history (cpu_mla.c says why).
The caller is moed/model/attention/mla_torch.py.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from moed.model.kernels import CpuKernels

_p, _l, _i = ctypes.c_void_p, ctypes.c_long, ctypes.c_int


@functools.cache
def _fn(lib: ctypes.CDLL):
    """moed_mla_decode_bf16 with its signature declared (once per loaded library)."""
    f = lib.moed_mla_decode_bf16
    f.argtypes = [_p, _l, _l, _p, _l, _l, _l, _l, _p, _p, _p, _l, _l, _l, _l, _l, _p, _l, _l, _p, _l, _l,
                  _p, _p, ctypes.c_float, _p, _l, _i]
    f.restype = _i
    return f


def mla_decode_bf16(kernels: CpuKernels, q_nope: torch.Tensor, q_rope: torch.Tensor,
                    kv_layer: torch.Tensor, tables: torch.Tensor, rows: torch.Tensor,
                    seqs: torch.Tensor, lens: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
                    scale: float, out: torch.Tensor) -> None:
    """Absorbed attention of query rows `rows` [R] (int64 token rows of q_nope [T, H, nope] and
    q_rope [T, H, rope], bf16, dims contiguous) into out [T, H, vd] bf16 (contiguous; only those
    rows written). Row i attends to the first lens[i] tokens of sequence seqs[i], whose block
    table is tables[seqs[i]] ([S, max_blocks] int64); kv_layer: one layer of the mla cache
    [num_blocks, bs, r + rope] bf16; w_uk [H, nope, r] and w_uv [H, vd, r] fp32."""
    if q_nope.stride(-1) != 1:
        q_nope = q_nope.contiguous()
    if q_rope.stride(-1) != 1:
        q_rope = q_rope.contiguous()
    t, h, nope = q_nope.shape
    num_blocks, bs, width = kv_layer.shape
    r, vd = w_uk.shape[2], w_uv.shape[1]
    if (kv_layer.dtype != torch.bfloat16 or q_nope.dtype != torch.bfloat16 or w_uk.dtype != torch.float32
            or w_uv.dtype != torch.float32 or not kv_layer.is_contiguous() or not out.is_contiguous()
            or width != r + q_rope.shape[2] or out.shape != (t, h, vd)):
        raise ValueError(f"mla_decode_bf16: q {tuple(q_nope.shape)} {q_nope.dtype}, cache "
                         f"{tuple(kv_layer.shape)} {kv_layer.dtype}, w_uk {tuple(w_uk.shape)} {w_uk.dtype}, "
                         f"out {tuple(out.shape)}")
    w_uk, w_uv, tables = w_uk.contiguous(), w_uv.contiguous(), tables.contiguous()
    rc = _fn(kernels.lib)(
        q_nope.data_ptr(), q_nope.stride(0), q_nope.stride(1), q_rope.data_ptr(), q_rope.stride(0),
        q_rope.stride(1), t, rows.shape[0], rows.data_ptr(), seqs.data_ptr(), lens.data_ptr(), h, nope,
        q_rope.shape[2], r, vd, kv_layer.data_ptr(), num_blocks, bs, tables.data_ptr(), tables.shape[0],
        tables.shape[1], w_uk.data_ptr(), w_uv.data_ptr(), scale, out.data_ptr(), out.stride(0),
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError("moed_mla_decode_bf16: " + ("out of memory" if rc == -1 else "bad row or block id"))
