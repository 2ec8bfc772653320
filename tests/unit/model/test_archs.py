"""The architecture registry: lookups, a clear error for an unknown model_type, each module's
config mapping and weight names, and a new architecture added by one file in archs/."""
from __future__ import annotations

import json
import shutil
import sys
import textwrap

import pytest
import torch

from moed.model import archs
from moed.model.batch import ForwardBatch
from moed.dev.checkpoint import init_archs
from moed.model.kv_layout import KVLayout
from moed.model.loader import compile_rules
from moed.model.runner import ModelRunner
from moed.model.spec import ModelSpec, SpecError
from moed.model.hf_config import load_spec, spec_from_config


def test_lookup():
    assert {"qwen3_moe", "mixtral"} <= set(archs.supported())
    assert "_hf" not in archs.supported()            # helpers are not architectures
    for name in archs.supported():
        a = archs.get(name)
        assert a.model_type == name and compile_rules(a.weight_names)
    assert init_archs() == archs.supported()          # `moed model init` writes every one of them


def test_unknown_model_type_lists_the_supported_ones(tmp_path):
    with pytest.raises(SpecError, match=r"model_type 'llama' is not supported; supported: deepseek_v3, mixtral, qwen3_moe"):
        archs.get("llama")
    with pytest.raises(SpecError, match="model_type None is not supported; supported: deepseek_v3, mixtral"):
        spec_from_config({"hidden_size": 8})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama4", "hidden_size": 8}))
    with pytest.raises(SpecError, match="'llama4' is not supported; supported: deepseek_v3, mixtral, qwen3_moe"):
        ModelRunner(tmp_path, device="cpu", num_blocks=4, block_size=4)      # fails at start


def test_qwen3_config_mapping():
    f = archs.get("qwen3_moe").spec_fields(
        {"num_experts": 8, "moe_intermediate_size": 96, "intermediate_size": 384, "norm_topk_prob": True,
         "decoder_sparse_step": 2, "mlp_only_layers": [3]}, 6)
    assert f == dict(num_experts=8, moe_intermediate_size=96, dense_intermediate_size=384,
                     norm_topk_prob=True, qk_norm=True, dense_layers=(0, 2, 3, 4))
    v5 = archs.get("qwen3_moe").spec_fields({"num_local_experts": 4, "moe_intermediate_size": 8}, 2)
    assert v5["num_experts"] == 4
    with pytest.raises(SpecError, match="sliding"):
        archs.get("qwen3_moe").spec_fields({"sliding_window": 4096, "use_sliding_window": True}, 2)
    # a window that is configured but not used is fine (real Qwen3 configs say so)
    assert archs.get("qwen3_moe").spec_fields(
        {"sliding_window": 4096, "use_sliding_window": False, "num_experts": 2, "moe_intermediate_size": 8}, 1)


def test_mixtral_config_mapping():
    f = archs.get("mixtral").spec_fields({"num_local_experts": 8, "intermediate_size": 14336}, 32)
    assert f == dict(num_experts=8, moe_intermediate_size=14336, dense_intermediate_size=0,
                     norm_topk_prob=True, qk_norm=False, dense_layers=())
    with pytest.raises(SpecError, match="sliding"):
        archs.get("mixtral").spec_fields({"sliding_window": 4096, "num_local_experts": 8}, 2)
    with pytest.raises(SpecError, match="intermediate_size"):
        archs.get("mixtral").spec_fields({"num_local_experts": 8}, 2)


def test_each_arch_names_its_own_checkpoint_tensors():
    def kind(arch: str, name: str) -> str | None:
        return next((k for p, k in compile_rules(archs.get(arch).weight_names) if p.match(name)), None)

    assert kind("mixtral", "model.layers.3.block_sparse_moe.experts.7.w3.weight") == "expert.up"
    assert kind("mixtral", "model.layers.3.block_sparse_moe.gate.weight") == "router"
    assert kind("qwen3_moe", "model.layers.3.mlp.experts.7.up_proj.weight") == "expert.up"
    assert kind("qwen3_moe", "model.layers.0.self_attn.q_norm.weight") == "q_norm"
    assert kind("qwen3_moe", "model.layers.1.mlp.down_proj.weight") == "dense.down"
    for arch in ("mixtral", "qwen3_moe"):
        assert kind(arch, "model.embed_tokens.weight") == "embed"
        assert kind(arch, "model.layers.0.self_attn.k_proj.bias") == "qkv"
        assert kind(arch, "model.layers.0.mlp.experts.gate_up_proj") == "fused.gate_up"
    assert kind("qwen3_moe", "model.layers.3.block_sparse_moe.experts.7.w3.weight") is None
    assert kind("mixtral", "model.layers.0.self_attn.q_norm.weight") is None
    with pytest.raises(ValueError, match="unknown weight kinds"):
        compile_rules(((r"x", "experts"),))


def test_kv_layout_comes_from_the_arch():
    spec = spec_from_config({"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 3,
                             "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 32,
                             "intermediate_size": 16, "num_local_experts": 2, "num_experts_per_tok": 1,
                             "rope_theta": 1e4, "max_position_embeddings": 32})
    assert archs.kv_layout(spec, 8, torch.bfloat16) == KVLayout.gqa(3, 1, 16, 8, torch.bfloat16)


def test_register_refuses_a_second_arch_of_the_same_type():
    a = archs.get("mixtral")
    assert archs.register(a) is a                  # the same object again is a no-op
    with pytest.raises(ValueError, match="registered twice"):
        archs.register(archs.Arch("mixtral", a.spec_fields, a.weight_names, a.build_layer, a.kv_layout))


NEW_ARCH_FILE = '''
"""A third architecture as one file (here Mixtral's pieces under another model_type): what a
module gives is model_type, spec_fields, weight_names, build_layer and kv_layout."""
from moed.model.archs import Arch, register
from moed.model.archs import mixtral
from moed.model.archs._hf import gqa_kv_layout

register(Arch("toy_moe", mixtral.spec_fields, mixtral.WEIGHTS, mixtral.build_layer, gqa_kv_layout))
'''


def test_a_new_arch_is_one_file_in_archs(tmp_path, monkeypatch, make_checkpoint):
    """Drop a module next to the others (here: a directory on the package path) and a checkpoint
    whose config.json says its model_type loads and runs; spec, loader and runner are untouched."""
    extra = tmp_path / "pkg"
    extra.mkdir()
    (extra / "toy_moe.py").write_text(textwrap.dedent(NEW_ARCH_FILE))
    monkeypatch.setattr(archs, "__path__", [*archs.__path__, str(extra)])
    monkeypatch.setattr(archs, "_REGISTRY", dict(archs._REGISTRY))
    monkeypatch.setattr(archs, "_discovered", False)
    monkeypatch.delitem(sys.modules, "moed.model.archs.toy_moe", raising=False)
    try:
        assert "toy_moe" in archs.supported()
        src = make_checkpoint("mixtral", "tiny", 0, num_layers=2, hidden_size=64, num_heads=4,
                              num_kv_heads=2, moe_intermediate_size=32, num_experts=3)
        toy = tmp_path / "toy"
        shutil.copytree(src, toy)
        cfg = json.loads((toy / "config.json").read_text())
        (toy / "config.json").write_text(json.dumps({**cfg, "model_type": "toy_moe"}))
        spec: ModelSpec = load_spec(toy)
        assert spec.arch == "toy_moe"
        batch = ForwardBatch([[5, 6, 7]], [0], [[0]])
        got = ModelRunner(toy, dtype="float32", device="cpu", num_blocks=2, block_size=4).forward(batch)
        want = ModelRunner(src, dtype="float32", device="cpu", num_blocks=2, block_size=4).forward(batch)
        assert torch.equal(got, want)
    finally:
        sys.modules.pop("moed.model.archs.toy_moe", None)
