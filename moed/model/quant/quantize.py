"""Online quantization of a plain weight at load (`model.quantization`), pure torch.

  fp8   DeepSeek-V3's format: one scale per 128x128 block, scale = amax(block) / 448, the
        weight divided by it and rounded to float8_e4m3fn (block_fp8 gives the checkpoint form)
  int8  per output channel, symmetric: scale = amax(row) / 127, round-to-nearest
  int4  group-wise along the input dim (group_size columns, default 128), symmetric:
        scale = amax(group) / 7, q = round(w / scale) clamped to [-8, 7], stored q + 8

Scales are computed in fp32 from the weight as stored (bf16 widened exactly). A block or group
of zeros gets scale 1 (its values quantize to 0 whatever the scale).
"""
from __future__ import annotations

import torch

from moed.model.quant.weight import FP8_MAX, QuantWeight, expand, pack_int4

FP8_BLOCK = (128, 128)


def _grouped_amax(w: torch.Tensor, group: int) -> torch.Tensor:
    """[..., out, in] -> amax over each group of `group` input columns: [..., out, ceil(in/group)]."""
    n = w.shape[-1]
    pad = -n % group
    a = torch.nn.functional.pad(w.abs(), (0, pad)) if pad else w.abs()
    return a.view(*a.shape[:-1], -1, group).amax(dim=-1)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def block_fp8(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint form: (float8_e4m3fn [..., out, in], scale_inv fp32 [..., ceil(out/bo), ceil(in/bi)])
    with W ~= q * scale_inv[i // bo, j // bi]."""
    bo, bi = block
    w = w.float()
    out, n = w.shape[-2:]
    rows = _grouped_amax(w, bi)                                       # [..., out, cb]
    pad = -out % bo
    if pad:
        rows = torch.nn.functional.pad(rows.transpose(-1, -2), (0, pad)).transpose(-1, -2)
    amax = rows.reshape(*rows.shape[:-2], -1, bo, rows.shape[-1]).amax(dim=-2)    # [..., rb, cb]
    scale = _safe(amax / FP8_MAX)
    full = expand(scale.repeat_interleave(bo, dim=-2)[..., :out, :], bi, n)
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def from_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> QuantWeight:
    """A block-scaled fp8 matrix as a QuantWeight: each row gets its row block's scales."""
    out = q.shape[-2]
    rows = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :out, :].contiguous()
    return QuantWeight("fp8", q.contiguous(), rows, None, block[1], q.shape[-1])


def quantize(w: torch.Tensor, fmt: str, group_size: int = 128) -> QuantWeight:
    """A plain weight [..., out, in] in the given format (see the module docstring)."""
    if fmt == "fp8":
        return from_block_fp8(*block_fp8(w), FP8_BLOCK)
    w = w.float()
    n = w.shape[-1]
    if fmt == "int8":
        scale = _safe(w.abs().amax(dim=-1, keepdim=True) / 127.0)
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return QuantWeight("int8", q, scale, None, n, n)
    if fmt == "int4":
        scale = _safe(_grouped_amax(w, group_size) / 7.0)
        q = torch.round(w / expand(scale, group_size, n)).clamp(-8, 7) + 8
        return QuantWeight("int4", pack_int4(q), scale, None, group_size, n)
    raise ValueError(f"unknown quantization {fmt!r}; expected fp8, int8 or int4")
