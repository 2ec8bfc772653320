"""The engine's KV tensor as block payloads (the one torch file of the tiers).

The tensor is `[num_layers, num_blocks, *block_shape]` (moed.model.kv_layout), so block b is
`kv[:, b]`: num_layers runs of `block_bytes`, gathered into one payload. Reads and writes run
on the engine's loop thread between steps (no forward pass touches the tensor then).
"""
from __future__ import annotations

from typing import Any

import torch


class KVBlockIO:
    def __init__(self, kv: torch.Tensor, layout: Any) -> None:
        self.kv = kv
        self.block_bytes = int(layout.bytes_per_block)

    def read(self, block_id: int) -> bytes:
        t = self.kv[:, block_id].contiguous()
        if t.device.type != "cpu":
            t = t.cpu()
        return t.view(torch.uint8).numpy().tobytes()

    def write(self, block_id: int, data: bytes) -> None:
        if len(data) != self.block_bytes:
            raise ValueError(f"payload of {len(data)} bytes, a block is {self.block_bytes}")
        dst = self.kv[:, block_id]
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.kv.dtype)
        dst.copy_(src.view(dst.shape))
