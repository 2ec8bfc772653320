"""Scheduler: continuous batching with chunked prefill, prefix caching and preemption.

No prefill or decode phase (vLLM v1's model): every request has tokens *known* (prompt +
output) and tokens *computed* (K/V in the cache); each step gives each request up to
`known - computed` new tokens. A decode is a 1-token catch-up, a prefill a large one,
chunked when it does not fit the step. Pure Python, no torch.

The scheduler owns the queues and makes every change to them; a step policy (moed.engine.policies,
`balance.policy`) decides what a step holds, reading a read-only view and acting through the step's
draft (`_Draft`). Running requests catch up first: when the KV pool cannot hold their tokens,
RUNNING's last is preempted (recompute: blocks freed, back to WAITING) — possibly the request
itself; a lone request always fits (generation stops at the pool's capacity, finish "length"). Both
queues are in priority order (vLLM's `priority`, lower first; `insert_by_priority`), so that victim
is the least urgent, most recently seated request; one is also preempted for the seat of a more
urgent waiting one (`seat_victim`). Waiting ones are admitted after, only if nothing was preempted:
cached prefix blocks count as computed, a prompt the pool can never hold finishes with an error, a
remote-KV one parks until its KV arrives (moed.engine.parking), one whose next blocks sit in the KV
tiers may load them instead (moed.engine.tier_admission). Requests whose computed reaches known
after the step sample a token (`update`).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from moed.balance.cost import AdvertisedCost, CostModel, ExpertShape
from moed.engine.drafts.propose import SpecSettings, draft_room, draft_slots, observe, propose
from moed.engine.parking import RemoteKVParking
from moed.engine.plan import ScheduledChunk, StepPlan, build_plan, token_event, top_row
from moed.engine.policies import CostPolicy, StepPolicy, StepTimeBudget, TokenPolicy
from moed.engine.request import Request
from moed.engine.seating import insert_by_priority, seat_victim, take_blocks
from moed.engine.tier_admission import TierAdmission
from moed.kvcache.manager import NO_HIT, KVCacheManager, PrefixHit
from moed.kvcache.tiers import TieredCache
from moed.types import ContextRule, FinishReason, RequestState, TokenEvent

if TYPE_CHECKING:
    from moed.model.spec_verify import Verified


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 on_remote_allocated: Callable[[Request, list[int]], None] | None = None,
                 policy: StepPolicy | None = None, cost: CostModel | None = None,
                 experts: ExpertShape | None = None, tiers: TieredCache | None = None,
                 recompute_s_per_token: float = 1e-4) -> None:
        """policy: the token budget unless given (the engine sets `balance.policy`'s);
        cost: the engine's cost model, fitted from measured steps (the cost policy, tier and
        peer-read predictions); recompute_s_per_token: the prediction until it is fitted."""
        self._kv = kv
        self.set_limits(max_num_seqs, max_num_batched_tokens)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._held: dict[str, Request] = {}     # prefill-only, finished, blocks kept for transfer
        self._requests_ro, self._held_ro = MappingProxyType(self._requests), \
            MappingProxyType(self._held)
        self._parking = RemoteKVParking(kv, on_remote_allocated)    # WAITING_REMOTE_KV
        self._tiers = TierAdmission(kv)                             # WAITING_TIER_KV
        if tiers is not None:
            self._tiers.attach(tiers)
        self._policy: StepPolicy = policy if policy is not None else TokenPolicy()
        self._cost, self._experts = cost, experts
        self._recompute_s_per_token = recompute_s_per_token
        self._num_preemptions = 0
        self._spec: SpecSettings | None = None      # speculative decoding: off
        self.drafting = True    # this step may draft (the step loop's per-step switch sets it)

    # ---- set up (the engine's builder and reloads; at a step boundary) ---------------------
    def set_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        # A budget below the batch size would starve decodes behind the first ones.
        self._max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self._max_num_batched_tokens = max_num_batched_tokens

    def set_policy(self, policy: StepPolicy) -> None:
        self._policy = policy

    def set_speculation(self, spec: SpecSettings | None) -> None:
        """[speculative] (moed.engine.drafts.propose): decoding requests draft, None = off."""
        self._spec = spec

    def use_cost_model(self, cost: CostModel | None, experts: ExpertShape | None) -> None:
        self._cost, self._experts = cost, experts

    def attach_tiers(self, tiers: TieredCache) -> None:
        """The engine's L2/L3 cache (moed.kvcache.tiers): admission may load from it."""
        self._tiers.attach(tiers)

    def set_recompute_s_per_token(self, seconds: float) -> None:
        """[tiers] recompute_us_per_token: the prediction until the cost model is fitted."""
        self._recompute_s_per_token = seconds

    # ---- read-only state (SchedulerView, AdmissionView; the engine's stats) -----------------
    @property
    def kv(self) -> KVCacheManager:
        return self._kv

    @property
    def waiting(self) -> Sequence[Request]:
        return self._waiting

    @property
    def running(self) -> Sequence[Request]:
        return self._running

    @property
    def requests(self) -> Mapping[str, Request]:
        return self._requests_ro

    @property
    def held(self) -> Mapping[str, Request]:
        return self._held_ro

    @property
    def remote(self) -> Mapping[str, Request]:
        return self._parking.view

    @property
    def loading(self) -> Mapping[str, Request]:
        return self._tiers.loading

    @property
    def tiers(self) -> TieredCache | None:
        return self._tiers.tiers

    @property
    def cost(self) -> CostModel | None:
        return self._cost

    @property
    def experts(self) -> ExpertShape | None:
        return self._experts

    @property
    def policy(self) -> StepPolicy:
        return self._policy

    @property
    def time_budget(self) -> StepTimeBudget | None:
        """The cost policy's step time budget (None under another policy)."""
        return self._policy.budget if isinstance(self._policy, CostPolicy) else None

    @property
    def num_speculative_tokens(self) -> int:
        """k, the most draft tokens a request verifies a step (0: none, or the step switch's plain)."""
        return 0 if self._spec is None or not self.drafting else self._spec.k

    @property
    def max_num_seqs(self) -> int:
        return self._max_num_seqs

    @property
    def max_num_batched_tokens(self) -> int:
        return self._max_num_batched_tokens

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def seated(self) -> int:
        return len(self._running) + len(self._parking) + len(self._tiers.loading)

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self._waiting)

    def prefix_hit(self, req: Request) -> PrefixHit:
        """What a waiting prompt may skip (nothing when its prompt logprobs are wanted)."""
        if req.prompt_logprobs_pending:
            return NO_HIT
        return self._kv.prefix_hit(req.token_ids, req.cache_root)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- intake and ends -------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self._requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        # Generation stops ("length") once a request would outgrow the whole KV pool, so a
        # lone request always fits and preemption can never loop.
        req.max_model_len = ContextRule(req.max_model_len, self._kv.capacity_tokens).limit
        self._requests[req.request_id] = req
        insert_by_priority(self._waiting, req, front=False)

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """Finish a request in any live state and free its blocks."""
        if req.finished:
            return
        if req.state is RequestState.RUNNING:
            self._running.remove(req)
        elif req.state is RequestState.WAITING_REMOTE_KV:
            self._parking.drop(req.request_id)
        elif req.state is not RequestState.WAITING_TIER_KV:
            self._waiting.remove(req)
        self._tiers.forget(req)                     # a load's late result is dropped
        if req.prefill_only and reason in (FinishReason.STOP, FinishReason.LENGTH):
            # KV still to be read by the transfer ("length": the prompt reached the context)
            self._held[req.request_id] = req
        else:
            self._kv.free(req.request_id)
        req.finish(reason, error)
        del self._requests[req.request_id]

    def release(self, request_id: str) -> bool:
        """Free a finished prefill-only request's blocks (its KV has been sent or abandoned)."""
        if self._held.pop(request_id, None) is None:
            return False
        self._kv.free(request_id)
        return True

    def abort(self, request_id: str) -> TokenEvent | None:
        if self.release(request_id):
            return None
        req = self._requests.get(request_id)
        if req is None:
            return None
        self.finish(req, FinishReason.ABORT)
        return token_event(req, (), "", (), FinishReason.ABORT)

    # ---- planning --------------------------------------------------------------------------
    def schedule(self) -> tuple[StepPlan, list[TokenEvent]]:
        """-> (this step's plan, events for requests finished while planning, e.g. errors)."""
        draft = _Draft(self)
        victim = seat_victim(self._waiting, self._running, self.seated, self._max_num_seqs)
        if victim is not None:     # every seat taken, a more urgent request waits for one
            draft.preempted_ids.append(self._preempt(victim))
        self._policy.fill(self, draft)
        return build_plan(self._kv, draft.chunks, draft.preempted_ids), draft.events

    def advertised(self) -> AdvertisedCost | None:
        """This node's prefill cost state (advertised; early rejection's): None unless cost-fitted."""
        p = self._policy
        return p.advertised(self) if isinstance(p, CostPolicy) else None

    def predict_prefill_s(self, tokens: int, start: int) -> float:
        """Predicted time to compute `tokens` prompt tokens after `start` (the cost model once
        fitted, else [tiers] recompute_us_per_token)."""
        if tokens <= 0:
            return 0.0
        if self._cost is not None and self._cost.ready:
            return self._cost.coefficients.prefill_seconds(tokens, start,
                                                           self._max_num_batched_tokens)
        return tokens * self._recompute_s_per_token

    def _preempt(self, req: Request) -> str:
        self._tiers.forget(req)         # re-admission decides (and logs) afresh
        self._running.remove(req)
        self._kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.set_state(RequestState.WAITING)
        insert_by_priority(self._waiting, req, front=True)
        self._num_preemptions += 1
        return req.request_id

    # ---- results ---------------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: Sequence[int],
               logprobs: Sequence[float] | None = None,
               top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None,
               verified: Mapping[str, Verified] | None = None) -> list[TokenEvent]:
        """Apply one step: `sampled[j]` is the token of the j-th request of `plan.sampled`
        that had no draft; `verified` holds the verification of each chunk with one."""
        events: list[TokenEvent] = []
        j = 0
        for c in plan.chunks:
            req = c.request
            if req.finished:        # aborted while the step ran (engine applies aborts first)
                j += c.sample and not c.draft
                continue
            if c.draft:
                events.extend(self._apply_verified(req, c, verified[req.request_id]))
                continue
            req.num_computed_tokens += c.num_new_tokens
            self._kv.commit(req.request_id, req.token_ids, req.num_cacheable_tokens)
            if not c.sample:
                continue
            tok = int(sampled[j])
            lp = () if logprobs is None or not req.params.logprobs else (float(logprobs[j]),)
            top = top_row(req, None if top_logprobs is None else top_logprobs[j])
            j += 1
            events.append(self.accept_token(req, tok, lp, top))
        return events

    def _apply_verified(self, req: Request, c: ScheduledChunk, v: Verified
                        ) -> list[TokenEvent]:
        """A speculating request's step: its accepted drafts and the one token after them
        are appended one by one through the same stop checks as a sampled token (the run is
        cut at the first that finishes it: its blocks are freed then). Otherwise its K/V
        holds the known token and the accepted drafts: computed grows by 1 + accepted, only
        full blocks of those are committed (a rejected draft is never cached), and the blocks
        past the known tokens, holding rejected drafts only, are freed."""
        out: list[TokenEvent] = []
        for i, tok in enumerate(v.token_ids):
            lp = () if v.logprobs is None or not req.params.logprobs else (v.logprobs[i],)
            out.append(self.accept_token(req, tok, lp, top_row(
                req, None if v.top_logprobs is None else v.top_logprobs[i])))
            if req.finished:
                return out
        req.acceptance = observe(req.acceptance, len(c.draft), v.accepted)
        req.num_computed_tokens += c.num_new_tokens + v.accepted
        self._kv.commit(req.request_id, req.token_ids, req.num_cacheable_tokens)
        self._kv.truncate(req.request_id, req.num_tokens)
        return out

    def accept_token(self, req: Request, tok: int, lp: tuple[float, ...] = (),
                     top: tuple[tuple[tuple[int, float], ...], ...] = ()) -> TokenEvent:
        """Append a sampled token, run stop checks, finish the request if it is done."""
        text, reason = req.append_token(tok)
        if reason is None and req.prefill_only:
            reason = FinishReason.STOP
        if reason is not None:      # req.error: why append_token failed it (else None)
            self.finish(req, reason, req.error)
        return token_event(req, (tok,), text, lp, reason, req.error, top=top)

    def complete_remote_prefill(self, request_id: str, first_token_id: int,
                                logprob: float | None = None,
                                top_logprobs: Sequence[tuple[int, float]] | None = None
                                ) -> TokenEvent:
        """The prefill node wrote the prompt's KV and sampled its first token: start decoding."""
        req = self._parking.unpark(request_id)
        req.set_state(RequestState.RUNNING)
        insert_by_priority(self._running, req, front=False)
        lp = () if logprob is None or not req.params.logprobs else (float(logprob),)
        return self.accept_token(req, first_token_id, lp, top_row(req, top_logprobs))

    def tier_load_target(self, request_id: str, block_ids: Sequence[int]) -> bool:
        """A finished load may be copied into L1 (its request still waits for these blocks)."""
        return self._tiers.target(request_id, block_ids)

    def complete_tier_load(self, request_id: str, num_blocks: int) -> bool:
        """The first `num_blocks` loaded blocks hold their K/V now: the request runs
        (computing the rest). False: it is no longer waiting."""
        req = self._tiers.complete(request_id, num_blocks)
        if req is None:
            return False
        req.set_state(RequestState.RUNNING)
        insert_by_priority(self._running, req, front=False)
        return True


class _Draft:
    """The step being planned (moed.engine.policies.StepDraft): a policy's moves, applied."""

    def __init__(self, s: Scheduler) -> None:
        self._s = s
        self.chunks: list[ScheduledChunk] = []
        self.preempted_ids: list[str] = []
        self.events: list[TokenEvent] = []
        self._extended: dict[str, int] = {}     # running request id -> its chunk's index

    @property
    def num_chunks(self) -> int:
        return len(self.chunks)

    @property
    def preempted(self) -> bool:
        return bool(self.preempted_ids)

    def extend(self, req: Request, n: int, *, preempt: bool) -> bool:
        s = self._s
        if req.state is not RequestState.RUNNING:
            return False            # preempted earlier in this step
        end = req.num_computed_tokens + n
        while not s.kv.can_append(req.request_id, end):
            if not preempt:
                return False
            victim = s._running[-1]
            self.preempted_ids.append(s._preempt(victim))
            if victim is req:
                return False
        s.kv.append_slots(req.request_id, end)
        self._extended[req.request_id] = len(self.chunks)
        self.chunks.append(ScheduledChunk(req, n, end == req.num_tokens))
        return True

    def speculate(self, req: Request, room: int) -> int:
        s = self._s
        at = self._extended.get(req.request_id)
        last = None if at is None else self.chunks[at]
        if not s.num_speculative_tokens or last is None or last.draft or not last.sample:
            return 0
        draft = propose(s._spec, req, min(room, draft_room(req, s._spec.k)))
        # never preempt for a guess: cut it to the room of the blocks held and free now
        kv = s.kv
        room = (len(kv.block_table(req.request_id)) + kv.num_free_blocks) * kv.block_size
        draft = draft[:room - req.num_tokens]
        if not draft:
            return 0
        s.kv.append_slots(req.request_id, min(draft_slots(s._spec, req, len(draft)), room))
        self.chunks[at] = ScheduledChunk(req, last.num_new_tokens, True, draft)
        return len(draft)

    def admit(self, req: Request, hit: PrefixHit, n: int) -> bool:
        s = self._s
        if not s.kv.can_allocate_prompt(hit, hit.num_tokens + n):
            return False
        s._waiting.remove(req)
        take_blocks(s.kv, req, hit, hit.num_tokens + n, RequestState.RUNNING,
                    count_cached=req.num_preemptions == 0)
        _scheduled(req)
        insert_by_priority(s._running, req, front=False)
        self.chunks.append(ScheduledChunk(req, n, req.num_computed_tokens + n == req.num_tokens))
        return True

    def park_remote(self, req: Request) -> bool:
        s = self._s
        if not s._parking.park(req, s.prefix_hit(req)):
            return False
        s._waiting.remove(req)
        _scheduled(req)
        return True

    def load_from_tiers(self, req: Request, hit: PrefixHit) -> bool:
        s = self._s
        # busy: a step runs before the load can be collected when anything else runs, or is
        # still to be admitted in this step (a waiting request behind this one)
        if not s._tiers.try_load(s, req, hit, bool(s._running) or len(s._waiting) > 1):
            return False
        s._waiting.remove(req)
        _scheduled(req)
        return True

    def refuse_too_long(self, req: Request) -> bool:
        s, kv = self._s, self._s.kv
        if kv.blocks_for(req.num_tokens) <= kv.num_blocks:
            return False
        s.finish(req, FinishReason.ERROR,
                 f"prompt of {req.num_tokens} tokens needs {kv.blocks_for(req.num_tokens)} KV "
                 f"blocks but the whole cache has {kv.num_blocks} blocks of {kv.block_size} "
                 f"tokens ({kv.capacity_tokens} tokens)")
        self.events.append(token_event(req, (), "", (), FinishReason.ERROR, req.error))
        return True


def _scheduled(req: Request) -> None:
    """A request leaves WAITING with KV blocks: its queue time ends the first time."""
    if req.first_scheduled_time is None:
        req.first_scheduled_time = time.monotonic()

