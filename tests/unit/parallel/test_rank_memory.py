"""The per-rank memory budget, and a rank's partial load: a runner placed on rank r of N holds
exactly its slots' expert tensors (equal to the checkpoint's), ~1/N of the expert bytes."""
from __future__ import annotations

import pytest
import torch

from moed.model.loader import load_weights
from moed.model.runner import ModelRunner
from moed.model.hf_config import load_spec
from moed.parallel.memory import rank_memory
from moed.parallel.dispatch import RankPlacement
from moed.parallel.layout import EPLayout


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_loads_only_its_experts(tiny_qwen3, n: int) -> None:
    spec = load_spec(tiny_qwen3)
    full = load_weights(tiny_qwen3, spec, "float32")
    one = ModelRunner(tiny_qwen3, dtype="float32", device="cpu", num_blocks=4, block_size=16)
    total = one.resident_expert_bytes()
    for rank in range(n):
        place = RankPlacement(EPLayout.contiguous(spec.num_experts, n), rank, torch.device("cpu"))
        part = load_weights(tiny_qwen3, spec, "float32", slots=place.local_slots)
        mine = list(place.local_slots)
        for name, t in full.items():
            if ".experts." in name:
                assert torch.equal(part[name], t[mine]), name
            else:
                assert torch.equal(part[name], t), name
        runner = ModelRunner(tiny_qwen3, dtype="float32", device="cpu", num_blocks=4,
                             block_size=16, placement=place)
        assert runner.resident_expert_bytes() * n == total
        b = rank_memory(spec, torch.float32, n, rank, 4, 16, 0)
        assert b.expert_bytes == runner.resident_expert_bytes()
        assert b.all_expert_bytes == total


def test_budget_refuses_with_numbers_and_bigger_ep_leaves_room_for_kv(tiny_qwen3) -> None:
    spec = load_spec(tiny_qwen3)
    need1 = rank_memory(spec, torch.bfloat16, 1, 0, 64, 16, 0)
    need4 = rank_memory(spec, torch.bfloat16, 4, 0, 64, 16, 0)
    assert need4.total_bytes < need1.total_bytes
    limit_mb = -(-need4.total_bytes // 2**20)          # fits EP=4, not EP=1
    assert limit_mb << 20 < need1.total_bytes
    at1 = rank_memory(spec, torch.bfloat16, 1, 0, 64, 16, limit_mb)
    at4 = rank_memory(spec, torch.bfloat16, 4, 0, 64, 16, limit_mb)
    assert not at1.fits and at4.fits
    msg = at1.message()
    assert "dense weights" in msg and "8 expert slots" in msg and "64 KV blocks" in msg
    assert at1.kv_blocks_fit == 0 and at4.kv_blocks_fit > 0
    # with memory both fit in, EP=4's extra KV blocks are the expert bytes it does not hold
    roomy = -(-need1.total_bytes // 2**20) + 1
    r1 = rank_memory(spec, torch.bfloat16, 1, 0, 64, 16, roomy)
    r4 = rank_memory(spec, torch.bfloat16, 4, 0, 64, 16, roomy)
    freed = r1.expert_bytes - r4.expert_bytes
    assert r4.kv_blocks_fit - r1.kv_blocks_fit in (freed // r1.kv_block_bytes,
                                                   freed // r1.kv_block_bytes + 1)
    # experts.resident_bytes: the rank holds that many bytes of its slots (whole slots), not all
    slot = need4.expert_bytes // need4.slots
    cold = rank_memory(spec, torch.bfloat16, 4, 0, 64, 16, 0, resident_bytes=slot + slot // 2)
    assert (cold.slots, cold.expert_bytes) == (1, slot) and need4.slots > 1
    assert cold.all_expert_bytes == need4.all_expert_bytes


@pytest.mark.parametrize("fused", [False, True])
def test_partial_load_with_replica_slots_both_namings(make_checkpoint, fused: bool) -> None:
    """5 experts over 2 ranks: 3 slots each, rank 1's spare slot a replica of expert 0; per-expert
    and fused (transformers 5.x) checkpoints load the same slots."""
    model = make_checkpoint("qwen3_moe", "tiny", 3, hidden_size=64, num_layers=2, num_heads=4,
                            num_kv_heads=2, num_experts=5, moe_intermediate_size=32,
                            **({"write_fused": True} if fused else {}))
    spec = load_spec(model)
    full = load_weights(model, spec, "float32")
    lay = EPLayout.contiguous(5, 2)
    assert lay.local_experts(1) == (3, 4, 0)
    for rank in range(2):
        mine = list(lay.local_experts(rank))
        part = load_weights(model, spec, "float32", slots=tuple(mine))
        for i in range(2):
            for name in ("experts.gate_up", "experts.down"):
                key = f"layers.{i}.{name}"
                assert torch.equal(part[key], full[key][mine]), (rank, key)


def test_budget_counts_the_mtp_layer_when_it_is_served() -> None:
    """speculative.method mtp: the MTP layer's weights (its experts spread like any MoE
    layer's) and its KV layer are in the rank's budget."""
    from pathlib import Path

    demo = Path(__file__).resolve().parents[3] / "models" / "stdlib-ds3-tiny"
    spec = load_spec(demo)
    moe_layers = spec.num_layers - len(spec.dense_layers)
    plain = rank_memory(spec, torch.float32, 2, 0, 8, 16, 0)
    mtp = rank_memory(spec, torch.float32, 2, 0, 8, 16, 0, mtp=1)
    assert mtp.expert_bytes * moe_layers == plain.expert_bytes * (moe_layers + 1)
    assert mtp.dense_bytes > plain.dense_bytes
    assert mtp.kv_block_bytes * spec.num_layers == plain.kv_block_bytes * (spec.num_layers + 1)
