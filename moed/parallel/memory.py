"""One rank's memory (RankMemory): dense weights + its expert slots + KV blocks must fit
parallel.rank_memory_mb, checked before any weight is read (moed/preflight.py).

All sizes come from the checkpoint's config (moed.model.loader.expected_shapes, the shapes the
loader allocates) and the KV layout's bytes per block; the packed CPU-kernel copies pad each
matrix to 32 rows, which the figures ignore (under 1% on real models). With the same memory,
EP=N holds ~1/N of the experts, and `kv_blocks_fit` says how many KV blocks the rest holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moed.model import archs
from moed.model.loader import expected_shapes, is_expert
from moed.model.spec import ModelSpec
from moed.parallel.layout import EPLayout


@dataclass(frozen=True)
class RankMemory:
    ep_size: int
    slots: int                  # expert slots this rank holds per MoE layer
    dense_bytes: int            # everything but the routed experts (every rank holds it)
    expert_bytes: int           # this rank's expert slots, all MoE layers
    all_expert_bytes: int       # every expert once (what EP=1 holds)
    kv_block_bytes: int
    kv_blocks: int
    limit_bytes: int            # 0: unchecked

    @property
    def weights_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_blocks * self.kv_block_bytes

    @property
    def fits(self) -> bool:
        return self.limit_bytes == 0 or self.total_bytes <= self.limit_bytes

    @property
    def kv_blocks_fit(self) -> int:
        """KV blocks the limit leaves room for beside the weights (0 without a limit)."""
        return max(0, (self.limit_bytes - self.weights_bytes) // self.kv_block_bytes) if self.limit_bytes else 0

    def message(self) -> str:
        mb = lambda b: f"{b / 2**20:,.1f} MB"      # noqa: E731
        room = (f"room for {self.kv_blocks_fit} KV blocks beside the weights"
                if self.weights_bytes <= self.limit_bytes else "the weights alone do not fit")
        return (f"this rank needs {mb(self.total_bytes)}: dense weights {mb(self.dense_bytes)} "
                f"+ {self.slots} expert slots per layer {mb(self.expert_bytes)} (every expert: "
                f"{mb(self.all_expert_bytes)}, ep_size {self.ep_size}) + {self.kv_blocks} KV "
                f"blocks {mb(self.kv_blocks * self.kv_block_bytes)}; parallel.rank_memory_mb "
                f"allows {mb(self.limit_bytes)}: {room}")


def rank_memory(spec: ModelSpec, dtype: torch.dtype, ep_size: int, rank: int, num_blocks: int,
                block_size: int, limit_mb: int, redundant: int = 0, quant: object | None = None,
                kv_dtype: torch.dtype | None = None, mtp: int = 0, resident_bytes: int = 0) -> RankMemory:
    """quant: the weights' quantization Plan (moed/model/quant/formats.py), None: plain.
    kv_dtype: the KV cache's (engine.kv_cache_dtype; default: the model's dtype).
    mtp: MTP layers served (speculative.method mtp): their weights (their experts spread like
    any layer's) and their KV layer count too.
    resident_bytes: experts.resident_bytes (0: every slot resident): the cold-expert store keeps
    that many bytes of this rank's slots (whole slots per MoE layer, cold/policy.py), the rest
    on disk."""
    from moed.model.quant import plan_bytes

    item = torch.empty((), dtype=dtype).element_size()
    dense = experts = 0
    for name, shape in expected_shapes(spec, mtp=mtp).items():
        n = plan_bytes(name, shape, item, quant)
        if is_expert(name):
            experts += n
        else:
            dense += n
    if spec.tie_word_embeddings and getattr(quant, "head", ""):     # a quantized copy of embed
        dense += plan_bytes("lm_head", (spec.vocab_size, spec.hidden_size), item, quant)
    slots = spec.num_experts
    if ep_size > 1:
        slots = EPLayout.contiguous(spec.num_experts, ep_size, redundant).slots_per_rank
    if resident_bytes > 0 and experts:      # whole slots: a slot's bytes in every MoE layer
        slots = min(slots, max(1, resident_bytes * spec.num_experts // experts))
    mine = experts * slots // max(spec.num_experts, 1)
    kv = archs.kv_layout(spec, block_size, kv_dtype or dtype, mtp).bytes_per_block
    return RankMemory(ep_size, slots, dense, mine, experts, kv, num_blocks, limit_mb << 20)
