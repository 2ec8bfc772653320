"""ModelSpec parsing: both config dialects, dense layers, clear errors."""
from __future__ import annotations

import json

import pytest

from moed.model.spec import SpecError
from moed.model.hf_config import load_spec, spec_from_config

QWEN_REAL = {  # the shape of a real Qwen3-MoE config.json (top-level rope_theta, num_experts)
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "moe_intermediate_size": 768, "intermediate_size": 6144, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "eos_token_id": 151645,
    "bos_token_id": 151643, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "sliding_window": None, "hidden_act": "silu",
}
MIXTRAL_V5 = {  # transformers 5.x style: rope_parameters, num_local_experts, no head_dim
    "model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
    "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2,
    "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 32768, "eos_token_id": 2, "bos_token_id": 1, "dtype": "bfloat16",
}


def test_qwen3_real_style():
    s = spec_from_config(QWEN_REAL)
    assert (s.arch, s.num_experts, s.top_k, s.head_dim) == ("qwen3_moe", 128, 8, 128)
    assert s.rope_theta == 1e6 and s.norm_topk_prob and s.qk_norm
    assert s.moe_intermediate_size == 768 and s.dense_layers == ()
    assert s.eos_token_ids == (151645,) and s.bos_token_id == 151643
    assert s.moe_layers == tuple(range(48))


def test_qwen3_v5_style_and_dense_layers():
    cfg = {**QWEN_REAL, "num_local_experts": 6, "num_experts_per_tok": 2,
           "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
           "mlp_only_layers": [0], "decoder_sparse_step": 2, "norm_topk_prob": False}
    del cfg["num_experts"], cfg["rope_theta"], cfg["head_dim"]
    s = spec_from_config({**cfg, "num_hidden_layers": 6})
    assert s.num_experts == 6 and s.rope_theta == 5e5 and not s.norm_topk_prob
    assert s.head_dim == 2048 // 32
    assert s.dense_layers == (0, 2, 4) and s.moe_layers == (1, 3, 5)


def test_mixtral_v5_style():
    s = spec_from_config(MIXTRAL_V5, {"eos_token_id": [2, 7]})
    assert (s.arch, s.num_experts, s.moe_intermediate_size) == ("mixtral", 8, 14336)
    assert s.norm_topk_prob and not s.qk_norm and s.head_dim == 128 and s.rope_theta == 1e6
    assert s.eos_token_ids == (2, 7)


@pytest.mark.parametrize("patch,msg", [
    ({"model_type": "llama"}, "not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope type"),
    ({"num_key_value_heads": 5}, "multiple"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"hidden_act": "gelu"}, "silu"),
    ({"sliding_window": 4096}, "sliding"),
    ({"dtype": "int8"}, "dtype"),
])
def test_bad_configs(patch, msg):
    with pytest.raises(SpecError, match=msg):
        spec_from_config({**MIXTRAL_V5, **patch})


def test_load_spec_from_dir(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(SpecError, match="malformed"):
        load_spec(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN_REAL))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert load_spec(tmp_path).eos_token_ids == (151645, 151643)


def test_spec_of_generated_checkpoints(tiny_qwen3, tiny_mixtral):
    q, m = load_spec(tiny_qwen3), load_spec(tiny_mixtral)
    assert (q.arch, q.num_layers, q.num_experts, q.top_k, q.num_heads, q.num_kv_heads) == ("qwen3_moe", 4, 8, 2, 8, 2)
    assert (m.arch, m.hidden_size, m.vocab_size, m.moe_intermediate_size) == ("mixtral", 256, 4096, 128)
    assert q.torch_dtype == "bfloat16" and len(q.eos_token_ids) == 2
