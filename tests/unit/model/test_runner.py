"""ModelRunner plumbing, the MoE layer against a naive per-token reference, backend registry."""
from __future__ import annotations

import pytest
import torch

from moed.model import archs
from moed.model.attention.registry import get_backend
from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.moe import MoELayer
from moed.model.runner import ModelRunner, auto_num_blocks
from moed.model.hf_config import load_spec
from conftest import needs_onednn_bf16     # tests/unit/model/conftest.py

CPU = torch.device("cpu")
PLAIN = ComputeContext(CPU, torch.float32)
KW = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=5, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def ckpt(make_checkpoint):
    return make_checkpoint("qwen3_moe", "tiny", 3, **KW)


def test_runner_attributes_and_bf16(ckpt):
    r = ModelRunner(ckpt, device="cpu", num_blocks=10, block_size=4)
    assert r.dtype == torch.bfloat16 and r.device.type == "cpu" and r.backend.name == "torch"
    assert r.kv_cache.shape == (2, 10, 2, 4, 2, 16) and r.kv_cache.dtype == torch.bfloat16
    batch = ForwardBatch([[1, 2, 3, 4, 5, 6], [7, 8]], [0, 0], [[3, 1], [0]])
    lo = r.forward(batch)
    assert lo.dtype == torch.float32 and lo.shape == (2, r.spec.vocab_size) and torch.isfinite(lo).all()
    f32 = ModelRunner(ckpt, dtype="float32", device="cpu", num_blocks=10, block_size=4).forward(batch)
    assert (lo - f32).abs().max() < 0.25 * f32.abs().max()
    assert (lo.argmax(-1) == f32.argmax(-1)).all()


def test_kv_written_where_the_table_says(ckpt):
    r = ModelRunner(ckpt, dtype="float32", device="cpu", num_blocks=8, block_size=4)
    r.forward(ForwardBatch([[1, 2, 3, 4, 5]], [0], [[6, 2]]))
    used = r.kv_cache.abs().sum(dim=(0, 2, 4, 5))        # [blocks, slots]
    assert (used[6] > 0).all() and (used[2, :1] > 0).all() and (used[2, 1:] == 0).all()
    assert used[[0, 1, 3, 4, 5, 7]].sum() == 0


def test_bad_batches_are_rejected(ckpt):
    r = ModelRunner(ckpt, dtype="float32", device="cpu", num_blocks=4, block_size=4)
    for batch, msg in [
        (ForwardBatch([[1, 2, 3, 4, 5]], [0], [[0]]), "need 2 KV blocks"),
        (ForwardBatch([[1]], [0], [[9]]), "block id out of range"),
        (ForwardBatch([[r.spec.vocab_size]], [0], [[0]]), "token id out of range"),
        (ForwardBatch([[]], [0], [[0]]), "no new tokens"),
        (ForwardBatch([], [], []), "empty"),
    ]:
        with pytest.raises(ValueError, match=msg):
            r.forward(batch)


def test_sizes_and_registry(ckpt):
    spec = load_spec(ckpt)
    per = archs.kv_layout(spec, 16, torch.bfloat16).bytes_per_block
    assert per == 2 * 2 * 16 * 2 * 16 * 2
    assert auto_num_blocks(spec, 16, "bfloat16", 1) == (1 << 20) // per
    with pytest.raises(ValueError, match="holds no block"):
        auto_num_blocks(spec, 1 << 16, torch.float32, 1)
    kv = archs.kv_layout(spec, 16, torch.float32)
    assert get_backend("auto", spec, kv, PLAIN).name == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope", spec, kv, PLAIN)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_backend("flashinfer", spec, kv, PLAIN)
    from moed.model.kv_layout import KVLayout
    with pytest.raises(ValueError, match="does not serve KV layout kind 'mla'"):
        get_backend("torch", spec, KVLayout.mla(2, 576, 16, torch.float32), PLAIN)


def _naive_moe(layer: MoELayer, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    w, idx = layer.router.route(x)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(layer.router.top_k):
            e = int(idx[t, j])
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w[t, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
    return out


def test_moe_grouped_matches_naive_and_replicas(ckpt):
    spec = load_spec(ckpt)
    g = torch.Generator().manual_seed(0)
    E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    router, gate_up, down = (torch.randn(E, H, generator=g), torch.randn(E, 2 * I, H, generator=g) * 0.1,
                             torch.randn(E, H, I, generator=g) * 0.1)
    load = torch.zeros(E, dtype=torch.long)
    layer = MoELayer(spec, router, gate_up, down, load, PLAIN)
    x = torch.randn(23, H, generator=g)
    ref = _naive_moe(layer, x, gate_up, down)
    assert torch.allclose(layer(x), ref, atol=1e-5)
    assert int(load.sum()) == 23 * spec.top_k
    assert torch.allclose(layer(x[:1]), ref[:1], atol=1e-5)               # batch-1 path
    assert int(load.sum()) == 24 * spec.top_k
    # Replicate experts 0 and 3 into physical slots 5 and 6: same math, new map.
    rep = MoELayer(spec, router, torch.cat([gate_up, gate_up[[0, 3]]]), torch.cat([down, down[[0, 3]]]), load, PLAIN)
    rep.set_expert_map(torch.tensor([[0, 5], [1, 1], [2, 2], [3, 6], [4, 4]]), torch.tensor([2, 1, 1, 2, 1]))
    assert torch.allclose(rep(x), ref, atol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        rep.set_expert_map(torch.tensor([[0], [1], [2], [3], [9]]), torch.ones(5, dtype=torch.long))


@needs_onednn_bf16
def test_moe_packed_bf16_matches_plain(ckpt):
    spec = load_spec(ckpt)
    g = torch.Generator().manual_seed(1)
    E, H, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    args = (torch.randn(E, H, generator=g).bfloat16(), (torch.randn(E, 2 * I, H, generator=g) * 0.1).bfloat16(),
            (torch.randn(E, H, I, generator=g) * 0.1).bfloat16())
    x = torch.randn(9, H, generator=g).bfloat16()
    plain = MoELayer(spec, *args, torch.zeros(E, dtype=torch.long), ComputeContext(CPU, torch.bfloat16))(x)
    packed = MoELayer(spec, *args, torch.zeros(E, dtype=torch.long), ComputeContext(CPU, torch.bfloat16, pack=True))(x)
    assert torch.allclose(plain.float(), packed.float(), atol=2e-2)
