"""KVLayout: GQA sizes as the cache always had them, an MLA layout's sizes, a layout id that is
stable across processes and tells layouts apart, and the runner allocating and exposing it."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from moed.model import archs
from moed.model.kv_layout import KVLayout
from moed.model.runner import ModelRunner
from moed.model.hf_config import load_spec
from moed.transfer.base import RegionLayout

BF16 = torch.bfloat16


@pytest.mark.parametrize("layers,hkv,d,bs,dtype", [(2, 2, 16, 4, BF16), (48, 4, 128, 16, BF16),
                                                    (3, 1, 64, 8, torch.float32)])
def test_gqa_numbers_are_the_old_kv_cache_shape_and_bytes(layers, hkv, d, bs, dtype):
    kv = KVLayout.gqa(layers, hkv, d, bs, dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    # what attention/base.py's kv_cache_shape / kv_bytes_per_block computed before KVLayout
    assert kv.shape(10) == (layers, 10, 2, bs, hkv, d)
    assert kv.bytes_per_block == layers * 2 * bs * hkv * d * elem
    assert kv.block_bytes == 2 * bs * hkv * d * elem
    assert kv.entry_shape == (2, hkv, d) and kv.block_shape == (2, bs, hkv, d)
    t = kv.allocate(10, "cpu")
    assert t.shape == kv.shape(10) and t.dtype == dtype and not t.any()
    assert t.numel() * t.element_size() == 10 * kv.bytes_per_block
    assert kv.block_format == f"{str(dtype).removeprefix('torch.')}:2x{bs}x{hkv}x{d}"


def test_mla_layout_sizes():
    """DeepSeek-V3: one 576-wide latent (kv_lora_rank 512 + rope 64) per token, no separate V."""
    kv = KVLayout.mla(61, 512 + 64, 64, BF16)
    assert kv.kind == "mla" and kv.entry_shape == (576,) and kv.block_shape == (64, 576)
    assert kv.shape(7) == (61, 7, 64, 576)
    assert kv.block_bytes == 64 * 576 * 2 and kv.bytes_per_block == 61 * 64 * 576 * 2
    assert kv.block_format == "bfloat16:64x576" and kv.layout_id.startswith("mla-")
    assert kv.allocate(2, "cpu").shape == (61, 2, 64, 576)


def test_layout_id_tells_layouts_apart():
    base = KVLayout.gqa(4, 2, 64, 16, BF16)
    others = [KVLayout.gqa(4, 2, 64, 32, BF16), KVLayout.gqa(4, 2, 64, 16, torch.float32),
              KVLayout.gqa(4, 4, 64, 16, BF16), KVLayout.gqa(4, 2, 128, 16, BF16),
              KVLayout.gqa(5, 2, 64, 16, BF16),
              KVLayout.mla(4, 256, 16, BF16)]         # same bytes per token as base, other kind
    ids = {base.layout_id} | {o.layout_id for o in others}
    assert len(ids) == 1 + len(others)
    assert KVLayout.gqa(4, 2, 64, 16, BF16).layout_id == base.layout_id
    assert others[-1].block_bytes == base.block_bytes and others[-1].layout_id != base.layout_id


def test_layout_id_is_stable_across_processes_and_releases():
    kv = KVLayout.gqa(8, 4, 64, 16, BF16)
    code = ("import torch; from moed.model.kv_layout import KVLayout; "
            "print(KVLayout.gqa(8, 4, 64, 16, torch.bfloat16).layout_id)")
    for seed in ("0", "12345"):           # Python's hash() would differ between these
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                             check=True, timeout=120).stdout.strip()
        assert out == kv.layout_id
    # Pinned: nodes of different releases compare it; change it only with the layout itself.
    assert kv.layout_id == "gqa-5070a56ce022"


@pytest.mark.parametrize("bad", [
    dict(kind="paged"), dict(block_size=0), dict(num_layers=0), dict(entry_shape=(2, 0, 64)),
    dict(entry_shape=(3, 2, 64)), dict(kind="mla"),
])
def test_bad_layouts_are_refused(bad):
    with pytest.raises(ValueError):
        KVLayout(**{**dict(kind="gqa", entry_shape=(2, 2, 64), dtype=BF16, block_size=16, num_layers=2), **bad})


def test_runner_allocates_and_exposes_its_arch_layout(make_checkpoint):
    ckpt = make_checkpoint("mixtral", "tiny", 0, num_layers=2, num_kv_heads=2, hidden_size=64,
                           num_heads=4, moe_intermediate_size=32, num_experts=3)
    spec = load_spec(ckpt)
    r = ModelRunner(ckpt, dtype="float32", device="cpu", num_blocks=6, block_size=4)
    assert r.kv_layout == archs.kv_layout(spec, 4, torch.float32) == KVLayout.gqa(2, 2, 16, 4, torch.float32)
    assert r.kv_cache.shape == r.kv_layout.shape(6) and r.kv_cache.dtype == torch.float32
    region = r.kv_region()
    assert region.tensor is r.kv_cache
    raw = RegionLayout.from_tensor(r.kv_cache)          # what transfer used to derive from the tensor
    assert region.layout == RegionLayout(**{**raw.__dict__, "layout_id": r.kv_layout.layout_id})
