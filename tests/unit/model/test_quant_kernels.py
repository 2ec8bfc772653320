"""The native quantized matmul (cpu_quant.c via moed/model/kernels/quant.py) against the reference
(QuantWeight.dequantize in fp32, then an fp32 matmul), on every kernel variant this CPU runs;
bit for bit against that sum spelled out in torch in the kernel's order, and the variants
bitwise equal to each other; Linear's wiring; and engine level, a tiny qwen3_moe
quantized at load (int8, int4, fp8): in float32 the same greedy tokens on the native path as on
the reference path; in bf16 logits no farther from the float32 run than the reference's.

Tolerances (stated, and why): the kernel dequantizes each weight to the very fp32 value the
reference does (checked exactly below with one-hot inputs), so the two fp32 results differ only
by summation order: each is within gamma_K = K * 2^-24 of the exact sum relative to
sum_k |x_k w_k|, so they differ by at most 2 * gamma_K * sum_k |x_k w_k|. bf16 output is that
fp32 result rounded once: within half a bf16 ulp (2^-8 relative) of it, plus the same bound.
"""
from __future__ import annotations

import pytest
import torch

from moed.model import kernels as K
from moed.model import layers as layers_mod
from moed.model.kernels import quant as kq
from moed.model.layers import Linear, quant_paths
from moed.model.quant.linear import qlinear as reference
from moed.model.quant.quantize import quantize
from moed.model.quant.weight import QuantWeight, pack_int4

from conftest import isa_pair_params, isa_params     # tests/unit/model/conftest.py
from torch_threads import threads   # tests/unit/model/torch_threads.py



def _weight(fmt: str, n: int, k: int, group: int, asym: bool, seed: int) -> QuantWeight:
    """A random QuantWeight: every code of the format occurs (fp8: all but the NaN codes,
    subnormals included), random positive scales, random zero points when asym."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    scale = torch.rand(n, groups, generator=g) * 0.02 + 1e-3
    zero = None
    if fmt == "int8":
        data = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        if asym:
            zero = torch.randint(-20, 20, (n, groups), generator=g, dtype=torch.int8)
    elif fmt == "int4":
        data = pack_int4(torch.randint(0, 16, (n, k), generator=g))
        if asym:
            zero = torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8)
    else:
        codes = torch.arange(256, dtype=torch.uint8)
        codes = codes[(codes & 0x7f) != 0x7f]
        data = codes[torch.randint(0, len(codes), (n, k), generator=g)].view(torch.float8_e4m3fn)
    return QuantWeight(fmt, data, scale, zero, group, k)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """2 * gamma_K * sum_k |x_k w_k| (see the module docstring)."""
    return 2 * x.shape[1] * 2.0 ** -24 * (x.abs() @ w.abs().T)


CASES = [  # fmt, asym, (N, K), group
    ("int8", False, (48, 256), 256),        # one group per row (the online int8 layout)
    ("int8", False, (45, 200), 200),        # K not a multiple of 16: a scalar tail
    ("int8", True, (33, 160), 32),          # zero points, several groups
    ("int4", False, (48, 256), 64),
    ("int4", False, (17, 133), 32),         # odd K: a half byte of padding, a tail past 128
    ("int4", True, (31, 200), 32),          # zero points, N not a multiple of 4 or 16
    ("int4", True, (5, 70), 70),            # one group, K not a multiple of 32
    ("fp8", False, (40, 256), 128),
    ("fp8", False, (19, 300), 16),          # tail past the last full 16 columns
]


@pytest.mark.parametrize("fmt,asym,shape,group", CASES,
                         ids=[f"{c[0]}{'-asym' if c[1] else ''}-{c[2][0]}x{c[2][1]}-g{c[3]}" for c in CASES])
@pytest.mark.parametrize("isa", isa_params())
def test_native_equals_reference(isa, fmt, asym, shape, group):
    k = K.load(isa)
    n, kk = shape
    qw = _weight(fmt, n, kk, group, asym, seed=n * kk)
    w = qw.dequantize(torch.float32)
    # the weights themselves: one-hot rows read W^T back, each value exactly the reference's
    eye = torch.eye(kk)
    assert torch.equal(kq.qlinear(k, eye, qw), w.T.contiguous())
    g = torch.Generator().manual_seed(7)
    for rows in (1, 2, 7, 33):
        x = torch.randn(rows, kk, generator=g)
        want = x @ w.T
        got = kq.qlinear(k, x, qw)
        assert ((got - want).abs() <= _bound(x, w)).all(), (rows, (got - want).abs().max())
        xb = x.bfloat16()
        want_b = xb.float() @ w.T
        got_b = kq.qlinear(k, xb, qw)
        assert got_b.dtype == torch.bfloat16
        tol = want_b.abs() * 2.0 ** -8 + _bound(xb.float(), w)
        assert ((got_b.float() - want_b).abs() <= tol).all(), rows
        # against quant/linear.py's own qlinear in fp32 (what Linear falls back to)
        assert ((got - reference(x, qw)).abs() <= _bound(x, w)).all()


def _spelled_out(x: torch.Tensor, qw: QuantWeight) -> torch.Tensor:
    """The kernel's fp32 sum spelled out in torch (what cpu_quant.c's header describes): per
    output, 16 lane accumulators, each an FMA chain over its columns in vector order (int4: per
    32 columns the 16 even ones, then the 16 odd ones); GCC's _mm512_reduce_add_ps order over the
    lanes; then the columns past the last full vector, each product rounded then added, from 0.
    An FMA is spelled in float64 (the fp32 product is exact there), rounded once to fp32."""
    w = qw.dequantize(torch.float32)
    k = w.shape[1]
    step = 32 if qw.fmt == "int4" else 16
    kv = k - k % step
    acc = torch.zeros(x.shape[0], w.shape[0], 16)
    lanes = torch.arange(16)
    for k0 in range(0, kv, step):
        vecs = [k0 + 2 * lanes, k0 + 2 * lanes + 1] if qw.fmt == "int4" else [k0 + lanes]
        for cols in vecs:
            prod = x[:, None, cols].double() * w[None, :, cols].double()
            acc = (acc.double() + prod).float()
    t3 = acc[..., 8:] + acc[..., :8]
    t6 = t3[..., 4:] + t3[..., :4]
    t8 = t6[..., :2] + t6[..., 2:]
    out = t8[..., 0] + t8[..., 1]
    tail = torch.zeros_like(out)
    for c in range(kv, k):
        tail = tail + x[:, None, c] * w[None, :, c]
    return out + tail if kv < k else out


@pytest.mark.parametrize("fmt,asym,shape,group", CASES,
                         ids=[f"{c[0]}{'-asym' if c[1] else ''}-{c[2][0]}x{c[2][1]}-g{c[3]}" for c in CASES])
@pytest.mark.parametrize("isa", isa_params())
def test_bitwise_equal_to_the_spelled_out_sum(isa, fmt, asym, shape, group):
    """The variants are held to one reference bit for bit: the same weights (checked above), the
    same FMAs in the same order (cpu_quant.c's header), at 1, 3 and 6 rows (fused and buffered)."""
    k = K.load(isa)
    n, kk = shape
    qw = _weight(fmt, n, kk, group, asym, seed=n * kk + 1)
    x = torch.randn(6, kk, generator=torch.Generator().manual_seed(3))
    want = _spelled_out(x, qw)
    for rows in (1, 3, 6):
        assert torch.equal(kq.qlinear(k, x[:rows], qw), want[:rows]), rows


def test_bias_added_in_fp32_and_rounded_once():
    k = K.load(K.runnable_isas()[0])
    qw = _weight("int8", 20, 64, 64, False, seed=3)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(20)
    plain = kq.qlinear(k, x, qw)
    assert torch.equal(kq.qlinear(k, x, qw, bias), plain + bias)


@pytest.mark.parametrize("isa_a,isa_b", isa_pair_params())
@pytest.mark.parametrize("fmt,asym,shape,group", CASES,
                         ids=[f"{c[0]}{'-asym' if c[1] else ''}-{c[2][0]}x{c[2][1]}-g{c[3]}" for c in CASES])
def test_variants_bitwise_equal(fmt, asym, shape, group, isa_a, isa_b):
    """Each pair of variants (those this CPU runs; AVX2 forced on an AVX512 machine): the same
    bits, fp32 and bf16, for row counts on both sides of each variant's register tile (the
    buffered path included)."""
    a, b = K.load(isa_a), K.load(isa_b)
    n, kk = shape
    qw = _weight(fmt, n, kk, group, asym, seed=n + kk)
    g = torch.Generator().manual_seed(11)
    for rows in (1, 2, 3, 5, 8, 33):
        x = torch.randn(rows, kk, generator=g)
        assert torch.equal(kq.qlinear(a, x, qw), kq.qlinear(b, x, qw)), rows
        xb = x.bfloat16()
        assert torch.equal(kq.qlinear(a, xb, qw), kq.qlinear(b, xb, qw)), rows


def test_rows_independent_of_batch_and_threads():
    """A row's result does not depend on the other rows (fused vs buffered tiles) nor on the
    thread count: the same bits for one row alone and inside 33, on 1 and 2 threads."""
    k = K.load(K.runnable_isas()[0])
    qw = _weight("int4", 37, 256, 32, True, seed=5)
    x = torch.randn(33, 256, generator=torch.Generator().manual_seed(2))
    with threads(1):
        one = torch.cat([kq.qlinear(k, x[i:i + 1], qw) for i in range(33)])
    with threads(2):
        assert torch.equal(kq.qlinear(k, x, qw), one)


def test_what_it_does_not_serve_says_why():
    qw = _weight("int8", 8, 96, 24, False, seed=1)
    assert "group 24" in kq.unserved(qw)
    assert "3-D" in kq.unserved(QuantWeight("int8", torch.zeros(2, 8, 32, dtype=torch.int8),
                                            torch.ones(2, 8, 1), None, 32, 32))
    lin = Linear(qw, kernels=K.cpu_kernels())
    assert lin.qpath.startswith("reference (group 24")
    x = torch.randn(1, 96)
    assert torch.equal(lin(x), reference(x, qw))
    with pytest.raises(RuntimeError, match="cannot take"):
        kq.qlinear(K.cpu_kernels(), x, qw)      # the C side refuses it too, never reads wrongly


def test_linear_takes_native_for_few_rows_reference_above():
    k = K.cpu_kernels()
    qw = quantize(torch.randn(64, 128), "int4", 32)
    bias = torch.randn(64)
    lin = Linear(qw, bias, kernels=k)
    assert lin.qpath == "native" and quant_paths([lin]) == {"native": 1}
    x = torch.randn(kq.MAX_ROWS + 1, 128)
    assert torch.equal(lin(x[:kq.MAX_ROWS]), kq.qlinear(k, x[:kq.MAX_ROWS], qw, bias))
    assert torch.equal(lin(x), reference(x, qw, bias))            # past MAX_ROWS: the reference
    assert quant_paths([Linear(qw)]) == {"reference (no native CPU kernels)": 1}


# ---- engine level ----------------------------------------------------------------------------

def _greedy(runner, steps: int = 8) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Two prompts prefilled together (7 and 11 rows: the native kernel), then decoded greedily."""
    from moed.model.batch import ForwardBatch
    prompts = [[5, 17, 33, 2, 9, 100, 7], [40, 41, 3, 3, 250, 12, 1, 90, 66, 4, 8]]
    start, toks, out, logits_all = [0, 0], prompts, [[], []], []
    for _ in range(steps):
        logits = runner.forward(ForwardBatch(token_ids=toks, start_pos=list(start), block_tables=[[0, 1], [2, 3]]))
        logits_all.append(logits.float().clone())
        start = [s + len(t) for s, t in zip(start, toks)]
        toks = [[int(v)] for v in logits.argmax(-1)]
        for i, t in enumerate(toks):
            out[i].append(t[0])
    return out, logits_all


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_native_path_against_the_reference_path(tiny_qwen3, monkeypatch, fmt, dtype):
    from moed.model.runner import ModelRunner

    def runner():
        return ModelRunner(tiny_qwen3, dtype=dtype, device="cpu", num_blocks=16, block_size=16,
                           quantization=fmt, quantization_group_size=32)
    calls = []
    native_linear = layers_mod.quant_linear
    monkeypatch.setattr(layers_mod, "quant_linear", lambda *a: calls.append(1) or native_linear(*a))
    native = runner()
    paths = quant_paths(native.model)
    assert set(paths) == {"native"} and paths["native"] > 0, paths
    got, got_logits = _greedy(native)
    assert calls, "the native kernel served no call"
    monkeypatch.setattr(layers_mod, "QUANT_MAX_ROWS", 0)          # every call on the reference path
    ref = runner()
    calls.clear()
    want, want_logits = _greedy(ref)
    assert not calls
    if dtype == "float32":      # summation order only: the same tokens, logits within 1e-4
        assert got == want
        for a, b in zip(got_logits, want_logits):
            assert (a - b).abs().max() <= 1e-4 * b.abs().max()
        return
    # bf16: the reference rounds each dequantized weight to bf16 first, the kernel keeps fp32
    # weights. Against the float32 run (the same quantized weights) on the prefill step, the
    # native path must be no farther off than the reference (later steps: a near-tie in a tiny
    # random model's routing can flip either way, so they are not compared)
    monkeypatch.undo()
    exact = _greedy(ModelRunner(tiny_qwen3, dtype="float32", device="cpu", num_blocks=16, block_size=16,
                                quantization=fmt, quantization_group_size=32), steps=1)[1][0]
    # (10% margin: both are bf16 computations whose errors differ by summation order; on an
    # Ice Lake without AVX512-BF16 oneDNN's reference came out 2% closer in int4: 0.0951 vs 0.0970)
    assert (got_logits[0] - exact).abs().max() <= 1.1 * (want_logits[0] - exact).abs().max()
