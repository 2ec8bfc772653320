"""The step: schedule -> execute -> postprocess, once, for the three drivers.

`StepCore.step(driver)` is the engine's one step. What differs between the asynchronous
serving loop, the expert-parallel group's lock-step loop and the synchronous `generate` is a
`StepDriver` (moed.engine.drivers): where the forward pass runs (the step thread, under the
group's watchdog, or the caller's thread), whether the group agrees first, what a failed
forward does, and what runs between two steps (the group's observation and rebalance).

    boundary: commands, finished tier loads -> schedule (unless leaving) -> [no plan: flush
    the KV events] -> driver.agree -> IDLE / LEAVE: back to the driver | EMPTY: a forward
    without rows (EP) | STEP: [step thread] forward + sample -> scheduler.update -> events,
    subscribers -> flush the KV events -> driver.between_steps -> expert-load read

Only the step loop (one of the drivers) calls it: it is the one writer of the scheduler and
the KV manager.
"""
from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import structlog

from moed.engine.client import Listeners
from moed.engine.masks import MaskPool
from moed.engine.request import Request
from moed.engine.resume import force
from moed.engine.runner import StepRunner
from moed.engine.plan import ScheduledChunk, StepPlan
from moed.engine.scheduler import Scheduler
from moed.engine.drafts.gate import StepGate
from moed.engine.drafts.mtp_kv import MTPBacklog
from moed.engine.speculate import (SpecOut, emitted, gate_rows, mtp_drafts, tail_charge, verify_rows,
                                   with_first_drafts)
from moed.engine.speculate import record as record_spec
from moed.engine.stream import RequestStream, StepStats
from moed.kvcache.manager import KVCacheManager
from moed.model.logprobs import compute as compute_prompt_logprobs
from moed.model.logprobs import prompt_positions
from moed.model.sampler import SampleResult, SampleRow, sample
from moed.model.spec_verify import Verified
from moed.obs import metrics
from moed.types import ErrorKind, FinishReason, PromptLogprob, TokenEvent

if TYPE_CHECKING:
    from moed.engine.balancing import EngineBalance
    from moed.kvcache.events import KVEventRecorder
    from moed.kvcache.publisher import ZmqPublisher
    from moed.kvcache.tiers import TieredCache

log = structlog.get_logger(__name__)

EXPERT_LOAD_INTERVAL_S = 1.0
PromptLPs = dict[str, list[PromptLogprob]]     # one step's prompt logprobs, by request id
# the sampled rows' result, forward + sample seconds, prompt logprobs, speculation's results
Executed = tuple[SampleResult | None, float, PromptLPs, SpecOut]


class Go(enum.Enum):
    """The driver's word after scheduling: what this step does."""
    STEP = "step"       # run the plan
    EMPTY = "empty"     # no plan here, but the group steps: a forward without rows (EP)
    IDLE = "idle"       # nothing to do: the driver waits for work
    LEAVE = "leave"     # the loop ends


class StepDriver(Protocol):
    """What one driver of `StepCore.step` decides (moed.engine.drivers has the three)."""
    reads_expert_load: bool     # the serving loops read the runner's expert load between steps
    # the MTP layer's MoE exchanges this rank makes this step, its own passes padded with
    # empty ones: k where any rank of the group drafts, else 0; 0 outside a group
    # (expert parallelism, moed.parallel.agree.Verdict.mtp_passes)
    mtp_passes: int

    def leaving(self) -> bool:
        """Schedule nothing this step (the loop is stopping)."""
    async def agree(self, plan: StepPlan | None) -> Go:
        """After scheduling: step, idle or leave (a group agrees here)."""
    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) where the forward pass runs (the step thread or the caller's)."""
    def contain(self, plan: StepPlan, err: Exception) -> bool:
        """A forward pass raised: True = handled (its requests failed), False = re-raise."""
    def after_forward(self) -> None:
        """Right after a forward pass (the group counts its steps)."""
    async def between_steps(self) -> None:
        """After the step's tokens are out (the group's expert rebalance)."""


class StepCore:
    """The step and its parts; `moed.engine.engine.Engine` is the rest (commands, API,
    lifecycle). The attributes below are the engine's, set in its __init__."""
    runner: StepRunner
    scheduler: Scheduler
    kv: KVCacheManager
    balance: EngineBalance
    tiers: TieredCache | None
    eos_token_ids: tuple[int, ...]
    steps: int
    _tokenizer: Any
    _masks: MaskPool
    _grammar_failed: dict[str, str]
    _forced: dict[str, deque[int]]      # a migrated stream's sent tokens (engine/resume.py)
    _streams: dict[str, RequestStream]
    _kv_events: KVEventRecorder | None
    _kv_publisher: ZmqPublisher | None
    _on_step: Listeners[Callable[[StepStats], None]]
    _on_progress: Listeners[Callable[[str, list[int], int], None]]
    _on_load: Listeners[Callable[[Any], None]]
    _load_read_at: float
    _load_pending: bool
    _executor: ThreadPoolExecutor | None
    _mtp: bool          # speculative decoding with the MTP layer: forward with hidden states
    _mtp_k: int         # its k (chained drafts) as configured; 0 without the MTP layer
    _mtp_kv: MTPBacklog | None  # its KV entries deferred by plain steps (drafts/mtp_kv.py)
    _gate: StepGate | None      # speculation's per-step switch (None: off, or not adaptive)
    _gate_step: tuple[int, bool, float] | None  # this step's (decoding rows, may draft, start)
    _clock: Callable[[], float]     # the switch's clock (time.perf_counter; tests inject one)

    def _apply_commands(self) -> None:
        raise NotImplementedError

    def kv_block_table(self, request_id: str) -> list[int]:
        raise NotImplementedError

    def _publish(self, events: Sequence[TokenEvent]) -> None:
        """Deliver events; a finished request's stream is dropped (and an unresolved
        `kv_blocks` future is cancelled: the request ended before its blocks were allocated)."""
        for ev in events:
            s = self._streams.get(ev.request_id)
            if s is None:
                continue
            s.put(ev)
            if ev.finished:
                del self._streams[ev.request_id]
                self._forced.pop(ev.request_id, None)    # a migrated one's unreplayed rest
                if s.kv_blocks is not None and not s.kv_blocks.done():
                    s.kv_blocks.cancel()

    async def step(self, driver: StepDriver) -> Go:
        """One step (see the module docstring) -> what it did: STEP (also an EMPTY forward),
        IDLE or LEAVE (the driver idles or ends its loop)."""
        self._apply_commands()
        self._collect_tier_loads()
        t0 = time.perf_counter()
        plan = None if driver.leaving() else self._schedule()
        if plan is None:                # one batch a step: a working one flushes last
            self._flush_kv_events()
        go = await driver.agree(plan)
        if go is Go.IDLE and driver.reads_expert_load:
            self._read_expert_load(force=True)      # flush the window before idling
        if go is Go.IDLE or go is Go.LEAVE:
            return go
        if driver.reads_expert_load:
            self._load_pending = True
        if plan is None:                # Go.EMPTY: the group steps, this rank has no rows
            await driver.call(self.runner.forward_empty, driver.mtp_passes)
            driver.after_forward()
            await driver.between_steps()
            return Go.STEP
        try:
            res, fwd_s, plps, spec = await driver.call(self._execute, plan, driver.mtp_passes)
        except Exception as e:
            if not driver.contain(plan, e):
                raise
            return Go.STEP
        driver.after_forward()
        self._finish_step(plan, res, t0, fwd_s, plps, spec)  # tokens out before any move
        self._flush_kv_events()
        await driver.between_steps()
        if driver.reads_expert_load:
            self._read_expert_load(force=False)
        return Go.STEP

    def _flush_kv_events(self) -> None:
        """This step's KV events to the publisher's thread (a put on its queue, no I/O)."""
        if self._kv_publisher is not None and self._kv_events.pending:
            self._kv_publisher.publish(self._kv_events.drain())

    def _tier_results(self) -> bool:
        """An I/O result is waiting (it may have woken the loop before the loop cleared its
        wake event: then the loop must not sleep)."""
        return self.tiers is not None and self.tiers.has_results()

    def _collect_tier_loads(self) -> None:
        """At a step boundary: copy finished loads into their L1 blocks and resume their
        requests (the scheduler learns of a load at the next step, whatever its queue holds)."""
        if self.tiers is None:
            return
        s = self.scheduler
        for r in self.tiers.collect():
            n = 0
            if s.tier_load_target(r.request_id, r.block_ids):
                for bid, data in zip(r.block_ids, r.payloads):
                    self.tiers.io.write(bid, data)
                    n += 1
                if r.failed is not None:
                    log.warning("kv_tier_load_short", request_id=r.request_id, loaded=n,
                                wanted=len(r.block_ids), reason=r.failed,
                                effect="the rest is recomputed")
            s.complete_tier_load(r.request_id, n)
        cost = s.cost
        if cost is not None and cost.ready:     # eviction weighs recompute time per byte
            bpb = self.tiers.io.block_bytes
            self.tiers.recompute_s_per_byte = \
                s.predict_prefill_s(self.kv.block_size, 0) / max(bpb, 1)

    def _read_expert_load(self, force: bool) -> None:
        """Between steps: pass the runner's expert load to its subscribers (once per interval,
        or now with force) if any step ran since the last read. One read per window (it
        resets the counts): every subscriber gets the same tensor."""
        if not self._on_load or not self._load_pending:
            return
        now = time.monotonic()
        if not force and now - self._load_read_at < EXPERT_LOAD_INTERVAL_S:
            return
        self._load_read_at, self._load_pending = now, False
        try:
            load = self.runner.expert_load()
        except Exception:
            log.exception("expert_load_read_failed")
            return
        if load is None:        # a runner that counts no routing
            return
        self._on_load.emit(load)

    def _schedule(self) -> StepPlan | None:
        if not self.scheduler.has_work():
            return None
        s, gate = self.scheduler, self._gate
        self._gate_step = None
        if gate is not None:    # may this step draft: measured per batch-size class
            rows = gate_rows(s.running)
            s.drafting, why = gate.choose(rows) if rows else (True, None)
            if why is not None:
                self._gate_step = (rows, s.drafting, self._clock())
                metrics.count_spec_step("draft" if s.drafting else "plain", why.value)
        plan, events = s.schedule()
        self._publish(events)
        return None if plan.empty else plan

    def _mtp_full(self, plan: StepPlan | None) -> bool:
        """Whether this step runs the MTP layer in full, its MoE included (a step that may not
        draft writes its KV entries only): what a rank tells its group (GroupDriver.agree)."""
        # no row samples (prompt chunks only, a prefill node's): nothing to draft, KV suffices
        return self._mtp and plan is not None and self.scheduler.drafting \
            and any(c.sample for c in plan.chunks)

    def _execute(self, plan: StepPlan, mtp_passes: int = 0) -> Executed:
        """Runs in the executor thread: forward + sample (+ the prompt logprobs of the chunks
        that ask). Reads the plan, mutates nothing else. mtp_passes: StepDriver.mtp_passes."""
        t0 = time.perf_counter()
        asks = [_prompt_positions(c) for c in plan.chunks]
        batch = plan.batch
        if any(asks) or any(c.draft for c in plan.chunks):
            # rows that do not ask (nor draft) pay nothing: the batch stays as planned
            batch = replace(batch, all_logits=tuple(bool(a) or bool(c.draft)
                                                    for a, c in zip(asks, plan.chunks)))
        gram = [c for c in plan.chunks if c.sample and c.request.grammar is not None]
        pending = self._masks.start([c.request.grammar for c in gram],  # + a mask a draft
                                    [c.draft for c in gram]) if gram else None
        hid = None
        if self._mtp:       # the MTP layer drafts from every row's hidden state (after sampling)
            logits, hid = self.runner.forward(batch, hidden=True)
            out = logits
        else:
            logits = out = self.runner.forward(batch)
        plps: PromptLPs = {}
        ver: dict[str, Verified] = {}
        masks: dict[str, Any] = {}      # by request id: int32 [1 + drafts masked, words]
        if pending is not None:
            got, failed = pending.collect()
            masks = {c.request.request_id: m for c, m in zip(gram, got)}
            for j, why in failed.items():
                self._grammar_failed[gram[j].request.request_id] = why
        if batch.all_logits:
            last = batch.sample_rows
            for i, (c, pos) in enumerate(zip(plan.chunks, asks)):
                if pos:     # position p of sequence i is row base + p (its rows end at last[i])
                    r = c.request
                    base = last[i] - c.num_new_tokens + 1 - r.num_computed_tokens
                    plps[r.request_id] = compute_prompt_logprobs(
                        logits[base + pos.start:base + pos.stop],
                        r.prompt_token_ids[pos.start + 1:pos.stop + 1],
                        r.params.prompt_logprobs or 0)
            ver = verify_rows(logits, last, plan.chunks, self._sample_row, masks)
            logits = logits[last]
        idx = [i for i, c in enumerate(plan.chunks) if c.sample and not c.draft]
        if not idx:
            return (None, time.perf_counter() - t0, plps,
                    self._spec_out(plan, hid, idx, None, ver, mtp_passes))
        if len(idx) != len(plan.chunks):
            logits = logits[idx]
        reqs = [plan.chunks[i].request for i in idx]
        rows = [self._sample_row(r, masks[r.request_id][0] if r.request_id in masks else None)
                for r in reqs]
        # the step's own argmax, if it has one (None: the sampler computes it)
        argmax = self.runner.argmax_of(out) if logits is out else None
        res = sample(logits, rows, argmax)
        return res, time.perf_counter() - t0, plps, self._spec_out(plan, hid, idx, res, ver, mtp_passes)

    def _spec_out(self, plan: StepPlan, hid: Any, idx: list[int], res: SampleResult | None,
                  ver: dict[str, Verified], mtp_passes: int = 0) -> SpecOut:
        """The drafts' verifications and, with the MTP layer, its drafts for the next step."""
        if hid is None:
            return SpecOut(ver)
        return SpecOut(ver, *mtp_drafts(self.runner, plan, hid, idx,
                                        None if res is None else res.token_ids, ver,
                                        self.scheduler.num_speculative_tokens,
                                        self._mtp_full(plan), mtp_passes, self._mtp_kv))

    def _sample_row(self, req: Request, mask: Any = None) -> SampleRow:
        p = req.params
        banned: tuple[int, ...] = ()
        if req.num_output_tokens < p.min_tokens:
            banned = p.stop_token_ids + (() if p.ignore_eos else self.eos_token_ids)
        if not p.penalized:
            return SampleRow(p, req.rng, banned, grammar=req.grammar, mask=mask)
        # the penalties' history: read here, in the executor thread, while the loop waits (it
        # appends this step's token only after)
        return SampleRow(p, req.rng, banned, req.token_ids, req.num_prompt_tokens,
                         grammar=req.grammar, mask=mask)

    def _finish_step(self, plan: StepPlan, res: SampleResult | None, t0: float,
                     fwd_s: float, plps: PromptLPs | None = None,
                     spec: SpecOut | None = None) -> None:
        toks = [] if res is None else res.token_ids
        if self._forced:
            toks = force(self._forced, plan, toks)
        self._fail_grammars(plan)
        for c in plan.chunks if plps else ():
            if c.request.request_id in plps and not c.request.finished:
                c.request.prompt_logprobs.extend(plps[c.request.request_id])
        ver = None if spec is None else spec.verified
        if ver:
            record_spec(plan.chunks, ver)
        if spec is not None and self._mtp_kv is not None:   # before update: its cache commits
            self._mtp_kv.apply(spec.deferral)
        g = self._gate_step     # a draining batch's drafting step: the tail it adds (before update)
        spread = tail_charge(plan.chunks, ver, self.balance.fixed_step_s, self.scheduler.waiting) if g else 0.0
        events = self.scheduler.update(plan, toks, None if res is None else res.logprobs,
                                       None if res is None else res.top_logprobs, ver)
        if spec is not None and spec.mtp:   # for the position after the tokens known now
            events = with_first_drafts(events, plan.chunks, spec.mtp)
            for c in plan.chunks:
                r = c.request
                if r.request_id in spec.mtp and not r.finished:
                    r.drafter = (r.num_tokens, spec.mtp[r.request_id])
        if any(c.request.params.prompt_logprobs is not None for c in plan.chunks):
            events = _with_prompt_logprobs(events, plan)
        for c in plan.chunks:   # a token that took the grammar past a limit (Request.append_token)
            if c.request.error_kind is ErrorKind.GRAMMAR and c.request.grammar is not None:
                metrics.GRAMMAR_FAILED.labels("limit").inc()
                self._forget_grammar(c.request)
                c.request.grammar = None        # counted once
        self._publish(events)
        self.steps += 1
        # a decode step the switch's choice made a difference to (a step that might draft but
        # had no draft is neither arm's: ngram found no match, an MTP run's first step) learns
        if g is not None and plan.num_prefill_tokens == 0 and (ver or not g[1]):
            self._gate.observe(g[0], g[1], emitted(len(toks), ver or {}), self._clock() - g[2] + spread)
        self.balance.observe(plan.batch, fwd_s,     # the cost model learns from every step
                             [len(c.draft) for c in plan.chunks] if ver else ())
        if self.tiers is not None:
            self.tiers.observe_step(time.perf_counter() - t0)
        if self._on_progress:
            for c in plan.chunks:
                r = c.request
                if r.prefill_only and self.kv.has(r.request_id):
                    self._on_progress.emit(r.request_id, self.kv_block_table(r.request_id),
                                           r.num_computed_tokens)
        if self._on_step:
            st = self.kv.stats()
            self._on_step.emit(StepStats(
                step=self.steps, batch_size=len(plan.chunks),
                num_prefill_tokens=plan.num_prefill_tokens, num_decode_tokens=plan.num_decode_tokens,
                num_sampled=len(toks), num_finished=sum(e.finished for e in events),
                num_preempted=len(plan.preempted), step_seconds=time.perf_counter() - t0,
                forward_seconds=fwd_s, running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting), kv_blocks_used=st.used, kv_blocks_free=st.free))

    def _fail_grammars(self, plan: StepPlan) -> None:
        """End the requests whose grammar overran this step (late mask, limit hit), alone: a
        400 grammar_too_complex; their sampled token is dropped (update skips them)."""
        if not self._grammar_failed:
            return
        failed, self._grammar_failed = self._grammar_failed, {}
        for c in plan.chunks:
            r = c.request
            why = failed.get(r.request_id)
            if why is None or r.finished:
                continue
            metrics.GRAMMAR_FAILED.labels(why).inc()
            msg = (f"its token mask took over structured.mask_timeout_ms "
                   f"({self._masks.timeout_s * 1000:g} ms)" if why == "mask_timeout"
                   else f"a grammar engine limit was hit: {r.grammar.error}")
            log.warning("grammar_overran", request_id=r.request_id, reason=why)
            if why == "limit":
                self._forget_grammar(r)
            self.scheduler.finish(r, FinishReason.ERROR, msg)
            self._publish([_error(r, msg, ErrorKind.GRAMMAR)])

    def _forget_grammar(self, req: Request) -> None:
        from moed.model.grammar import compiler_for

        spec = req.params.grammar
        if spec is not None and self._tokenizer is not None:
            compiler_for(self._tokenizer).forget(spec)

    def _fail(self, plan: StepPlan, err: Exception) -> None:
        self._grammar_failed.clear()
        msg = f"engine step failed: {type(err).__name__}: {err}"
        for c in plan.chunks:
            r = c.request
            if not r.finished:
                self.scheduler.finish(r, FinishReason.ERROR, msg)
                self._publish([_error(r, msg)])


def _prompt_positions(c: ScheduledChunk) -> range:
    """The chunk's positions whose prompt logprobs are still to compute (empty: none asked)."""
    r = c.request
    if r.params.prompt_logprobs is None:
        return range(0)
    return prompt_positions(r.num_computed_tokens, c.num_new_tokens, r.num_prompt_tokens,
                            len(r.prompt_logprobs))


def _with_prompt_logprobs(events: list[TokenEvent], plan: StepPlan) -> list[TokenEvent]:
    """The first token's event of a request that asked carries its prompt logprobs."""
    reqs = {c.request.request_id: c.request for c in plan.chunks}
    out = []
    for ev in events:
        r = reqs.get(ev.request_id)
        if r is not None and ev.token_ids and r.params.prompt_logprobs is not None \
                and not r.prompt_logprobs_sent:
            r.prompt_logprobs_sent = True
            ev = replace(ev, prompt_logprobs=tuple(r.prompt_logprobs))
        out.append(ev)
    return out


def _error(req: Request, msg: str, kind: ErrorKind | None = None) -> TokenEvent:
    return TokenEvent.finish(req.request_id, FinishReason.ERROR, error_kind=kind,
                             prompt_tokens=req.num_prompt_tokens,
                             cached_tokens=req.num_cached_tokens, error=msg)
