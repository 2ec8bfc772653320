"""What a step runs and what it produces: the plan (its chunks and their ForwardBatch) the
scheduler hands the engine, and the TokenEvents it reports per request."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moed.engine.request import Request
from moed.kvcache.manager import KVCacheManager
from moed.model.batch import ForwardBatch
from moed.types import FinishReason, TokenEvent


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int
    sample: bool                    # computed reaches known after this chunk: sample a token
    # speculative decoding (moed.engine.speculate): draft tokens run after the chunk's one
    # known token, verified instead of sampled; never part of request.token_ids
    draft: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    batch: ForwardBatch | None      # None when nothing runs this step
    num_prefill_tokens: int         # tokens of chunks that do not end in a sample or are > 1
    num_decode_tokens: int
    preempted: tuple[str, ...] = ()

    @property
    def sampled(self) -> list[Request]:
        return [c.request for c in self.chunks if c.sample]

    @property
    def empty(self) -> bool:
        return not self.chunks


def build_plan(kv: KVCacheManager, chunks: Sequence[ScheduledChunk], preempted: Sequence[str]
               ) -> StepPlan:
    """The step's ForwardBatch from its chunks (taken before `update` advances them)."""
    if not chunks:
        return StepPlan((), None, 0, 0, tuple(preempted))
    toks, starts, tables, prompt = [], [], [], []
    n_decode = 0
    for c in chunks:
        r = c.request
        s = r.num_computed_tokens
        toks.append(r.token_ids[s:s + c.num_new_tokens] + list(c.draft))
        starts.append(s)
        prompt.append(s + c.num_new_tokens <= r.num_prompt_tokens)
        tables.append(list(kv.block_table(r.request_id)))
        if c.num_new_tokens == 1 and c.sample and r.num_output_tokens > 0:
            n_decode += 1 + len(c.draft)
    batch = ForwardBatch(toks, starts, tables, prompt=tuple(prompt))
    return StepPlan(tuple(chunks), batch, batch.num_tokens - n_decode, n_decode,
                    tuple(preempted))


def top_row(req: Request, row: Sequence[tuple[int, float]] | None
            ) -> tuple[tuple[tuple[int, float], ...], ...]:
    """One token's top logprobs as the TokenEvent carries them (empty when not asked)."""
    n = req.params.top_logprobs
    if not n or row is None:
        return ()
    return (tuple((int(t), float(v)) for t, v in list(row)[:n]),)


def token_event(req: Request, toks: tuple[int, ...], text: str, lps: tuple[float, ...],
                reason: FinishReason | None, error: str | None = None,
                top: tuple[tuple[tuple[int, float], ...], ...] = ()) -> TokenEvent:
    """The event a step reports for `req`: its new tokens, or how it finished."""
    return TokenEvent(req.request_id, toks, text, lps, reason, req.num_prompt_tokens,
                      req.num_cached_tokens, error, top,
                      timings=None if reason is None else req.timings(),
                      error_kind=req.error_kind if error is not None else None)
