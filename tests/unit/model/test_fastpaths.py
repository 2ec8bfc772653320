"""CPU bf16 fast paths agree with the plain fp32 math within bf16 rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moed.model import layers
from moed.model.layers import Linear, can_pack

needs_pack = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                reason="oneDNN bf16 kernels unavailable on this CPU")


@needs_pack
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_linear_kernels_agree(rows):
    # rows <= GEMV_ROWS take the ATen gemv (oneDNN off for the call), more rows the packed weight.
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float())
    for lin in (Linear(w, b, pack=True), Linear(w, b)):
        y = lin(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 96)
        assert torch.allclose(y.float(), ref, atol=3e-2, rtol=1e-2)
    assert torch._C._get_mkldnn_enabled()            # the gemv switch is restored


def test_gemv_restores_the_onednn_switch_on_error():
    with pytest.raises(RuntimeError):
        layers.gemv(torch.ones(1, 3), torch.ones(4, 5))
    assert torch._C._get_mkldnn_enabled()
