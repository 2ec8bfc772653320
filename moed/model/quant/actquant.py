"""int8 activations (model.quantization_activations = "int8"): the torch reference of cpu_qdot.c's
arithmetic, bit for bit (its header states it; tests/unit/model/test_quant_qdot.py holds the
kernels to it).

Each activation row is quantized per weight group (symmetric, round half to even, |x_q| <= 127),
the integer products of a group summed exactly in 16 lanes (lane l: bytes 4l..4l+3 of each
64-byte chunk), each lane's sum scaled once per group by (x scale * weight scale) into an fp32
accumulator, and the 16 lanes summed in halves. Slow (a loop over lanes and groups): tests and
docs only.
"""
from __future__ import annotations

import torch

from moed.model.quant.weight import QuantWeight

ACTIVATIONS = ("none", "int8")      # model.quantization_activations
ACT_FORMATS = ("int8", "int4")      # weight formats the integer path serves


def quantize_rows(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (fp32) -> (codes int8 [R, K], scales fp32 [R, groups]) per `group` columns."""
    r, k = x.shape
    codes = torch.empty((r, k), dtype=torch.int8)
    scales = []
    for k0 in range(0, k, group):
        xs = x[:, k0:k0 + group]
        amax = xs.abs().amax(1, keepdim=True)
        inv = torch.where(amax > 0, torch.div(torch.full_like(amax, 127.0), amax), torch.zeros_like(amax))
        codes[:, k0:k0 + group] = torch.round(xs * inv).clamp(-127, 127).to(torch.int8)
        scales.append(torch.div(amax, torch.full_like(amax, 127.0)))
    return codes, torch.cat(scales, 1)


def _lanes(fmt: str, width: int) -> torch.Tensor:
    """The lane (0..15) of each column of a group `width` wide (cpu_qdot.c's chunk layout)."""
    p = torch.arange(width)
    c = p % 64
    pos = c // 2 + (c % 2) * 32 if fmt == "int4" else c
    return pos // 4


def _codes(w: QuantWeight) -> torch.Tensor:
    """w's integer codes [N, K] as int64 (int4 nibbles unpacked), zero points not subtracted."""
    if w.fmt == "int8":
        return w.data.to(torch.int64)
    d = w.data.to(torch.int64)
    return torch.stack((d & 15, d >> 4), -1).reshape(d.shape[0], -1)[:, :w.in_features]


def qdot_reference(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [R, K] (bf16 or fp32) @ w^T (+ bias fp32) with int8 activations -> [R, N] in x's dtype:
    cpu_qdot.c's numbers exactly. w: a 2-D int8 or int4 QuantWeight."""
    if w.fmt not in ACT_FORMATS:
        raise ValueError(f"int8 activations serve {' and '.join(ACT_FORMATS)} weights, not {w.fmt}")
    k = w.in_features
    g = min(w.group, k)
    xq, sx = quantize_rows(x.float(), g)
    q = _codes(w)
    acc = torch.zeros((x.shape[0], q.shape[0], 16), dtype=torch.float32)
    for gi, k0 in enumerate(range(0, k, g)):
        cols = slice(k0, min(k0 + g, k))
        if w.zero is not None:
            z = w.zero[:, gi].to(torch.int64) if w.fmt == "int4" else w.zero[:, gi].view(torch.int8).to(torch.int64)
        else:
            z = torch.full((q.shape[0],), 8 if w.fmt == "int4" else 0, dtype=torch.int64)
        wq = (q[:, cols] - z[:, None]).double()      # products and sums exact in float64
        xg = xq[:, cols].double()
        lanes = _lanes(w.fmt, cols.stop - cols.start)
        ints = torch.stack([xg[:, lanes == i] @ wq[:, lanes == i].T for i in range(16)], -1)
        s = sx[:, gi, None] * w.scale[:, gi][None, :]           # fp32, one rounding
        acc = acc + ints.float() * s[..., None]
    for half in (8, 4, 2, 1):
        acc = acc[..., :half] + acc[..., half:2 * half]
    y = acc[..., 0]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
