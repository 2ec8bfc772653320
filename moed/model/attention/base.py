"""Attention backend interface over the paged KV cache that moed/model/kv_layout.py describes.

Both backends serve the `gqa` KVLayout: a layer's view of the cache is
[num_blocks, 2, block_size, H_kv, D] with K at [:, 0] and V at [:, 1] (FlashInfer paged NHD).
A backend reads block size and entry shape from the KVLayout it is given, and device, dtype and
the CPU kernels from the model's ComputeContext; it refuses a layout kind it does not implement.

Per step the runner calls `plan(batch, positions)` once (build index tensors), then per layer
`forward(layer, q, k, v, kv_layer)`, which first writes the new K/V into the paged cache and
then attends causally over each sequence's whole history.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.kv_layout import KVLayout
from moed.model.spec import ModelSpec


class AttentionBackend(ABC):
    name: str = ""
    kv_kinds: tuple[str, ...] = ("gqa",)        # KVLayout kinds this backend reads and writes

    def __init__(self, spec: ModelSpec, kv: KVLayout, ctx: ComputeContext) -> None:
        if kv.kind not in self.kv_kinds:
            raise ValueError(f"attention backend {self.name!r} does not serve KV layout kind {kv.kind!r}")
        self.spec, self.kv = spec, kv
        self.block_size, self.device, self.dtype = kv.block_size, ctx.device, ctx.dtype
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
