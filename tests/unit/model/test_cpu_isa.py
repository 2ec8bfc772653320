"""The native kernels' ISA variants (moed/model/kernels: avx512bf16, avx512, avx2): which one loads,
MOED_CPU_ISA forcing and refusing, the cache keeping them apart, and the bitwise contract.

The contract: every variant computes each output in the same order with the same roundings,
so all variants are bitwise equal to each other, and the matmul to a reference that spells
that order out (fp32, per k pair: + x_odd * w_odd, then + x_even * w_even, each rounded once:
what vdpbf16ps does and cpu_avx2.h's two FMAs do; bf16 products are exact in fp32, so torch's
multiply-then-add rounds exactly once per step too). Every pair of variants is compared bitwise;
a variant this CPU cannot run skips with why: an AVX512 machine (no BF16: Skylake-SP to Ice Lake)
runs avx512 and avx2, one with AVX512-BF16 all three, an AVX2-only one avx2 alone.
The torch-tolerance tests of tests/unit/model/test_cpu_kernels.py and the native decode step's
bitwise test run on every variant too (their `kern` fixtures are parametrized by variant).
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from moed.model import kernels as K
from moed.model.batch import ForwardBatch
from moed.model.kernels.choice import NATIVE_ONLY, FixedChooser

from conftest import forced_isa, isa_pair_params, isa_params     # tests/unit/model/conftest.py
from torch_threads import threads               # tests/unit/model/torch_threads.py

HAVE_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler to build the kernels")
AVX2_ONLY = K.ISA_NEEDS["avx2"] | {"sse4_2", "popcnt"}     # a Zen3's flags, as far as the loader looks
ICE_LAKE = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}    # AVX512, no BF16
NOT_FMA_ORDER = ("this CPU's vdpbf16ps does not sum as two FMAs, odd element first (moed_dot_order_matches "
                 "in cpu_bf16.c; measured so on Sapphire Rapids): the variants cannot be bitwise equal here")


def _reference_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] @ w [N, K]^T in the kernels' order, in torch: fp32, k pairs in order, odd
    element first; bias added in fp32; one round to bf16 (nearest even)."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for kp in range(x.shape[1] // 2):
        for j in (2 * kp + 1, 2 * kp):
            acc = acc + xf[:, j, None] * wf[None, :, j]       # exact product, one rounding: an FMA
    if bias is not None:
        acc = acc + bias.float()
    return acc.bfloat16()


def _order_sensitive(g: torch.Generator, rows: int, kk: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x, w whose dot products depend on the summation order at bf16 resolution: every third
    k pair adds +-2^16-sized products that cancel within the pair, so what survives of the
    running sum depends on which of the two came first (random data alone hides fp32 order in
    the final bf16 rounding nearly always)."""
    x = torch.randn(rows, kk, generator=g)
    w = torch.randn(n, kk, generator=g) * 0.1
    big = torch.arange(0, kk // 2, 3)
    x[:, 2 * big] = x[:, 2 * big + 1] = 16.0
    s = 4096.0 * (1 + torch.rand(n, len(big), generator=g))
    w[:, 2 * big + 1], w[:, 2 * big] = s, -s
    return x.bfloat16(), w.bfloat16()


@needs_cc
@pytest.mark.parametrize("isa", isa_params())
def test_linear_is_bitwise_the_reference(isa):
    """Row tiles (1, 2, 3 rows; 2 + 2; 8 + 1; 17; 34: the AVX2 variant's 32 rows per widened
    block + 2), column tails, K of one pair and of several of the AVX2 kernel's input chunks (128
    pairs) and widened weight panels (64 pairs; 65 = one + one), bias or none, 1-2 threads;
    data whose bf16 results depend on the accumulation order."""
    k = K.load(isa)
    assert k.dot_order_ok, NOT_FMA_ORDER
    g = torch.Generator().manual_seed(1)
    for rows, kk, n in ((1, 64, 96), (2, 100, 33), (3, 2, 40), (9, 256, 70), (17, 38, 32), (5, 600, 40),
                        (4, 130, 40), (34, 130, 40)):
        x, w = _order_sensitive(g, rows, kk, n)
        other_order = _reference_linear(x.view(rows, -1, 2).flip(-1).reshape(rows, kk),
                                        w.view(n, -1, 2).flip(-1).reshape(n, kk), None)
        if kk > 2:      # the test can tell the orders apart
            assert not torch.equal(other_order, _reference_linear(x, w, None))
        b = torch.randn(n, generator=g).bfloat16()
        packed = k.pack(w)
        for n_threads in (1, 2):
            with threads(n_threads):
                assert torch.equal(k.linear_bf16(x, packed, n), _reference_linear(x, w, None)), (isa, rows, kk, n)
                assert torch.equal(k.linear_bf16(x, packed, n, b), _reference_linear(x, w, b)), (isa, rows, kk, n)


@needs_cc
@pytest.mark.parametrize("isa_a,isa_b", isa_pair_params())
def test_variants_are_bitwise_equal_kernel_by_kernel(isa_a, isa_b):
    """Every entry point, each pair of variants, on shapes that take the vector tails, the
    chunked MoE path (many rows, 2 threads), every row tile and every attention head size."""
    a, b = K.load(isa_a), K.load(isa_b)
    assert a.dot_order_ok and b.dot_order_ok, NOT_FMA_ORDER
    g = torch.Generator().manual_seed(2)
    H, I, E, P, topk = 80, 40, 7, 9, 3
    router = a.pack(torch.randn(E, H, generator=g).bfloat16())
    gate_up = a.pack((torch.randn(P, 2 * I, H, generator=g) * 0.1).bfloat16())
    down = a.pack((torch.randn(P, H, I, generator=g) * 0.1).bfloat16())
    l2p = torch.tensor([[0, 7], [1, 1], [2, 8], [3, 3], [4, 4], [5, 5], [6, 6]])
    nrep = torch.tensor([2, 1, 2, 1, 1, 1, 1])

    def moe(k, x):
        load = torch.zeros(E, dtype=torch.long)
        out = k.moe_bf16(x, router, E, topk, True, l2p, nrep, load, gate_up, down, I, offset=1)
        phys, wts = k.route_bf16(x, router, E, topk, True, l2p, nrep, None, P, offset=1)
        counts = torch.bincount(phys.flatten(), minlength=P)
        xs = x[phys.flatten().argsort(stable=True) // topk]
        return out, load, phys, wts, k.experts_bf16(xs, counts, gate_up, down, I)

    def same(x, y):
        assert type(x) is type(y)
        if isinstance(x, tuple):
            for u, v in zip(x, y):
                same(u, v)
        else:
            assert torch.equal(x, y), f"differ by {(x.float() - y.float()).abs().max()}"

    with threads(2):
        for t in (1, 5, 300):                     # decode rows; many rows: handed-out chunks
            x = torch.randn(t, H, generator=g).bfloat16()
            same(moe(a, x), moe(b, x))
        w, bias = torch.randn(70, 600, generator=g).bfloat16(), torch.randn(70, generator=g).bfloat16()
        for rows in (*range(1, 18), 34):          # every row tile, 8 + 8 + 1, 32 + 2; K of 3 input chunks
            x = torch.randn(rows, 600, generator=g).bfloat16()
            same(a.linear_bf16(x, a.pack(w), 70, bias), b.linear_bf16(x, b.pack(w), 70, bias))
        codes = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        same(a.fp8_to_bf16(codes).view(torch.int16), b.fp8_to_bf16(codes).view(torch.int16))    # NaN codes too
        h, delta = torch.randn(9, 100, generator=g).bfloat16(), torch.randn(9, 100, generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(100, generator=g)).bfloat16()
        same(a.rms_norm_bf16(h, w, 1e-6, delta), b.rms_norm_bf16(h, w, 1e-6, delta))
        for d in (32, 64, 128, 256):
            hq, hkv, bs = 8, 2, 16
            qkv = torch.randn(5, (hq + 2 * hkv) * d, generator=g).bfloat16()
            qk_w = (1 + 0.1 * torch.randn(hq + hkv, d, generator=g)).bfloat16()
            cos, sin = torch.randn(5, 1, d, generator=g).bfloat16(), torch.randn(5, 1, d, generator=g).bfloat16()
            same(a.qk_norm_rope_bf16(qkv, hq + hkv, d, qk_w, 1e-6, cos, sin),
                 b.qk_norm_rope_bf16(qkv, hq + hkv, d, qk_w, 1e-6, cos, sin))
            cache = torch.randn(16, 2, bs, hkv, d, generator=g).bfloat16()
            q = torch.randn(3, hq, d, generator=g).bfloat16()
            tables = torch.stack([torch.randperm(16, generator=g)[:13] for _ in range(3)])
            lens = torch.tensor([1, 133, 200])      # AVX2 widens values 16-128 keys a tile
            same(a.decode_attn_bf16(q, cache, tables, lens, 0.1), b.decode_attn_bf16(q, cache, tables, lens, 0.1))
            n, start = 21, 30
            qp = torch.randn(n, hq, d, generator=g).bfloat16()
            kp, vp = torch.randn(2, start + n, hkv, d, generator=g).bfloat16()
            same(a.prefill_attn_bf16(qp, kp, vp, start, 0.1), b.prefill_attn_bf16(qp, kp, vp, start, 0.1))
        logits = torch.randn(4, 32001, generator=g)
        logits[1, 5] = float("nan")
        same(a.argmax_f32(logits), b.argmax_f32(logits))


_MODEL_RUNS: dict = {}       # variant -> its run (a variant in several pairs runs once)


@needs_cc
@pytest.mark.parametrize("isa_a,isa_b", isa_pair_params())
def test_variants_are_bitwise_equal_through_a_model(make_checkpoint, isa_a, isa_b):
    """A whole model, prefill then native decode steps: the same logits, KV bytes and expert
    loads on each pair of variants (softmax, exp, silu, rounding: all of it, end to end)."""
    from moed.model.runner import ModelRunner

    assert K.load(isa_a).dot_order_ok and K.load(isa_b).dot_order_ok, NOT_FMA_ORDER
    ckpt = make_checkpoint("qwen3_moe", seed=5)
    for isa in (isa_a, isa_b):
        if isa in _MODEL_RUNS:
            continue
        with forced_isa(isa) as k:
            saved, k.choose = k.choose, FixedChooser(NATIVE_ONLY)
            try:
                r = ModelRunner(ckpt, dtype="bfloat16", device="cpu", attention_backend="torch",
                                num_blocks=16, block_size=16)
                assert r.ctx.kernels is k and r.native_decode is not None
                assert r._kernel_classes() == f"1:{isa} 2-8:{isa} 9-64:{isa} 65-512:{isa} >512:{isa}"
                prompts, tables = [[5, 6, 7, 8, 9] * 4, [11, 12, 13]], [[0, 1, 2], [3, 4, 5]]
                out = [r.forward(ForwardBatch(prompts, [0, 0], tables))]
                pos = [20, 3]
                for _ in range(3):
                    out.append(r.forward(ForwardBatch([[int(t)] for t in out[-1].argmax(-1)], pos, tables)))
                    pos = [p + 1 for p in pos]
                _MODEL_RUNS[isa] = (out, r.kv_cache.clone(), r.model.expert_load.clone())
            finally:
                k.choose = saved
    (la, kva, ea), (lb, kvb, eb) = _MODEL_RUNS[isa_a], _MODEL_RUNS[isa_b]
    assert all(torch.equal(x, y) for x, y in zip(la, lb))
    assert torch.equal(kva, kvb) and torch.equal(ea, eb)


def test_what_serves_each_row_class_is_summed_over_shapes():
    """model_runner_ready's kernel_classes: the variant, oneDNN, or both with oneDNN's share."""
    from moed.model.kernels.choice import LinearChoice, by_class

    a, b = LinearChoice((False, False, False, True, True)), LinearChoice((False, False, True, False, True))
    assert by_class([a, b], "avx2") == "1:avx2 2-8:avx2 9-64:avx2+onednn(1/2) 65-512:avx2+onednn(1/2) >512:onednn"
    assert by_class([], "avx2") == "none"


def test_auto_picks_the_fastest_variant_the_cpu_runs(monkeypatch):
    monkeypatch.delenv(K.ISA_ENV, raising=False)
    monkeypatch.setattr(K, "cpu_flags", lambda: ICE_LAKE | {"avx512_bf16"})   # Zen4, Sapphire Rapids
    assert K.isa_from_env() == "avx512bf16" and K.runnable_isas() == ["avx512bf16", "avx512", "avx2"]
    monkeypatch.setattr(K, "cpu_flags", lambda: ICE_LAKE)
    assert K.isa_from_env() == "avx512" and K.runnable_isas() == ["avx512", "avx2"]
    assert K.isa_missing("avx512bf16") == "CPU lacks avx512_bf16"
    monkeypatch.setattr(K, "cpu_flags", lambda: AVX2_ONLY)                     # Zen3
    assert K.isa_from_env() == "avx2" and K.isa_missing("avx512bf16") == "CPU lacks avx512_bf16, avx512bw, avx512f, avx512vl"
    assert K.isa_missing("avx512") == "CPU lacks avx512bw, avx512f, avx512vl"
    monkeypatch.setenv(K.ISA_ENV, "auto")
    assert K.isa_from_env() == "avx2"
    monkeypatch.setattr(K, "cpu_flags", lambda: frozenset({"sse2", "avx"}))    # too old for any
    assert K.isa_from_env() is None and not K.cpu_flags_ok()


def test_forcing_refuses_what_is_no_variant_or_cannot_run(monkeypatch):
    monkeypatch.setenv(K.ISA_ENV, "avx512f")
    with pytest.raises(K.IsaRefused, match="names no kernel variant; use auto, avx512bf16, avx512, avx2"):
        K.isa_from_env()
    monkeypatch.setenv(K.ISA_ENV, "amx")
    with pytest.raises(K.IsaRefused, match="no AMX variant is built yet"):
        K.isa_from_env()
    monkeypatch.setattr(K, "cpu_flags", lambda: AVX2_ONLY)
    monkeypatch.setenv(K.ISA_ENV, "AVX512BF16")                                 # any case
    with pytest.raises(K.IsaRefused, match=r"cannot run it \(CPU lacks avx512_bf16.*it runs: avx2"):
        K.isa_from_env()
    monkeypatch.setenv(K.ISA_ENV, "avx512")
    with pytest.raises(K.IsaRefused, match=r"avx512: this CPU cannot run it \(CPU lacks avx512bw, avx512f, "
                                           r"avx512vl\); it runs: avx2"):
        K.isa_from_env()
    monkeypatch.setattr(K, "cpu_flags", lambda: ICE_LAKE)
    monkeypatch.setenv(K.ISA_ENV, "avx512bf16")
    with pytest.raises(K.IsaRefused, match=r"\(CPU lacks avx512_bf16\); it runs: avx512, avx2"):
        K.isa_from_env()
    monkeypatch.setenv(K.ISA_ENV, "avx512")
    assert K.isa_from_env() == "avx512"
    monkeypatch.setattr(K, "cpu_flags", lambda: AVX2_ONLY)
    K.cpu_kernels.cache_clear()
    try:          # the serving path raises too: a forced variant is never quietly replaced
        with pytest.raises(K.IsaRefused):
            K.cpu_kernels()
    finally:
        K.cpu_kernels.cache_clear()
    monkeypatch.setenv(K.ISA_ENV, "avx2")
    assert K.isa_from_env() == "avx2"


def test_the_setting_is_a_known_moed_variable_checked_with_the_config(tmp_path):
    from moed.config import CPU_ISA_VALUES, ConfigError, load, unknown_env

    assert unknown_env({K.ISA_ENV: "avx2"}) == []
    assert CPU_ISA_VALUES == ("auto", *K.ISAS)
    env = {"MOED_MODEL_PATH": str(tmp_path)}
    assert load(environ={**env, K.ISA_ENV: "AVX2"}) is not None
    assert load(environ={**env, K.ISA_ENV: "avx512"}) is not None
    with pytest.raises(ConfigError, match="MOED_CPU_ISA='amx': not one of auto, avx512bf16, avx512, avx2"):
        load(environ={**env, K.ISA_ENV: "amx"})


def test_serve_refuses_a_forced_variant_the_cpu_cannot_run_before_loading(make_checkpoint, monkeypatch):
    """moed serve / check-config's pre-flight: a one-line ConfigError, before any weight is read."""
    from moed import preflight
    from moed.config import ConfigError, load

    cfg = load(environ={"MOED_MODEL_PATH": str(make_checkpoint("qwen3_moe")), "MOED_MODEL_DEVICE": "cpu",
                        K.ISA_ENV: "avx512bf16"})
    monkeypatch.setenv(K.ISA_ENV, "avx512bf16")
    monkeypatch.setattr(K, "cpu_flags", lambda: AVX2_ONLY)
    with pytest.raises(ConfigError, match="environment: MOED_CPU_ISA=avx512bf16: this CPU cannot run it"):
        preflight.check(cfg)
    monkeypatch.setenv(K.ISA_ENV, "avx2")
    preflight.check(cfg)


@pytest.fixture(scope="module")
def built() -> dict:
    """Every variant in the session's kernel cache (the tests that force a variant build most
    of them there anyway; a fresh cache would compile all three again, ~20 s)."""
    return {isa: K.build(None, isa) for isa in K.ISAS}


@needs_cc
def test_cache_keeps_variants_apart_and_checks_at_load(built, monkeypatch):
    """Each variant has its own .so name; a .so is refused as another variant, and a CPU that
    cannot run a variant never loads its .so (a cache filled on an AVX512 machine is safe on a
    Zen3: it loads the avx2 file beside it)."""
    paths = built
    assert len(set(paths.values())) == len(K.ISAS)
    assert all(f"-{isa}-" in p.name for isa, p in paths.items())
    runs = K.runnable_isas()
    if runs:
        isa = runs[0]
        other = next(i for i in K.ISAS if i != isa)
        with pytest.raises(K.KernelUnavailable, match=f"is the {isa} variant, not {other}"):
            K.CpuKernels(paths[isa], other)
        assert K.CpuKernels(paths[isa], isa).isa == isa
    monkeypatch.setattr(K, "cpu_flags", lambda: AVX2_ONLY)

    def no_load(*a, **kw):
        raise AssertionError("loaded a .so this CPU cannot run")

    monkeypatch.setattr(K, "load", K.load.__wrapped__)         # uncached: a fresh process
    monkeypatch.setattr(K.ctypes, "CDLL", no_load)
    for isa in ("avx512bf16", "avx512"):
        with pytest.raises(K.KernelUnavailable, match=f"cannot run the {isa} kernels"):
            K.load(isa)


@needs_cc
@pytest.mark.skipif(not shutil.which("objdump"), reason="no objdump to read the AVX2 build's code")
def test_avx2_build_holds_no_avx512_instruction(built):
    """The AVX2 .so must run on a CPU without AVX-512: no zmm register and no mask register
    anywhere in its code (cpu_avx2.h shadows every 512-bit intrinsic cpu_bf16.c uses)."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(built["avx2"])],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert "ymm" in text
    bad = [line for line in text.splitlines() if "zmm" in line or "%k" in line.split("#")[0]]
    assert not bad, bad[:5]


@needs_cc
@pytest.mark.skipif(not shutil.which("objdump"), reason="no objdump to read the AVX512 build's code")
def test_avx512_build_holds_no_bf16_instruction(built):
    """The avx512 .so must run on a CPU without AVX512-BF16 (Skylake-SP to Ice Lake): 512-bit
    code, but no vdpbf16ps / vcvtneps2bf16 / vcvtne2ps2bf16 (cpu_avx512.h does their work)."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(built["avx512"])],
                          capture_output=True, text=True, timeout=60, check=True).stdout
    assert "zmm" in text
    bad = [line for line in text.splitlines() if "vdpbf16ps" in line or "ps2bf16" in line]
    assert not bad, bad[:5]
