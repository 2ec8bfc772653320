"""The reference matmul of a QuantWeight: dequantize the layer's weight to the activation dtype,
then F.linear. Runs every format on any CPU (and GPU) with torch alone; its numbers are exactly
the dequantized weight's (fp32: the same as transformers on those weights). Native kernels
(the next issue) replace it where they win and must equal it.

Memory: one layer's plain weight exists only during its call (an expert's [2I, H], an attention
projection), so resident memory stays the quantized size.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moed.model.quant.weight import QuantWeight


def qlinear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w.dequantize(x.dtype), bias)
