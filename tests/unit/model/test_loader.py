"""Loader: both expert namings and sharded checkpoints give the same weights and logits;
mismatched checkpoints fail with clear errors."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moed.model.batch import ForwardBatch
from moed.model.loader import WeightError, load_weights
from moed.model.runner import ModelRunner
from moed.model.hf_config import load_spec

KW = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=5, moe_intermediate_size=32)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def variants(request, make_checkpoint):
    arch = request.param
    return {
        "per_expert": make_checkpoint(arch, "tiny", 2, **KW),
        "fused": make_checkpoint(arch, "tiny", 2, write_fused=True, **KW),
        "sharded_fused": make_checkpoint(arch, "tiny", 2, write_fused=True, max_shard_size="200KB", **KW),
        "sharded": make_checkpoint(arch, "tiny", 2, max_shard_size="200KB", **KW),
    }


def test_namings_on_disk(variants):
    keys = set(load_file(str(variants["per_expert"] / "model.safetensors")))
    assert any(".experts.3." in k for k in keys)
    fused = set(load_file(str(variants["fused"] / "model.safetensors")))
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused and not any(".experts.3." in k for k in fused)
    index = json.loads((variants["sharded"] / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1


def test_all_styles_load_identically(variants):
    spec = load_spec(variants["per_expert"])
    base = load_weights(variants["per_expert"], spec, "float32")
    assert base["layers.0.experts.gate_up"].shape == (5, 64, 64)
    assert base["layers.0.experts.down"].shape == (5, 64, 32)
    assert base["layers.0.qkv"].shape == ((4 + 2 * 2) * 16, 64)
    for name in ("fused", "sharded", "sharded_fused"):
        w = load_weights(variants[name], spec, "float32")
        assert w.keys() == base.keys()
        for k in base:
            assert torch.equal(w[k], base[k]), (name, k)
    assert load_weights(variants["fused"], spec)["embed"].dtype == torch.bfloat16   # config's dtype


def test_same_logits_per_style(variants):
    batch = ForwardBatch([[5, 6, 7, 8, 9], [3]], [0, 0], [[2, 0], [1]])
    outs = [ModelRunner(d, dtype="float32", device="cpu", num_blocks=3, block_size=4).forward(batch)
            for d in variants.values()]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst / "model.safetensors"


def test_missing_unexpected_and_bad_shapes(make_checkpoint, tmp_path):
    src = make_checkpoint("qwen3_moe", "tiny", 2, **KW)
    spec = load_spec(src)
    tensors = load_file(str(src / "model.safetensors"))

    path = _copy(src, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if ".experts.4.up_proj" not in k and "q_norm" not in k}, str(path))
    with pytest.raises(WeightError, match=r"missing.*q_norm|incomplete.*experts.gate_up"):
        load_weights(path.parent, spec)

    path = _copy(src, tmp_path / "unexpected")
    save_file({**tensors, "model.layers.0.mlp.mystery.weight": torch.zeros(2)}, str(path))
    with pytest.raises(WeightError, match="unexpected tensors.*mystery"):
        load_weights(path.parent, spec)

    path = _copy(src, tmp_path / "extra_expert")
    save_file({**tensors, "model.layers.0.mlp.experts.5.up_proj.weight": torch.zeros(32, 64)}, str(path))
    with pytest.raises(WeightError, match="expert 5 but config has 5"):
        load_weights(path.parent, spec)

    path = _copy(src, tmp_path / "shape")
    bad = dict(tensors)
    bad["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(bad, str(path))
    with pytest.raises(WeightError, match=r"k_proj.weight: shape \(16, 64\), expected \(32, 64\)"):
        load_weights(path.parent, spec)

    with pytest.raises(WeightError, match="no \\*.safetensors"):
        load_weights(tmp_path, spec)


def test_real_config_dialect_gives_same_logits(make_checkpoint, tmp_path):
    """The hub's older config style (top-level rope_theta, num_experts, torch_dtype) loads the same."""
    src = make_checkpoint("qwen3_moe", "tiny", 2, **KW)
    dst = shutil.copytree(src, tmp_path / "real")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["torch_dtype"] = cfg.pop("dtype")
    (dst / "config.json").write_text(json.dumps(cfg))
    assert load_spec(dst) == load_spec(src)
    batch = ForwardBatch([[9, 8, 7, 6, 5, 4]], [0], [[1, 0]])
    a, b = (ModelRunner(d, dtype="float32", device="cpu", num_blocks=2, block_size=4).forward(batch)
            for d in (src, dst))
    assert torch.equal(a, b)
