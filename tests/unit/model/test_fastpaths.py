"""CPU bf16 fast paths agree with the plain fp32 math within bf16 rounding."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moed.model import layers
from moed.model.context import can_pack
from moed.model.layers import Linear

needs_pack = pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.bfloat16),
                                reason="oneDNN bf16 kernels unavailable on this CPU")


@needs_pack
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("out_features", [96, layers.GEMV_2ROW_MAX_NUMEL // 64 + 1])
def test_linear_kernels_agree(rows, out_features):
    # 1 row (2 for small weights) takes the ATen gemv with oneDNN off, more the packed weight.
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(out_features, 64, generator=g) * 0.1).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    ref = F.linear(x.float(), w.float(), b.float())
    packed = Linear(w, b, pack=True)
    assert packed.gemv_rows == (2 if out_features == 96 else 1)
    for lin in (packed, Linear(w, b)):
        y = lin(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, out_features)
        assert torch.allclose(y.float(), ref, atol=3e-2, rtol=1e-2)
    assert torch._C._get_mkldnn_enabled()            # the gemv switch is restored


def test_gemv_restores_the_onednn_switch_on_error():
    with pytest.raises(RuntimeError):
        layers.gemv(torch.ones(1, 3), torch.ones(4, 5))
    assert torch._C._get_mkldnn_enabled()


def test_gemv_from_many_threads_leaves_onednn_on():
    """The switch is process-global: concurrent save/restore must not leave oneDNN off."""
    import threading

    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16)
    errors: list[BaseException] = []

    def hammer() -> None:
        try:
            for _ in range(300):
                layers.gemv(x, w)
        except BaseException as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and torch._C._get_mkldnn_enabled()


def test_without_onednn_bf16_the_native_kernels_serve_every_row_count(monkeypatch):
    """An AVX2 CPU (or ONEDNN_MAX_CPU_ISA=AVX2) has no oneDNN bf16: the kernels must not go
    off with it (they once did, and moed ran torch's bf16 path at 0.4-0.6x llama.cpp)."""
    import shutil

    from moed.model import context as ctx_mod
    from moed.model.context import ComputeContext
    from moed.model.kernels import cpu_flags_ok, cpu_kernels

    if not (cpu_flags_ok() and (shutil.which("cc") or shutil.which("gcc"))) or cpu_kernels() is None:
        pytest.skip("CPU runs no native kernel variant, or no C compiler")
    monkeypatch.setattr(ctx_mod, "can_pack", lambda d, t: False)
    ctx = ComputeContext.build("cpu", torch.bfloat16)
    assert not ctx.pack and ctx.kernels is not None
    k = ctx.kernels

    def no_race(n: int, kk: int):
        raise AssertionError("raced against oneDNN, which cannot run here")
    monkeypatch.setattr(k, "choose", no_race)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    lin = Linear(w, None, ctx.pack, ctx.for_weight(w))
    assert lin.kpacked is not None and lin.packed is None and lin.choice is None
    for rows in (1, 8, 600):           # decode, a batch, the open (prefill) class
        x = torch.randn(rows, 64, generator=g).bfloat16()
        assert torch.equal(lin(x), k.linear_bf16(x, k.pack(w), 96, None))
        assert not lin.uses_onednn(rows)
