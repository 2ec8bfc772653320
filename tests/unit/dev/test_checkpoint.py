"""init_checkpoint: HF-format output transformers loads, seeds, overrides, CLI entry points."""
from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file

from moed.dev import checkpoint as model_init
from moed.dev.checkpoint import init_checkpoint

KW = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, moe_intermediate_size=32)


def test_files_and_transformers_loads_it(make_checkpoint):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    d = make_checkpoint("mixtral", "tiny", 0, num_experts=3, **KW)
    for f in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (d / f).is_file(), f
    cfg = AutoConfig.from_pretrained(d)
    assert (cfg.model_type, cfg.num_local_experts, cfg.hidden_size, cfg.num_key_value_heads) == ("mixtral", 3, 64, 2)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) <= cfg.vocab_size
    out = model(torch.tensor([tok("hello world")["input_ids"]])).logits
    assert out.shape[-1] == cfg.vocab_size and out[0, -1].std() > 0.5    # wide init: logits not flat


def test_seeds_and_overrides(tmp_path):
    a = init_checkpoint("qwen3_moe", tmp_path / "a", seed=7, num_experts=3, **KW)
    b = init_checkpoint("qwen3_moe", tmp_path / "b", seed=7, num_experts=3, **KW)
    c = init_checkpoint("qwen3_moe", tmp_path / "c", seed=8, num_experts=3, **KW)
    wa, wb, wc = (load_file(str(p / "model.safetensors")) for p in (a, b, c))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["dtype"] == "bfloat16" and cfg["norm_topk_prob"] is True
    gen = json.loads((a / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]
    with pytest.raises(ValueError, match="unknown checkpoint override 'num_expert'"):
        init_checkpoint("qwen3_moe", tmp_path / "d", num_expert=3)
    with pytest.raises(ValueError, match="does not apply to mixtral"):
        init_checkpoint("mixtral", tmp_path / "d", mlp_only_layers=[0])
    with pytest.raises(ValueError, match="unknown arch"):
        init_checkpoint("llama", tmp_path / "d")
    with pytest.raises(ValueError, match="unknown preset"):
        init_checkpoint("mixtral", tmp_path / "d", preset="huge")


def test_cli_entry_points(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    model_init.add_arguments(parser)
    out = tmp_path / "m"
    args = parser.parse_args(["--arch", "mixtral", "--out", str(out), "--seed", "3"])
    assert model_init.main(args) == 0 and (out / "config.json").is_file()
    assert model_init.main(args) == 2 and "not empty" in capsys.readouterr().err
    forced = parser.parse_args(["--arch", "qwen3_moe", "--out", str(out), "--force"])
    assert model_init.main(forced) == 0 and '"qwen3_moe"' in (out / "config.json").read_text()
    with pytest.raises(SystemExit):
        parser.parse_args(["--arch", "gpt2", "--out", str(out)])
