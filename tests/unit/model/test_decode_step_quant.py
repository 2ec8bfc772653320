"""The native decode step on quantized weights (moed/model/decode_step.py, kernels/cpu_step.c):
every projection and MoE layer calls the kernel the layered path calls for that weight
(moed_qlinear, moed_qdot_linear with int8 activations, moed_moe_q_routed; the lm_head int8 or
the model's format), so logits, K/V and expert-load counts are bitwise the layered path's
(test_decode_step.py's side-by-side runs), and every decode step of up to 64 rows stays native.
"""
from __future__ import annotations

import pytest
import torch

from moed.model import decode_step as ds
from moed.model.runner import ModelRunner

import quant_ckpt       # tests/quant_ckpt.py
from test_decode_step import BS, _Counting, _decode_rounds, pytestmark  # noqa: F401 (the skips)
from torch_threads import threads

# (weights, activations, lm_head): each format on both activation modes, heads in int8 and the
# model's own format; fp8 (no int8 activations: refused at load) on moed_qlinear too
CASES = [("int8", "none", "none"), ("int8", "int8", "int8"), ("int4", "none", "model"),
         ("int4", "int8", "int8"), ("fp8", "none", "none")]


def _runner(ckpt, fmt: str, act: str, head: str, num_blocks: int = 64, **kw) -> ModelRunner:
    return ModelRunner(ckpt, dtype="bfloat16", device="cpu", attention_backend="torch", num_blocks=num_blocks,
                       block_size=BS, quantization=fmt, quantization_group_size=32,
                       quantization_activations=act, quantization_lm_head=head, **kw)


def _pair(ckpt, fmt: str, act: str, head: str) -> tuple[ModelRunner, ModelRunner]:
    native, layered = _runner(ckpt, fmt, act, head), _runner(ckpt, fmt, act, head)
    assert native.model.quantized and native.native_decode is not None, native.native_decode_off
    layered.native_decode = None
    return native, layered


@pytest.mark.parametrize("fmt,act,head", CASES, ids=["-".join(c) for c in CASES])
def test_quantized_native_step_is_bitwise_the_layered_path(kern, make_checkpoint, fmt, act, head):
    """Batches of 1, 3 and 9 (the row classes), blocks crossed; every decode step native (a
    quantized model that leaves the native step fails here), each kernel the layered path's."""
    native, layered = _pair(make_checkpoint("qwen3_moe"), fmt, act, head)
    step = native.native_decode
    want = ds.PROJ_QDOT if act == "int8" else ds.PROJ_QLINEAR
    kinds = {ly.qkv.kind for ly in step._layers} | {ly.o.kind for ly in step._layers}
    assert kinds == {want}
    assert {ly.moe.kind for ly in step._layers} == {ds.MOE_Q}
    assert {ly.moe.qact for ly in step._layers} == {int(act == "int8")}
    lm = native.model.lm_head
    assert step._head_native and step._model.lm_head.kind == (ds.PROJ_BF16 if head == "none" else want)
    assert head == "none" or lm.quant.fmt == ("int8" if head == "int8" else fmt)
    native.native_decode = counting = _Counting(step)
    with threads(2):
        for lengths in ([BS - 1], [5, BS, 2 * BS + 1], [1, 2, 3, 15, 16, 17, 31, 32, 40]):
            _decode_rounds(native, layered, lengths, steps=2)
    assert counting.rows == [1, 1, 3, 3, 9, 9]
    # past the few-row kernels (64 rows) the layered path takes the blocked ones: not native
    assert step.serves_rows(64) and not step.serves_rows(65)


def test_quantized_step_on_every_variant(isa_kern, make_checkpoint):
    """int4 weights on int8 activations (the integer dots) on each kernel variant this CPU runs."""
    native, layered = _pair(make_checkpoint("qwen3_moe"), "int4", "int8", "int8")
    _decode_rounds(native, layered, [3, BS + 2], steps=2)


@pytest.mark.parametrize("method,opt", [("gptq", dict(group=32, symmetric=False)),
                                        ("ct", dict(bits=8, group=32, symmetric=False, packed=False))],
                         ids=["gptq-int4-zeros", "ct-int8-zeros"])
def test_quantized_checkpoint_with_zero_points(kern, make_checkpoint, tmp_path, method, opt):
    """A checkpoint's own asymmetric int4 / int8 weights (zero points) on int8 activations."""
    quant_ckpt.make(make_checkpoint("qwen3_moe"), tmp_path / "q", tmp_path / "oracle", method, **opt)
    native, layered = _pair(tmp_path / "q", "", "int8", "none")
    assert native.model.layers[0].attn.qkv.quant.zero is not None
    _decode_rounds(native, layered, [3, BS + 2], steps=2)


def test_quantized_step_follows_the_expert_map(kern, make_checkpoint):
    """Replicated experts (EPLB's map, 2 replicas each): the same slots and load counts."""
    native, layered = _pair(make_checkpoint("qwen3_moe"), "int4", "none", "int8")
    e = native.spec.num_experts
    perm = torch.randperm(e, generator=torch.Generator().manual_seed(1))
    for r in (native, layered):
        for layer in r.model.layers:
            layer.mlp.set_expert_map(torch.stack([perm, perm], 1), torch.full((e,), 2, dtype=torch.long))
    _decode_rounds(native, layered, [7, 20, 33], steps=2)


def test_quantized_head_past_its_kernel_runs_after_the_step(kern, make_checkpoint):
    """An lm_head whose few-row calls are not a native kernel's (here: the reference path) runs
    after the step on its own path, as the layered path runs it: still native, still bitwise."""
    native, layered = _pair(make_checkpoint("qwen3_moe"), "int8", "none", "int8")
    for r in (native, layered):
        r.model.lm_head.kernels, r.model.lm_head.qrows, r.model.lm_head.qblocked = None, 0, False
    native.native_decode = counting = _Counting(ds.NativeDecodeStep(native.model, native.backend, native.kv_cache))
    assert not counting.step._head_native
    _decode_rounds(native, layered, [4, 18], steps=2)
    assert counting.rows == [2, 2]


def test_quantized_step_refusals(kern, make_checkpoint):
    """Where the layered path leaves the fused quantized kernels, the step says so and stays off."""
    ckpt = make_checkpoint("qwen3_moe")
    r = _runner(ckpt, "int4", "none", "none", batch_invariant=True)     # per-expert path there
    assert r.native_decode is None
    assert r.native_decode_off == "layer 0: quantized experts off moed_moe_q_routed (the per-expert path)"
    r = _runner(ckpt, "int8", "none", "none")
    lin = r.model.layers[1].attn.o
    lin.kernels, lin.qpath = None, "reference (a test's)"
    assert ds.unsupported(r.model, r.backend, r.kv_cache) == \
        "layer 1: a quantized projection off the kernels (reference (a test's))"
