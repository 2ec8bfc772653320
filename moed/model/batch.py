"""The contract between the engine (scheduler) and the model runner for one forward step.

The engine fills a ForwardBatch with plain Python lists; the runner turns it into tensors on
its device. Sequence i contributes `token_ids[i]` new tokens at positions
`start_pos[i] .. start_pos[i] + len(token_ids[i]) - 1`; their K/V are written into the blocks of
`block_tables[i]` (block j holds positions j*block_size .. (j+1)*block_size-1), and attention reads
positions 0 .. start_pos[i] + len(token_ids[i]) - 1 from the same table.
The runner returns fp32 logits of the rows `logit_rows` names, in order: the LAST new token of
every sequence, except that a sequence flagged in `all_logits` (prompt logprobs) contributes
every new token's row; `sample_rows[i]` is where sequence i's last token landed. Without
`all_logits` that is [B, vocab] with row i = sequence i.
A sequence with one new token runs the decode attention path unless `prompt` flags it: one
prompt token (a chunked prefill's last token, a prefix-cache hit's remainder) takes the
prefill path, as the whole prompt would. The two kernels round differently, so otherwise a
prompt's tokens would depend on where the step budget cut it (docs/migration.md). The other way
round, a short chunk of decoded tokens (a speculative step's known token and drafts) takes the
decode path row by row where the backend can (MLA on the torch backend), as plain decoding
computes those positions.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: list[list[int]]      # new tokens per sequence (>= 1 each)
    start_pos: list[int]            # tokens already in the KV cache per sequence
    block_tables: list[list[int]]   # physical KV block ids per sequence
    all_logits: tuple[bool, ...] = ()   # per sequence: logits of every new token (() = none)
    prompt: tuple[bool, ...] = ()       # per sequence: its new tokens are prompt tokens (() = none)

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.start_pos) == len(self.block_tables)):
            raise ValueError("ForwardBatch fields must have one entry per sequence")
        if self.all_logits and len(self.all_logits) != len(self.token_ids):
            raise ValueError("ForwardBatch.all_logits must have one entry per sequence (or none)")
        if self.prompt and len(self.prompt) != len(self.token_ids):
            raise ValueError("ForwardBatch.prompt must have one entry per sequence (or none)")

    @property
    def num_seqs(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def decode_seqs(self) -> list[int]:
        """Sequences whose one new token is a decode step's (not a prompt token)."""
        return [i for i, t in enumerate(self.token_ids)
                if len(t) == 1 and not (self.prompt and self.prompt[i])]

    @property
    def is_decode_only(self) -> bool:
        return len(self.decode_seqs) == len(self.token_ids)

    @property
    def logit_rows(self) -> list[int]:
        """Indices into the flattened new tokens whose logits the runner returns."""
        rows, end = [], 0
        for i, toks in enumerate(self.token_ids):
            start, end = end, end + len(toks)
            rows.extend(range(start, end) if self.all_logits and self.all_logits[i]
                        else (end - 1,))
        return rows

    @property
    def sample_rows(self) -> list[int]:
        """Per sequence: its last new token's row in the runner's output."""
        out, n = [], 0
        for i, toks in enumerate(self.token_ids):
            n += len(toks) if self.all_logits and self.all_logits[i] else 1
            out.append(n - 1)
        return out
