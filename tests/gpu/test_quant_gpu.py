"""fp8 weights on the GPU through torch._scaled_mm against the reference dequantize path (GPU only).

Tolerance: the activations are quantized to e4m3 per token and 128 columns (3 mantissa bits:
relative rounding <= 2^-4 per value); over K products with random signs the error of a dot
product grows ~sqrt(K) * 2^-4 * typical |x w|, so the outputs are compared relative to their
scale at 5% (max) and the cosine at >= 0.999."""
from __future__ import annotations

import pytest
import torch

from moed.model.quant.linear import fp8_scaled_mm, scaled_mm_serves
from moed.model.quant.quantize import quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("m,n,k", [(1, 256, 512), (7, 384, 1000), (64, 2048, 7168)])
def test_fp8_scaled_mm_close_to_the_reference(m, n, k):
    g = torch.Generator().manual_seed(0)
    w = quantize(torch.randn(n, k, generator=g) * 0.05, "fp8")
    w = type(w)(w.fmt, w.data.cuda(), w.scale.cuda(), None, w.group, w.in_features)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    if not scaled_mm_serves(x, w):
        pytest.skip("no fp8 tensor cores on this GPU (compute capability < 8.9)")
    ref = torch.nn.functional.linear(x.float(), w.dequantize(torch.float32))
    got = fp8_scaled_mm(x, w).float()
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()
    assert torch.nn.functional.cosine_similarity(got.flatten(), ref.flatten(), dim=0) >= 0.999
