"""int8 activations (model.quantization_activations = "int8"; cpu_qdot.c via kernels/quant.py):
the kernels against quant/actquant.py's torch reference of the same W8A8 / W4A8 arithmetic,
bit for bit, on every variant this CPU runs (AVX2 forced on an AVX512 machine too; on a VNNI CPU
the vpmaddubsw path as well), independent of the batch and the thread count; the fused MoE on
the same path; the setting's wiring and refusals; and engine level, a quantized model with the
setting runs the integer path (a spy fails otherwise) with greedy tokens close to "none".
"""
from __future__ import annotations

import pytest
import torch

from moed.model import kernels as K
from moed.model.executor import Routing
from moed.model.kernels import quant as kq
from moed.model.moe import LocalExperts
from moed.model.quant.actquant import qdot_reference, quantize_rows
from moed.model.quant.weight import QuantWeight

from conftest import isa_params     # tests/unit/model/conftest.py
from test_quant_kernels import _weight   # random int8 / int4 weights, every code
from torch_threads import threads   # tests/unit/model/torch_threads.py


@pytest.fixture(autouse=True)
def _vnni_back():
    """moed_qdot_vnni is process-wide (one .so per variant): back on after each test."""
    yield
    for isa in K.ISAS:
        if not K.isa_missing(isa):
            kq.qdot_vnni(K.load(isa), 1)


def _kernels(isa: str, vnni: int) -> K.CpuKernels:
    k = K.load(isa)
    kq.qdot_vnni(k, vnni)
    return kq.with_act(k, "int8")


CASES = [  # fmt, asym, (N, K), group
    ("int8", False, (37, 256), 256),        # one group per row (the online int8 layout)
    ("int8", False, (20, 200), 200),        # K not a multiple of 64: a masked last chunk
    ("int8", True, (16, 192), 64),
    ("int4", False, (45, 256), 128),        # the online int4 layout
    ("int4", True, (12, 160), 32),          # half chunks
    ("int4", False, (9, 98), 98),           # one group, K % 64 = 34
    ("int4", True, (11, 1216), 1216),       # one group of 19 chunks
    ("int4", False, (13, 512), 256),        # two chunk pairs a group (AVX2's many-row panel)
    ("int4", False, (3, 33024), 128),       # 258 groups: past AVX2's batch-1 row (qd_row4) holds
]


def _vnni_params() -> list:
    return [pytest.param(1, id="vnni"), pytest.param(0, id="maddubs")]


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("vnni", _vnni_params())
@pytest.mark.parametrize("fmt,asym,shape,group", CASES)
def test_kernel_equals_reference_bitwise(isa, vnni, fmt, asym, shape, group):
    k = _kernels(isa, vnni)
    n, kk = shape
    w = _weight(fmt, n, kk, group, asym, seed=n + kk)
    gen = torch.Generator().manual_seed(7)
    bias = torch.randn(n, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(5, kk, generator=gen) * torch.rand(1, kk, generator=gen) * 4).to(dtype)
        x[1] = 0                                    # an all-zero row: scale 0
        got = kq.qlinear(k, x, w, bias)
        want = qdot_reference(x, w, bias)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits), want.view(bits)), (fmt, dtype)
        for r in (0, 2):                            # one row: the kernel's batch-1 tile
            assert torch.equal(kq.qlinear(k, x[r:r + 1], w, bias).view(bits), want[r:r + 1].view(bits)), (fmt, dtype, r)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_int4_products_at_their_bound(isa, rows):
    """Every int4 code 15 against every x_q at +127 (or -127): each vpmaddubsw pair is +-3810, the
    most a pair can be, over a group of 1024 columns (16 chunks), on the batch-1, two-row and
    one-row tiles: no partial sum may saturate or wrap."""
    k = _kernels(isa, 0)
    n, kk = 6, 1024
    data = torch.full((n, kk // 2), 0xFF, dtype=torch.uint8)
    w = QuantWeight("int4", data, torch.full((n, 1), 0.01), None, kk, kk)
    x = torch.ones(rows, kk)
    x[1:] = -1
    got = kq.qlinear(k, x, w)
    assert torch.equal(got, qdot_reference(x, w))
    assert torch.allclose(got[0], torch.full((n,), 7 * 0.01 * kk))      # (15 - 8) * scale per column


@pytest.mark.parametrize("isa", isa_params())
def test_rows_and_threads_do_not_change_a_row(isa):
    k = _kernels(isa, 1)
    w = _weight("int4", 64, 512, 128, False, seed=3)
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with threads(1):
        full = kq.qlinear(k, x, w)
    for rows, nt in ((1, 2), (3, 1), (17, 2), (64, 3)):
        with threads(nt):
            assert torch.equal(kq.qlinear(k, x[:rows], w), full[:rows]), (rows, nt)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("fmt,shape,group", [("int4", (21, 512), 128), ("int4", (9, 768), 384),
                                             ("int8", (21, 256), 256), ("int8", (7, 384), 128)])
def test_many_rows_equal_the_reference_bitwise(isa, fmt, shape, group):
    """Past two rows AVX2 runs a panel of up to 32 input rows a unit (cpu_qdot.c qd_panel4 /
    qd_panel8): row counts across the panel's edges (3, 32, 33, 64), an odd N (the last unit's
    clamped row), groups of one and of several chunk pairs, both thread counts: the reference's
    bits, and each row's bits the same as alone."""
    k = _kernels(isa, 1)
    n, kk = shape
    w = _weight(fmt, n, kk, group, False, seed=n * kk)
    gen = torch.Generator().manual_seed(11)
    bias = torch.randn(n, generator=gen)
    x = (torch.randn(64, kk, generator=gen) * torch.rand(1, kk, generator=gen) * 4).to(torch.bfloat16)
    x[5] = 0
    want = qdot_reference(x, w, bias)
    for rows, nt in ((3, 1), (32, 2), (33, 2), (64, 1)):
        with threads(nt):
            got = kq.qlinear(k, x[:rows], w, bias)
        assert torch.equal(got.view(torch.int16), want[:rows].view(torch.int16)), (rows, nt)


def test_close_to_the_exact_product():
    """The integer path is an approximation: per output, |error| stays within what rounding x to
    127 levels per group allows (sum |w| * sx / 2, plus fp32 slack), and the reference's own
    quantized rows hold |x_q| <= 127 with the group's largest at exactly 127."""
    w = _weight("int8", 32, 256, 256, False, seed=5)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    xq, sx = quantize_rows(x, 256)
    assert int(xq.abs().max()) == 127 and torch.equal(xq.abs().amax(1), torch.full((4,), 127, dtype=torch.int8))
    wd = w.dequantize(torch.float32)
    exact = x.double() @ wd.double().T
    bound = (wd.abs().sum(1)[None, :] * sx / 2).double() * 1.001 + 1e-4
    assert ((qdot_reference(x, w).double() - exact).abs() <= bound).all()


# ---- the fused MoE (moed_moe_q) on the same path ----------------------------------------------

P, H, I, TOP_K = 6, 160, 96, 2


def _stack(fmt: str, n: int, k: int, group: int, asym: bool, seeds: range) -> QuantWeight:
    ws = [_weight(fmt, n, k, group, asym, seed) for seed in seeds]
    zero = None if ws[0].zero is None else torch.stack([w.zero for w in ws])
    return QuantWeight(fmt, torch.stack([w.data for w in ws]), torch.stack([w.scale for w in ws]), zero, group, k)


def _experts(fmt: str, group: int, asym: bool, kernels) -> LocalExperts:
    return LocalExperts(_stack(fmt, 2 * I, H, group, asym, range(P)), _stack(fmt, H, I, group, asym, range(50, 50 + P)),
                        False, None, None, kernels)


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("fmt,group,asym", [("int8", 32, False), ("int8", 32, True), ("int4", 32, False),
                                            ("int4", 32, True)])
def test_fused_moe_equals_the_per_expert_path_on_int8_activations(isa, fmt, group, asym, monkeypatch):
    """moe_q with int8 activations == the per-expert path whose Linears run qlinear on them (each
    expert matrix = qdot_reference: checked too), bf16 bit for bit; and the call does pass act."""
    le = _experts(fmt, group, asym, _kernels(isa, 1))
    assert le.qkernels is not None and kq.experts_act(le.qkernels, *le.quant) == 1
    ref = LocalExperts(*le.quant, False, None, None, le.qkernels)
    ref.qkernels = None
    for t in (1, 3, 9):
        x = _same_as_per_expert(le, ref, t, P, H)
    e0 = ref.experts[0][0]
    assert torch.equal(e0(x), qdot_reference(x, e0.quant))


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("fmt,group", [("int4", 128), ("int8", 256)])
def test_fused_moe_many_rows_an_expert_equal_the_per_expert_path(isa, fmt, group):
    """Experts of ~2 to ~40 rows in moe_q (AVX2's many-row panels from 3: dimensions whole chunk
    pairs, int8 one group per row): the per-expert path's bits."""
    kern = _kernels(isa, 1)
    e, h, i = 4, 256, 256
    le = LocalExperts(_stack(fmt, 2 * i, h, min(group, h), False, range(e)),
                      _stack(fmt, h, i, min(group, i), False, range(50, 50 + e)), False, None, None, kern)
    ref = LocalExperts(*le.quant, False, None, None, le.qkernels)
    ref.qkernels = None
    for t in (5, 20, 64):
        _same_as_per_expert(le, ref, t, e, h)


def _same_as_per_expert(le: LocalExperts, ref: LocalExperts, t: int, experts: int, h: int) -> torch.Tensor:
    """t random bf16 tokens routed to TOP_K of `experts` each: le's output bit for bit ref's; x."""
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
    g = torch.Generator().manual_seed(t)
    phys = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(t)])
    r = Routing(torch.softmax(torch.randn(t, TOP_K, generator=g), -1).to(torch.bfloat16), phys, False)
    got, want = le(x, r), ref(x, r)
    assert torch.equal(got, want), (t, (got.float() - want.float()).abs().max())
    return x


# ---- the setting, and a model on it ----------------------------------------------------------

def test_setting_refused_where_it_cannot_apply(tiny_qwen3):
    from moed.config import ConfigError, ModelConfig
    from moed.config import load as load_config
    from moed.config.env import env_fields
    from moed.model.quant.formats import QuantConfigError, check_activations, plan
    from moed.preflight import quantization

    assert ModelConfig().quantization_activations == "none"
    with pytest.raises(ConfigError, match="model.quantization_activations"):
        ModelConfig(quantization_activations="int4")
    assert env_fields()["MOED_MODEL_QUANTIZATION_ACTIVATIONS"] == ("model", "quantization_activations")
    env = dict(MOED_MODEL_PATH=str(tiny_qwen3), MOED_MODEL_QUANTIZATION_ACTIVATIONS="int8")
    with pytest.raises(ConfigError, match="weights are plain"):
        quantization(load_config(environ=env))
    with pytest.raises(ConfigError, match="fp8"):
        quantization(load_config(environ={**env, "MOED_MODEL_QUANTIZATION": "fp8"}))
    quantization(load_config(environ={**env, "MOED_MODEL_QUANTIZATION": "int4"}))
    with pytest.raises(QuantConfigError, match="fp8"):         # an int8 model with an fp8 head? no such plan;
        check_activations(plan(tiny_qwen3, "fp8", 128, "model"), "int8")   # an fp8 model's own head
    check_activations(plan(tiny_qwen3, "int8", 128, "int8"), "int8")


def _greedy(runner, steps: int = 8, forced: list[list[int]] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and logits of 2 sequences; forced: feed these tokens instead (teacher forcing)."""
    from moed.model.batch import ForwardBatch
    prompts = [[5, 17, 33, 2, 9, 100, 7], [40, 41, 3, 3, 250, 12, 1, 90, 66, 4, 8]]
    start, toks, out, logits_all = [0, 0], prompts, [[], []], []
    for step in range(steps):
        logits = runner.forward(ForwardBatch(token_ids=toks, start_pos=list(start), block_tables=[[0, 1], [2, 3]]))
        logits_all.append(logits.float().clone())
        start = [s + len(t) for s, t in zip(start, toks)]
        toks = [[int(v)] for v in logits.argmax(-1)] if forced is None else [[f[step]] for f in forced]
        for i, t in enumerate(toks):
            out[i].append(t[0])
    return out, logits_all


@pytest.mark.skipif(K.cpu_kernels() is None, reason="native CPU kernels off")
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_engine_runs_the_integer_path_close_to_none(tiny_qwen3, monkeypatch, fmt):
    """A tiny qwen3_moe quantized at load with quantization_activations int8: every quantized
    Linear of a decode step calls moed_qdot_linear and every MoE layer's call passes act (the spy
    fails otherwise); the default ("none") never does. Closeness (the measure): teacher-forced on
    the "none" run's greedy tokens (a random tiny model's logits are flat; one flipped argmax
    would derail a free run), the same greedy token in >= 80% of steps (measured 100%), and the
    prompt's logits no more than 4x as far from the float32 run (relative L2) as "none"'s
    (measured ~1.9x: 2.1% vs 1.1%; each quantized matmul alone is ~0.7% off the exact product).
    Decode steps are not bounded: this random model amplifies a perturbation step to step (the
    bf16 "none" run itself reaches 20% from float32 at some steps)."""
    from moed.model.runner import ModelRunner

    def runner(act: str) -> ModelRunner:
        return ModelRunner(tiny_qwen3, dtype="bfloat16", device="cpu", num_blocks=16, block_size=16,
                           quantization=fmt, quantization_group_size=32, quantization_activations=act)
    on = runner("int8")
    on.native_decode = None     # the layered path's calls, spied (the native step: test_decode_step_quant.py)
    lib = on.ctx.for_weight(on.model.lm_head.quant if on.model.lm_head.quant is not None else
                            on.model.layers[0].attn.qkv.quant).lib
    calls, acts = [], []
    real, real_act = lib.moed_qdot_linear, kq.experts_act
    monkeypatch.setattr(lib, "moed_qdot_linear", lambda *a: calls.append(a[2]) or real(*a))
    monkeypatch.setattr(kq, "experts_act", lambda *a: acts.append(real_act(*a)) or acts[-1])
    off = runner("none")
    off.native_decode = None
    want, want_logits = _greedy(off)
    assert not calls and not any(acts), "the default took the integer path"
    acts.clear()
    got, got_logits = _greedy(on, forced=want)
    n_layers = len(on.model.layers)
    assert acts == [1] * (8 * n_layers), acts
    assert calls.count(2) >= 7 * 2 * n_layers, "a decode step's Linears left moed_qdot_linear"
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) / sum(map(len, want))
    monkeypatch.undo()
    exact = _greedy(ModelRunner(tiny_qwen3, dtype="float32", device="cpu", num_blocks=16, block_size=16,
                                quantization=fmt, quantization_group_size=32), steps=1)[1][0]
    rel = lambda a: float((a - exact).norm() / exact.norm())        # noqa: E731
    assert same >= 0.8, (got, want)
    assert rel(got_logits[0]) <= 4 * rel(want_logits[0]), (rel(got_logits[0]), rel(want_logits[0]))
