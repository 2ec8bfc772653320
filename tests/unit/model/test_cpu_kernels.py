"""The native CPU kernels (moed/model/kernels) against the torch paths they replace, in bf16.

Each kernel mirrors the torch path's bf16 roundings, so outputs agree to a bf16 ulp or two
(fp32 summation order differs). Thread counts 1-3 run every split and barrier path (tests
otherwise run with OMP_NUM_THREADS=1). These run on every kernel variant the CPU runs (the `kern`
fixture is parametrized by variant: an AVX512-BF16 machine runs the AVX2 variant's too; one the
CPU cannot run skips with why) wherever there is a C compiler (CI has one): there a build failure
is a test failure, not a skip. Bitwise checks between variants: test_cpu_isa.py.
"""
from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moed.model import kernels as K
from moed.model.attention.torch_backend import TorchBackend
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.kernels.choice import NATIVE_ONLY, FixedChooser
from moed.model.kv_layout import KVLayout
from moed.model.layers import Rotary, apply_rotary, rms_norm
from moed.model.moe import MoELayer
from moed.model.hf_config import load_spec

from conftest import forced_isa, isa_params     # tests/unit/model/conftest.py
from torch_threads import threads     # tests/unit/model/torch_threads.py

CPU = torch.device("cpu")
TORCH_BF16 = ComputeContext(CPU, torch.bfloat16)            # the torch path, no packing


def _ctx(kern: K.CpuKernels, pack: bool = False) -> ComputeContext:
    return ComputeContext(CPU, torch.bfloat16, pack=pack, kernels=kern)


def _backend(spec, ctx: ComputeContext) -> TorchBackend:
    kv = KVLayout.gqa(spec.num_layers, spec.num_kv_heads, spec.head_dim, 16, torch.bfloat16)
    return TorchBackend(spec, kv, ctx)


pytestmark = [
    pytest.mark.skipif(not K.cpu_flags_ok(), reason="CPU runs no kernel variant (x86-64 AVX2+FMA or AVX512-BF16)"),
    pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                       reason="no C compiler to build the kernels (moed then runs the torch path)"),
]


@pytest.fixture(scope="module", params=isa_params())
def kern(request) -> K.CpuKernels:
    """Each kernel variant this CPU runs, in turn, forced (MOED_CPU_ISA) so the contexts and
    runners the tests build take it too; the others skip with why."""
    with forced_isa(request.param) as k:
        saved, k.choose = k.choose, FixedChooser(NATIVE_ONLY)    # these tests check the native kernels
        yield k
        k.choose = saved


def _close(a: torch.Tensor, b: torch.Tensor, ulps: float = 2) -> None:
    """Equal to within `ulps` bf16 ulps of the larger magnitude (bf16 ulp = 2^-7 relative)."""
    a, b = a.float(), b.float()
    tol = ulps * 2.0 ** -7 * torch.maximum(a.abs(), b.abs()) + 1e-6
    bad = (a - b).abs() > tol
    assert not bad.any(), f"{int(bad.sum())} of {a.numel()} differ; worst {(a - b).abs().max().item()}"


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("rows,k,n", [(1, 64, 96), (2, 100, 33), (5, 1024, 64), (8, 96, 129), (19, 256, 40), (16, 2, 7)])
def test_linear_matches_fp32(kern, n_threads, rows, k, n):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    packed = kern.pack(w)
    assert packed.shape == (-(-n // 32), k // 2, 32, 2)
    with threads(n_threads):
        y, yb = kern.linear_bf16(x, packed, n), kern.linear_bf16(x, packed, n, b)
    ref = x.float() @ w.float().T
    _close(y, ref.bfloat16())
    _close(yb, (ref + b.float()).bfloat16())


def _moe(spec, gen, extra_physical: int = 0, scale: float = 0.1):
    E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    router = torch.randn(E, H, generator=gen).bfloat16()
    gate_up = (torch.randn(E, 2 * I, H, generator=gen) * scale).bfloat16()
    down = (torch.randn(E, H, I, generator=gen) * scale).bfloat16()
    if extra_physical:      # replicas of experts 0 and 2 in physical slots E, E + 1
        gate_up, down = torch.cat([gate_up, gate_up[[0, 2]]]), torch.cat([down, down[[0, 2]]])
    return router, gate_up, down


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("arch,kw", [
    ("qwen3_moe", dict(num_experts=7, top_k=3, hidden_size=80, moe_intermediate_size=40)),   # K tails
    ("mixtral", dict(num_experts=8, top_k=2)),                                             # no renorm
])
def test_moe_matches_torch_path(kern, make_checkpoint, n_threads, arch, kw):
    spec = load_spec(make_checkpoint(arch, **kw))
    g = torch.Generator().manual_seed(n_threads)
    router, gate_up, down = _moe(spec, g)
    E = spec.num_experts
    torch_load, kern_load = torch.zeros(E, dtype=torch.long), torch.zeros(E, dtype=torch.long)
    ref_layer = MoELayer(spec, router, gate_up, down, torch_load, TORCH_BF16)
    layer = MoELayer(spec, router, gate_up, down, kern_load, _ctx(kern))
    for t in (1, 3, 8, 16):
        x = torch.randn(t, spec.hidden_size, generator=g).bfloat16()
        with threads(n_threads):
            out = layer(x)
        _close(out, ref_layer(x), ulps=3)
    assert torch.equal(kern_load, torch_load) and int(kern_load.sum()) == 28 * spec.top_k


def test_moe_replicas_and_bad_map(kern, make_checkpoint):
    spec = load_spec(make_checkpoint("qwen3_moe", num_experts=5, num_kv_heads=1))
    g = torch.Generator().manual_seed(7)
    router, gate_up, down = _moe(spec, g, extra_physical=2)
    E = spec.num_experts
    ref = MoELayer(spec, router, gate_up, down, torch.zeros(E, dtype=torch.long), TORCH_BF16)
    rep = MoELayer(spec, router, gate_up, down, torch.zeros(E, dtype=torch.long), _ctx(kern))
    l2p, nrep = torch.tensor([[0, 5], [1, 1], [2, 6], [3, 3], [4, 4]]), torch.tensor([2, 1, 2, 1, 1])
    ref.set_expert_map(l2p, nrep)
    rep.set_expert_map(l2p.int(), nrep.int())          # any integer dtype: stored as int64
    x = torch.randn(12, spec.hidden_size, generator=g).bfloat16()
    _close(rep(x), ref(x), ulps=3)
    # A map pointing past the physical experts is refused by the kernel too (never read out of bounds).
    rep.router.logical_to_physical = torch.tensor([[0, 9], [1, 1], [2, 2], [3, 3], [4, 4]])
    with pytest.raises(RuntimeError, match="expert map"):
        rep(x)


def _paged_case(gen, hq: int, hkv: int, d: int, lens: list[int], bs: int = 16):
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 3
    perm = torch.randperm(nb, generator=gen).tolist()          # blocks scattered over the pool
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    cache = torch.randn(nb, 2, bs, hkv, d, generator=gen).bfloat16()
    b = len(lens)
    qkv_width = (hq + 2 * hkv) * d
    q = torch.randn(b, qkv_width, generator=gen).bfloat16()[:, :hq * d].view(b, hq, d)   # strided rows
    k, v = torch.randn(b, hkv, d, generator=gen).bfloat16(), torch.randn(b, hkv, d, generator=gen).bfloat16()
    batch = ForwardBatch([[1]] * b, [n - 1 for n in lens], tables)
    return cache, q, k, v, batch, torch.tensor([n - 1 for n in lens])


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("hq,hkv,d", [(16, 4, 64), (4, 4, 32), (6, 2, 128), (8, 1, 256), (4, 2, 96)])
def test_decode_attention_matches_torch_path(kern, make_checkpoint, n_threads, hq, hkv, d):
    spec = load_spec(make_checkpoint("qwen3_moe", num_heads=hq, num_kv_heads=hkv, head_dim=d))
    g = torch.Generator().manual_seed(hq + d)
    cache, q, k, v, batch, pos = _paged_case(g, hq, hkv, d, [1, 15, 16, 17, 100, 33])
    ref_be = _backend(spec, TORCH_BF16)
    assert ref_be.kernels is None
    be = _backend(spec, ComputeContext.build(CPU, torch.bfloat16))
    assert be.kernels is (None if d == 96 else kern)     # other head sizes keep the torch path
    outs = []
    for backend in (ref_be, be):
        backend.plan(batch, pos)
        c = cache.clone()
        with threads(n_threads):
            outs.append(backend.forward(0, q, k, v, c))
    _close(outs[1], outs[0])


def test_mixed_batch_decode_rows_take_the_kernel(kern, make_checkpoint):
    """A step with a prefill chunk among decode sequences: the decode rows go to the decode
    kernel, the chunk to the prefill kernel, and the result matches the torch path (the chunk
    to within a bf16 ulp of its largest output: the prefill kernel takes the exact row max
    where SDPA's flash kernel rescales by a running one, so its bf16 roundings of exp differ)."""
    spec = load_spec(make_checkpoint("qwen3_moe"))
    hq, hkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    g = torch.Generator().manual_seed(21)
    cache = torch.randn(12, 2, 16, hkv, d, generator=g).bfloat16()
    batch = ForwardBatch([[1], [1, 2, 3], [1]], [20, 30, 5], [[0, 1], [2, 3, 4], [5]])
    pos = torch.tensor([20, 30, 31, 32, 5])
    q = torch.randn(5, hq, d, generator=g).bfloat16()
    k, v = torch.randn(5, hkv, d, generator=g).bfloat16(), torch.randn(5, hkv, d, generator=g).bfloat16()
    outs = []
    for use in (None, kern):
        be = _backend(spec, TORCH_BF16 if use is None else _ctx(use))
        assert be.kernels is use
        be.plan(batch, pos)
        outs.append(be.forward(0, q, k, v, cache.clone()))
    dec = [0, 4]
    _close(outs[1][dec], outs[0][dec])
    chunk_err = (outs[1][1:4].float() - outs[0][1:4].float()).abs().max()
    assert chunk_err <= 2.0 ** -7 * outs[0][1:4].float().abs().max()


def test_decode_attention_refuses_bad_block_ids(kern):
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(4, 2, 16, 2, 64, generator=g).bfloat16()
    q = torch.randn(1, 4, 64, generator=g).bfloat16()
    with pytest.raises(RuntimeError, match="block id"):
        kern.decode_attn_bf16(q, cache, torch.tensor([[0, 7]]), torch.tensor([20]), 0.125)
    with pytest.raises(RuntimeError, match="block id"):
        kern.decode_attn_bf16(q, cache, torch.tensor([[0]]), torch.tensor([20]), 0.125)   # table too short


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("hidden,head_dim", [(192, 64), (100, 40)])      # 16-lane tails too
def test_norms_and_rotary_match_torch(kern, n_threads, hidden, head_dim):
    g = torch.Generator().manual_seed(5)
    h, delta = torch.randn(9, hidden, generator=g).bfloat16(), torch.randn(9, hidden, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16()
    with threads(n_threads):
        out, resid = kern.rms_norm_bf16(h, w, 1e-6, delta)
        plain, same = kern.rms_norm_bf16(h, w, 1e-6)
    assert torch.equal(resid, h + delta) and same is h
    _close(out, rms_norm(h + delta, w, 1e-6))
    _close(plain, rms_norm(h, w, 1e-6))

    hq, hkv, d, t = 6, 2, head_dim, 5
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).bfloat16()
    qk_w = (1 + 0.1 * torch.randn(hq + hkv, d, generator=g)).bfloat16()
    rot = Rotary(d, 10000.0, 64, torch.bfloat16, torch.device("cpu"))
    cos, sin = rot.tables(torch.tensor([0, 3, 7, 31, 63]), 63)
    qk = qkv[:, :(hq + hkv) * d].view(t, hq + hkv, d)
    for weight, ref in ((qk_w, apply_rotary(rms_norm(qk, qk_w, 1e-6), cos, sin)), (None, apply_rotary(qk, cos, sin))):
        with threads(n_threads):
            got = kern.qk_norm_rope_bf16(qkv, hq + hkv, d, weight, 1e-6, cos, sin)
        _close(got, ref)


@pytest.fixture(scope="module")
def fresh_build(tmp_path_factory) -> Path:
    """This CPU's variant compiled into a fresh cache, once for the two tests below (a fresh
    build is the slow part: ~8 s on two cores)."""
    return K.build(tmp_path_factory.mktemp("fresh"))


def test_build_is_cached_and_failures_are_clear(fresh_build, tmp_path, monkeypatch):
    first = fresh_build
    assert first.is_file() and first.name.startswith(f"moed_cpu_bf16-{K.best_isa()}-")
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]     # no temp file left
    shutil.copy2(first, tmp_path / first.name)
    first = tmp_path / first.name
    mtime = first.stat().st_mtime_ns
    assert K.build(tmp_path) == first and first.stat().st_mtime_ns == mtime    # reused, not rebuilt

    # No compiler: a cache built ahead of time still serves; an empty one says why it cannot.
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert K.build(tmp_path) == first
    with pytest.raises(K.KernelUnavailable, match="does not run"):
        K.build(tmp_path / "other")
    monkeypatch.delenv("CC")

    blocker = tmp_path / "a-file"          # a cache path under a file: unwritable even for root
    blocker.write_text("")
    with pytest.raises(K.KernelUnavailable, match="not writable"):
        K.build(blocker / "cache")


def test_cli_builds_kernels_ahead_of_time(fresh_build, tmp_path, capsys, monkeypatch):
    """An image built on a machine without AVX512-BF16: every variant is built and its path
    printed (stdout stays just the paths), the AVX512 loads are skipped and say why; the same
    cache then serves this CPU without building again. The cache starts with this CPU's
    variant (fresh_build's copy: found, not built); the CLI compiles the others, at once."""
    from moed.cli import main

    (tmp_path / "k").mkdir()
    seeded = shutil.copy2(fresh_build, tmp_path / "k" / fresh_build.name)
    real_flags = K.cpu_flags
    monkeypatch.setattr(K, "cpu_flags", lambda: K.ISA_NEEDS["avx2"])        # an AVX2-only CPU
    assert main(["model", "kernels", "--cache", str(tmp_path / "k")]) == 0
    out, err = capsys.readouterr()
    paths = [Path(p) for p in out.split()]                                  # every variant, one a line
    assert all(p.parent == tmp_path / "k" and p.is_file() for p in paths) and len(paths) == len(K.ISAS)
    assert Path(seeded) in paths and len(list((tmp_path / "k").iterdir())) == len(K.ISAS)  # no temp left
    assert "avx512bf16 built, not loaded: CPU lacks avx512_bf16" in err
    assert "avx512 built, not loaded: CPU lacks avx512bw, avx512f, avx512vl" in err

    monkeypatch.setattr(K, "cpu_flags", real_flags)
    mtimes = [p.stat().st_mtime_ns for p in paths]
    assert main(["model", "kernels", "--cache", str(tmp_path / "k")]) == 0
    assert [Path(p) for p in capsys.readouterr().out.split()] == paths == \
        [K.build(tmp_path / "k", isa) for isa in K.ISAS]
    assert [p.stat().st_mtime_ns for p in paths] == mtimes                 # found, not rebuilt
    (tmp_path / "f").write_text("")
    assert main(["model", "kernels", "--cache", str(tmp_path / "f" / "k")]) == 1
    assert "cannot be built here" in capsys.readouterr().err


def test_no_compiler_and_no_cache_serves_on_the_torch_path(tmp_path, monkeypatch, make_checkpoint):
    """The operator's compiler-less host: cpu_kernels() gives None (not an error) and a bf16
    model loads and runs on the torch path, saying so."""
    from moed.model.batch import ForwardBatch
    from moed.model.runner import ModelRunner

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MOED_KERNEL_CACHE", str(tmp_path / "empty"))
    K.cpu_kernels.cache_clear()
    monkeypatch.setattr(K, "load", functools.cache(K.load.__wrapped__))     # a fresh process: nothing loaded
    try:
        assert K.cpu_kernels() is None
        r = ModelRunner(make_checkpoint("qwen3_moe"), dtype="bfloat16", device="cpu",
                        attention_backend="torch", num_blocks=8, block_size=16)
        assert r.describe()["cpu_kernels"] == "off" and r.backend.kernels is None
        logits = r.forward(ForwardBatch([[5, 6, 7]], [0], [[0]]))
        assert logits.shape == (1, r.spec.vocab_size) and torch.isfinite(logits).all()
    finally:
        monkeypatch.undo()
        K.cpu_kernels.cache_clear()


def test_env_switch_turns_kernels_off(monkeypatch):
    monkeypatch.setenv("MOED_CPU_KERNELS", "0")
    K.cpu_kernels.cache_clear()
    try:
        assert K.cpu_kernels() is None
    finally:
        monkeypatch.delenv("MOED_CPU_KERNELS")
        K.cpu_kernels.cache_clear()
    assert K.cpu_kernels() is not None


def test_model_forward_with_kernels_matches_torch_path(kern, make_checkpoint):
    """A whole bf16 model, decode steps after a prefill: logits within bf16 noise of the
    kernel-free path, and the same greedy tokens wherever the torch path's top two logits are
    more than bf16 noise apart. The checkpoint has transformers' init scale (bf16 rounding is
    not amplified layer to layer) and routes every token to all experts: with top-k < E, an ulp
    of router logit legitimately flips a near-tied expert choice between two bf16 kernels. Both
    runs are fed the torch path's tokens, so one near-tie (two logits an ulp apart) does not
    send the runs down different sequences."""
    from moed.model.runner import ModelRunner

    ckpt = make_checkpoint("qwen3_moe", seed=3, init_std=0.02, num_layers=3, num_experts=4, top_k=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 20, 37)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    runs, fed = [], None
    for on in (False, True):
        r = ModelRunner(ckpt, dtype="bfloat16", device="cpu", attention_backend="torch", num_blocks=32, block_size=16)
        if on:
            assert isinstance(r.model.kernels, K.CpuKernels) and isinstance(r.backend.kernels, K.CpuKernels)
        else:
            r.model.kernels = r.backend.kernels = r.native_decode = None
            for layer in r.model.layers:
                layer.kernels = layer.attn.kernels = layer.mlp.kernels = None
        steps = [r.forward(ForwardBatch(prompts, [0, 0, 0], tables))]
        pos = [len(p) for p in prompts]
        for i in range(6):
            toks = fed[i] if fed is not None else [[int(t)] for t in steps[-1].argmax(-1)]
            steps.append(r.forward(ForwardBatch(toks, pos, tables)))
            pos = [p + 1 for p in pos]
        fed = fed or [[[int(t)] for t in s.argmax(-1)] for s in steps]
        runs.append(steps)
    clear = 0
    for ref, got in zip(*runs):
        assert (got - ref).abs().max() <= 0.02 * ref.abs().max()
        top2 = ref.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 2 * 2.0 ** -7 * top2[:, 0].abs()    # 2 ulps: past bf16 noise
        assert torch.equal(got.argmax(-1)[sure], ref.argmax(-1)[sure])
        clear += int(sure.sum())
    assert clear >= 12, f"only {clear} of 21 greedy choices were clear of bf16 noise"


@pytest.mark.parametrize("n_threads", [1, 2])
def test_argmax_is_torchs(kern, n_threads):
    """The sampler's argmax (sampler.argmax_rows): torch's index on every row, including ties
    (the first), NaN (the first NaN wins), all -inf, +inf, and rows not a multiple of 16 long."""
    g = torch.Generator().manual_seed(0)
    cases = [torch.randn(b, v, generator=g) for b, v in ((1, 32000), (3, 17), (5, 1), (33, 32001), (2, 15))]
    ties = torch.round(torch.randn(16, 1000, generator=g) * 2)
    odd = torch.randn(6, 50, generator=g)
    odd[0, 7] = odd[0, 9] = float("nan")
    odd[1] = float("-inf")
    odd[2] = 1.0
    odd[3, 49] = float("inf")
    odd[4, 3] = float("nan")
    odd[4, 20] = float("inf")
    big = torch.randn(40, 32000, generator=g)      # enough to take the parallel loop
    with threads(n_threads):
        for x in cases + [ties, odd, big, big[:, ::2]]:
            assert torch.equal(kern.argmax_f32(x), x.argmax(-1))
            # bf16 logits upcast (the MTP layer's drafts): bf16's rounding makes many ties
            xb = x.bfloat16()
            assert torch.equal(kern.argmax_f32(xb.float()), xb.argmax(-1))


def test_norms_on_many_rows(kern):
    """Prefill-sized inputs on several threads (a per-row stack buffer once overflowed here)."""
    g = torch.Generator().manual_seed(9)
    h, delta = torch.randn(5000, 1024, generator=g).bfloat16(), torch.randn(5000, 1024, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(1024, generator=g)).bfloat16()
    with threads(2):
        out, resid = kern.rms_norm_bf16(h, w, 1e-6, delta)
    _close(out, rms_norm(h + delta, w, 1e-6))
    qkv = torch.randn(3000, 24 * 64, generator=g).bfloat16()
    rot = Rotary(64, 10000.0, 4096, torch.bfloat16, torch.device("cpu"))
    cos, sin = rot.tables(torch.arange(3000), 2999)
    with threads(2):
        got = kern.qk_norm_rope_bf16(qkv, 16, 64, None, 1e-6, cos, sin)
    _close(got, apply_rotary(qkv[:, :16 * 64].view(3000, 16, 64), cos, sin))


@pytest.mark.parametrize("rows", [1, 3, 17, 80, 300])
def test_linear_layer_keeps_one_packed_copy(kern, rows):
    """With kernels, Linear keeps only the kernels' packed weight (no plain, no oneDNN copy)
    and serves any row count from it."""
    from moed.model import layers

    g = torch.Generator().manual_seed(rows)
    w, b = (torch.randn(96, 128, generator=g) * 0.1).bfloat16(), torch.randn(96, generator=g).bfloat16()
    lin = layers.Linear(w, b, pack=True, kernels=kern)
    assert lin.weight is None and lin.packed is None and lin.kpacked is not None
    x = torch.randn(rows, 128, generator=g).bfloat16()
    _close(lin(x), F.linear(x.float(), w.float(), b.float()).bfloat16(), ulps=3)


def test_moe_layer_fused_kernel_and_grouped_path_agree_with_torch(kern, make_checkpoint):
    """The fused kernel at decode and prefill sizes (one chunk of an expert's rows, several
    chunks, an expert with a near-empty last chunk), and the grouped path on kernel Linears
    (what serves where oneDNN wins a row class), both match the torch layer."""
    spec = load_spec(make_checkpoint("qwen3_moe", num_experts=7, top_k=3, hidden_size=80, moe_intermediate_size=40))
    g = torch.Generator().manual_seed(11)
    router, gate_up, down = _moe(spec, g)
    ref = MoELayer(spec, router, gate_up, down, torch.zeros(7, dtype=torch.long), TORCH_BF16)
    layer = MoELayer(spec, router, gate_up, down, torch.zeros(7, dtype=torch.long), _ctx(kern, pack=True))
    for t in (5, 40, 150, 700):       # 700 x 3 / 7: ~300 rows per expert, several chunks
        x = torch.randn(t, spec.hidden_size, generator=g).bfloat16()
        _close(layer(x), ref(x), ulps=4)
        _close(layer.experts(x, layer.router(x)), ref(x), ulps=4)
    assert torch.equal(layer.router.load, ref.router.load)     # both routed every batch twice


def test_results_do_not_depend_on_the_thread_count(kern, make_checkpoint):
    """Each output element is computed by one thread in a fixed order: bitwise equal results
    for 1, 2 and 3 threads (nodes with different thread counts agree exactly)."""
    spec = load_spec(make_checkpoint("qwen3_moe", num_experts=7, top_k=3, hidden_size=80, moe_intermediate_size=40))
    g = torch.Generator().manual_seed(13)
    router, gate_up, down = _moe(spec, g)
    layer = MoELayer(spec, router, gate_up, down, torch.zeros(7, dtype=torch.long), _ctx(kern, pack=True))
    x = torch.randn(30, spec.hidden_size, generator=g).bfloat16()
    w = kern.pack((torch.randn(200, 80, generator=g) * 0.1).bfloat16())
    cache, q, _, _, batch, _ = _paged_case(g, 16, 4, 64, [3, 40, 77])
    tables = torch.tensor([t + [0] * (5 - len(t)) for t in batch.block_tables])
    lens = torch.tensor([3, 40, 77])
    outs = []
    for n in (1, 2, 3):
        with threads(n):
            outs.append((layer(x), kern.linear_bf16(x, w, 200), kern.rms_norm_bf16(x, router[0], 1e-6, x)[0],
                         kern.decode_attn_bf16(q, cache, tables, lens, 0.125)))
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
