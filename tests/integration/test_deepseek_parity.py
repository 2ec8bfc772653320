"""DeepSeek-V3 end-to-end parity with transformers (fp32, the real ModelRunner and Engine).

The three shapes cover: q_lora_rank set and null; n_group > 1 with topk_group < n_group; one
and two dense leading layers; an odd number of routed experts per group (3 and 5); YaRN rotary;
interleaved and plain rope layout; one and two shared experts. Each is served batched, with
prefill chunked at 16 tokens, then with prefix-cache hits (the same checks and helpers as
test_engine_parity.py: every greedy token equals the oracle's argmax, logits within 1e-3, the
whole sequence equals transformers' generate, every KV block returned). A pool too small for
the requests checks preemption and recompute on the latent cache.
"""
from __future__ import annotations

import pytest
import torch

from moed.config import EngineConfig
from moed.engine.engine import Engine
from moed.model.runner import ModelRunner
from moed.model.tokenizer import Tokenizer
from moed.types import SamplingParams
from test_engine_parity import (BLOCK, RecordingRunner, _check, _oracle, _serve,
                                chunked_and_prefix_hit_parity)

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.707}
SHAPES = {
    # q_lora, 4 groups of 3 experts keep 2, one dense layer, YaRN
    "qlora-g4of3-dense1-yarn": dict(hidden_size=128, num_layers=3, num_heads=4, num_experts=12, top_k=3,
                                    moe_intermediate_size=48, q_lora_rank=48, kv_lora_rank=32,
                                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_group=4,
                                    topk_group=2, first_k_dense_replace=1, rope_scaling=YARN),
    # no q_lora, 2 groups of 5 keep 1, two dense layers, two shared experts
    "noqlora-g2of5-dense2": dict(hidden_size=96, num_layers=3, num_heads=6, num_experts=10, top_k=2,
                                 moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=40,
                                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_group=2,
                                 topk_group=1, first_k_dense_replace=2, n_shared_experts=2),
    # q_lora, ungrouped, plain (not interleaved) rope
    "qlora-nogroup-plainrope": dict(hidden_size=128, num_layers=2, num_heads=8, num_experts=6, top_k=2,
                                    moe_intermediate_size=64, q_lora_rank=64, kv_lora_rank=64,
                                    qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, n_group=1,
                                    topk_group=1, first_k_dense_replace=1, rope_interleave=False),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """name -> checkpoint dir, built once per shape (the shared cache's names would be too long)."""
    from moed.dev.checkpoint import init_checkpoint

    root, built = tmp_path_factory.mktemp("deepseek"), {}

    def get(name: str):
        if name not in built:
            built[name] = init_checkpoint("deepseek_v3", root / name, preset="tiny", seed=3, **SHAPES[name])
        return built[name]
    return get


def _runner(d, num_blocks: int) -> ModelRunner:
    return ModelRunner(d, dtype="float32", device="cpu", attention_backend="torch",
                       num_blocks=num_blocks, block_size=BLOCK)


@pytest.mark.parametrize("name", list(SHAPES))
async def test_deepseek_engine_parity(checkpoint, name):
    d = checkpoint(name)
    runner = _runner(d, 96)
    assert runner.kv_layout.kind == "mla"
    spec = runner.spec
    assert runner.kv_layout.entry_shape == (spec.kv_lora_rank + spec.qk_rope_head_dim,)
    rec = RecordingRunner(runner)
    engine = Engine(rec, Tokenizer.from_dir(d), EngineConfig(block_size=BLOCK, max_num_batched_tokens=16,
                                                             max_num_seqs=8))
    await chunked_and_prefix_hit_parity(engine, rec, _oracle(d), spec.vocab_size, seed=11)


async def test_deepseek_preemption_parity(checkpoint):
    d = checkpoint("noqlora-g2of5-dense2")
    rec = RecordingRunner(_runner(d, 14))
    engine = Engine(rec, Tokenizer.from_dir(d), EngineConfig(block_size=BLOCK, max_num_batched_tokens=32))
    ref = _oracle(d)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 4000, (10,), generator=gen).tolist() for _ in range(4)]
    await engine.start()
    try:
        outs = await _serve(engine, prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        assert engine.scheduler.num_preemptions > 0
        for p, o in zip(prompts, outs):
            _check(ref, rec, p, o)
        assert engine.stats().kv_blocks_used == 0
    finally:
        await engine.shutdown()
