"""Engine: the async step loop the HTTP server sits on.

One writer: the step-loop coroutine is the only code that touches the scheduler and the KV
manager. `add_request`, `abort`, `complete_remote_prefill` and `release_kv` only enqueue a
command; the loop applies them at the next step boundary. The forward pass and sampling run in
ONE executor thread, so the event loop keeps serving HTTP while a step computes. When there is
nothing to do the loop sleeps on an asyncio.Event.

The contract callers hold it by is `moed.engine.client.EngineClient`; commands are typed
(`moed.engine.commands`), one handler each (`moed.engine.boundary`, `_HANDLERS`).

`at_step_boundary(fn)` runs a callable between two steps (e.g. expert-map swaps).
Expert-load subscribers (`subscribe_expert_load`) get the runner's expert load ([layers,
experts] tokens routed since the last read) about every EXPERT_LOAD_INTERVAL_S
(moed.engine.step) while steps run, and when the loop goes idle; the engine is the runner's
only expert-load reader (its read resets the counts), and every subscriber gets the same window.
`apply_config(cfg)` adopts the live limits (max_num_seqs, max_num_batched_tokens).

Each step (moed.engine.step, one function for the three drivers of moed.engine.drivers: the
serving loop, an expert-parallel rank's lock-step loop, `generate`): drain commands ->
scheduler.schedule() -> [executor] runner.forward + sample -> scheduler.update() -> publish
TokenEvents to each request's stream -> step subscribers. Built from the config by
moed.engine.build. Where a new prompt's KV comes from (here, a prefill node, a peer's cache)
is the node's PromptSource (moed.engine.prompts), set once as the node starts.

Disaggregation hooks (used by the prefill/decode roles):
- Decode side: `add_request(..., remote_kv=True)` allocates blocks for the WHOLE prompt (prefix
  cache hits included) and parks the request in WAITING_REMOTE_KV; `stream.kv_blocks` resolves
  to `(block_ids, num_cached_tokens)` — the writer fills `block_ids[num_cached_tokens //
  block_size:]`. `complete_remote_prefill(request_id, first_token_id, logprob, top_logprobs,
  draft)` then marks the prompt computed, publishes the first token and decodes on (with the
  MTP layer, `draft` is the prefill node's draft for its first step); a seeded request's
  generator is advanced as if token one had been sampled here, so its later tokens match a
  colocated run. Abort frees the blocks as usual.
- Prefill side: `add_request(..., prefill_only=True)` runs the prompt (chunked), samples the
  first token and finishes with "stop" ("length" if the prompt reached the context limit) — but
  KEEPS its blocks on either (with the MTP layer, its token's event carries the layer's
  `draft` for the position after it). After every step that computed some of its prompt, the
  prefill-progress subscribers get `(request_id, block_ids, num_computed_tokens)`
  (block_ids = the whole table; blocks below num_computed_tokens // block_size are final). Call
  `release_kv(request_id)` once the KV has been sent (or abort to give up).
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import structlog

from moed.config import (BalanceConfig, Config, EngineConfig, KVEventsConfig, SpeculativeConfig,
                         StructuredConfig, TiersConfig)
from moed.engine.balancing import EngineBalance, calibrate
from moed.engine.boundary import Boundary
from moed.engine.build import build_engine, make_kv_events, make_tiers
from moed.engine.client import Listeners, Unsubscribe
from moed.engine.commands import (Abort, AddRequest, ApplyConfig, CallAtBoundary, Command,
                                  CompleteRemotePrefill, ReleaseKV)
from moed.engine.drafts.gate import StepGate
from moed.engine.drafts.mtp_kv import MTPBacklog
from moed.engine.drafts.propose import SpecSettings
from moed.engine.drivers import GroupDriver, ServeDriver, generate, serve, serve_group
from moed.engine.masks import MaskPool
from moed.engine.prompts import LocalPrompts, PendingPrompt, PromptSource
from moed.engine.request import Request
from moed.engine.resume import REPLAYS, check, prime
from moed.engine.runner import StepRunner
from moed.engine.scheduler import Scheduler
from moed.engine.speculate import log_start as log_spec_start
from moed.engine.step import _error
from moed.engine.step_thread import StepThread, build_on_step_thread, on_step_thread
from moed.engine.stream import RequestStream, StepStats
from moed.kvcache.manager import KVCacheManager
from moed.types import ContextRule, EngineStats, FinishReason, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from moed.balance.cost import AdvertisedCost
    from moed.parallel.runtime import EPRuntime
    from moed.transfer import KVRegion

log = structlog.get_logger(__name__)


class Engine(Boundary):
    def __init__(self, runner: StepRunner, tokenizer: Any, cfg: EngineConfig, *,
                 max_model_len: int | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 on_prefill_progress: Callable[[str, list[int], int], None] | None = None,
                 on_expert_load: Callable[[Any], None] | None = None,
                 balance: BalanceConfig | None = None, ep: EPRuntime | None = None,
                 tiers: TiersConfig | None = None, model_id: str = "",
                 kv_events: KVEventsConfig | None = None,
                 structured: StructuredConfig | None = None,
                 speculative: SpeculativeConfig | None = None,
                 step_thread: StepThread | None = None) -> None:
        """step_thread: from_config's (moed.engine.step_thread), where every forward pass runs.
        ep: this rank's moed.parallel.runtime.EPRuntime (expert parallelism; joined).
        tiers: the KV tiers below the KV tensor (host memory, disk); None or all 0 = none.
        model_id: the checkpoint's (moed.model.identity): names the disk tier's files with the
        layout id. kv_events: vLLM's KV-events stream (moed.kvcache.events), from start().
        speculative: [speculative] (moed.engine.speculate); None or method "" = off."""
        self._model_id = model_id
        self.runner = runner
        self.ep = ep
        # the app's "this node must exit" (expert parallelism: the group failed)
        self.on_group_failure: Callable[[str], None] | None = None
        self._ep_draining = False
        self._tokenizer = tokenizer
        self.cfg = cfg
        spec = runner.spec
        limit = spec.max_position_embeddings
        self._max_model_len = min(max_model_len or limit, limit)
        eos = tuple(spec.eos_token_ids) + tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.eos_token_ids = tuple(dict.fromkeys(eos))
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens,
                                   on_remote_allocated=self._remote_allocated)
        spec_s = None if speculative is None else SpecSettings.from_config(speculative)
        self.scheduler.set_speculation(spec_s)
        self._mtp = spec_s is not None and spec_s.method == "mtp"
        self._mtp_k = spec_s.k if self._mtp else 0     # as configured, whatever the switch says
        self._mtp_kv = MTPBacklog() if self._mtp else None
        self._gate = StepGate() if spec_s is not None and spec_s.adaptive else None
        self._gate_step, self._clock = None, time.perf_counter
        log_spec_start(spec_s)
        # the prefill balancer: cost model fed below from each step, time budget (None: tokens)
        self.balance = EngineBalance(self.scheduler, spec, balance)
        self.tiers = make_tiers(self, tiers)
        self._kv_events_cfg = kv_events if kv_events is not None and kv_events.active else None
        self._kv_events = make_kv_events(self)
        self._kv_publisher = None
        self._on_step: Listeners[Callable[[StepStats], None]] = Listeners("step")
        self._on_progress: Listeners[Callable[[str, list[int], int], None]] = \
            Listeners("prefill_progress")
        self._on_load: Listeners[Callable[[Any], None]] = Listeners("expert_load")
        for listeners, fn in ((self._on_step, on_step), (self._on_progress, on_prefill_progress),
                              (self._on_load, on_expert_load)):
            if fn is not None:
                listeners.add(fn)
        if ep is not None and ep.rebalancer is not None:    # EPLB: the group's load window
            self._on_load.add(ep.rebalancer.add_load)
        self._load_read_at = time.monotonic()
        self._load_pending = False      # steps ran since the last expert-load read
        self._streams: dict[str, RequestStream] = {}
        self._inbox: deque[Command] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._step_thread = step_thread
        self._stopping = False
        self.steps = 0
        # structured outputs: masks beside the forward pass, each with a deadline
        # (moed.engine.masks); requests whose grammar overran this step, failed at its end
        st = structured or StructuredConfig()
        self._masks = MaskPool(st.mask_workers, st.mask_timeout_ms / 1000)
        self._grammar_failed: dict[str, str] = {}
        self._forced: dict[str, deque[int]] = {}    # migrated streams' sent tokens (resume.py)
        # where new prompts' KV comes from (moed.engine.prompts), and the requests it holds
        # parked: checked, with a stream, not yet in the scheduler
        self._prompts: PromptSource = LocalPrompts()
        self._parked: dict[str, Request] = {}

    @classmethod
    def from_config(cls, cfg: Config, **kw: Any) -> Engine:
        """Runner, tokenizer, engine (moed.engine.build), built on the step thread it keeps."""
        return build_on_step_thread(build_engine, cfg, cls, **kw)

    def use_prompt_source(self, source: PromptSource) -> None:
        """The node's PromptSource: a role component's, set once as the node starts (before
        /ready: no request has been admitted yet)."""
        if not isinstance(self._prompts, LocalPrompts):
            raise RuntimeError("the prompt source is chosen once, when the node is built")
        self._prompts = source

    # ---- properties ------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def context(self) -> ContextRule:
        return ContextRule(self._max_model_len, self.kv.capacity_tokens)

    def model_info(self) -> dict[str, str]:
        """Which path serves (arch, dtype, device, attention backend, CPU kernels, KV dtype)."""
        return self.runner.describe()

    @property
    def kv_bytes_per_token(self) -> int:
        """One token's KV across all layers (the moed_kv_cache_bytes_per_token gauge)."""
        layout = self.runner.kv_layout
        return layout.bytes_per_token if layout is not None else 0

    def limits(self) -> dict[str, int]:
        """The limits the scheduler uses now (a reload lands at the next step)."""
        return {"max_num_seqs": self.scheduler.max_num_seqs,
                "max_num_batched_tokens": self.scheduler.max_num_batched_tokens}

    def kv_region(self) -> KVRegion:
        """What the transfer layer registers: this node's KV tensor and its layout
        (moed.transfer.KVRegion; moed.roles.common)."""
        return self.runner.kv_region()

    @property
    def kv_layout_id(self) -> str:
        """The KV layout's id (moed.model.kv_layout): two nodes can exchange KV only when
        theirs are equal. Gossiped in the member metadata."""
        layout = self.runner.kv_layout
        return layout.layout_id if layout is not None else ""

    # ---- subscribers (see moed.engine.client) ----------------------------------------------
    def subscribe_step(self, fn: Callable[[StepStats], None]) -> Unsubscribe:
        return self._on_step.add(fn)

    def subscribe_prefill_progress(self, fn: Callable[[str, list[int], int], None]
                                   ) -> Unsubscribe:
        return self._on_progress.add(fn)

    def subscribe_expert_load(self, fn: Callable[[Any], None]) -> Unsubscribe:
        return self._on_load.add(fn)

    @property
    def alive(self) -> bool:
        """True while the step loop runs: False before start(), after shutdown() and once the
        loop has crashed (every request then fails; /ready answers 503)."""
        return self._task is not None and not self._task.done() and not self._stopping

    def stats(self) -> EngineStats:
        s, st = self.scheduler, self.kv.stats()
        return EngineStats(
            running=len(s.running), waiting=len(s.waiting) + self._pending_adds(),
            waiting_remote_kv=len(s.remote), queued_prompt_tokens=s.queued_prompt_tokens,
            kv_blocks_total=st.total, kv_blocks_used=st.used, kv_blocks_free=st.free,
            prefix_cache_queries=st.prefix_query_tokens, prefix_cache_hits=st.prefix_hit_tokens,
            steps=self.steps, extra={"kv_blocks_cached": float(st.cached),
                                     "prefix_cache_requests": float(st.prefix_queries),
                                     "preemptions": float(s.num_preemptions),
                                     "waiting_tier_kv": float(len(s.loading)),
                                     **self.balance.extra(),
                                     **({} if self.tiers is None else self.tiers.stats())},
            waiting_by_priority=self._waiting_by_priority())

    def _waiting_by_priority(self) -> tuple[tuple[int, int], ...]:
        s = self.scheduler
        counts = Counter(r.params.priority for r in (*s.waiting, *s.remote.values()))
        counts.update(c.request.params.priority for c in self._inbox
                      if isinstance(c, AddRequest))
        return tuple(sorted(counts.items()))

    def _pending_adds(self) -> int:
        return sum(1 for c in self._inbox if isinstance(c, AddRequest))

    # ---- public API (call from the event loop's thread) ------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    *, remote_kv: bool = False, prefill_only: bool = False,
                    resume: Sequence[int] = (), replay: str = "decode") -> RequestStream:
        """resume: output tokens another node already streamed (a migrated request), replayed
        as output by `replay` (moed.engine.resume: "decode" forces them as the next steps'
        tokens and still publishes their events, "prefill" recomputes them as one prefill), the
        KV computed here, never by a prompt source (a prefill node would sample a first token
        that was already sent)."""
        if self._stopping:
            done = self._task is not None and self._task.done()
            raise RuntimeError("engine is not running (stopped or crashed)" if done
                               else "engine is shutting down")
        req = self._new_request(request_id, prompt_token_ids, params, remote_kv, prefill_only)
        if resume and replay == "prefill":
            prime(req, resume, self.spec.vocab_size)
        elif resume:
            if replay not in REPLAYS:
                raise ValueError(f"replay {replay!r}: one of {', '.join(REPLAYS)}")
            check(resume, self.spec.vocab_size, req.num_prompt_tokens, req.max_model_len)
            if request_id not in self._streams:
                self._forced[request_id] = deque(int(t) for t in resume)
                req.replaying = True
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, self.abort)
        self._streams[request_id] = stream
        self._parked[request_id] = req
        if remote_kv or resume:     # the caller brings the KV itself / recomputed here
            self._submit(request_id, remote_kv)
        else:
            self._prompts.admit(PendingPrompt(request_id, req.prompt_token_ids, params,
                                              prefill_only, stream, self._submit))
        return stream

    def _submit(self, request_id: str, remote_kv: bool) -> None:
        """A parked request to the scheduler (nothing when it was aborted or the engine
        stopped meanwhile)."""
        req = self._parked.pop(request_id, None)
        stream = self._streams.get(request_id)
        if req is None or stream is None:
            return
        if remote_kv:
            req.remote_kv = True
            stream.kv_blocks = asyncio.get_running_loop().create_future()
        self._post(AddRequest(req))

    def abort(self, request_id: str) -> None:
        self._prompts.cancel(request_id)
        self._post(Abort(request_id))

    def complete_remote_prefill(self, request_id: str, first_token_id: int,
                                logprob: float | None = None,
                                top_logprobs: Sequence[tuple[int, float]] | None = None,
                                draft: int | None = None) -> None:
        self._post(CompleteRemotePrefill(request_id, int(first_token_id), logprob, top_logprobs,
                                         draft))

    def release_kv(self, request_id: str) -> None:
        self._post(ReleaseKV(request_id))

    def apply_balance(self, cfg: BalanceConfig) -> None:
        """Adopt a reloaded [balance] at the next step boundary (policy, targets, buckets)."""
        fut = self.at_step_boundary(lambda: self.balance.apply(cfg))
        fut.add_done_callback(lambda f: None if f.cancelled() or f.exception() is None
                              else log.error("balance_reload_failed", error=repr(f.exception())))

    def ttft_over_deadline(self, prompt_tokens: int, timeout_s: float | None
                           ) -> tuple[float, float] | None:
        """Early rejection: (predicted TTFT, deadline) when a new prompt would miss it."""
        return self.balance.ttft_over_deadline(prompt_tokens, timeout_s)

    def predict_prefill_s(self, tokens: int, start: int) -> float:
        """The scheduler's prediction for `tokens` prompt tokens after `start` cached ones
        (load-or-recompute: the tiers, peer reads)."""
        return self.scheduler.predict_prefill_s(tokens, start)

    def advertised(self) -> AdvertisedCost | None:
        """The cost state this node gossips (None without a fitted cost model)."""
        return self.scheduler.advertised()

    def calibrate(self, steps: int) -> int:
        """Fit the cost model on `steps` synthetic steps; before start() only (blocks)."""
        if self._task is not None:
            raise RuntimeError("calibrate() runs before the engine loop starts")
        return on_step_thread(self._step_thread, calibrate, self, steps)

    def apply_config(self, cfg: EngineConfig) -> None:
        """Adopt the live fields (max_num_seqs, max_num_batched_tokens) at the next step."""
        self._post(ApplyConfig(cfg))

    def at_step_boundary(self, fn: Callable[[], Any]) -> asyncio.Future:
        """Run `fn()` on the loop between two steps (no forward in flight), e.g. to read the
        runner's expert load or install a new expert map. -> a future with fn's result."""
        fut = asyncio.get_running_loop().create_future()
        self._post(CallAtBoundary(fn, fut))
        return fut

    def kv_block_table(self, request_id: str) -> list[int]:
        return list(self.kv.block_table(request_id))

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._executor = (self._step_thread.executor if self._step_thread is not None
                          else ThreadPoolExecutor(1, "moed-step"))
        if self.tiers is not None:      # an I/O thread's finished load wakes the loop
            loop, wake = asyncio.get_running_loop(), self._wake
            self.tiers.set_waker(lambda: loop.call_soon_threadsafe(wake.set))
        if self._kv_events_cfg is not None:
            from moed.kvcache.publisher import ZmqPublisher

            self._kv_publisher = ZmqPublisher(self._kv_events_cfg, self.kv.block_size,
                                              0 if self.ep is None else self.ep.cfg.ep_rank)
            self._flush_kv_events()     # the start: cleared, then the disk tier's blocks
        self._task = asyncio.create_task(self._loop(), name="moed-engine-loop")
        log.info("engine_started", kv_blocks=self.kv.num_blocks, block_size=self.kv.block_size,
                 max_model_len=self._max_model_len)

    async def shutdown(self) -> None:
        """Stop stepping after the current step; abort every request (their streams end)."""
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            try:
                await self._task
            finally:
                self._task = None
        self._apply_commands()
        for rid in list(self.scheduler.requests) + list(self.scheduler.held):
            self._publish([self.scheduler.abort(rid)])
        for rid in list(self._streams):     # added after the loop ended, or parked
            self._publish([TokenEvent.finish(rid, FinishReason.ABORT)])
        self._parked.clear()
        if self.tiers is not None:          # queued L3 writes land, so a restart finds them
            self.tiers.set_waker(None)
            await asyncio.to_thread(self.tiers.close)
        self._masks.shutdown()
        if self._kv_publisher is not None:
            self._flush_kv_events()
            await asyncio.to_thread(self._kv_publisher.close)
            self._kv_publisher = None
        if (stop := self._step_thread or self._executor) is not None:
            # a failed EP group's step thread may still sit in a collective (until gloo's timeout)
            stop.shutdown(wait=self.ep is None or self.ep.group is None
                          or self.ep.group.failed is None)
            self._executor = self._step_thread = None
        if self.ep is not None:
            self.ep.close()
        log.info("engine_stopped", steps=self.steps)

    async def _loop(self) -> None:
        try:
            await (self._steps() if self.ep is None else self._steps_ep())
        except Exception as e:          # a bug: fail every request rather than leave it hanging
            log.exception("engine_loop_crashed")
            self._stopping = True
            msg = f"engine failure: {type(e).__name__}: {e}"
            for rid in list(self.scheduler.requests):
                req = self.scheduler.requests[rid]
                try:
                    self.scheduler.finish(req, FinishReason.ERROR, msg)
                except Exception:       # the scheduler itself may be what broke
                    log.exception("engine_crash_cleanup_failed", request_id=rid)
                self._publish([_error(req, msg)])
            for rid in list(self._streams):     # still in the inbox: never reached the scheduler
                self._publish([TokenEvent.finish(rid, FinishReason.ERROR, error=msg)])

    async def _steps(self) -> None:
        assert self._wake is not None
        await serve(self, ServeDriver(self, self._wake))

    async def _steps_ep(self) -> None:
        assert self._wake is not None and self.ep is not None
        await serve_group(self, GroupDriver(self, self.ep, self._wake))

    # ---- synchronous convenience (tests, bench) --------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion (on the step thread if any); -> token ids per prompt."""
        if self._task is not None:
            raise RuntimeError("generate() cannot run while the async engine loop is running")
        return on_step_thread(self._step_thread, generate, self, prompts, params)
