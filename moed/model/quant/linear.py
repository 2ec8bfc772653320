"""The reference matmul of a QuantWeight: dequantize the layer's weight to the activation dtype,
then F.linear. Runs every format on any CPU (and GPU) with torch alone; its numbers are exactly
the dequantized weight's (fp32: the same as transformers on those weights). Native kernels
(the next issue) replace it where they win and must equal it.

On CUDA, fp8 weights take torch._scaled_mm instead (fp8_scaled_mm below: activations quantized
per token and group, DeepSeek's dynamic scheme), where the GPU has fp8 tensor cores.

Memory: one layer's plain weight exists only during its call (an expert's [2I, H], an attention
projection), so resident memory stays the quantized size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moed.model.quant.weight import QuantWeight


def qlinear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.is_cuda and scaled_mm_serves(x, w):
        return fp8_scaled_mm(x, w, bias)
    return F.linear(x, w.dequantize(x.dtype), bias)


# ---- GPU: fp8 weights through torch._scaled_mm ---------------------------------------------

def scaled_mm_serves(x: torch.Tensor, w: QuantWeight) -> bool:
    """fp8 tensor cores (compute capability >= 8.9) for an fp8 weight whose groups and output
    rows are the sizes cuBLASLt takes (multiples of 16)."""
    if w.fmt != "fp8" or not x.is_cuda or w.group % 16 or w.data.shape[-2] % 16:
        return False
    return torch.cuda.get_device_capability(x.device) >= (8, 9)


def fp8_scaled_mm(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T as DeepSeek's `activation_scheme: dynamic` means it: x quantized per token
    and per group of w.group columns to float8_e4m3fn (amax / 448), then per group one
    torch._scaled_mm with row-wise scales (the token's, the weight row's), summed in fp32.
    W8A8 numerics: close to the reference path (the activations' rounding adds ~2^-4 relative
    per product), not equal; tests/gpu/test_quant_gpu.py states the tolerance."""
    m, k = x.shape
    if m == 1:      # cuBLASLt refuses one-row row-wise scaling (CUBLAS_STATUS_NOT_SUPPORTED, H200)
        return fp8_scaled_mm(x.repeat(2, 1), w, bias)[:1]
    g, n = w.group, w.data.shape[-2]
    groups = -(-k // g)
    xf = x.float()
    if groups * g != k:         # the weight's last group is partial: pad both with zeros
        xf = F.pad(xf, (0, groups * g - k))
    xg = xf.view(m, groups, g)
    xs = (xg.abs().amax(-1) / 448.0).clamp(min=1e-12)                        # [M, G]
    xq = (xg / xs.unsqueeze(-1)).to(torch.float8_e4m3fn).view(m, groups * g)
    wq = w.data if groups * g == k else F.pad(w.data.view(torch.uint8), (0, groups * g - k)).view(torch.float8_e4m3fn)
    out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    for b in range(groups):
        cols = slice(b * g, (b + 1) * g)
        out += torch._scaled_mm(xq[:, cols], wq[:, cols].t(), scale_a=xs[:, b:b + 1].contiguous(),
                                scale_b=w.scale[:, b].view(1, n).contiguous(), out_dtype=torch.bfloat16).float()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
