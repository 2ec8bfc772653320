"""The speculative step's executor half: verify each drafting chunk, count it, say it at start.

A chunk with a draft (moed.engine.drafts.propose, taken by the scheduler's `speculate`) ran
its known token and its k drafts as k + 1 new tokens with every row's logits
(ForwardBatch.all_logits). `verify_rows` hands those rows to moed.model.spec_verify.verify with
the SampleRow the step would have sampled the next token from, so penalties, logit_bias,
min_tokens' bans, seeds and logprobs are exactly those of plain decoding. The scheduler then
appends the emitted tokens through the normal stop checks and rolls back the KV of the rejected
ones (Scheduler._apply_verified).

A step with drafts is not decode-only (k + 1 tokens in a row), so the runner's native decode
step (1-token rows only) steps aside for it and the layered path runs it; said once at start.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import structlog
import torch

from moed.engine.drafts.propose import SpecSettings
from moed.engine.plan import ScheduledChunk
from moed.engine.request import Request
from moed.model.sampler import SampleRow
from moed.model.spec_verify import DraftRow, Verified, verify
from moed.obs import metrics

log = structlog.get_logger(__name__)


def verify_rows(logits: torch.Tensor, last: Sequence[int], chunks: Sequence[ScheduledChunk],
                sample_row: Callable[[Request], SampleRow]) -> dict[str, Verified]:
    """logits: the runner's rows with every drafting chunk flagged all_logits; last[i]: where
    chunk i's last row landed. -> each drafting request's verification, by request id."""
    idx = [i for i, c in enumerate(chunks) if c.draft]
    if not idx:
        return {}
    rows = torch.cat([logits[last[i] - len(chunks[i].draft):last[i] + 1] for i in idx])
    reqs = [DraftRow(sample_row(chunks[i].request), chunks[i].draft,
                     chunks[i].request.num_output_tokens) for i in idx]
    return {chunks[i].request.request_id: v for i, v in zip(idx, verify(rows, reqs))}


def record(chunks: Sequence[ScheduledChunk], verified: dict[str, Verified]) -> None:
    """vLLM's spec_decode counters for one step."""
    for c in chunks:
        v = verified.get(c.request.request_id) if c.draft else None
        if v is None:
            continue
        metrics.SPEC_DRAFTS.inc()
        metrics.SPEC_DRAFT_TOKENS.inc(len(c.draft))
        metrics.SPEC_ACCEPTED.inc(v.accepted)
        for pos in range(v.accepted):
            metrics.SPEC_ACCEPTED_POS.labels(str(pos)).inc()


def log_start(spec: SpecSettings | None) -> None:
    """One line at start naming the method and its settings (nothing when off)."""
    if spec is None:
        return
    log.info("speculative_decoding", method=spec.method, num_speculative_tokens=spec.k,
             prompt_lookup_min=spec.n_min, prompt_lookup_max=spec.n_max,
             grammar_rows="not speculated (one token a step)",
             native_decode="steps with drafts take the layered path (the native decode "
                           "step, where it runs, serves 1-token rows only)")
