"""Engine: the async step loop the HTTP server sits on.

One writer: the step-loop coroutine is the only code that touches the scheduler and the KV
manager. `add_request`, `abort`, `complete_remote_prefill` and `release_kv` only enqueue a
command; the loop applies them at the next step boundary. The forward pass and sampling run in
ONE executor thread, so the event loop keeps serving HTTP while a step computes. When there is
nothing to do the loop sleeps on an asyncio.Event.

The contract callers hold it by is `moed.engine.client.EngineClient`; commands are typed
(`moed.engine.commands`), one handler each (`_HANDLERS`).

`at_step_boundary(fn)` runs a callable between two steps (e.g. expert-map swaps).
Expert-load subscribers (`subscribe_expert_load`) get the runner's expert load ([layers,
experts] tokens routed since the last read) about every EXPERT_LOAD_INTERVAL_S while steps run,
and when the loop goes idle; the engine is the runner's only expert-load reader (its read
resets the counts), and every subscriber gets the same window.
`apply_config(cfg)` adopts the live limits (max_num_seqs, max_num_batched_tokens).

Each step:  drain commands -> scheduler.schedule() -> [executor] runner.forward + sample ->
scheduler.update() -> publish TokenEvents to each request's stream -> step subscribers.

Disaggregation hooks (used by the prefill/decode roles):
- Decode side: `add_request(..., remote_kv=True)` allocates blocks for the WHOLE prompt (prefix
  cache hits included) and parks the request in WAITING_REMOTE_KV; `stream.kv_blocks` resolves
  to `(block_ids, num_cached_tokens)` — the writer fills `block_ids[num_cached_tokens //
  block_size:]`. `complete_remote_prefill(request_id, first_token_id, logprob, top_logprobs)`
  then marks the prompt computed, publishes the first token and decodes on; a seeded request's
  generator is advanced as if token one had been sampled here, so its later tokens match a
  colocated run. Abort frees the blocks as usual.
- Prefill side: `add_request(..., prefill_only=True)` runs the prompt (chunked), samples the
  first token and finishes with "stop" ("length" if the prompt reached the context limit) — but
  KEEPS its blocks on either. After every step that computed some of its prompt, the
  prefill-progress subscribers get `(request_id, block_ids, num_computed_tokens)`
  (block_ids = the whole table; blocks below num_computed_tokens // block_size are final). Call
  `release_kv(request_id)` once the KV has been sent (or abort to give up).
"""
from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import structlog

from moed.config import (BalanceConfig, Config, EngineConfig, KVEventsConfig,
                         StructuredConfig, TiersConfig)
from moed.engine.client import Listeners, Unsubscribe
from moed.engine.commands import (Abort, AddRequest, ApplyConfig, CallAtBoundary, Command,
                                  CompleteRemotePrefill, ReleaseKV)
from moed.engine.balancing import EngineBalance, calibrate
from moed.engine.masks import MaskPool
from moed.engine.plan import ScheduledChunk, StepPlan
from moed.engine.request import Request
from moed.engine.scheduler import Scheduler
from moed.engine.stream import RequestStream, StepStats
from moed.kvcache.manager import KVCacheManager
from moed.model.logprobs import compute as compute_prompt_logprobs
from moed.model.logprobs import prompt_positions
from moed.model.sampler import SampleResult, SampleRow, make_generator, sample, skip_one_token
from moed.obs import metrics
from moed.types import (ContextRule, EngineStats, ErrorKind, FinishReason, PromptLogprob,
                        SamplingParams, TokenEvent)

log = structlog.get_logger(__name__)

EXPERT_LOAD_INTERVAL_S = 1.0
PromptLPs = dict[str, list[PromptLogprob]]     # one step's prompt logprobs, by request id


class Engine:
    def __init__(self, runner: Any, tokenizer: Any, cfg: EngineConfig, *,
                 max_model_len: int | None = None,
                 on_step: Callable[[StepStats], None] | None = None,
                 on_prefill_progress: Callable[[str, list[int], int], None] | None = None,
                 on_expert_load: Callable[[Any], None] | None = None,
                 balance: BalanceConfig | None = None, ep: Any = None,
                 tiers: TiersConfig | None = None, model_id: str = "",
                 kv_events: KVEventsConfig | None = None,
                 structured: StructuredConfig | None = None) -> None:
        """ep: this rank's moed.parallel.runtime.EPRuntime (expert parallelism; joined).
        tiers: the KV tiers below the KV tensor (host memory, disk); None or all 0 = none.
        model_id: the checkpoint's (moed.model.identity): with the layout id it names the
        disk tier's files, so a restart on other weights never reads their KV.
        kv_events: vLLM's KV-events stream (moed.kvcache.events); published from start()."""
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
        # the prefill balancer: cost model fed below from each step, time budget (None: tokens)
        self.balance = EngineBalance(self.scheduler, spec, balance)
        self.tiers = self._make_tiers(tiers)
        self._kv_events_cfg = kv_events if kv_events is not None and kv_events.active else None
        self._kv_events = self._make_kv_events()
        self._kv_publisher: Any = None
        self._on_step: Listeners[Callable[[StepStats], None]] = Listeners("step")
        self._on_progress: Listeners[Callable[[str, list[int], int], None]] = \
            Listeners("prefill_progress")
        self._on_load: Listeners[Callable[[Any], None]] = Listeners("expert_load")
        for listeners, fn in ((self._on_step, on_step), (self._on_progress, on_prefill_progress),
                              (self._on_load, on_expert_load)):
            if fn is not None:
                listeners.add(fn)
        if getattr(ep, "rebalancer", None) is not None:    # EPLB: the group's load window
            self._on_load.add(ep.rebalancer.add_load)
        self._load_read_at = time.monotonic()
        self._load_pending = False      # steps ran since the last expert-load read
        self._streams: dict[str, RequestStream] = {}
        self._inbox: deque[Command] = deque()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._stopping = False
        self.steps = 0
        # structured outputs: masks beside the forward pass, each with a deadline
        # (moed.engine.masks); requests whose grammar overran this step, failed at its end
        st = structured or StructuredConfig()
        self._masks = MaskPool(st.mask_workers, st.mask_timeout_ms / 1000)
        self._grammar_failed: dict[str, str] = {}

    @classmethod
    def from_config(cls, cfg: Config, **kw: Any) -> Engine:
        """Build the ModelRunner and Tokenizer from cfg.model / cfg.engine."""
        import torch

        from moed.model.runner import ModelRunner, auto_num_blocks, resolve_device, resolve_dtype
        from moed.model.spec import load_spec
        from moed.model.tokenizer import Tokenizer

        e, m = cfg.engine, cfg.model
        threads, why = step_threads(e.num_threads, _cores_available(), os.environ)
        if threads:
            torch.set_num_threads(threads)
        log.info("engine_threads", torch_threads=torch.get_num_threads(),
                 cores_available=_cores_available(), chosen_by=why)
        spec = load_spec(m.path)
        device = resolve_device(m.device)
        dtype = resolve_dtype(m.dtype, spec, device)
        from moed.engine.memory import kv_memory_mb
        sized: dict[str, float] = {}
        sized_by = "engine.num_kv_blocks"
        num_blocks = e.num_kv_blocks
        if not num_blocks:
            kv_mb, sized_by, sized = kv_memory_mb(cfg, spec, dtype, device)
            num_blocks = auto_num_blocks(spec, block_size=e.block_size, dtype=dtype,
                                         memory_mb=kv_mb, kv_dtype=e.kv_cache_dtype)
        ep = None
        if cfg.parallel.ep_size > 1:    # plan (which experts to load), load, then rendezvous
            from moed.parallel.runtime import EPRuntime
            ep = EPRuntime.plan(cfg.parallel, spec.num_experts, device)
        runner = ModelRunner(m.path, dtype=dtype, device=device, spec=spec,
                             attention_backend=e.attention_backend, num_blocks=num_blocks,
                             block_size=e.block_size, kv_dtype=e.kv_cache_dtype,
                             placement=None if ep is None else ep.placement,
                             quantization=m.quantization,
                             quantization_group_size=m.quantization_group_size)
        if ep is not None:
            ep.join()
            ep.attach(runner.model)     # the expert balancer, if parallel.eplb_interval_s
        from moed.model.identity import model_id
        engine = cls(runner, Tokenizer.from_dir(m.path), e, max_model_len=m.max_model_len or None,
                     balance=cfg.balance, ep=ep, tiers=cfg.tiers, model_id=model_id(m.path),
                     kv_events=cfg.kv_events, structured=cfg.structured, **kw)
        # what the KV budget buys: requests of the model's full context that fit at once
        tokens = num_blocks * e.block_size
        log.info("kv_cache_sized", kv_blocks=num_blocks, block_size=e.block_size,
                 kv_mb=round(num_blocks * runner.kv_layout.bytes_per_block / 2**20, 1),
                 kv_dtype=runner.kv_layout.dtype_name, kv_bytes_per_token=runner.kv_layout.bytes_per_token,
                 sized_by=sized_by, **sized,
                 kv_tokens=tokens, max_model_len=engine.max_model_len,
                 max_concurrency_at_max_len=round(tokens / engine.max_model_len, 2),
                 max_num_seqs=e.max_num_seqs)
        return engine

    def _make_tiers(self, t: TiersConfig | None) -> Any:
        """The L2/L3 cache over this engine's KV tensor, hooked to L1's evictions."""
        if t is None:
            return None
        # load-or-recompute's prediction before the cost model is fitted: the tiers' and the
        # peer reads' (moed.roles.kvshare, tiers.peer_reuse without L2/L3) alike
        self.scheduler.set_recompute_s_per_token(t.recompute_us_per_token * 1e-6)
        if not t.enabled:
            return None
        if not self.cfg.enable_prefix_caching:
            raise ValueError("KV tiers need engine.enable_prefix_caching")
        from moed.kvcache.tiers import TieredCache, TierSettings
        from moed.kvcache.tiers.kvio import KVBlockIO

        layout = self.runner.kv_layout
        if t.disk_bytes and not self._model_id:
            raise ValueError("a disk KV tier needs the checkpoint's model id (Engine model_id)")
        cache = TieredCache(TierSettings(
            host_bytes=t.host_bytes, disk_bytes=t.disk_bytes, disk_dir=t.disk_dir,
            disk_io=t.disk_io, write_through=t.write_through, load_threads=t.load_threads,
            read_timeout_s=t.read_timeout_s, host_bandwidth=t.host_bandwidth_mbps * 1e6,
            disk_bandwidth=t.disk_bandwidth_mbps * 1e6, half_life_s=t.reuse_half_life_s),
            KVBlockIO(self.runner.kv_cache, layout),
            f"{layout.layout_id}.m-{self._model_id}" if self._model_id else layout.layout_id)
        self.kv.set_tier_hooks(cache.offer, cache.on_cached)
        self.scheduler.attach_tiers(cache)
        return cache

    def _make_kv_events(self) -> Any:
        """The recorder on L1 and the tiers: a fresh process holds nothing (AllBlocksCleared
        first), except the disk blocks an earlier one left (announced without tokens)."""
        if self._kv_events_cfg is None:
            return None
        from moed.kvcache.events import KVEventRecorder

        rec = KVEventRecorder(self.kv.block_size, keep_tokens=self.tiers is not None)
        rec.cleared()
        self.kv.set_events(rec)
        if self.tiers is not None:
            for tier, key in self.tiers.held():
                rec.tier_changed(tier, key, True)
            self.tiers.on_change = rec.tier_changed
        return rec

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

    # ---- properties ------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def spec(self) -> Any:
        return self.runner.spec

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
        layout = getattr(self.runner, "kv_layout", None)
        return layout.bytes_per_token if layout is not None else 0

    def limits(self) -> dict[str, int]:
        """The limits the scheduler uses now (a reload lands at the next step)."""
        return {"max_num_seqs": self.scheduler.max_num_seqs,
                "max_num_batched_tokens": self.scheduler.max_num_batched_tokens}

    def kv_region(self) -> Any:
        """What the transfer layer registers: this node's KV tensor and its layout
        (moed.transfer.KVRegion; moed.roles.common)."""
        return self.runner.kv_region()

    @property
    def kv_layout_id(self) -> str:
        """The KV layout's id (moed.model.kv_layout): two nodes can exchange KV only when
        theirs are equal. Gossiped in the member metadata."""
        layout = getattr(self.runner, "kv_layout", None)
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
                                     **({} if self.tiers is None else self.tiers.stats())})

    def _pending_adds(self) -> int:
        return sum(1 for c in self._inbox if isinstance(c, AddRequest))

    # ---- public API (call from the event loop's thread) ------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    *, remote_kv: bool = False, prefill_only: bool = False) -> RequestStream:
        if self._stopping:
            done = self._task is not None and self._task.done()
            raise RuntimeError("engine is not running (stopped or crashed)" if done
                               else "engine is shutting down")
        req = self._new_request(request_id, prompt_token_ids, params, remote_kv, prefill_only)
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, self.abort)
        if remote_kv:
            stream.kv_blocks = asyncio.get_running_loop().create_future()
        self._streams[request_id] = stream
        self._post(AddRequest(req))
        return stream

    def abort(self, request_id: str) -> None:
        self._post(Abort(request_id))

    def complete_remote_prefill(self, request_id: str, first_token_id: int,
                                logprob: float | None = None,
                                top_logprobs: Sequence[tuple[int, float]] | None = None) -> None:
        self._post(CompleteRemotePrefill(request_id, int(first_token_id), logprob, top_logprobs))

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

    def calibrate(self, steps: int) -> int:
        """Fit the cost model on `steps` synthetic steps; before start() only (blocks)."""
        if self._task is not None:
            raise RuntimeError("calibrate() runs before the engine loop starts")
        return calibrate(self, steps)

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

    def _post(self, cmd: Command) -> None:
        self._inbox.append(cmd)
        if self._wake is not None:
            self._wake.set()

    def _new_request(self, request_id: str, prompt: Sequence[int], params: SamplingParams,
                     remote_kv: bool = False, prefill_only: bool = False) -> Request:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        # the model's context only: a prompt over this node's KV capacity is the scheduler's
        # to refuse (an error event), so a prefill role's caller can retry on a bigger node
        err = ContextRule(self._max_model_len).prompt_error(len(prompt))
        if err is not None:
            raise ValueError(err)
        vocab = self.spec.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")
        detok = None
        if self._tokenizer is not None:
            from moed.model.tokenizer import IncrementalDetokenizer
            detok = IncrementalDetokenizer(self._tokenizer, prompt,
                                           skip_special_tokens=params.skip_special_tokens)
        return Request(request_id, prompt, params, self.eos_token_ids, self._max_model_len,
                       detok, remote_kv=remote_kv, prefill_only=prefill_only,
                       rng=None if params.seed is None else make_generator(params.seed),
                       grammar=self._grammar(params))

    def _grammar(self, params: SamplingParams) -> Any:
        """The request's own grammar matcher (None without a grammar). The API handler (and a
        prefill node's job handler) compiled the spec off the loop, so this is a cache hit and
        a ~2 us copy; a GrammarError is a ValueError (the caller's 400)."""
        if params.grammar is None:
            return None
        from moed.model.grammar import compiler_for
        return compiler_for(self._tokenizer).matcher(params.grammar)

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moed-step")
        if self.tiers is not None:      # an I/O thread's finished load wakes the loop
            loop, wake = asyncio.get_running_loop(), self._wake
            self.tiers.set_waker(lambda: loop.call_soon_threadsafe(wake.set))
        if self._kv_events_cfg is not None:
            from moed.kvcache.publisher import ZmqPublisher

            self._kv_publisher = ZmqPublisher(self._kv_events_cfg, self.kv.block_size,
                                              getattr(getattr(self.ep, "cfg", None), "ep_rank", 0))
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
        for rid in list(self._streams):     # added after the loop ended
            self._publish([TokenEvent.finish(rid, FinishReason.ABORT)])
        if self.tiers is not None:          # queued L3 writes land, so a restart finds them
            self.tiers.set_waker(None)
            await asyncio.to_thread(self.tiers.close)
        self._masks.shutdown()
        if self._kv_publisher is not None:
            self._flush_kv_events()
            await asyncio.to_thread(self._kv_publisher.close)
            self._kv_publisher = None
        if self._executor is not None:
            # a failed EP group's step thread may still sit in a collective (until gloo's timeout)
            self._executor.shutdown(wait=self.ep is None or self.ep.group is None
                                    or self.ep.group.failed is None)
            self._executor = None
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
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while not self._stopping:
            self._apply_commands()
            self._collect_tier_loads()
            t0 = time.perf_counter()
            plan = self._schedule()
            if plan is None:
                self._flush_kv_events()                 # one batch a step: here before idling
                self._read_expert_load(force=True)      # flush the window before idling
                self._wake.clear()
                if not self._inbox and not self._stopping and not self._tier_results():
                    await self._wake.wait()
                continue
            try:
                res, fwd_s, plps = await loop.run_in_executor(self._executor, self._execute,
                                                              plan)
            except Exception as e:      # a broken step fails its requests, not the engine
                log.exception("engine_step_failed", batch=plan.batch.num_seqs)
                self._fail(plan, e)
                continue
            finally:
                self._load_pending = True
            self._finish_step(plan, res, t0, fwd_s, plps)
            self._flush_kv_events()
            self._read_expert_load(force=False)

    async def _steps_ep(self) -> None:
        """The step loop of an expert-parallel rank (moed.parallel.agree): every step opens
        with the group's agreement; when anyone has work every rank runs one forward pass (an
        empty one without work here), when nobody has the group idles on one wake key. A
        failed or left peer ends every request here with a 503 and the node exits non-zero."""
        from moed.parallel.group import GroupFailed

        assert self._wake is not None and self.ep is not None
        agreement, plan = self.ep.agreement, None
        try:
            while True:
                self._apply_commands()
                self._collect_tier_loads()
                t0 = time.perf_counter()
                leaving = self._stopping
                plan = None if leaving else self._schedule()
                if plan is None:                # one batch a step: a working one flushes last
                    self._flush_kv_events()
                if leaving:
                    await self._ep_call(agreement.wake_peers)
                verdict = await self._ep_call(agreement.agree, plan is not None, leaving,
                                              self.ep.rebalance_wanted())
                if leaving:
                    return
                if verdict.leaving:
                    if self._ep_draining:       # the whole group is stopping: not a failure
                        self._group_down("a peer rank left the group", failed=False)
                        return
                    raise self.ep.fail("a peer rank left the group")
                if not verdict.working:
                    self._read_expert_load(force=True)      # flush the window before idling
                    self._wake.clear()
                    if self._inbox or self._stopping or self._tier_results():
                        # work came after this step's schedule: idle() returns at once, but
                        # sets the epoch's key first, since the peers are idling on it
                        self._wake.set()
                    await agreement.idle(self._wake, self._executor)
                    continue
                self._load_pending = True
                if plan is None:
                    await self._ep_call(self.runner.forward_empty)
                    self.ep.observe_step()
                    if self.ep.rebalance_due(verdict.rebalance):    # EPLB, between two steps
                        await self._ep_call(self.ep.rebalance_step, verdict.rebalance)
                    continue
                res, fwd_s, plps = await self._ep_call(self._execute, plan)
                self.ep.observe_step()
                self._finish_step(plan, res, t0, fwd_s, plps)   # tokens out before any move
                self._flush_kv_events()
                if self.ep.rebalance_due(verdict.rebalance):
                    await self._ep_call(self.ep.rebalance_step, verdict.rebalance)
                self._read_expert_load(force=False)
        except GroupFailed as e:
            self.ep.fail(str(e))
            self._group_down(str(e))
        except Exception as e:      # a local failure mid-step leaves the peers' collectives unmatched
            log.exception("engine_step_failed", batch=0 if plan is None else plan.batch.num_seqs)
            self.ep.fail(f"this rank's step failed: {type(e).__name__}: {e}")
            self._group_down(f"this rank's step failed: {type(e).__name__}")

    async def _ep_call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn on the step thread, under the group's watchdog (gloo times out first; this is
        the backstop for a thread that never returns)."""
        assert self.ep is not None
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        try:
            return await asyncio.wait_for(fut, self.ep.watchdog_s)
        except asyncio.TimeoutError:
            raise self.ep.fail(f"a step made no progress for {self.ep.watchdog_s:g} s") from None

    def expect_group_end(self) -> None:
        """The node drains (SIGTERM): a peer rank leaving the EP group from now on is the
        group stopping together, not a failure (this node then exits 0)."""
        self._ep_draining = True

    def _group_down(self, reason: str, failed: bool = True) -> None:
        """The EP group cannot step: every request ends 503 (retryable on another node), the
        loop ends, and (failed) the app is told to leave membership and exit non-zero."""
        self._stopping = True
        msg = "the node's expert-parallel group lost a rank"     # no peer address to clients
        for rid in list(self.scheduler.requests):
            req = self.scheduler.requests[rid]
            self.scheduler.finish(req, FinishReason.ERROR, msg)
            self._publish([TokenEvent.finish(rid, FinishReason.ERROR, prompt_tokens=req.num_prompt_tokens,
                                             cached_tokens=req.num_cached_tokens, error=msg,
                                             error_kind=ErrorKind.UNAVAILABLE)])
        for rid in list(self._streams):
            self._publish([TokenEvent.finish(rid, FinishReason.ERROR, error=msg,
                                             error_kind=ErrorKind.UNAVAILABLE)])
        if failed and self.on_group_failure is not None:
            self.on_group_failure(f"expert-parallel group failed: {reason}")
        elif not failed:
            log.info("ep_group_ended", reason=reason)

    def _read_expert_load(self, force: bool) -> None:
        """Between steps: pass the runner's expert load to its subscribers (once per interval,
        or now with force) if any step ran since the last read. One read per window (it
        resets the counts): every subscriber gets the same tensor."""
        read = getattr(self.runner, "expert_load", None)
        if not self._on_load or read is None or not self._load_pending:
            return
        now = time.monotonic()
        if not force and now - self._load_read_at < EXPERT_LOAD_INTERVAL_S:
            return
        self._load_read_at, self._load_pending = now, False
        try:
            load = read()
        except Exception:
            log.exception("expert_load_read_failed")
            return
        self._on_load.emit(load)

    # ---- one step (shared by the async loop and generate()) --------------------------------
    def _schedule(self) -> StepPlan | None:
        if not self.scheduler.has_work():
            return None
        plan, events = self.scheduler.schedule()
        self._publish(events)
        return None if plan.empty else plan

    def _execute(self, plan: StepPlan) -> tuple[SampleResult | None, float, PromptLPs]:
        """Runs in the executor thread: forward + sample (+ the prompt logprobs of the chunks
        that ask). Reads the plan, mutates nothing else."""
        t0 = time.perf_counter()
        asks = [_prompt_positions(c) for c in plan.chunks]
        batch = plan.batch
        if any(asks):       # rows that do not ask pay nothing: the batch stays as planned
            batch = replace(batch, all_logits=tuple(bool(a) for a in asks))
        gram = [c.request for c in plan.chunks if c.sample and c.request.grammar is not None]
        pending = self._masks.start([r.grammar for r in gram]) if gram else None
        logits = out = self.runner.forward(batch)
        plps: PromptLPs = {}
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
            logits = logits[last]
        idx = [i for i, c in enumerate(plan.chunks) if c.sample]
        if not idx:
            return None, time.perf_counter() - t0, plps
        if len(idx) != len(plan.chunks):
            logits = logits[idx]
        masks: dict[str, Any] = {}
        if pending is not None:
            got, failed = pending.collect()
            masks = {r.request_id: m for r, m in zip(gram, got)}
            for j, why in failed.items():
                self._grammar_failed[gram[j].request_id] = why
        reqs = [plan.chunks[i].request for i in idx]
        rows = [self._sample_row(r, masks.get(r.request_id)) for r in reqs]
        known = getattr(self.runner, "argmax_of", None)     # the step's own argmax, if it has one
        argmax = known(out) if known is not None and logits is out else None
        return sample(logits, rows, argmax), time.perf_counter() - t0, plps

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
                     fwd_s: float, plps: PromptLPs | None = None) -> None:
        toks = [] if res is None else res.token_ids
        self._fail_grammars(plan)
        for c in plan.chunks if plps else ():
            if c.request.request_id in plps and not c.request.finished:
                c.request.prompt_logprobs.extend(plps[c.request.request_id])
        events = self.scheduler.update(plan, toks, None if res is None else res.logprobs,
                                       None if res is None else res.top_logprobs)
        if any(c.request.params.prompt_logprobs is not None for c in plan.chunks):
            events = _with_prompt_logprobs(events, plan)
        for c in plan.chunks:   # a token that took the grammar past a limit (Request.append_token)
            if c.request.error_kind is ErrorKind.GRAMMAR and c.request.grammar is not None:
                metrics.GRAMMAR_FAILED.labels("limit").inc()
                self._forget_grammar(c.request)
                c.request.grammar = None        # counted once
        self._publish(events)
        self.steps += 1
        self.balance.observe(plan.batch, fwd_s)     # the cost model learns from every step
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

    # ---- commands: one handler each, applied only here (the step loop's boundary) ----------
    def _apply_commands(self) -> None:
        while self._inbox:
            cmd = self._inbox.popleft()
            self._HANDLERS[type(cmd)](self, cmd)

    def _add(self, cmd: AddRequest) -> None:
        if self._stopping:
            self._publish([TokenEvent.finish(cmd.request.request_id, FinishReason.ABORT)])
        else:
            self.scheduler.add(cmd.request)

    def _abort(self, cmd: Abort) -> None:
        ev = self.scheduler.abort(cmd.request_id)
        if ev is not None:
            self._publish([ev])

    def _complete_remote(self, cmd: CompleteRemotePrefill) -> None:
        req = self.scheduler.remote.get(cmd.request_id)
        if req is not None:     # token one was drawn remotely: consume its randomness
            skip_one_token(req.rng, req.params, self.spec.vocab_size)
        try:
            self._publish([self.scheduler.complete_remote_prefill(
                cmd.request_id, cmd.token_id, cmd.logprob, cmd.top_logprobs)])
        except KeyError:
            log.warning("remote_prefill_unknown_request", request_id=cmd.request_id)

    def _release(self, cmd: ReleaseKV) -> None:
        self.scheduler.release(cmd.request_id)

    def _call(self, cmd: CallAtBoundary) -> None:
        try:
            res = cmd.fn()
        except Exception as e:
            if not cmd.future.done():
                cmd.future.set_exception(e)
        else:
            if not cmd.future.done():
                cmd.future.set_result(res)

    def _config(self, cmd: ApplyConfig) -> None:
        self.cfg = cfg = cmd.config
        self.scheduler.set_limits(cfg.max_num_seqs, cfg.max_num_batched_tokens)

    _HANDLERS: dict[type, Callable[[Engine, Any], None]] = {
        AddRequest: _add, Abort: _abort, CompleteRemotePrefill: _complete_remote,
        ReleaseKV: _release, CallAtBoundary: _call, ApplyConfig: _config}

    def _remote_allocated(self, req: Request, block_ids: list[int]) -> None:
        s = self._streams.get(req.request_id)
        if s is not None and s.kv_blocks is not None and not s.kv_blocks.done():
            s.kv_blocks.set_result((block_ids, req.num_cached_tokens))

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
                if s.kv_blocks is not None and not s.kv_blocks.done():
                    s.kv_blocks.cancel()

    # ---- synchronous convenience (tests, bench) --------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion on the calling thread; -> output token ids per prompt.
        Must not be used while the async loop runs."""
        if self._task is not None:
            raise RuntimeError("generate() cannot run while the async engine loop is running")
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError("one SamplingParams per prompt (or a single one for all)")
        base = f"gen-{self.steps}-{id(prompts)}"
        reqs = [self._new_request(f"{base}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
        for r in reqs:
            self.scheduler.add(r)
        while any(not r.finished for r in reqs):
            self._collect_tier_loads()
            t0 = time.perf_counter()
            plan = self._schedule()
            if plan is None:
                if all(r.finished for r in reqs):    # e.g. a prompt that can never fit
                    break
                if self.scheduler.loading and self.tiers is not None:
                    if not self.tiers.wait(30.0):
                        raise RuntimeError("KV tier loads did not finish within 30 s")
                    continue
                raise RuntimeError("scheduler made no progress with requests pending")
            res, fwd_s, plps = self._execute(plan)
            self._finish_step(plan, res, t0, fwd_s, plps)
        for r in reqs:
            if r.finish_reason is FinishReason.ERROR:
                raise RuntimeError(f"request {r.request_id} failed: {r.error}")
        return [r.output_token_ids for r in reqs]


def step_threads(configured: int, cores: int, environ: Mapping[str, str]) -> tuple[int, str]:
    """The step thread's torch/OpenMP pool size -> (threads, why); 0 threads = leave torch's.

    engine.num_threads > 0 is taken as is. 0 (auto): OMP_NUM_THREADS, when set, is the
    operator's choice and torch has already read it; otherwise one core fewer than this process
    may use (its affinity mask), so the event loop (HTTP, SSE, the scheduler) keeps a core
    while the pool computes: with every core in the pool, the client's inter-token latency was
    3.3x the engine's step (29 vs 8.8 ms on a 2-core AMX Xeon, issue 16; 16.6 ms with one
    thread). A many-core node gives up 1/cores of its compute for it."""
    if configured > 0:
        return configured, "engine.num_threads"
    if environ.get("OMP_NUM_THREADS"):
        return 0, "OMP_NUM_THREADS"
    return max(1, cores - 1), "auto: cores available - 1"


def _cores_available() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:      # not Linux
        return os.cpu_count() or 1


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
