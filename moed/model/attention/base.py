"""Attention backend interface and the one paged KV layout both backends share.

KV cache (FlashInfer paged NHD): one tensor [num_layers, num_blocks, 2, block_size, H_kv, D];
a layer's view is [num_blocks, 2, block_size, H_kv, D] with K at [:, 0] and V at [:, 1].
Transfer and tiering code works on block ids and byte ranges of this layout.

Per step the runner calls `plan(batch, positions)` once (build index tensors), then per layer
`forward(layer, q, k, v, kv_layer)`, which first writes the new K/V into the paged cache and
then attends causally over each sequence's whole history.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from moed.model.batch import ForwardBatch
from moed.model.spec import ModelSpec


def kv_cache_shape(spec: ModelSpec, num_blocks: int, block_size: int) -> tuple[int, ...]:
    return (spec.num_layers, num_blocks, 2, block_size, spec.num_kv_heads, spec.head_dim)


def kv_bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return spec.num_layers * 2 * block_size * spec.num_kv_heads * spec.head_dim * elem


class AttentionBackend(ABC):
    name: str = ""

    def __init__(self, spec: ModelSpec, block_size: int, device: torch.device, dtype: torch.dtype) -> None:
        self.spec, self.block_size, self.device, self.dtype = spec, block_size, device, dtype
        self.scale = spec.head_dim ** -0.5

    @abstractmethod
    def plan(self, batch: ForwardBatch, positions: torch.Tensor) -> None:
        """Once per step: turn the batch's block tables into the index tensors forward needs.

        positions [T] (device, int64) are the new tokens' positions, sequence by sequence."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the new tokens -> attention output [T, Hq, D].

        q, k and v may be strided views of the fused qkv output (last dim contiguous)."""
