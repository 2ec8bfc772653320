"""model.quantization_lm_head: the logits head quantized at load and run on the native quantized
matmul (docs/quantization.md, "The heads")."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

import quant_ckpt       # tests/quant_ckpt.py
from moed.config import ConfigError, ModelConfig
from moed.model import layers
from moed.model.batch import ForwardBatch
from moed.model.hf_config import load_spec
from moed.model.kernels import cpu_kernels
from moed.model.layers import Linear
from moed.model.loader import load_weights
from moed.model.quant import bytes_by_format
from moed.model.quant.formats import QuantConfigError, plan
from moed.model.quant.quantize import quantize
from moed.model.quant.weight import QuantWeight
from moed.model.runner import ModelRunner
from moed.model.safetensors_file import WeightError

SHAPE = dict(hidden_size=96, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=4,
             moe_intermediate_size=48, vocab_size=512)
kernels_only = pytest.mark.skipif(cpu_kernels() is None, reason="native CPU kernels off")


@pytest.fixture(scope="module")
def src(make_checkpoint):
    return make_checkpoint("qwen3_moe", "tiny", 5, **SHAPE)


@pytest.fixture(scope="module")
def tied(src, tmp_path_factory):
    """src with tie_word_embeddings: no lm_head.weight, the head reads the embedding."""
    d = tmp_path_factory.mktemp("tied") / "m"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    t = load_file(str(d / "model.safetensors"))
    del t["lm_head.weight"]
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


# ---- the plan and the config ----------------------------------------------------------------

def test_plan_resolves_the_heads_format(src, tmp_path):
    assert plan(src, "int4", 32).head == ""                         # the default: plain
    p = plan(src, "int4", 32, "model")
    assert (p.head, p.head_format(96)) == ("int4", ("int4", 32))
    assert plan(src, "int4", 32, "int8").head_format(96) == ("int8", 96)    # per output channel
    assert plan(src, "fp8", 32, "model").head_format(96) == ("fp8", 128)
    quant_ckpt.make(src, tmp_path / "q", tmp_path / "o", "gptq", group=48, symmetric=True)
    assert plan(tmp_path / "q", "", 128, "model").head_format(96) == ("int4", 48)   # the checkpoint's group


def test_a_quantized_head_on_a_plain_model_is_refused(src):
    for value in ("int8", "model"):
        with pytest.raises(QuantConfigError, match="model.quantization_lm_head.*weights are plain"):
            plan(src, "", 128, value)
    with pytest.raises(QuantConfigError, match="expected one of none, int8, model"):
        plan(src, "int4", 128, "int4")


def test_config_key_and_env(src):
    from moed.config import load as load_config
    from moed.config.env import env_fields
    from moed.preflight import quantization

    assert ModelConfig().quantization_lm_head == "none"
    with pytest.raises(ConfigError, match="model.quantization_lm_head"):
        ModelConfig(quantization_lm_head="int4")
    assert env_fields()["MOED_MODEL_QUANTIZATION_LM_HEAD"] == ("model", "quantization_lm_head")
    env = dict(MOED_MODEL_PATH=str(src), MOED_MODEL_QUANTIZATION_LM_HEAD="model")
    cfg = load_config(environ=env)
    assert cfg.model.quantization_lm_head == "model"
    with pytest.raises(ConfigError, match="quantization_lm_head: model asks for a quantized lm_head"):
        quantization(cfg)           # the pre-flight: the model quantizes nothing
    quantization(load_config(environ={**env, "MOED_MODEL_QUANTIZATION": "int4"}))


# ---- loading --------------------------------------------------------------------------------

@pytest.mark.parametrize("head,fmt,group", [("int8", "int8", 96), ("model", "int4", 32)])
def test_loaded_head_is_the_quantizers(src, head, fmt, group):
    spec = load_spec(src)
    p = plan(src, "int4", 32, head)
    got = load_weights(src, spec, "bfloat16", plan=p)
    plain = load_weights(src, spec, "bfloat16")
    w = got["lm_head"]
    assert isinstance(w, QuantWeight) and (w.fmt, w.group) == (fmt, group)
    want = quantize(plain["lm_head"], fmt, group)
    assert all(torch.equal(a, b) for a, b in zip(w.tensors(), want.tensors()))
    assert torch.equal(got["embed"], plain["embed"])        # the embedding stays plain
    from moed.parallel.memory import rank_memory
    assert rank_memory(spec, torch.bfloat16, 1, 0, 0, 16, 0, quant=p).weights_bytes == \
        sum(bytes_by_format(got).values())


def test_tied_embeddings_keep_plain_rows_for_the_gather(tied):
    spec = load_spec(tied)
    p = plan(tied, "int4", 32, "int8")
    got = load_weights(tied, spec, "bfloat16", plan=p)
    assert got["embed"].dtype == torch.bfloat16
    assert isinstance(got["lm_head"], QuantWeight)
    want = quantize(got["embed"], "int8")
    assert torch.equal(got["lm_head"].data, want.data) and torch.equal(got["lm_head"].scale, want.scale)
    from moed.parallel.memory import rank_memory
    assert rank_memory(spec, torch.bfloat16, 1, 0, 0, 16, 0, quant=p).weights_bytes == \
        sum(bytes_by_format(got).values())


def _with_quantized_head(src, tmp_path):
    """A compressed-tensors int8 checkpoint whose lm_head is quantized too (as llm-compressor
    writes it when lm_head is not in `ignore`) -> (dir, the head's dequantized weight)."""
    q = tmp_path / "q"
    quant_ckpt.make(src, q, tmp_path / "o", "ct", bits=8, group=0, symmetric=True, packed=False)
    t = load_file(str(q / "model.safetensors"))
    enc, deq = quant_ckpt.ct(t.pop("lm_head.weight").float(), 8, 0, True, False, torch.Generator())
    t.update({f"lm_head.{k}": v for k, v in enc.items()})
    save_file(t, str(q / "model.safetensors"), metadata={"format": "pt"})
    return q, deq


def test_a_checkpoints_quantized_head_kept_as_stored(src, tmp_path):
    q, deq = _with_quantized_head(src, tmp_path)
    spec = load_spec(q)
    kept = load_weights(q, spec, "float32", plan=plan(q, "", 128, "model"))["lm_head"]
    assert isinstance(kept, QuantWeight) and kept.fmt == "int8"
    assert torch.equal(kept.dequantize(), deq)
    plain = load_weights(q, spec, "float32", plan=plan(q))["lm_head"]   # none: dequantized, as before
    assert torch.equal(plain, deq)
    with pytest.raises(WeightError, match="would requantize"):
        load_weights(q, spec, "float32", plan=replace(plan(q), head="fp8"))


# ---- computing ------------------------------------------------------------------------------

def _runner(d, head: str, quant: str = "int4") -> ModelRunner:
    return ModelRunner(d, dtype="bfloat16", device="cpu", num_blocks=16, block_size=16,
                       quantization=quant, quantization_group_size=32, quantization_lm_head=head)


def _steps(r: ModelRunner, rows: int) -> list[torch.Tensor]:
    """A prefill of `rows` 5-token prompts, then two decode steps -> the logits of each step."""
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, 512, (rows, 5), generator=g).tolist()
    tables = [[i] for i in range(rows)]
    out = [r.forward(ForwardBatch(prompts, [0] * rows, tables))]
    for s in range(2):
        ids = [[int(t)] for t in out[-1].argmax(-1)]
        out.append(r.forward(ForwardBatch(ids, [5 + s] * rows, tables)))
    return out


@kernels_only
@pytest.mark.parametrize("head", ["int8", "model"])
def test_logits_equal_the_dequantized_head_and_take_the_native_path(src, head, monkeypatch):
    r = _runner(src, head)
    lm = r.model.lm_head
    assert lm.quant is not None and lm.qpath == "native"
    calls = []
    real = layers.quant_linear
    monkeypatch.setattr(layers, "quant_linear",
                        lambda k, x, w, b: calls.append((w, x.shape[0])) or real(k, x, w, b))
    got = _steps(r, 8)
    assert [n for w, n in calls if w is lm.quant] == [8, 8, 8], "the head left the native matmul"
    # the reference: the same model with the head's dequantized weight as a plain bf16 matrix
    monkeypatch.setattr(layers, "quant_linear", real)
    r2 = _runner(src, head)
    r2.model.lm_head = Linear(lm.quant.dequantize(torch.bfloat16), pack=r2.ctx.pack, kernels=r2.ctx.kernels)
    want = _steps(r2, 8)
    for g, w in zip(got, want):
        # bf16 outputs of fp32 sums of the same products: one bf16 rounding apart at most
        assert (g - w).abs().max() <= w.abs().max() * 2.0 ** -7, (g - w).abs().max()
        assert torch.equal(g.argmax(-1), w.argmax(-1))


@kernels_only
def test_the_default_head_stays_plain(src):
    r = _runner(src, "none")
    assert r.model.lm_head.quant is None
    assert "int8" not in {x.fmt for x in [r.model.lm_head.weight] if isinstance(x, QuantWeight)}


def test_tied_model_runs_with_a_quantized_head(tied):
    r = _runner(tied, "int8")
    assert r.model.lm_head.quant is not None and isinstance(r.model.embed, torch.Tensor)
    logits = _steps(r, 2)
    assert all(torch.isfinite(x).all() for x in logits)
