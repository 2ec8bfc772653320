"""Scheduler: continuous batching with chunked prefill, prefix caching and preemption.

No prefill or decode phase (vLLM v1's model): every request has tokens *known* (prompt +
output) and tokens *computed* (K/V in the cache); each step gives each request up to
`known - computed` new tokens under a token budget. A decode is a 1-token catch-up, a prefill a
large one, chunked when it does not fit the budget. Pure Python, no torch.

Per step:
1. RUNNING requests in admission order get their catch-up. If the KV pool cannot hold the new
   tokens, the most recently admitted running request is preempted (recompute: blocks freed,
   back to the front of WAITING) until it can — possibly the request itself. A lone request
   always fits: generation stops at `kv capacity` tokens (finish "length").
2. If nothing was preempted, WAITING requests are admitted in arrival order while budget,
   `max_num_seqs` and KV allow; cached prefix blocks count as computed. A prompt that can never
   fit the whole pool finishes with FinishReason.ERROR. Remote-KV requests (decode role) get
   their whole prompt's blocks and park in WAITING_REMOTE_KV until `complete_remote_prefill`.
3. The plan's ForwardBatch holds every scheduled chunk; the requests whose computed reaches
   known after this step sample a token (`update`).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moed.engine.request import Request
from moed.kvcache.manager import KVCacheManager
from moed.model.batch import ForwardBatch
from moed.types import ContextRule, FinishReason, RequestState, TokenEvent


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int
    sample: bool                    # computed reaches known after this chunk: sample a token


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


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 on_remote_allocated: Callable[[Request, list[int]], None] | None = None) -> None:
        self.kv = kv
        self.set_limits(max_num_seqs, max_num_batched_tokens)
        self.on_remote_allocated = on_remote_allocated
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}       # WAITING_REMOTE_KV
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}         # prefill-only, finished, blocks kept for transfer
        self.num_preemptions = 0

    def set_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        # A budget below the batch size would starve decodes behind the first ones.
        self.max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens

    # ---- intake ----------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        # Generation stops ("length") once a request would outgrow the whole KV pool, so a
        # lone request always fits and preemption can never loop.
        req.max_model_len = ContextRule(req.max_model_len, self.kv.capacity_tokens).limit
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """Finish a request in any live state and free its blocks."""
        if req.finished:
            return
        if req.state is RequestState.RUNNING:
            self.running.remove(req)
        elif req.state is RequestState.WAITING_REMOTE_KV:
            del self.remote[req.request_id]
        else:
            self.waiting.remove(req)
        if req.prefill_only and reason in (FinishReason.STOP, FinishReason.LENGTH):
            # KV still to be read by the transfer ("length": the prompt reached the context)
            self.held[req.request_id] = req
        else:
            self.kv.free(req.request_id)
        req.finish(reason, error)
        del self.requests[req.request_id]

    def release(self, request_id: str) -> bool:
        """Free a finished prefill-only request's blocks (its KV has been sent or abandoned)."""
        if self.held.pop(request_id, None) is None:
            return False
        self.kv.free(request_id)
        return True

    def abort(self, request_id: str) -> TokenEvent | None:
        if self.release(request_id):
            return None
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.finish(req, FinishReason.ABORT)
        return _event(req, (), "", (), FinishReason.ABORT)

    # ---- planning --------------------------------------------------------------------------
    def schedule(self) -> tuple[StepPlan, list[TokenEvent]]:
        """-> (this step's plan, events for requests finished while planning, e.g. errors)."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        events: list[TokenEvent] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.can_append(req.request_id, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.state is not RequestState.RUNNING:
                break
            self.kv.append_slots(req.request_id, req.num_computed_tokens + n)
            chunks.append(ScheduledChunk(req, n, req.num_computed_tokens + n == req.num_tokens))
            budget -= n
            i += 1

        while (not preempted and self.waiting and budget > 0
               and len(self.running) + len(self.remote) < self.max_num_seqs):
            req = self.waiting[0]
            if self.kv.blocks_for(req.num_tokens) > self.kv.num_blocks:
                self.finish(req, FinishReason.ERROR, _too_long(req, self.kv))
                events.append(_event(req, (), "", (), FinishReason.ERROR, req.error))
                continue
            hit = self.kv.prefix_hit(req.token_ids)
            if req.remote_kv:
                if not self.kv.can_allocate_prompt(hit, req.num_tokens):
                    break
                alloc = self.kv.allocate_prompt(req.request_id, req.token_ids, hit, req.num_tokens)
                self.waiting.popleft()
                _scheduled(req)
                req.num_cached_tokens = alloc.num_cached_tokens
                req.num_computed_tokens = alloc.num_cached_tokens
                req.set_state(RequestState.WAITING_REMOTE_KV)
                self.remote[req.request_id] = req
                if self.on_remote_allocated is not None:
                    self.on_remote_allocated(req, list(alloc.block_ids))
                continue
            n = min(req.num_tokens - hit.num_tokens, budget)
            if not self.kv.can_allocate_prompt(hit, hit.num_tokens + n):
                break
            alloc = self.kv.allocate_prompt(req.request_id, req.token_ids, hit, hit.num_tokens + n)
            self.waiting.popleft()
            _scheduled(req)
            if req.num_preemptions == 0:
                req.num_cached_tokens = alloc.num_cached_tokens
            req.num_computed_tokens = alloc.num_cached_tokens
            req.set_state(RequestState.RUNNING)
            self.running.append(req)
            chunks.append(ScheduledChunk(req, n, req.num_computed_tokens + n == req.num_tokens))
            budget -= n

        return self._plan(chunks, preempted), events

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.set_state(RequestState.WAITING)
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _plan(self, chunks: list[ScheduledChunk], preempted: list[str]) -> StepPlan:
        if not chunks:
            return StepPlan((), None, 0, 0, tuple(preempted))
        toks, starts, tables = [], [], []
        n_decode = 0
        for c in chunks:
            r = c.request
            s = r.num_computed_tokens
            toks.append(r.token_ids[s:s + c.num_new_tokens])
            starts.append(s)
            tables.append(list(self.kv.block_table(r.request_id)))
            if c.num_new_tokens == 1 and c.sample and r.num_output_tokens > 0:
                n_decode += 1
        batch = ForwardBatch(toks, starts, tables)
        return StepPlan(tuple(chunks), batch, batch.num_tokens - n_decode, n_decode,
                        tuple(preempted))

    # ---- results ---------------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: Sequence[int],
               logprobs: Sequence[float] | None = None,
               top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None
               ) -> list[TokenEvent]:
        """Apply one step: `sampled[j]` is the token of the j-th request of `plan.sampled`."""
        events: list[TokenEvent] = []
        j = 0
        for c in plan.chunks:
            req = c.request
            if req.finished:        # aborted while the step ran (engine applies aborts first)
                j += c.sample
                continue
            req.num_computed_tokens += c.num_new_tokens
            self.kv.commit(req.request_id, req.token_ids, req.num_computed_tokens)
            if not c.sample:
                continue
            tok = int(sampled[j])
            lp = () if logprobs is None or not req.params.logprobs else (float(logprobs[j]),)
            top = _top(req, None if top_logprobs is None else top_logprobs[j])
            j += 1
            events.append(self.accept_token(req, tok, lp, top))
        return events

    def accept_token(self, req: Request, tok: int, lp: tuple[float, ...] = (),
                     top: tuple[tuple[tuple[int, float], ...], ...] = ()) -> TokenEvent:
        """Append a sampled token, run stop checks, finish the request if it is done."""
        text, reason = req.append_token(tok)
        if reason is None and req.prefill_only:
            reason = FinishReason.STOP
        if reason is not None:
            self.finish(req, reason)
        return _event(req, (tok,), text, lp, reason, top=top)

    def complete_remote_prefill(self, request_id: str, first_token_id: int,
                                logprob: float | None = None,
                                top_logprobs: Sequence[tuple[int, float]] | None = None
                                ) -> TokenEvent:
        """The prefill node wrote the prompt's KV and sampled its first token: start decoding."""
        req = self.remote.pop(request_id, None)
        if req is None:
            raise KeyError(f"no request {request_id!r} is waiting for remote KV")
        req.num_computed_tokens = req.num_tokens
        self.kv.commit(request_id, req.token_ids, req.num_computed_tokens)
        req.set_state(RequestState.RUNNING)
        self.running.append(req)
        lp = () if logprob is None or not req.params.logprobs else (float(logprob),)
        return self.accept_token(req, first_token_id, lp, _top(req, top_logprobs))


def _too_long(req: Request, kv: KVCacheManager) -> str:
    return (f"prompt of {req.num_tokens} tokens needs {kv.blocks_for(req.num_tokens)} KV blocks "
            f"but the whole cache has {kv.num_blocks} blocks of {kv.block_size} tokens "
            f"({kv.capacity_tokens} tokens)")


def _top(req: Request, row: Sequence[tuple[int, float]] | None
         ) -> tuple[tuple[tuple[int, float], ...], ...]:
    """One token's top logprobs as the TokenEvent carries them (empty when not asked)."""
    n = req.params.top_logprobs
    if not n or row is None:
        return ()
    return (tuple((int(t), float(v)) for t, v in list(row)[:n]),)


def _scheduled(req: Request) -> None:
    """A request leaves WAITING with KV blocks: its queue time ends the first time."""
    if req.first_scheduled_time is None:
        req.first_scheduled_time = time.monotonic()


def _event(req: Request, toks: tuple[int, ...], text: str, lps: tuple[float, ...],
           reason: FinishReason | None, error: str | None = None,
           top: tuple[tuple[tuple[int, float], ...], ...] = ()) -> TokenEvent:
    return TokenEvent(req.request_id, toks, text, lps, reason, req.num_prompt_tokens,
                      req.num_cached_tokens, error, top,
                      timings=None if reason is None else req.timings())
