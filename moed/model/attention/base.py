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
from dataclasses import dataclass

import torch

from moed.model.batch import ForwardBatch
from moed.model.context import ComputeContext
from moed.model.kv_layout import FP8_KV_SCALE, KVLayout, dequantize_kv, is_fp8
from moed.model.spec import ModelSpec


@dataclass(frozen=True)
class Paging:
    """A step's batch as the paged cache sees it, per sequence: new tokens, tokens in the KV
    once they are written, and the leading block-table entries that hold those."""
    q_lens: list[int]
    kv_lens: list[int]
    tables: list[list[int]]

    def table_tensor(self, device: torch.device) -> torch.Tensor:
        """[B, max blocks] int64, each table padded with block 0 (never read past its end)."""
        width = max(len(t) for t in self.tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables],
                            dtype=torch.long, device=device)

    def token_blocks(self, table_t: torch.Tensor, positions: torch.Tensor,
                     block_size: int) -> torch.Tensor:
        """[T] int64: the cache block each new token is written into (table_t: table_tensor)."""
        dev = table_t.device
        seq_of_token = torch.repeat_interleave(torch.arange(len(self.q_lens), device=dev),
                                               torch.tensor(self.q_lens, device=dev))
        return table_t[seq_of_token, positions // block_size]


# the longest chunk of decoded tokens after a history that a backend may attend as decode rows:
# a speculative step's known token and up to 8 drafts (speculative.num_speculative_tokens <= 8)
DECODED_CHUNK = 9


def decoded_chunks(batch: ForwardBatch) -> list[int]:
    """Sequences whose new tokens are a short chunk of decoded tokens after a history (a
    speculative step's known token and drafts), not prompt tokens: attended as one decode row
    per token, each over its own history, they get the bits plain decoding gives those
    positions (a prompt chunk keeps the prefill path: docs/migration.md)."""
    return [i for i, t in enumerate(batch.token_ids) if 1 < len(t) <= DECODED_CHUNK
            and batch.start_pos[i] > 0 and not (batch.prompt and batch.prompt[i])]


def paging(batch: ForwardBatch, block_size: int) -> Paging:
    """The batch's paging; ValueError when a block table is too short for its sequence."""
    q_lens = [len(t) for t in batch.token_ids]
    kv_lens = [s + n for s, n in zip(batch.start_pos, q_lens)]
    tables = []
    for i, (table, kv) in enumerate(zip(batch.block_tables, kv_lens)):
        need = -(-kv // block_size)
        if len(table) < need:
            raise ValueError(f"sequence {i}: {kv} tokens need {need} KV blocks, block table "
                             f"has {len(table)}")
        tables.append(list(table[:need]))
    return Paging(q_lens, kv_lens, tables)


class AttentionBackend(ABC):
    name: str = ""
    kv_kinds: tuple[str, ...] = ("gqa",)        # KVLayout kinds this backend reads and writes

    def __init__(self, spec: ModelSpec, kv: KVLayout, ctx: ComputeContext) -> None:
        if kv.kind not in self.kv_kinds:
            raise ValueError(f"attention backend {self.name!r} does not serve KV layout kind {kv.kind!r}")
        self.spec, self.kv = spec, kv
        self.block_size, self.device, self.dtype = kv.block_size, ctx.device, ctx.dtype
        self.scale = spec.head_dim ** -0.5
        # fp8 cache, bf16 compute on CPU: the native table lookup instead of torch's scalar cast
        self._fp8_lut = ctx.kernels if is_fp8(kv.dtype) and ctx.kernels is not None and \
            ctx.dtype == torch.bfloat16 and FP8_KV_SCALE == 1.0 else None

    def read_kv(self, x: torch.Tensor) -> torch.Tensor:
        """Cached values (gathered rows) in the compute dtype."""
        if self._fp8_lut is not None and x.dtype == torch.float8_e4m3fn and x.device.type == "cpu":
            return self._fp8_lut.fp8_to_bf16(x)
        return dequantize_kv(x, self.dtype)

    @abstractmethod
    def plan(self, batch: ForwardBatch, positions: torch.Tensor) -> None:
        """Once per step: turn the batch's block tables into the index tensors forward needs.

        positions [T] (device, int64) are the new tokens' positions, sequence by sequence."""

    @abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_layer: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the new tokens -> attention output [T, Hq, D].

        q, k and v may be strided views of the fused qkv output (last dim contiguous)."""
