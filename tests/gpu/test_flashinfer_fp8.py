"""FlashInfer with an fp8 KV cache (engine.kv_cache_dtype = fp8) against the torch backends on the
same fp8 cache (GPU only; not yet run: the branch was written on a machine without a GPU).

GQA (Qwen3-MoE, head_dim 64) and MLA (DeepSeek-V3's attention sizes, the ones FlashInfer's MLA
kernel is built for): a prefill step, then a decode step; logits and the written cache compared.
Whether the installed FlashInfer's MLA kernel takes an fp8 cache is its own answer at plan time
(native fp8 MLA landed for SM90 in 2026); a refusal fails this test, by design."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from moed.model.batch import ForwardBatch
from moed.model.kv_layout import FP8
from moed.model.runner import ModelRunner

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None,
                                 reason="flashinfer-python is not installed")]


def _checkpoint(kind: str, make_checkpoint, tmp_path):
    if kind == "gqa":
        return make_checkpoint("qwen3_moe", "tiny", 4, num_heads=4, num_kv_heads=2, num_layers=2)
    from moed.dev.checkpoint import init_checkpoint

    return init_checkpoint("deepseek_v3", tmp_path / "m", preset="tiny", seed=2, hidden_size=256, num_layers=2,
                           num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                           v_head_dim=128, q_lora_rank=192)


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_flashinfer_fp8_matches_torch_fp8(kind, make_checkpoint, tmp_path):
    d = _checkpoint(kind, make_checkpoint, tmp_path)
    kw = dict(dtype="bfloat16", device="cuda", num_blocks=32, block_size=16, kv_dtype="fp8")
    fi, ref = ModelRunner(d, attention_backend="flashinfer", **kw), ModelRunner(d, attention_backend="torch", **kw)
    assert fi.backend.name == "flashinfer" and fi.kv_cache.dtype == FP8 and fi.kv_layout.kind == kind
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, fi.spec.vocab_size, (n,), generator=g).tolist() for n in (5, 17, 40)]
    tables = [[3, 9, 1], [0, 12, 7], [20, 4, 30]]
    steps = [ForwardBatch([s[:-1] for s in seqs], [0, 0, 0], tables),
             ForwardBatch([s[-1:] for s in seqs], [len(s) - 1 for s in seqs], tables)]
    for batch in steps:
        a, b = fi.forward(batch), ref.forward(batch)
        assert (a - b).abs().max() < 0.05 * b.abs().max()
        assert (a.argmax(-1) == b.argmax(-1)).all()
    torch.testing.assert_close(fi.kv_cache.float(), ref.kv_cache.float(), atol=0.07, rtol=0.07)
