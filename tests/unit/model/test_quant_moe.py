"""moed_moe_q (cpu_quant.c via kernels/quant.py moe_q): a quantized MoE layer's experts and
weighted sum in one native call, against the per-expert path it replaces (LocalExperts with one
moed_qlinear per expert matrix and torch's SiLU, product and sum), on every kernel variant this
CPU runs; the variants bitwise equal; the result independent of the thread count; the EP /
cold-store seam (MoEMode.QFUSED) equal to the one-process call; and at engine level, that the
layers do take it.

Tolerance (stated, and why): bf16 is bit for bit (the same matmul code, cpu_bf16.c's activation,
the same roundings and summation orders). fp32 differs only in SiLU's exp (glibc expf in C,
torch's vectorised Sleef exp): an ulp or two on an activation, so an output within 2^-20 of the
largest one (measured ~1e-7 relative).
"""
from __future__ import annotations

import pytest
import torch

from moed.model import kernels as K
from moed.model.executor import MoEMode, Routing, combine
from moed.model.kernels import quant as kq
from moed.model.moe import LocalExperts
from moed.model.quant.quantize import quantize
from moed.model.quant.weight import QuantWeight

from conftest import isa_pair_params, isa_params     # tests/unit/model/conftest.py
from test_quant_kernels import _greedy   # two prompts prefilled together, then greedy decode
from torch_threads import threads   # tests/unit/model/torch_threads.py

P, H, I, TOP_K = 8, 160, 96, 3          # H, I: a vector part and a scalar tail for int4's 32
CASES = [("int8", 32, False), ("int8", 160, False), ("int8", 32, True), ("int4", 32, False),
         ("int4", 32, True), ("fp8", 32, False)]
IDS = [f"{f}-g{g}{'-asym' if a else ''}" for f, g, a in CASES]


def _with_zeros(w: QuantWeight, g: torch.Generator) -> QuantWeight:
    """w with random zero points (the asymmetric layout; values arbitrary, the paths must agree)."""
    shape = w.scale.shape
    zero = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8) if w.fmt == "int4" else \
        torch.randint(-20, 20, shape, generator=g, dtype=torch.int8)
    return QuantWeight(w.fmt, w.data, w.scale, zero, w.group, w.in_features)


def _experts(fmt: str, group: int, asym: bool, kernels) -> LocalExperts:
    """P experts quantized (fp8: 128-blocks whatever the group), zero points if asym."""
    g = torch.Generator().manual_seed(len(fmt) + group)
    gate_up = quantize(torch.randn(P, 2 * I, H, generator=g) * 0.1, fmt, group)
    down = quantize(torch.randn(P, H, I, generator=g) * 0.1, fmt, group if group < I else I)
    if asym:
        gate_up, down = _with_zeros(gate_up, g), _with_zeros(down, g)
    return LocalExperts(gate_up, down, False, None, None, kernels)


def _per_expert(le: LocalExperts) -> LocalExperts:
    """The same experts on the per-expert path (no fused call)."""
    ref = LocalExperts(*le.quant, False, None, None, le.qkernels)
    ref.qkernels = None
    return ref


def _routing(t: int, dtype: torch.dtype, seed: int) -> Routing:
    g = torch.Generator().manual_seed(seed)
    phys = torch.stack([torch.randperm(P, generator=g)[:TOP_K] for _ in range(t)])
    w = torch.softmax(torch.randn(t, TOP_K, generator=g), -1).to(dtype)
    return Routing(w, phys, False)


def _close_fp32(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool((got - want).abs().max() <= 2.0 ** -20 * want.abs().max())


@pytest.mark.parametrize("fmt,group,asym", CASES, ids=IDS)
@pytest.mark.parametrize("isa", isa_params())
def test_fused_equals_the_per_expert_path(isa, fmt, group, asym):
    le = _experts(fmt, group, asym, K.load(isa))
    assert le.qkernels is not None and le.qrows == kq.MAX_ROWS
    ref = _per_expert(le)
    for t in (1, 2, 5, 17):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(dtype)
            r = _routing(t, dtype, seed=t)
            got, want = le(x, r), ref(x, r)
            assert got.dtype == dtype
            if dtype == torch.bfloat16:
                assert torch.equal(got, want), (t, (got.float() - want.float()).abs().max())
            else:
                assert _close_fp32(got, want), (t, (got - want).abs().max())


@pytest.mark.parametrize("isa", isa_params())
def test_fused_sum_with_a_column_tail(isa):
    """A hidden size of 8k + 4: the weighted sum's last 4 columns take the scalar loop after its
    8-column vectors; both parts give the per-expert path's bits (bf16; fp32 as above)."""
    h, g = 100, torch.Generator().manual_seed(11)
    gate_up = quantize(torch.randn(P, 2 * I, h, generator=g) * 0.1, "int8", h)   # one group a row
    down = quantize(torch.randn(P, h, I, generator=g) * 0.1, "int8", 32)
    le = LocalExperts(gate_up, down, False, None, None, K.load(isa))
    ref = _per_expert(le)
    for t in (1, 3, 40):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype)
            r = _routing(t, dtype, seed=20 + t)
            got, want = le(x, r), ref(x, r)
            if dtype == torch.bfloat16:
                assert torch.equal(got, want), (t, (got.float() - want.float()).abs().max())
            else:
                assert _close_fp32(got, want), (t, (got - want).abs().max())


@pytest.mark.parametrize("isa_a,isa_b", isa_pair_params())
@pytest.mark.parametrize("fmt,group,asym", CASES, ids=IDS)
def test_variants_bitwise_equal(fmt, group, asym, isa_a, isa_b):
    a = _experts(fmt, group, asym, K.load(isa_a))
    b = LocalExperts(*a.quant, False, None, None, K.load(isa_b))
    for t in (1, 3, 9):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(dtype)
            r = _routing(t, dtype, seed=t + 1)
            assert torch.equal(a(x, r), b(x, r)), (t, dtype)


def test_independent_of_threads_and_of_other_tokens():
    """Each output by one thread in a fixed order: 1 vs 2 threads the same bits; a token's
    output does not depend on the other tokens of the call (each expert's rows in one pass)."""
    le = _experts("int4", 32, True, K.load(K.runnable_isas()[0]))
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    r = _routing(9, torch.bfloat16, seed=4)
    with threads(1):
        one = le(x, r)
        alone = [le(x[i:i + 2], Routing(r.weights[i:i + 2], r.physical[i:i + 2], False)) for i in range(0, 8, 2)]
    lone = Routing(r.weights[:1], r.physical[:1], False)   # one token: the down rows split by columns
    with threads(1):
        lone_one = le(x[:1], lone)
    with threads(2):
        assert torch.equal(le(x, r), one)
        assert torch.equal(le(x[:1], lone), lone_one)
    assert torch.equal(torch.cat(alone), one[:8])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_rows_then_combine_equal_the_one_call(dtype):
    """The EP / cold-store seam: rows grouped by slot through run_grouped(QFUSED), then
    executor.combine, give the one-process call's bits (what the cold store and an EP group
    compare against)."""
    le = _experts("int8", 32, False, K.load(K.runnable_isas()[0]))
    for t in (1, 6):
        x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(dtype)
        r = _routing(t, dtype, seed=10 + t)
        phys = r.physical.reshape(-1)
        order = torch.argsort(phys, stable=True)
        ys = x.new_empty((t * TOP_K, H))
        ys[order] = le.run_grouped(x.index_select(0, order // TOP_K), torch.bincount(phys, minlength=P),
                                   MoEMode.QFUSED)
        got = combine(ys.view(t, TOP_K, H), r.weights, r.physical, MoEMode.QFUSED)
        assert torch.equal(got, le(x, r)), t


def test_past_max_rows_and_unserved_keep_the_per_expert_path(monkeypatch):
    le = _experts("int8", 32, False, K.load(K.runnable_isas()[0]))
    calls = []
    fused = kq.moe_q
    monkeypatch.setattr(kq, "moe_q", lambda *a: calls.append(1) or fused(*a))
    x = torch.randn(kq.MAX_ROWS + 1, H)
    r = _routing(kq.MAX_ROWS + 1, torch.float32, seed=1)
    assert _close_fp32(le(x[:kq.MAX_ROWS], Routing(r.weights[:-1], r.physical[:-1], False)),
                       _per_expert(le)(x[:kq.MAX_ROWS], Routing(r.weights[:-1], r.physical[:-1], False)))
    assert calls == [1]
    le(x, r)
    assert calls == [1]         # MAX_ROWS + 1 tokens: the per-expert path
    gu, dn = le.quant
    assert "3-D" in kq.experts_unserved(gu[0], dn[0])
    assert LocalExperts(gu, dn, False, None, None, None).qkernels is None     # no kernels


# ---- engine level ----------------------------------------------------------------------------

def _moe_layers(runner) -> list:
    from moed.model.moe import MoELayer
    return [layer.mlp for layer in runner.model.layers if isinstance(layer.mlp, MoELayer)]


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_layers_take_the_fused_call(tiny_qwen3, monkeypatch, fmt, dtype):
    """A tiny quantized qwen3_moe: every MoE layer is set up for moed_moe_q (bf16: routed in the
    same call) and each forward calls it once per layer (fails if a layer silently stays
    per-expert). fp32: the per-expert path's greedy tokens, logits within 1e-5. bf16: the router
    is the bf16 MoE kernel's, not torch's (another rounding of the logits), so as the native
    matmul's own engine test: the prefill logits no farther from the fp32 run than the
    per-expert path's (10% margin)."""
    from moed.model.runner import ModelRunner

    def runner(dt: str = dtype):
        return ModelRunner(tiny_qwen3, dtype=dt, device="cpu", num_blocks=16, block_size=16,
                           quantization=fmt, quantization_group_size=32)
    fused = runner()
    fused.native_decode = None      # the layered path's calls, counted (the native step makes the
    layers = _moe_layers(fused)     # same ones in C: test_decode_step_quant.py)
    assert layers and all(m.experts.qkernels is not None for m in layers)
    assert all((m.qroute is not None) == (dtype == "bfloat16") for m in layers)
    calls = []
    for name in ("moe_q", "moe_q_routed"):
        real = getattr(kq, name)
        monkeypatch.setattr(kq, name, lambda *a, _f=real, _n=name: calls.append(_n) or _f(*a))
    got, got_logits = _greedy(fused, steps=6)
    # 18 prompt tokens, then 2-token decode steps: all fused, bf16 routed in the call
    assert calls == ["moe_q_routed" if dtype == "bfloat16" else "moe_q"] * (6 * len(layers))
    ref = runner()
    ref.native_decode = None        # it holds the fused kernels' pointers
    for m in _moe_layers(ref):
        m.experts.qkernels = None
    calls.clear()
    want, want_logits = _greedy(ref, steps=6)
    assert not calls
    if dtype == "float32":
        assert got == want
        for a, b in zip(got_logits, want_logits):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()
        return
    monkeypatch.undo()
    exact = _greedy(runner("float32"), steps=1)[1][0]
    assert (got_logits[0] - exact).abs().max() <= 1.1 * (want_logits[0] - exact).abs().max()


class _Spec:
    top_k, norm_topk_prob, num_experts = TOP_K, True, P


@pytest.mark.parametrize("isa", isa_params())
def test_routed_call_equals_its_halves(isa):
    """moed_moe_q_routed = CpuKernels.route_bf16 (what EP and the cold store route with) then
    moed_moe_q, bit for bit, with the same load counts; replicas (an EPLB map) included."""
    from moed.model.layers import Linear
    from moed.model.moe import Router
    kern = K.load(isa)
    le = _experts("int4", 32, False, kern)
    w = torch.randn(P, H, generator=torch.Generator().manual_seed(7)).bfloat16()
    wp = kern.pack(w)
    for replicas in (False, True):
        ra, rb = (Router(w, _Spec, P, torch.zeros(P, dtype=torch.long), Linear(w)) for _ in range(2))
        if replicas:        # expert 0 also in slot 7 (7's own expert unreachable: a test map)
            l2p = torch.stack([torch.arange(P), torch.arange(P)], 1)
            l2p[0, 1] = 7
            nrep = torch.ones(P, dtype=torch.long)
            nrep[0] = 2
            for r in (ra, rb):
                r.set_expert_map(l2p, nrep)
        for t in (1, 5):
            x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).bfloat16()
            got = kq.moe_q_routed(kern, x, wp, ra, *le.quant)
            phys, wts = kern.route_bf16(x, wp, P, TOP_K, True, rb.logical_to_physical, rb.num_replicas, rb.load,
                                        P, rb.next_offset())
            want = kq.moe_q(kern, x, phys, wts, *le.quant, t == 1 and not replicas)
            assert torch.equal(got, want), (replicas, t)
            assert torch.equal(ra.load, rb.load)
