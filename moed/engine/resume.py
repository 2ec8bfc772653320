"""A continuation: a request that already produced output tokens on another node (the router
migrated it there after that node failed mid-stream, docs/migration.md) resumes here as if it
had never moved. Two ways to replay the tokens the client already has (REPLAYS):

"decode": the prompt is prefilled as usual, then each sent token is FORCED as the sampled token
of one decode step (`force`): the same kernels, the same one-token steps and the same draws
from a seeded generator as the undisturbed run, so with the same batches the logits are
bitwise those of a run that never moved. Costs one step per sent token; the API drops those
tokens' events (the client has them).

"prefill" (`prime`): the sent tokens are OUTPUT, not prompt: they are replayed through the
request's own
`append_token` (so max_tokens / min_tokens count from the original start, the penalties read
them as output history, stop strings see them, the detokenizer and the stop filter hold exactly
what the old node held — text the client never got — and a grammar advances over them), and a
seeded request's generator is advanced one draw per token, as sampling them here would have.
The KV of prompt + those tokens is then recomputed like a request preempted by recompute: the
scheduler computes `token_ids` up to their end and samples the next token.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from moed.engine.plan import StepPlan
from moed.engine.request import Request
from moed.model.sampler import skip_one_token
from moed.types import REPLAYS

__all__ = ["REPLAYS", "check", "force", "prime"]


def check(output_ids: Sequence[int], vocab_size: int, prompt_len: int, max_len: int) -> None:
    """ValueError (the caller's 400) when `output_ids` cannot continue a prompt here."""
    bad = next((t for t in output_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"output token id {bad} is outside the vocabulary [0, {vocab_size})")
    if prompt_len + len(output_ids) >= max_len:
        raise ValueError("prompt + output tokens leave no room in the context")


def force(forced: dict[str, deque[int]], plan: StepPlan, sampled: Sequence[int]) -> list[int]:
    """The step's sampled tokens with each forced request's next sent token in its row (rows
    follow plan.sampled, as Scheduler.update reads them); a request's queue is dropped when
    empty or when the request has finished."""
    out, j = list(sampled), 0
    for c in plan.chunks:
        rid = c.request.request_id
        q = forced.get(rid)
        row = c.sample and not c.draft      # a drafting chunk's tokens come from verification
        if q is not None and row and not c.request.finished and j < len(out):
            out[j] = q.popleft()
        if q is not None and (not q or c.request.finished):
            del forced[rid]
            c.request.replaying = False     # it may draft from its next step
        j += row
    return out


def prime(req: Request, output_ids: Sequence[int], vocab_size: int) -> None:
    """Replay `output_ids` (already streamed to the client) into a fresh request; ValueError
    (the caller's 400) when they are not a live continuation: an id outside the vocabulary, no
    room left in the context, or a token after which the request had already finished."""
    if req.num_output_tokens:
        raise ValueError("the request already has output tokens")
    check(output_ids, vocab_size, req.num_prompt_tokens, req.max_model_len)
    for i, t in enumerate(output_ids):
        _, reason = req.append_token(int(t))       # its text went out from the old node
        if reason is not None:
            raise ValueError(f"the request finished ({reason.value}) at output token {i}; "
                             "nothing is left to continue")
        skip_one_token(req.rng, req.params, vocab_size)
    # TTFT belongs to the node that sent the first token, not to this one
    req.first_token_time = None
