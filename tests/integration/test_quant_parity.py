"""Quantized weights end to end: checkpoints in each format (tests/quant_ckpt.py, written by the
formats' published definitions from random bf16 checkpoints) and `model.quantization` of a bf16
one, served by the real engine in fp32 (chunked prefill mixed with decodes, then prefix-cache
hits: test_engine_parity's scenario, 64 new tokens per request), every token and logit against
transformers run on the same weights dequantized to fp32.

Tolerance: the logits within 1e-3 (test_engine_parity's). moed's native quantized matmul
(decode, chunks up to 64 rows) and its reference path (longer chunks) both multiply by the
dequantized weight, which in fp32 is bit-for-bit the oracle's (the same (q - zero) * scale, one
rounding); what remains is the summation order of the matmuls and attention, ~1e-5 here.

Bad input: a real `moed serve` / `check-config` process, one `moed: config error:` line naming
the tensor or key, exit 2, before any weight is read.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import quant_ckpt       # tests/quant_ckpt.py
from moed.config import EngineConfig
from moed.engine.engine import Engine
from moed.model.quant.weight import QuantWeight
from moed.model.runner import ModelRunner
from moed.model.tokenizer import Tokenizer
import test_engine_parity
from test_engine_parity import BLOCK, RecordingRunner, _oracle, chunked_and_prefix_hit_parity

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]

QWEN = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=6,
            moe_intermediate_size=96, vocab_size=1024)
DEEPSEEK = dict(hidden_size=128, num_layers=2, num_heads=4, num_experts=8, moe_intermediate_size=64,
                vocab_size=1024)

CASES = [   # id, arch, how: ("ckpt", method, kw) | ("online", fmt, group)
    ("qwen-fp8-block128", "qwen3_moe", ("ckpt", "fp8", dict(block=(128, 128)))),
    ("qwen-ct-w4a16-asym", "qwen3_moe", ("ckpt", "ct", dict(bits=4, group=32, symmetric=False, packed=True))),
    ("qwen-ct-w8a16-channel", "qwen3_moe", ("ckpt", "ct", dict(bits=8, group=0, symmetric=True, packed=False))),
    ("qwen-gptq-int4", "qwen3_moe", ("ckpt", "gptq", dict(group=32, symmetric=True))),
    ("qwen-awq-int4", "qwen3_moe", ("ckpt", "awq", dict(group=32))),
    ("qwen-online-int4", "qwen3_moe", ("online", "int4", 32)),
    ("qwen-online-int8", "qwen3_moe", ("online", "int8", 128)),
    ("qwen-online-fp8", "qwen3_moe", ("online", "fp8", 128)),
    ("mixtral-gptq-int4-asym", "mixtral", ("ckpt", "gptq", dict(group=32, symmetric=False))),
    ("mixtral-online-fp8", "mixtral", ("online", "fp8", 128)),
    ("deepseek-fp8-block128", "deepseek_v3", ("ckpt", "fp8", dict(block=(128, 128)))),
    ("deepseek-ct-w4a16", "deepseek_v3", ("ckpt", "ct", dict(bits=4, group=16, symmetric=True, packed=True))),
    ("deepseek-gptq-int4-asym", "deepseek_v3", ("ckpt", "gptq", dict(group=16, symmetric=False))),
    ("deepseek-online-int4", "deepseek_v3", ("online", "int4", 32)),
]


def _prepare(make_checkpoint, tmp_path, arch, how):
    src = make_checkpoint(arch, "tiny", 3, **(DEEPSEEK if arch == "deepseek_v3" else QWEN))
    kind, what, opt = how
    if kind == "ckpt":
        quant_ckpt.make(src, tmp_path / "q", tmp_path / "oracle", what, **opt)
        return tmp_path / "q", tmp_path / "oracle", {}
    quant_ckpt.online_oracle(src, tmp_path / "oracle", what, opt)
    return src, tmp_path / "oracle", dict(quantization=what, quantization_group_size=opt)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("arch,how", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_quantized_parity(make_checkpoint, tmp_path, monkeypatch, arch, how):
    monkeypatch.setattr(test_engine_parity, "NEW", 64)      # 64 greedy steps per request
    served, oracle, kw = _prepare(make_checkpoint, tmp_path, arch, how)
    runner = ModelRunner(served, dtype="float32", device="cpu", attention_backend="torch",
                         num_blocks=96, block_size=BLOCK, **kw)
    assert runner.model.quantized, "nothing was quantized"
    rec = RecordingRunner(runner)
    engine = Engine(rec, Tokenizer.from_dir(served), EngineConfig(block_size=BLOCK, max_num_batched_tokens=16,
                                                                  max_num_seqs=8))
    await chunked_and_prefix_hit_parity(engine, rec, _oracle(oracle), runner.spec.vocab_size, seed=11)


def test_bf16_quantized_runner_decodes_like_its_fp32_self(make_checkpoint, tmp_path):
    """bf16 compute on int4 weights: the experts hold the int4 bytes, and where the CPU runs
    the kernels a decode step is the native one (decode_step.py serves quantized weights)."""
    src = make_checkpoint("qwen3_moe", "tiny", 3, **QWEN)
    runner = ModelRunner(src, dtype="bfloat16", device="cpu", attention_backend="auto", num_blocks=16,
                         block_size=BLOCK, quantization="int4", quantization_group_size=32)
    assert (runner.native_decode is not None) == (runner.model.kernels is not None), runner.native_decode_off
    layer = runner.model.layers[0]
    assert isinstance(layer.attn.qkv.weight, QuantWeight) and layer.mlp.kernels is None
    bf16 = 2 * 6 * 3 * 96 * 128 * 2          # layers x experts x matrices x I x H x bytes
    assert runner.resident_expert_bytes() / bf16 == (0.5 + 4 / 32) / 2      # nibble + fp32 scale per 32


# ---- refusals through a real process --------------------------------------------------------

def _error(argv: list[str]) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run([sys.executable, "-m", "moed", *argv, "--port", "0"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("moed: ")]
    assert "weights_loaded" not in r.stdout + r.stderr
    return r.returncode, lines[-1] if lines else r.stdout + r.stderr


def _edit_tensors(d: Path, fn) -> None:
    t = load_file(str(d / "model.safetensors"))
    fn(t)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(d: Path, fn) -> None:
    cfg = json.loads((d / "config.json").read_text())
    fn(cfg["quantization_config"])
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.timeout(600)
def test_bad_quantized_checkpoints_refused_in_one_line(make_checkpoint, tmp_path):
    src = make_checkpoint("qwen3_moe", "tiny", 3, **QWEN)

    def fp8(name: str) -> Path:
        quant_ckpt.make(src, tmp_path / name, tmp_path / (name + "-o"), "fp8", block=(64, 64))
        return tmp_path / name

    key = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    wrong = fp8("wrong-shape")
    _edit_tensors(wrong, lambda t: t.__setitem__(key, torch.ones(1, 2)))
    truncated = fp8("truncated")
    f = truncated / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4])
    block = fp8("block")
    _edit_config(block, lambda q: q.__setitem__("weight_block_size", [128, 128]))
    method = fp8("method")
    _edit_config(method, lambda q: q.__setitem__("quant_method", "bitsandbytes"))
    cases = {
        "scale of the wrong shape": ([wrong], "q_proj.weight_scale_inv: shape [1, 2], expected [2, 2]"),
        "truncated file": ([truncated], "does not hold"),
        "weight_block_size not as declared": ([block], "in 128x128 blocks, quantization_config.weight_block_size"),
        "unsupported quant_method": ([method], "quantization_config.quant_method: 'bitsandbytes' is not supported"),
        "int4 on an fp8 checkpoint": ([fp8("requant"), "--quantization", "int4"],
                                      "model.quantization: int4 asked, but the checkpoint is already quantized"),
    }
    runs = [(case, cmd, argv, says) for case, (argv, says) in cases.items() for cmd in ("serve", "check-config")]
    with ThreadPoolExecutor(4) as pool:      # ten CLI starts, mostly imports: two at a time per core
        got = list(pool.map(lambda r: _error([r[1], "--model", str(r[2][0]), *r[2][1:]]), runs))
    for (case, cmd, _, says), (rc, line) in zip(runs, got):
        assert rc == 2 and line.startswith("moed: config error: ") and says in line, (case, cmd, line)
