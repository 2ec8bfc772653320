"""A fake model runner for engine/scheduler tests (import it as `engine_fakes`): its "KV cache"
stores token ids per slot, and its logits are a deterministic function of the sequence it READS BACK through the block
table. A wrong block table, a bad prefix-cache hit or a reused block that was not rewritten
changes the output, so tests compare against `next_token(true_sequence)`."""
from __future__ import annotations

from types import SimpleNamespace
from moed.engine.runner import RunnerDefaults

VOCAB = 64
EOS = 63


def next_token(seq: list[int]) -> int:
    """The fake model's greedy next token for a full sequence (never EOS)."""
    h = 7
    for i, t in enumerate(seq):
        h = (h * 131 + t * (i + 3)) % 1_000_003
    return h % (VOCAB - 1)


class FakeRunner(RunnerDefaults):
    def __init__(self, num_blocks: int, block_size: int, max_len: int = 4096) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.spec = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=max_len,
                                    eos_token_ids=(EOS,), num_layers=1)
        self.slots: dict[tuple[int, int], int] = {}
        self.batches = []

    def greedy(self, batch) -> list[int]:
        """One step without torch: write the batch's tokens, read each sequence back through
        its block table, return each one's next token (what argmax of forward() gives)."""
        self.batches.append(batch)
        bs = self.block_size
        out = []
        for toks, start, table in zip(batch.token_ids, batch.start_pos, batch.block_tables):
            for j, t in enumerate(toks):
                p = start + j
                self.slots[(table[p // bs], p % bs)] = t
            end = start + len(toks)
            out.append(next_token([self.slots.get((table[p // bs], p % bs), -1)
                                   for p in range(end)]))
        return out

    def forward(self, batch):
        import torch   # here, not at import: the scheduler tests run without torch

        out = torch.linspace(0, 1, VOCAB).repeat(batch.num_seqs, 1)   # a smooth background
        for i, nt in enumerate(self.greedy(batch)):                   # for sampling tests
            out[i, nt] = 8.0
        return out


def assert_followed_the_model(reqs, kv_tokens: int) -> None:
    """After a random workload ran to its end: each request's tokens are the model's own
    (next_token over prompt + output, whatever chunking, preemption or drafts it went
    through), finished by length; a prompt larger than the whole KV cache (kv_tokens) failed."""
    from moed.types import FinishReason

    for r in reqs:
        if r.num_prompt_tokens > kv_tokens:
            assert r.finish_reason is FinishReason.ERROR
            continue
        seq = list(r.prompt_token_ids)
        for _ in range(r.num_output_tokens):
            seq.append(next_token(seq))
        assert r.token_ids == seq and r.finish_reason is FinishReason.LENGTH
