"""The contract between the engine (scheduler) and the model runner for one forward step.

The engine fills a ForwardBatch with plain Python lists; the runner turns it into tensors on
its device. Sequence i contributes `token_ids[i]` new tokens at positions
`start_pos[i] .. start_pos[i] + len(token_ids[i]) - 1`; their K/V are written into the blocks of
`block_tables[i]` (block j holds positions j*block_size .. (j+1)*block_size-1), and attention reads
positions 0 .. start_pos[i] + len(token_ids[i]) - 1 from the same table.
The runner returns fp32 logits of the LAST new token of every sequence: shape [B, vocab].
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: list[list[int]]      # new tokens per sequence (>= 1 each)
    start_pos: list[int]            # tokens already in the KV cache per sequence
    block_tables: list[list[int]]   # physical KV block ids per sequence

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.start_pos) == len(self.block_tables)):
            raise ValueError("ForwardBatch fields must have one entry per sequence")

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def is_decode_only(self) -> bool:
        return all(len(t) == 1 for t in self.token_ids)
