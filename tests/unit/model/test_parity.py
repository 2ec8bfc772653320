"""Forward-level parity with transformers (the oracle), fp32: batched prefill of prompts of
different lengths over a paged, deliberately non-contiguous KV cache (block_size 4), decode
steps, and a chunked prefill mixed with decode; last-token logits within 1e-3."""
from __future__ import annotations

import random

import pytest
import torch

from moed.model.batch import ForwardBatch
from moed.model.runner import ModelRunner

SHAPES = [  # (arch, overrides): odd expert counts, GQA/MQA, top-3, a dense layer, raw top-k weights
    ("qwen3_moe", dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=7,
                       moe_intermediate_size=64)),
    ("qwen3_moe", dict(hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=3, num_experts=8, top_k=3,
                       moe_intermediate_size=48, mlp_only_layers=[1], dense_intermediate_size=80,
                       norm_topk_prob=False)),
    ("mixtral", dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=1, num_experts=5,
                     moe_intermediate_size=64)),
    ("mixtral", dict(hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=2, num_experts=8,
                     moe_intermediate_size=96)),
]
BLOCK = 4
TOL = 1e-3


def _oracle(model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                             experts_implementation="eager", attn_implementation="eager")
    return m.eval()


def _ref_logits(ref, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([seq])).logits[0, -1].float()


def _assert_close(ours: torch.Tensor, ref, seqs: list[list[int]]) -> None:
    for i, seq in enumerate(seqs):
        diff = (ours[i] - _ref_logits(ref, seq)).abs().max().item()
        assert diff <= TOL, f"sequence {i} (len {len(seq)}): max |diff| {diff:.2e}"


@pytest.mark.parametrize("arch,kw", SHAPES, ids=[f"{a}-e{k['num_experts']}-kv{k['num_kv_heads']}" for a, k in SHAPES])
def test_forward_parity(make_checkpoint, arch, kw):
    torch.manual_seed(0)
    d = make_checkpoint(arch, "tiny", 1, **kw)
    runner = ModelRunner(d, dtype="float32", device="cpu", attention_backend="torch",
                         num_blocks=48, block_size=BLOCK)
    ref = _oracle(d)
    vocab = runner.spec.vocab_size
    blocks = list(range(48))
    random.Random(3).shuffle(blocks)          # non-contiguous, unordered block tables
    tables = [blocks[i * 8:(i + 1) * 8] for i in range(5)]

    # 1) prefill of several prompts together (1 token, within one block, spanning 2-4 blocks)
    seqs = [torch.randint(0, vocab, (n,)).tolist() for n in (5, 9, 1, 13)]
    logits = runner.forward(ForwardBatch([list(s) for s in seqs], [0] * 4, tables[:4]))
    assert logits.shape == (4, vocab) and logits.dtype == torch.float32
    _assert_close(logits, ref, seqs)

    # 2) decode steps (greedy tokens appended)
    for _ in range(3):
        for s, t in zip(seqs, logits.argmax(-1).tolist()):
            s.append(t)
        logits = runner.forward(ForwardBatch([[s[-1]] for s in seqs], [len(s) - 1 for s in seqs], tables[:4]))
        _assert_close(logits, ref, seqs)

    # 3) chunked prefill of a new prompt (4 + 5 + 2 tokens) in the same steps as decodes
    prompt = torch.randint(0, vocab, (11,)).tolist()
    done = 0
    for chunk in (4, 5, 2):
        for s, t in zip(seqs, logits[:4].argmax(-1).tolist()):
            s.append(t)
        new = prompt[done:done + chunk]
        batch = ForwardBatch([[s[-1]] for s in seqs] + [new], [len(s) - 1 for s in seqs] + [done], tables)
        logits = runner.forward(batch)
        done += chunk
        _assert_close(logits, ref, seqs + [prompt[:done]])

    # expert-load counter: every token routed to top_k experts in each MoE layer
    load = runner.expert_load()
    n_tokens = sum(len(s) for s in seqs) + len(prompt)
    for layer in runner.spec.moe_layers:
        assert int(load[layer].sum()) == n_tokens * runner.spec.top_k
    for layer in runner.spec.dense_layers:
        assert int(load[layer].sum()) == 0
    assert int(runner.expert_load().sum()) == 0
