"""The native decode step (moed/model/decode_step.py) against the layer-by-layer path it stands
in for: two runners on one checkpoint, fed the same steps, one with the native step and one
without, must agree bit for bit in logits, in every K/V byte written and in the expert-load
counts (the native step runs the same kernels in the same order). Sequences cross block
boundaries, batches cross the kernels' row classes (1, 2-8, 9-64), and the expert map, biases
and rotary table change under it. Where it must not serve, the runner keeps the layered path.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from moed.model import kernels as K
from moed.model.batch import ForwardBatch
from moed.model.kernels.choice import FixedChooser, LinearChoice
from moed.model.runner import ModelRunner

from conftest import needs_onednn_bf16     # tests/unit/model/conftest.py
from torch_threads import threads     # tests/unit/model/torch_threads.py

pytestmark = [
    pytest.mark.skipif(not K.cpu_flags_ok(), reason="CPU runs no kernel variant (AVX2+FMA or AVX512-BF16; the native step runs on the kernels)"),
    pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")),
                       reason="no C compiler to build the kernels (moed then runs the torch path)"),
]

BS = 16


def _runner(ckpt, num_blocks: int = 64) -> ModelRunner:
    return ModelRunner(ckpt, dtype="bfloat16", device="cpu", attention_backend="torch",
                       num_blocks=num_blocks, block_size=BS)


def _pair(ckpt, num_blocks: int = 64) -> tuple[ModelRunner, ModelRunner]:
    native, layered = _runner(ckpt, num_blocks), _runner(ckpt, num_blocks)
    assert native.native_decode is not None
    layered.native_decode = None
    return native, layered


def _same_step(native: ModelRunner, layered: ModelRunner, batch: ForwardBatch) -> torch.Tensor:
    a, b = native.forward(batch), layered.forward(batch)
    assert a.dtype == torch.float32 and a.shape == (batch.num_seqs, native.spec.vocab_size)
    assert torch.equal(a, b), f"logits differ by {(a - b).abs().max()}"
    if batch.is_decode_only and native.native_decode is not None and native.native_decode.serves(batch):
        assert torch.equal(native.argmax_of(a), a.argmax(-1))     # the step's own argmax
        assert native.argmax_of(a.clone()) is None and native.argmax_of(a[:1]) is None
    else:
        assert native.argmax_of(a) is None
    assert layered.argmax_of(b) is None
    assert torch.equal(native.kv_cache, layered.kv_cache)
    assert torch.equal(native.model.expert_load, layered.model.expert_load)
    assert [ly.mlp.router.calls for ly in native.model.layers] == [ly.mlp.router.calls for ly in layered.model.layers]
    return a


def _decode_rounds(native: ModelRunner, layered: ModelRunner, lengths: list[int], steps: int,
                   seed: int = 0) -> None:
    """Prefill len(lengths) sequences (layer by layer on both), then `steps` decode steps of all
    of them, each token the greedy one, compared step by step."""
    g = torch.Generator().manual_seed(seed)
    vocab = native.spec.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    per = -(-(max(lengths) + steps) // BS)
    tables = [list(range(i * per, (i + 1) * per))[::-1] for i in range(len(lengths))]   # blocks out of order
    logits = _same_step(native, layered, ForwardBatch(prompts, [0] * len(prompts), tables))
    pos = list(lengths)
    for _ in range(steps):
        toks = [[int(t)] for t in logits.argmax(-1)]
        logits = _same_step(native, layered, ForwardBatch(toks, pos, tables))
        pos = [p + 1 for p in pos]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_native_step_is_bitwise_the_layered_path(isa_kern, make_checkpoint, arch, n_threads):
    """Batches of 1, 3 and 9 (three row classes), prompts ending on and next to block edges;
    on each kernel variant this CPU runs (AVX2 included on an AVX512 machine)."""
    native, layered = _pair(make_checkpoint(arch))
    with threads(n_threads):
        for lengths in ([BS - 1], [5, BS, 2 * BS + 1], [1, 2, 3, 15, 16, 17, 31, 32, 40]):
            _decode_rounds(native, layered, lengths, steps=3)


def test_native_step_follows_the_expert_map(kern, make_checkpoint):
    """EPLB swaps a router's map tensors between steps: the native step must read the new ones
    (a stale pointer would route by the old map, or read freed memory)."""
    native, layered = _pair(make_checkpoint("qwen3_moe"))
    e = native.spec.num_experts
    perm = torch.randperm(e, generator=torch.Generator().manual_seed(1))
    for l2p, nrep in ((perm.unsqueeze(1), torch.ones(e, dtype=torch.long)),                # moved
                      (torch.stack([perm, perm], 1), torch.full((e,), 2, dtype=torch.long))):   # 2 replicas
        for r in (native, layered):
            for layer in r.model.layers:
                layer.mlp.set_expert_map(l2p, nrep)
        _decode_rounds(native, layered, [7, 20, 33], steps=2)


def test_native_step_adds_projection_biases(kern, make_checkpoint):
    """Checkpoints with attention biases (qkv and o): the same biases on both paths."""
    native, layered = _pair(make_checkpoint("qwen3_moe"))
    g = torch.Generator().manual_seed(2)
    for layer_n, layer_l in zip(native.model.layers, layered.model.layers):
        for name in ("qkv", "o"):
            n = getattr(layer_n.attn, name).out_features
            bias = (torch.randn(n, generator=g) * 0.5).to(torch.bfloat16)
            getattr(layer_n.attn, name).bias = bias
            getattr(layer_l.attn, name).bias = bias.clone()
    from moed.model.decode_step import NativeDecodeStep
    native.native_decode = NativeDecodeStep(native.model, native.backend, native.kv_cache)  # reads the new pointers
    _decode_rounds(native, layered, [4, 18], steps=2)


def test_native_step_past_the_rotary_table(kern, make_checkpoint):
    """Positions past max_position_embeddings extend the rotary tables (never fail), on both."""
    native, layered = _pair(make_checkpoint("qwen3_moe", max_position_embeddings=32))
    _decode_rounds(native, layered, [30, 31], steps=4)
    assert native.model.rotary.cos.shape[0] > 32


@needs_onednn_bf16
def test_native_step_keeps_the_layered_path_where_onednn_serves(kern, make_checkpoint):
    """A row class measured for oneDNN (an AMX CPU, many rows), for a projection or for the
    experts' rows: those batches go layer by layer, the others natively, with the same results."""
    kern.choose = FixedChooser(LinearChoice((False, True, False, False, False)))    # oneDNN for 2-8 rows
    native, layered = _pair(make_checkpoint("qwen3_moe"))
    step = native.native_decode
    # 4 rows: the projections' class; 9: each of 8 experts gets 3 rows; 33: 9 rows per expert
    assert [step.serves_rows(n) for n in (1, 4, 9, 33)] == [True, False, False, True]
    native.native_decode = counting = _Counting(step)
    for lengths in ([5], [5, 6, 7, 8], [3] * 9, [2] * 33):
        _decode_rounds(native, layered, lengths, steps=1)
    assert counting.rows == [1, 33]


@needs_onednn_bf16
def test_native_step_serves_when_only_the_lm_head_is_onednn(kern, make_checkpoint):
    """lm_head's row class on oneDNN (a near tie on AMX CPUs) keeps the native step: it stops
    after the final norm and lm_head runs on oneDNN as the layered path runs it, bit for bit."""
    ckpt = make_checkpoint("qwen3_moe")
    vocab = _runner(ckpt).spec.vocab_size
    kern.choose = _HeadChooser(vocab, LinearChoice((True, True, False, False, False)))
    native, layered = _pair(ckpt)
    assert native.model.lm_head.choice.use_onednn(1)
    qkv = native.model.layers[0].attn.qkv.choice
    assert qkv is None or not qkv.any_onednn
    step = native.native_decode
    assert [step.serves_rows(n) for n in (1, 4, 9)] == [True, True, True]
    native.native_decode = counting = _Counting(step)
    for lengths in ([5], [5, 6, 7, 8], [17] * 9):     # lm_head on oneDNN, oneDNN, native
        _decode_rounds(native, layered, lengths, steps=2)
    assert counting.rows == [1, 1, 4, 4, 9, 9]


class _HeadChooser:
    """`head` for the weight shaped like the lm_head ([vocab, H]), native everywhere else."""

    def __init__(self, vocab: int, head: LinearChoice) -> None:
        self.vocab, self.head = vocab, head

    def __call__(self, n: int, k: int) -> LinearChoice:
        return self.head if n == self.vocab else LinearChoice((False,) * len(self.head.onednn))

    def chosen(self) -> list[LinearChoice]:
        return [self.head]


class _Counting:
    """The native step, noting the batch size of each step it serves."""

    def __init__(self, step) -> None:
        self.step, self.rows = step, []

    def serves(self, batch: ForwardBatch) -> bool:
        return self.step.serves(batch)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        self.rows.append(batch.num_seqs)
        return self.step(batch)

    def argmax_of(self, logits: torch.Tensor) -> torch.Tensor | None:
        return self.step.argmax_of(logits)


def test_native_step_refuses_what_it_does_not_implement(kern, make_checkpoint, monkeypatch):
    dense = _runner(make_checkpoint("qwen3_moe", mlp_only_layers=[1]))
    assert dense.native_decode is None
    from moed.model.decode_step import unsupported
    assert unsupported(dense.model, dense.backend, dense.kv_cache) == "layer 1 has a dense MLP"
    strided = _runner(make_checkpoint("qwen3_moe"))
    strided.model.layers[2].post_norm = torch.stack([strided.model.layers[2].post_norm] * 2, 1)[:, 0]
    assert unsupported(strided.model, strided.backend, strided.kv_cache) == \
        "a weight the kernel would read is not contiguous bf16"
    monkeypatch.setenv("MOED_CPU_KERNELS", "0")
    K.cpu_kernels.cache_clear()
    try:
        off = _runner(make_checkpoint("qwen3_moe"))
        assert off.native_decode is None and unsupported(off.model, off.backend, off.kv_cache) == "cpu kernels off"
    finally:
        monkeypatch.delenv("MOED_CPU_KERNELS")
        K.cpu_kernels.cache_clear()


def test_native_step_bad_tables_write_nothing(kern, make_checkpoint):
    """A block table too short for its position: the layered path's error, raised before any
    write; a block id out of range reaching the kernel: refused with nothing written."""
    native, _ = _pair(make_checkpoint("qwen3_moe"), num_blocks=8)
    native.forward(ForwardBatch([[5, 6, 7]], [0], [[2]]))
    kv, load = native.kv_cache.clone(), native.model.expert_load.clone()
    with pytest.raises(ValueError, match="sequence 0: 17 tokens need 2 KV blocks, block table has 1"):
        native.forward(ForwardBatch([[9]], [16], [[2]]))
    with pytest.raises(RuntimeError, match="bad token id, block id"):
        native.native_decode(ForwardBatch([[9], [9]], [3, 3], [[2], [8]]))     # bypasses the runner's check
    with pytest.raises(RuntimeError, match="bad token id, block id"):
        native.native_decode(ForwardBatch([[native.spec.vocab_size]], [3], [[2]]))
    assert torch.equal(native.kv_cache, kv) and torch.equal(native.model.expert_load, load)
