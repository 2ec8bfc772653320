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
   With KV tiers (moed.kvcache.tiers), a prompt whose next blocks sit in host memory or on disk
   either loads them (fresh blocks, WAITING_TIER_KV until `complete_tier_load` at a step
   boundary) or recomputes, whichever is predicted faster (`_admit_from_tiers`).
3. The plan's ForwardBatch holds every scheduled chunk; the requests whose computed reaches
   known after this step sample a token (`update`).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from moed.balance.step_time import Buckets, Item, choose, chunk_budget, step_budget, \
    whole_budget
from moed.balance.cost import (AdvertisedCost, CostModel, ExpertShape, bucket_of, max_chunk,
                               shape_of)
from moed.config import BalanceConfig
from moed.engine.request import Request
from moed.kvcache.manager import NO_HIT, KVCacheManager, PrefixHit
from moed.kvcache.tiers import admission
from moed.model.batch import ForwardBatch
from moed.types import ContextRule, FinishReason, RequestState, TokenEvent

log = structlog.get_logger(__name__)


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


@dataclass(frozen=True)
class TimeBudget:
    """balance.policy = "cost": the step's time budget and the prompt order (moed.balance)."""
    buckets: Buckets
    itl_target_s: float
    prefill_step_s: float
    max_partial: int

    @classmethod
    def from_config(cls, b: BalanceConfig) -> TimeBudget | None:
        """None for policy "tokens"."""
        if b.policy != "cost":
            return None
        targets = tuple(t / 1000 for t in b.ttft_targets_ms)
        step = b.prefill_step_ms / 1000 or min(targets) / 4
        return cls(Buckets(tuple(b.bucket_edges), targets), b.itl_target_ms / 1000, step,
                   b.max_partial_prefills)


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 on_remote_allocated: Callable[[Request, list[int]], None] | None = None) -> None:
        self.kv = kv
        self.set_limits(max_num_seqs, max_num_batched_tokens)
        self.on_remote_allocated = on_remote_allocated
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}       # WAITING_REMOTE_KV
        self.loading: dict[str, Request] = {}      # WAITING_TIER_KV
        self.tiers: Any = None                     # moed.kvcache.tiers.TieredCache (the engine's)
        self.recompute_s_per_token = 1e-4          # until the cost model is fitted ([tiers])
        self._tier_noted: set[str] = set()         # decision counted and logged (once per wait)
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}         # prefill-only, finished, blocks kept for transfer
        self.num_preemptions = 0
        # balance.policy = "cost": the engine sets these (cost is fed from measured steps)
        self.time_budget: TimeBudget | None = None
        self.cost: CostModel | None = None
        self.experts: ExpertShape | None = None

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
        elif req.state is RequestState.WAITING_TIER_KV:
            del self.loading[req.request_id]       # its load's late result is dropped
        else:
            self.waiting.remove(req)
        self._tier_noted.discard(req.request_id)
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
        """-> (this step's plan, events for requests finished while planning, e.g. errors).
        The cost policy once its model is fitted (`_schedule_cost`), else the token budget."""
        events: list[TokenEvent] = []
        if self._cost_ready():
            plan, events = self._schedule_cost()
            if not plan.empty or plan.preempted:
                return plan, events
        plan, more = self._schedule_tokens()
        return plan, events + more

    def _schedule_tokens(self) -> tuple[StepPlan, list[TokenEvent]]:
        """balance.policy = "tokens": running requests in admission order, then waiting ones
        in arrival order, while `max_num_batched_tokens` lasts."""
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
               and self._seated() < self.max_num_seqs):
            req = self.waiting[0]
            if self.kv.blocks_for(req.num_tokens) > self.kv.num_blocks:
                self.finish(req, FinishReason.ERROR, _too_long(req, self.kv))
                events.append(_event(req, (), "", (), FinishReason.ERROR, req.error))
                continue
            hit = NO_HIT if req.prompt_logprobs_pending else self.kv.prefix_hit(req.token_ids, req.cache_root)
            if req.remote_kv:
                if not self.kv.can_allocate_prompt(hit, req.num_tokens):
                    break
                alloc = self.kv.allocate_prompt(req.request_id, req.token_ids, hit,
                                                req.num_tokens, req.cache_root)
                self.waiting.popleft()
                _scheduled(req)
                req.num_cached_tokens = alloc.num_cached_tokens
                req.num_computed_tokens = alloc.num_cached_tokens
                req.set_state(RequestState.WAITING_REMOTE_KV)
                self.remote[req.request_id] = req
                if self.on_remote_allocated is not None:
                    self.on_remote_allocated(req, list(alloc.block_ids))
                continue
            if self._admit_from_tiers(req, hit):
                continue
            n = min(req.num_tokens - hit.num_tokens, budget)
            if not self.kv.can_allocate_prompt(hit, hit.num_tokens + n):
                break
            self.waiting.popleft()
            chunks.append(self._seat(req, hit, n))
            budget -= n

        return self._plan(chunks, preempted), events

    # ---- the cost policy (balance.policy = "cost", moed.balance.step_time) --------------------
    def set_time_budget(self, tb: TimeBudget | None) -> None:
        self.time_budget = tb

    def _cost_ready(self) -> bool:
        return self.time_budget is not None and self.cost is not None and self.cost.ready

    def _schedule_cost(self) -> tuple[StepPlan, list[TokenEvent]]:
        """Decodes first (preempting as the token policy does when KV runs out); remote-KV
        requests park in arrival order; then prompts, under way or waiting, get the chunks
        `moed.balance.step_time.choose` picks for the step's time. An empty plan sends the step
        to the token policy (e.g. partial prompts fill the KV pool: that path preempts)."""
        tb, cost = self.time_budget, self.cost
        assert tb is not None and cost is not None
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        events: list[TokenEvent] = []
        for req in [r for r in self.running if r.num_tokens - r.num_computed_tokens <= 1]:
            n = req.num_tokens - req.num_computed_tokens
            while req.state is RequestState.RUNNING and n > 0 and \
                    not self.kv.can_append(req.request_id, req.num_computed_tokens + n):
                victim = self.running[-1]       # never one scheduled above: they come earlier
                self._preempt(victim)
                preempted.append(victim.request_id)
            if req.state is not RequestState.RUNNING or n <= 0:
                continue
            self.kv.append_slots(req.request_id, req.num_computed_tokens + n)
            chunks.append(ScheduledChunk(req, n, True))
        seats = self.max_num_seqs - self._seated()
        items = [Item(r.request_id, r.num_computed_tokens, r.num_tokens - r.num_computed_tokens,
                      r.num_tokens, _age(r), True)
                 for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in list(self.waiting) if not preempted else []:
            if self.kv.blocks_for(req.num_tokens) > self.kv.num_blocks:
                self.finish(req, FinishReason.ERROR, _too_long(req, self.kv))
                events.append(_event(req, (), "", (), FinishReason.ERROR, req.error))
            elif req.remote_kv:
                if seats > 0 and self._park_remote(req):
                    seats -= 1
            else:
                items.append(Item(req.request_id, 0, req.num_tokens, req.num_tokens, _age(req)))
        base = shape_of(((c.request.num_computed_tokens, 1, True) for c in chunks), self.experts)
        decodes = bool(chunks)
        step = step_budget(decodes, tb.itl_target_s, tb.prefill_step_s)
        picks = choose(items, base, cost.coefficients,
                       chunk_budget(decodes, tb.itl_target_s, tb.prefill_step_s), tb.buckets,
                       max_partial=tb.max_partial,
                       max_tokens=self.max_num_batched_tokens - len(chunks), max_new=seats,
                       min_tokens=self.kv.block_size, experts=self.experts,
                       whole_s=whole_budget(decodes, step, min(tb.buckets.ttft_targets_s)))
        for p in picks:
            req = self.requests[p.key]
            if req.state is RequestState.RUNNING:
                end = req.num_computed_tokens + p.num_tokens
                if not self.kv.can_append(req.request_id, end):
                    continue
                self.kv.append_slots(req.request_id, end)
                chunks.append(ScheduledChunk(req, p.num_tokens, end == req.num_tokens))
                continue
            hit = NO_HIT if req.prompt_logprobs_pending else self.kv.prefix_hit(req.token_ids, req.cache_root)
            if self._admit_from_tiers(req, hit):
                continue
            n = min(p.num_tokens, req.num_tokens - hit.num_tokens)
            if not self.kv.can_allocate_prompt(hit, hit.num_tokens + n):
                continue
            self.waiting.remove(req)
            chunks.append(self._seat(req, hit, n))
        return self._plan(chunks, preempted), events

    def _seat(self, req: Request, hit: PrefixHit, n: int) -> ScheduledChunk:
        """Give a waiting request (already off the queue) its blocks for the prefix hit plus
        `n` new tokens and make it RUNNING; -> its chunk of this step. Both policies seat
        requests here (the caller checked can_allocate_prompt)."""
        alloc = self.kv.allocate_prompt(req.request_id, req.token_ids, hit, hit.num_tokens + n,
                                        req.cache_root)
        _scheduled(req)
        if req.num_preemptions == 0:
            req.num_cached_tokens = alloc.num_cached_tokens
        req.num_computed_tokens = alloc.num_cached_tokens
        req.set_state(RequestState.RUNNING)
        self.running.append(req)
        return ScheduledChunk(req, n, req.num_computed_tokens + n == req.num_tokens)

    def _seated(self) -> int:
        return len(self.running) + len(self.remote) + len(self.loading)

    # ---- KV tiers: load or recompute (moed.kvcache.tiers) ------------------------------------
    def predict_prefill_s(self, tokens: int, start: int) -> float:
        """Predicted time to compute `tokens` prompt tokens after `start` (the cost model once
        fitted, else [tiers] recompute_us_per_token)."""
        if tokens <= 0:
            return 0.0
        if self.cost is not None and self.cost.ready:
            return self.cost.coefficients.prefill_seconds(tokens, start,
                                                          self.max_num_batched_tokens)
        return tokens * self.recompute_s_per_token

    def _admit_from_tiers(self, req: Request, hit: Any) -> bool:
        """If the prompt's next blocks sit below L1 and loading (some of) them is predicted
        faster than recomputing: allocate, start the load, park in WAITING_TIER_KV. The
        decision and both predictions are logged per request."""
        t = self.tiers
        if t is None or req.remote_kv or req.prompt_logprobs_pending \
                or not self.kv.enable_prefix_caching:
            return False
        # busy: a step runs before the load can be collected when anything else runs, or is
        # still to be admitted in this step (a waiting request behind this one)
        got = admission.plan_for(self, req, hit, bool(self.running) or len(self.waiting) > 1)
        if got is None:
            return False
        m, plan = got
        bs, start = self.kv.block_size, hit.num_tokens
        rest = req.num_tokens - start
        n_tok = start + plan.num_load * bs
        if plan.num_load and not self.kv.can_allocate_prompt(hit, n_tok):
            return False            # no room now: admission tries again next step
        if req.request_id in self._tier_noted and not plan.num_load:
            return False            # a recompute already counted; the request waits for room
        self._tier_noted.add(req.request_id)
        t.record_lookup(m, plan)
        log.info("kv_tier_decision", request_id=req.request_id, decision=plan.decision,
                 predicted_load_s=round(plan.load_s, 6),
                 predicted_recompute_s=round(plan.recompute_s, 6),
                 blocks_below_l1=len(m.keys), blocks_loaded=plan.num_load,
                 from_host=m.tiers[:plan.num_load].count("host"),
                 from_disk=m.tiers[:plan.num_load].count("disk"))
        if not plan.num_load:
            return False
        self._tier_noted.discard(req.request_id)
        t.pin(m.keys[:plan.num_load])     # the allocation below may evict into the tiers
        alloc = self.kv.allocate_prompt(req.request_id, req.token_ids, hit, n_tok,
                                        req.cache_root)
        self.waiting.remove(req)
        _scheduled(req)
        if req.num_preemptions == 0:
            req.num_cached_tokens = alloc.num_cached_tokens
        req.num_computed_tokens = alloc.num_cached_tokens
        req.set_state(RequestState.WAITING_TIER_KV)
        self.loading[req.request_id] = req
        first = alloc.num_cached_blocks
        t.start_load(req.request_id, m.keys[:plan.num_load],
                     alloc.block_ids[first:first + plan.num_load],
                     plan.recompute_s - self.predict_prefill_s(rest - plan.num_load * bs, n_tok),
                     plan.load_s)
        return True

    def tier_load_target(self, request_id: str, block_ids: Sequence[int]) -> bool:
        """A finished load may be copied into L1: its request still waits for exactly these
        blocks (it was not aborted, its blocks not handed to another request)."""
        req = self.loading.get(request_id)
        if req is None:
            return False
        first = req.num_computed_tokens // self.kv.block_size
        return list(self.kv.block_table(request_id)[first:first + len(block_ids)]) == \
            list(block_ids)

    def complete_tier_load(self, request_id: str, num_blocks: int) -> bool:
        """The first `num_blocks` loaded blocks hold their K/V now: they count as computed
        (cached) and the request runs (computing the rest). False: it is no longer waiting."""
        req = self.loading.pop(request_id, None)
        if req is None:
            return False
        req.num_computed_tokens += num_blocks * self.kv.block_size
        self.kv.commit(request_id, req.token_ids, req.num_computed_tokens)
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens
        req.set_state(RequestState.RUNNING)
        self.running.append(req)
        return True

    def _park_remote(self, req: Request) -> bool:
        """A remote-KV request gets its whole prompt's blocks and waits for the prefill node."""
        hit = NO_HIT if req.prompt_logprobs_pending else self.kv.prefix_hit(req.token_ids, req.cache_root)
        if not self.kv.can_allocate_prompt(hit, req.num_tokens):
            return False
        alloc = self.kv.allocate_prompt(req.request_id, req.token_ids, hit, req.num_tokens,
                                        req.cache_root)
        self.waiting.remove(req)
        _scheduled(req)
        req.num_cached_tokens = alloc.num_cached_tokens
        req.num_computed_tokens = alloc.num_cached_tokens
        req.set_state(RequestState.WAITING_REMOTE_KV)
        self.remote[req.request_id] = req
        if self.on_remote_allocated is not None:
            self.on_remote_allocated(req, list(alloc.block_ids))
        return True

    def advertised(self) -> AdvertisedCost | None:
        """This node's prefill cost state (what it would advertise; what early rejection
        predicts from): prompt work queued per bucket, the share of a step prefill gets.
        None unless the cost policy runs with a fitted model."""
        if not self._cost_ready():
            return None
        tb, cost = self.time_budget, self.cost
        assert tb is not None and cost is not None
        edges = tb.buckets.edges
        toks, reqs = [0] * (len(edges) + 1), [0] * (len(edges) + 1)
        decodes = []
        for r in [*self.running, *(w for w in self.waiting if not w.remote_kv)]:
            left = r.num_tokens - r.num_computed_tokens
            if r.state is RequestState.RUNNING and left <= 1:
                decodes.append((r.num_computed_tokens, 1, True))
                continue
            b = bucket_of(edges, r.num_tokens)
            toks[b] += left
            reqs[b] += 1
        base = shape_of(decodes, self.experts)
        budget = step_budget(bool(decodes), tb.itl_target_s, tb.prefill_step_s)
        coef = cost.coefficients
        share = max(budget - coef.predict(base), 0.0) / budget if decodes else 1.0
        chunk = max_chunk(coef, base, 0, self.max_num_batched_tokens, budget, self.experts)
        return AdvertisedCost(coef, edges, tuple(toks), tuple(reqs), share,
                              chunk or self.kv.block_size)

    def _preempt(self, req: Request) -> None:
        self._tier_noted.discard(req.request_id)    # re-admission decides (and logs) afresh
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
        if reason is not None:      # req.error: why append_token failed it (else None)
            self.finish(req, reason, req.error)
        return _event(req, (tok,), text, lp, reason, req.error, top=top)

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


def _age(req: Request) -> float:
    return time.monotonic() - req.arrival_time


def _scheduled(req: Request) -> None:
    """A request leaves WAITING with KV blocks: its queue time ends the first time."""
    if req.first_scheduled_time is None:
        req.first_scheduled_time = time.monotonic()


def _event(req: Request, toks: tuple[int, ...], text: str, lps: tuple[float, ...],
           reason: FinishReason | None, error: str | None = None,
           top: tuple[tuple[tuple[int, float], ...], ...] = ()) -> TokenEvent:
    return TokenEvent(req.request_id, toks, text, lps, reason, req.num_prompt_tokens,
                      req.num_cached_tokens, error, top,
                      timings=None if reason is None else req.timings(),
                      error_kind=req.error_kind if error is not None else None)
