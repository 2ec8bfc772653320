"""The fp8 KV cache (engine.kv_cache_dtype = fp8, moed/model/kv_layout.py): the e4m3 round trip's
error bounds, the layout (id, bytes, blocks per MB), the attention backends against an
unquantized cache, and the fp8 path's self-consistency (whole prompt = chunked = prefix hit)
on the tiny Qwen3-MoE (GQA) and DeepSeek-V3 (MLA) checkpoints."""
from __future__ import annotations

import pytest
import torch

from moed.config import ConfigError, EngineConfig
from moed.model import archs
from moed.model.attention.registry import get_backend
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.kv_layout import FP8, FP8_MAX, KVLayout, dequantize_kv, kv_cache_dtype, quantize_kv
from moed.model.runner import ModelRunner, auto_num_blocks
from moed.model.hf_config import load_spec

PLAIN = ComputeContext(torch.device("cpu"), torch.float32)
ARCHS = ("qwen3_moe", "deepseek_v3")


def test_round_trip_error_bounds_and_clamp():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(20000, generator=gen) * torch.logspace(-3, 2.6, 20000)).clamp(-FP8_MAX, FP8_MAX)
    y = dequantize_kv(quantize_kv(x, FP8), torch.float32)
    normal = x.abs() >= 2 ** -6                    # e4m3's smallest normal
    # 3 mantissa bits, round to nearest: half a unit in the last place
    assert ((y - x).abs()[normal] <= x.abs()[normal] * 2 ** -4).all()
    assert ((y - x).abs()[~normal] <= 2 ** -10).all()       # subnormal step 2^-9
    assert (y - x).abs().max() > 0                              # it does round
    big = dequantize_kv(quantize_kv(torch.tensor([1e4, -1e4, 448.0]), FP8), torch.float32)
    assert big.tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]        # clamped, never NaN
    bf = torch.randn(8, dtype=torch.bfloat16)
    assert quantize_kv(bf, torch.bfloat16) is bf                # a cache of x's dtype: unchanged


def test_layout_id_bytes_and_blocks_per_mb(make_checkpoint):
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.float32) == kv_cache_dtype("fp8_e4m3", torch.bfloat16) == FP8
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv_cache_dtype("fp8_e5m2", torch.bfloat16)
    for make in (lambda dt: KVLayout.gqa(4, 2, 64, 16, dt), lambda dt: KVLayout.mla(4, 576, 16, dt, 64)):
        bf, f8 = make(torch.bfloat16), make(FP8)
        assert f8.layout_id != bf.layout_id and f8.block_format != bf.block_format
        assert f8.block_bytes * 2 == bf.block_bytes and f8.bytes_per_token * 2 == bf.bytes_per_token
        assert f8.allocate(3, "cpu").dtype == FP8
    for arch in ARCHS:
        spec = load_spec(make_checkpoint(arch))
        per = archs.kv_layout(spec, 16, FP8).bytes_per_block
        mb = 4 * per        # MiB: a whole number of blocks of every dtype (no rounding down)
        bf = auto_num_blocks(spec, 16, torch.bfloat16, mb)
        assert auto_num_blocks(spec, 16, torch.bfloat16, mb, "fp8") == 2 * bf == 4 << 20
        assert auto_num_blocks(spec, 16, torch.float32, mb, "fp8") == \
            4 * auto_num_blocks(spec, 16, torch.float32, mb)


def test_config_field_refuses_e5m2_and_unknown():
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(ConfigError, match="fp8_e5m2 is not supported"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ConfigError, match="engine.kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")


def _step_batches():
    """Two steps over 3 sequences: a 9-token prefill, then a decode + a chunk that reads the
    cached history + a fresh 5-token prompt (every read path of the torch backends)."""
    return [ForwardBatch([list(range(3, 12))], [0], [[5, 2, 7]]),
            ForwardBatch([[12], [20, 21, 22], [30, 31, 32, 33, 34]], [9, 0, 0],
                         [[5, 2, 7], [1, 4], [0, 3]])]


@pytest.mark.parametrize("arch", ARCHS)
def test_backend_output_close_to_an_unquantized_cache(arch, make_checkpoint):
    """One attention layer on the same q/k/v: fp8 cache vs fp32 cache. The error budget: each
    cached value is off by at most 1/16 of itself, which an average over positions shrinks."""
    spec = load_spec(make_checkpoint(arch))
    gen = torch.Generator().manual_seed(1)
    outs = {}
    for dt in (torch.float32, FP8):
        kv = archs.kv_layout(spec, 4, dt)
        be = get_backend("torch", spec, kv, PLAIN)
        cache = kv.allocate(8, "cpu")[0]
        gen.manual_seed(1)
        res = []
        for b in _step_batches():
            t = sum(len(x) for x in b.token_ids)
            pos = torch.tensor([p for x, s in zip(b.token_ids, b.start_pos) for p in range(s, s + len(x))])
            be.plan(b, pos)
            if kv.kind == "gqa":
                q = torch.randn((t, spec.num_heads, spec.head_dim), generator=gen)
                k, v = (torch.randn((t, spec.num_kv_heads, spec.head_dim), generator=gen) for _ in "kv")
                res.append(be.forward(0, q, k, v, cache))
            else:
                h, r = spec.num_heads, spec.kv_lora_rank
                qn = torch.randn((t, h, spec.qk_nope_head_dim), generator=gen)
                qr = torch.randn((t, h, spec.qk_rope_head_dim), generator=gen)
                c, kr = torch.randn((t, r), generator=gen), torch.randn((t, spec.qk_rope_head_dim), generator=gen)
                w_uk = torch.randn((h, spec.qk_nope_head_dim, r), generator=gen) * r ** -0.5
                w_uv = torch.randn((h, spec.v_head_dim, r), generator=gen) * r ** -0.5
                res.append(be.forward_mla(0, qn, qr, c, kr, cache, w_uk, w_uv))
        outs[dt] = torch.cat([o.flatten() for o in res])
    ref, f8 = outs[torch.float32], outs[FP8]
    err = (f8 - ref).abs().max() / ref.abs().max()
    assert 0 < err < 0.06, err


def _runner(ckpt, kv_dtype="fp8", dtype="float32"):
    return ModelRunner(ckpt, dtype=dtype, device="cpu", num_blocks=32, block_size=4, kv_dtype=kv_dtype)


def _greedy(r: ModelRunner, prompt: list[int], chunks: list[int], table: list[int], n: int,
            cached: int = 0) -> tuple[list[int], torch.Tensor]:
    """Prefill prompt[cached:] in chunks (sizes), then n greedy decode steps -> (tokens, logits)."""
    pos, logits = cached, []
    for size in chunks:
        lo = r.forward(ForwardBatch([prompt[pos:pos + size]], [pos], [table]))
        pos += size
    assert pos == len(prompt)
    toks = [int(lo.argmax())]
    logits.append(lo)
    for _ in range(n - 1):
        lo = r.forward(ForwardBatch([[toks[-1]]], [len(prompt) + len(toks) - 1], [table]))
        toks.append(int(lo.argmax()))
        logits.append(lo)
    return toks, torch.cat(logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])      # bf16: the CPU kernels' paths
@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_path_is_self_consistent_and_close_to_fp32(arch, dtype, make_checkpoint):
    """Same greedy tokens (and logits within float noise) with the prompt at once, in chunks,
    and after a prefix-cache hit (a second sequence over the first one's cached blocks). Against
    an fp32 cache: not equal (fp8 rounds), but close, within the tolerance measured on these
    checkpoints (RMS error / std of the logits: 0.11-0.17 Qwen3-MoE, 0.27-0.34 DeepSeek-V3 MLA,
    docs/config.md), with margin (fp32 compute only)."""
    ckpt = make_checkpoint(arch)
    r = _runner(ckpt, dtype=dtype)
    assert r.kv_cache.dtype == FP8 and r.describe()["kv_dtype"] == "float8_e4m3fn"
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, r.spec.vocab_size, (22,), generator=gen).tolist()
    table = list(range(8))
    whole, lw = _greedy(r, prompt, [22], table, 8)
    chunked, lc = _greedy(_runner(ckpt, dtype=dtype), prompt, [5, 7, 3, 7], table, 8)
    # prefix hit: a second sequence shares the first 16 tokens' blocks (0-3), own blocks after
    hit, lh = _greedy(r, prompt, [6], [0, 1, 2, 3, 10, 11, 12, 13], 8, cached=16)
    assert whole == chunked == hit
    # fp32: not float noise alone. A chunk's attention sums in another order than the whole
    # prompt's (SDPA with a mask vs causal, ISA-dependent: AVX2 vs AVX512 summation), and a later
    # layer's K/V value that lands at an fp8 rounding boundary can round to the neighbouring code
    # (3 mantissa bits: a step of 6-12%): on an AVX2-only EPYC one such flip moved a logit by
    # 0.013 (an fp32 cache: 4e-6), far under fp8's own error against fp32 (RMS 0.11-0.17 of the
    # logits' std, below).
    # bf16: MLA's chunked expanded form rounds apart.
    tol = 0.05 if dtype == "float32" else 0.1
    assert (lc - lw).abs().max() < tol and (lh - lw).abs().max() < tol
    if dtype != "float32":
        return
    # teacher-forced on the fp8 tokens, so both see the same history
    ref_tf = _forced(_runner(ckpt, "auto"), prompt, whole, table)
    rel = (lw - ref_tf).pow(2).mean().sqrt() / ref_tf.std()
    assert 0 < rel < (0.3 if arch == "qwen3_moe" else 0.5), rel


def _forced(r: ModelRunner, prompt: list[int], toks: list[int], table: list[int]) -> torch.Tensor:
    out = [r.forward(ForwardBatch([prompt], [0], [table]))]
    for i, t in enumerate(toks[:-1]):
        out.append(r.forward(ForwardBatch([[t]], [len(prompt) + i], [table])))
    return torch.cat(out)


def test_native_paths_refuse_fp8_with_a_reason(make_checkpoint):
    r = ModelRunner(make_checkpoint("qwen3_moe"), dtype="bfloat16", device="cpu", num_blocks=8,
                    block_size=4, kv_dtype="fp8")
    assert r.native_decode is None and r.backend.kernels is None
    if r.ctx.kernels is not None:        # this machine has the native kernels: fp8 turned them off
        assert r.native_decode_off.startswith("fp8 KV cache")
        assert "fp8" in r.backend.kernels_off
    bf = ModelRunner(make_checkpoint("qwen3_moe"), dtype="bfloat16", device="cpu", num_blocks=8, block_size=4)
    assert bf.kv_layout.bytes_per_token == 2 * r.kv_layout.bytes_per_token
    assert bf.kv_layout.layout_id != r.kv_layout.layout_id
    lo = r.forward(ForwardBatch([[1, 2, 3, 4, 5], [6]], [0, 0], [[1, 2], [3]]))
    assert torch.isfinite(lo).all()


def test_native_fp8_read_equals_torch_cast(make_checkpoint):
    """The CPU table lookup (bf16 compute) gives torch's cast bit for bit, and the same logits."""
    from moed.model.kernels import cpu_kernels

    k = cpu_kernels()
    if k is None:
        pytest.skip("no native CPU kernels on this machine")
    every = torch.arange(256, dtype=torch.uint8).view(FP8).repeat(300)      # > the threading cut
    assert torch.equal(k.fp8_to_bf16(every).view(torch.int16), every.to(torch.bfloat16).view(torch.int16))
    ckpt = make_checkpoint("qwen3_moe")
    runs = []
    for native in (True, False):
        r = ModelRunner(ckpt, dtype="bfloat16", device="cpu", num_blocks=16, block_size=4, kv_dtype="fp8")
        assert (r.backend._fp8_lut is not None) is True
        if not native:
            r.backend._fp8_lut = None                          # torch's own cast
        runs.append(torch.cat([r.forward(b) for b in _step_batches()]))
    assert torch.equal(runs[0], runs[1])
