"""Prefill attention never materialises [T, T] scores. On the torch path a fresh prompt and a
chunk over a cached history both go to torch's CPU flash kernel (blocked, online softmax), none
to the math path (bmm + softmax over the full score matrix); with the native kernels (CPU bf16)
to prefill_attn_bf16, blocked over 8 query rows. Both match a direct fp32 computation."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from moed.model import kernels as K
from moed.model.attention.torch_backend import TorchBackend
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.kv_layout import KVLayout
from moed.model.hf_config import load_spec

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _reference(q, k, v, start, scale):
    """q [n, Hq, D] at positions start.., k/v [start + n, Hkv, D]: causal GQA in fp32."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    kk, vv = (t.float().repeat_interleave(g, dim=1).transpose(0, 1) for t in (k, v))
    s = q.float().transpose(0, 1) @ kk.transpose(1, 2) * scale
    mask = torch.arange(k.shape[0])[None, :] > torch.arange(start, start + n)[:, None]
    return (torch.softmax(s.masked_fill(mask, float("-inf")), -1) @ vv).transpose(0, 1)


def test_prefill_and_chunked_prefill_take_the_flash_path(make_checkpoint):
    spec = load_spec(make_checkpoint("qwen3_moe", num_heads=8, num_kv_heads=2, head_dim=32))
    bs, hq, hkv, d = 16, 8, 2, 32
    kv = KVLayout.gqa(spec.num_layers, hkv, d, bs, torch.bfloat16)
    be = TorchBackend(spec, kv, ComputeContext(torch.device("cpu"), torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    cache = torch.zeros(12, 2, bs, hkv, d, dtype=torch.bfloat16)
    # sequence 0: a fresh 40-token prompt; sequence 1: 30 new tokens after 50 cached ones
    hist_k, hist_v = (torch.randn(50, hkv, d, generator=g).bfloat16() for _ in range(2))
    tables = [[0, 1, 2], [5, 6, 7, 8, 9]]
    flat = cache.view(-1, hkv, d)
    for p in range(50):
        row = tables[1][p // bs] * 2 * bs + p % bs
        flat[row], flat[row + bs] = hist_k[p], hist_v[p]
    batch = ForwardBatch([[1] * 40, [1] * 30], [0, 50], tables)
    positions = torch.cat((torch.arange(40), torch.arange(50, 80)))
    q = torch.randn(70, hq, d, generator=g).bfloat16()
    k, v = (torch.randn(70, hkv, d, generator=g).bfloat16() for _ in range(2))
    be.plan(batch, positions)
    with torch.profiler.profile() as prof:
        out = be.forward(0, q, k, v, cache[None][0])
    ops = [e.key for e in prof.key_averages()]
    assert ops.count(FLASH) == 1 and prof.key_averages()[ops.index(FLASH)].count == 2
    assert "aten::_scaled_dot_product_attention_math" not in ops and "aten::softmax" not in ops
    want0 = _reference(q[:40], k[:40], v[:40], 0, be.scale)
    want1 = _reference(q[40:], torch.cat((hist_k, k[40:])), torch.cat((hist_v, v[40:])), 50, be.scale)
    for got, want in ((out[:40], want0), (out[40:], want1)):
        assert (got.float() - want).abs().max() < 2e-2


needs_kernels = pytest.mark.skipif(
    not K.cpu_flags_ok() or not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
    reason="no AVX512-BF16 or no C compiler: prefill attention stays on SDPA")


@needs_kernels
@pytest.mark.parametrize("n,start,hq,hkv,d", [(1, 0, 4, 4, 32), (5, 0, 4, 2, 64), (40, 0, 8, 2, 32),
                                              (30, 50, 8, 2, 32), (129, 7, 16, 4, 64), (17, 100, 6, 2, 128),
                                              (9, 3, 8, 1, 256)])
def test_prefill_kernel_matches_fp32_as_closely_as_sdpa(n, start, hq, hkv, d):
    """The native prefill kernel: as close to fp32 attention as SDPA's flash kernel is (both
    round exp to bf16 for the p.v product), for fresh prompts and chunks after a history, tiles
    of query rows (8 on AVX512, 32 on AVX2) cut anywhere, GQA and every head size; bitwise the
    same on 1-3 threads."""
    kern = K.cpu_kernels()
    g = torch.Generator().manual_seed(n + start)
    q = torch.randn(n, (hq + 2 * hkv) * d, generator=g).bfloat16()[:, :hq * d].view(n, hq, d)   # strided rows
    k, v = (torch.randn(start + n, hkv, d, generator=g).bfloat16() for _ in range(2))
    scale = d ** -0.5
    want = _reference(q, k, v, start, scale)
    mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
    sdpa = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          attn_mask=mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    outs = []
    for threads in (1, 2, 3):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            outs.append(kern.prefill_attn_bf16(q, k, v, start, scale))
        finally:
            torch.set_num_threads(old)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    err, sdpa_err = ((o.float() - want).abs().max() for o in (outs[0], sdpa))
    assert err <= max(1.5 * sdpa_err, 2.0 ** -8 * want.abs().max())


@needs_kernels
def test_backend_sends_prefills_to_the_kernel(make_checkpoint):
    spec = load_spec(make_checkpoint("qwen3_moe", num_heads=8, num_kv_heads=2, head_dim=32))
    kv = KVLayout.gqa(spec.num_layers, 2, 32, 16, torch.bfloat16)
    be = TorchBackend(spec, kv, ComputeContext(torch.device("cpu"), torch.bfloat16, pack=True,
                                               kernels=K.cpu_kernels()))
    g = torch.Generator().manual_seed(1)
    cache = torch.zeros(4, 2, 16, 2, 32, dtype=torch.bfloat16)
    be.plan(ForwardBatch([[1] * 40], [0], [[0, 1, 2]]), torch.arange(40))
    q = torch.randn(40, 8, 32, generator=g).bfloat16()
    k, v = (torch.randn(40, 2, 32, generator=g).bfloat16() for _ in range(2))
    with torch.profiler.profile() as prof:
        out = be.forward(0, q, k, v, cache)
    assert FLASH not in [e.key for e in prof.key_averages()]
    assert torch.equal(out, K.cpu_kernels().prefill_attn_bf16(q, k, v, 0, be.scale))
