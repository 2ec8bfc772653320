"""A continuation: a request that already produced output tokens on another node (the router
migrated it there after that node failed mid-stream, docs/migration.md) resumes here as if it
had never moved.

The already-sent tokens are OUTPUT, not prompt: they are replayed through the request's own
`append_token` (so max_tokens / min_tokens count from the original start, the penalties read
them as output history, stop strings see them, the detokenizer and the stop filter hold exactly
what the old node held — text the client never got — and a grammar advances over them), and a
seeded request's generator is advanced one draw per token, as sampling them here would have.
The KV of prompt + those tokens is then recomputed like a request preempted by recompute: the
scheduler computes `token_ids` up to their end and samples the next token.
"""
from __future__ import annotations

from collections.abc import Sequence

from moed.engine.request import Request
from moed.model.sampler import skip_one_token


def prime(req: Request, output_ids: Sequence[int], vocab_size: int) -> None:
    """Replay `output_ids` (already streamed to the client) into a fresh request; ValueError
    (the caller's 400) when they are not a live continuation: an id outside the vocabulary, no
    room left in the context, or a token after which the request had already finished."""
    if req.num_output_tokens:
        raise ValueError("the request already has output tokens")
    bad = next((t for t in output_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"output token id {bad} is outside the vocabulary [0, {vocab_size})")
    if req.num_prompt_tokens + len(output_ids) >= req.max_model_len:
        raise ValueError("prompt + output tokens leave no room in the context")
    for i, t in enumerate(output_ids):
        _, reason = req.append_token(int(t))       # its text went out from the old node
        if reason is not None:
            raise ValueError(f"the request finished ({reason.value}) at output token {i}; "
                             "nothing is left to continue")
        skip_one_token(req.rng, req.params, vocab_size)
    # TTFT belongs to the node that sent the first token, not to this one
    req.first_token_time = None
