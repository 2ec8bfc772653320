"""Quantized prefill (many rows): moed_qlinear_blocked and moed_moe_q's blocked mode
(cpu_quant.c via kernels/quant.py), each weight block dequantized once per call into the bf16
kernel's packed layout. Against the reference path (QuantWeight.dequantize(bfloat16), then
F.linear), on every kernel variant this CPU runs; the variants bitwise equal; the thread count
changes no bits; the MoE layer bitwise equal to the per-expert path; and at engine level, that a
long quantized bf16 prompt takes these kernels.

Tolerance (stated, and why): the blocked kernel multiplies the very bf16 weights the reference
does (checked exactly below with one-hot inputs: each output is then one weight) by the same bf16
inputs, sums the exact products in fp32 and rounds once, so it and the reference differ only by
fp32 summation order: each within gamma_K * sum_k |x_k w_k| (gamma_K = K * 2^-24) of the exact
sum before its one rounding to bf16 (half an ulp, 2^-8 relative), hence within one bf16 ulp of
the larger plus 2 gamma_K sum_k |x_k w_k| of each other.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moed.model import kernels as K
from moed.model import layers as layers_mod
from moed.model.executor import Routing
from moed.model.kernels import quant as kq
from moed.model.layers import Linear
from moed.model.moe import LocalExperts
from moed.model.quant.linear import qlinear as reference
from moed.model.quant.quantize import quantize
from moed.model.quant.weight import QuantWeight

from conftest import isa_pair_params, isa_params     # tests/unit/model/conftest.py
from torch_threads import threads   # tests/unit/model/torch_threads.py

CASES = [  # fmt, asym, (N, K), group: partial blocks of 32 rows, scalar column tails
    ("int8", False, (70, 232), 232),        # one group per row; K % 16 = 8
    ("int8", True, (33, 256), 32),
    ("int4", False, (70, 208), 32),         # K % 32 = 16
    ("int4", True, (40, 256), 64),
    ("int4", False, (48, 200), 200),        # one group a row; K / 2 % 16 = 4 (the nibble table's tail)
    ("fp8", False, (70, 256), 128),
]
IDS = [f"{f}{'-asym' if a else ''}-{n}x{k}" for f, a, (n, k), _ in CASES]


def _weight(fmt: str, asym: bool, n: int, k: int, group: int, seed: int = 0) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    w = quantize(torch.randn(n, k, generator=g) * 0.1, fmt, group)
    if not asym:
        return w
    zero = torch.randint(0, 16, w.scale.shape, generator=g, dtype=torch.uint8) if fmt == "int4" else \
        torch.randint(-20, 20, w.scale.shape, generator=g, dtype=torch.int8)
    return QuantWeight(w.fmt, w.data, w.scale, zero, w.group, w.in_features)


def _within(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """The module docstring's bound: one bf16 ulp of the larger + 2 gamma_K sum |x w|."""
    ulp = torch.maximum(got.float().abs(), want.float().abs()) * 2.0 ** -7
    bound = ulp + 2 * x.shape[1] * 2.0 ** -24 * (x.float().abs() @ w.float().abs().T)
    return bool(((got.float() - want.float()).abs() <= bound).all())


@pytest.mark.parametrize("fmt,asym,shape,group", CASES, ids=IDS)
@pytest.mark.parametrize("isa", isa_params())
def test_blocked_matches_the_reference(isa, fmt, asym, shape, group):
    kern = K.load(isa)
    n, k = shape
    w = _weight(fmt, asym, n, k, group)
    assert not kq.blocked_unserved(w)
    wb = w.dequantize(torch.bfloat16)
    # one-hot rows: each output is one weight, so the packed bf16 weights are the reference's exactly
    eye = torch.eye(k, dtype=torch.bfloat16)[:200]
    assert torch.equal(kq.qlinear_blocked(kern, eye, w), wb[:, :200].T.contiguous())
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).bfloat16()
    for rows in (65, 200, 513):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        got = kq.qlinear_blocked(kern, x, w, bias.float())
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        assert _within(got, reference(x, w, bias), x, wb), rows


@pytest.mark.parametrize("isa_a,isa_b", isa_pair_params())
@pytest.mark.parametrize("fmt,asym,shape,group", CASES, ids=IDS)
def test_blocked_variants_bitwise_equal(fmt, asym, shape, group, isa_a, isa_b):
    w = _weight(fmt, asym, *shape, group)
    x = torch.randn(130, shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(kq.qlinear_blocked(K.load(isa_a), x, w), kq.qlinear_blocked(K.load(isa_b), x, w))


def test_blocked_independent_of_threads_and_rows():
    """Blocks split between threads, each output by one thread: 1 vs 3 threads the same bits;
    a row's result does not depend on the other rows (the first 65 alone)."""
    kern = K.load(K.runnable_isas()[0])
    w = _weight("int4", True, 200, 256, 32)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    with threads(1):
        one = kq.qlinear_blocked(kern, x, w)
    with threads(3):
        assert torch.equal(kq.qlinear_blocked(kern, x, w), one)
    assert torch.equal(kq.qlinear_blocked(kern, x[:65], w), one[:65])


def test_linear_takes_it_past_max_rows():
    """layers.Linear: bf16 past MAX_ROWS the blocked kernel, up to it the few-row kernel; fp32
    past it the reference path; an odd K is refused by the blocked kernel (reference path)."""
    kern = K.load(K.runnable_isas()[0])
    w = _weight("int8", False, 64, 256, 256)
    lin = Linear(w, kernels=kern)
    assert lin.qblocked
    x = torch.randn(kq.MAX_ROWS + 1, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert torch.equal(lin(x), kq.qlinear_blocked(kern, x, w))
    assert torch.equal(lin(x[:kq.MAX_ROWS]), kq.qlinear(kern, x[:kq.MAX_ROWS], w))
    assert torch.equal(lin(x.float()), F.linear(x.float(), w.dequantize()))
    odd = _weight("int8", False, 8, 255, 255)
    assert "odd" in kq.blocked_unserved(odd) and not Linear(odd, kernels=kern).qblocked


# ---- MoE: moed_moe_q blocked ------------------------------------------------------------------

P, H, I, TOP_K = 8, 160, 96, 3


def _experts(fmt: str, kernels) -> LocalExperts:
    g = torch.Generator().manual_seed(5)
    gate_up = quantize(torch.randn(P, 2 * I, H, generator=g) * 0.1, fmt, 32)
    down = quantize(torch.randn(P, H, I, generator=g) * 0.1, fmt, 32)
    return LocalExperts(gate_up, down, False, None, None, kernels)


def _skewed(t: int, seed: int) -> Routing:
    """Expert 0 in every token's top-k (t rows: past MAX_ROWS), the rest spread (fewer each)."""
    g = torch.Generator().manual_seed(seed)
    rest = torch.stack([torch.randperm(P - 1, generator=g)[:TOP_K - 1] + 1 for _ in range(t)])
    phys = torch.cat([torch.zeros(t, 1, dtype=torch.long), rest], 1)
    w = torch.softmax(torch.randn(t, TOP_K, generator=g), -1).bfloat16()
    return Routing(w, phys, False)


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("isa", isa_params())
def test_moe_blocked_equals_the_per_expert_path(isa, fmt, monkeypatch):
    """Past MAX_ROWS tokens (bf16) the layer is one moed_moe_q call in blocked mode, bit for bit
    the per-expert path (its Linears: blocked past MAX_ROWS rows, the few-row kernel up to it)."""
    le = _experts(fmt, K.load(isa))
    t = kq.MAX_ROWS + 36
    x = torch.randn(t, H, generator=torch.Generator().manual_seed(6)).bfloat16()
    r = _skewed(t, 7)
    assert le.qblocked_serves(x) and not le.qfused_serves(x)
    calls = []
    real = kq.moe_q
    monkeypatch.setattr(kq, "moe_q", lambda *a: calls.append(a[-1]) or real(*a))
    got = le(x, r)
    assert calls == [True]
    ref = LocalExperts(*le.quant, False, None, None, le.qkernels)
    ref.qkernels = None
    assert torch.equal(got, ref(x, r))


@pytest.mark.parametrize("isa_a,isa_b", isa_pair_params())
def test_moe_blocked_variants_bitwise_equal(isa_a, isa_b):
    a, b = _experts("int4", K.load(isa_a)), _experts("int4", K.load(isa_b))
    x = torch.randn(90, H, generator=torch.Generator().manual_seed(8)).bfloat16()
    r = _skewed(90, 9)
    assert torch.equal(a(x, r), b(x, r))


# ---- engine level ----------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_long_prompt_takes_the_blocked_kernels(tiny_qwen3, monkeypatch, fmt):
    """A tiny bf16 qwen3_moe quantized at load, one 100-token prompt: every MoE layer is one
    blocked moed_moe_q_routed call and the attention projections the blocked matmul; a
    quantized Linear on the reference path fails the test. The last token's logits on average as
    close to the fp32 model's as the reference path's (25% margin: both bf16 with the same
    roundings, summing in other orders; the MoE kernel's router rounds its logits as the bf16
    kernel does, and a near-tie routing flip in a tiny random model moves the largest error
    either way, so the mean is compared: measured 0.124 vs 0.135 int8, 0.0254 vs 0.0255 int4)."""
    from moed.model.batch import ForwardBatch
    from moed.model.moe import MoELayer
    from moed.model.runner import ModelRunner

    def runner(dtype: str = "bfloat16") -> ModelRunner:
        return ModelRunner(tiny_qwen3, dtype=dtype, device="cpu", num_blocks=16, block_size=16,
                           quantization=fmt, quantization_group_size=32)

    prompt = [(7 * i + 3) % 200 + 1 for i in range(100)]
    batch = ForwardBatch(token_ids=[prompt], start_pos=[0], block_tables=[list(range(8))])
    lin_calls, moe_calls = [], []
    real_lin, real_moe = layers_mod.quant_linear_blocked, kq.moe_q_routed
    monkeypatch.setattr(layers_mod, "quant_linear_blocked", lambda *a: lin_calls.append(1) or real_lin(*a))
    monkeypatch.setattr(kq, "moe_q_routed", lambda *a: moe_calls.append(a[-1]) or real_moe(*a))
    monkeypatch.setattr(layers_mod, "qlinear", lambda *a: pytest.fail("a quantized Linear took the reference path"))
    native = runner()
    got = native.forward(batch).float()
    moe = [layer.mlp for layer in native.model.layers if isinstance(layer.mlp, MoELayer)]
    assert moe and moe_calls == [True] * len(moe)
    assert len(lin_calls) >= 2 * len(native.model.layers)      # qkv and o at least, per layer
    monkeypatch.undo()
    monkeypatch.setattr(layers_mod, "QUANT_MAX_ROWS", 0)       # every quantized call on the reference path
    ref = runner()
    assert not any(layer.mlp.experts.qblocked for layer in ref.model.layers if isinstance(layer.mlp, MoELayer))
    want = ref.forward(batch).float()
    monkeypatch.undo()
    exact = runner("float32").forward(batch).float()
    assert (got - exact).abs().mean() <= 1.25 * (want - exact).abs().mean()
