"""Prefill role: run a decode node's prompt and write its KV straight into the decode node.

A prefill job's lifecycle (one HTTP request POST /internal/prefill holds it):

    accept ──▶ RUNNING ──(first token sampled)──▶ FINISHING ──(last write DONE)──▶ DONE
      │           │  each engine step that finishes whole blocks: NIXL WRITE of those blocks
      │           │  (contiguous runs merged), awaited before the next one, so the final write's
      │           │  notification (the first token) is the last thing the decode node sees
      │           └──────────────┬─────────────────────┘
      │                          ▼
      │        CANCELLED  decode went away (connection closed) or DELETE /internal/prefill/{id}
      │        EXPIRED    the lease (the decode's timeout, capped by transfer.lease_s) ran out
      │        FAILED     a write failed (decode died: its peer entry is dropped) or the engine
      │                   could not run the prompt
      └── 401 not signed with the cluster secret (moed.api.internal); 403 the job's capability
          does not match its node, blocks or expiry; 409 need_metadata: the decode's transfer
          metadata for its incarnation is unknown; 409 incompatible_mtp: the job's decode node
          drafts with the MTP layer and this node has none, or the reverse; 400 bad job /
          incompatible KV layout; 503 draining.

With `speculative.method = "mtp"` (the runner holds DeepSeek-V3's MTP layer, one more KV layer
per block) every prefill step also runs the MTP layer over the positions it computed, as a
colocated node does, so the blocks written to the decode node carry that layer's KV over the
whole prompt (the last position's entry made with the sampled token one), and FirstToken
carries the layer's draft for the decode node's first step (docs/speculative.md).

With `tiers.peer_reuse` (moed.roles.kvshare) a job first reads the prompt's leading blocks that
another prefill (or colocated) node caches, when that is predicted faster than recomputing
them (`reuse.prefetch`, bounded by the job's lease; any failure recomputes): the engine then
finds them as a prefix hit and computes only the rest; the whole prompt's KV still goes to
the decode node.

Ownership: whatever the outcome, the handler's `finally` aborts the engine request, which frees
the job's blocks at the next step boundary (held or still computing) — no block outlives its job.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import structlog
from aiohttp import web

from moed.api.errors import APIError
from moed.api.internal import require_signed
from moed.api.state import STATE
from moed.balance import capacity
from moed.config import Config
from moed.engine.client import EngineClient
from moed.engine.stream import RequestStream
from moed.obs import metrics, trace
from moed.roles.common import advertise_transfer, new_incarnation, start_worker
from moed.roles.protocol import (FirstToken, PrefillJobSpec, ProtocolError, first_token_params,
                                 line)
from moed.transfer import (BadMetadata, IncompatibleLayout, StalePeer, TransferHandle,
                           TransferState, TransferError)
from moed.transfer.worker import TransferWorker
from moed.types import FinishReason, TokenEvent

if TYPE_CHECKING:
    from moed.app import App

log = structlog.get_logger(__name__)


class JobState(str, enum.Enum):
    RUNNING = "running"
    FINISHING = "finishing"
    DONE = "done"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    FAILED = "failed"


_ENDS = frozenset({JobState.CANCELLED, JobState.EXPIRED, JobState.FAILED})
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.RUNNING: frozenset({JobState.FINISHING}) | _ENDS,
    JobState.FINISHING: frozenset({JobState.DONE}) | _ENDS,
    JobState.DONE: frozenset(),
    JobState.CANCELLED: frozenset(),
    JobState.EXPIRED: frozenset(),
    JobState.FAILED: frozenset(),
}


class PrefixReuse(Protocol):
    """Cluster prefix reuse's reader (moed.roles.kvshare.KVShareComponent)."""

    async def prefetch(self, request_id: str, tokens: Sequence[int],
                       salt: str = "") -> None: ...


class JobFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class PrefillJob:
    spec: PrefillJobSpec
    engine_id: str
    expires_at: float                           # loop time
    state: JobState = JobState.RUNNING
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    table: list[int] = field(default_factory=list)
    sent: int = 0                               # prompt blocks [0, sent) are at the decode node
    task: asyncio.Task | None = None
    handle: TransferHandle | None = None        # the transfer in flight, if any
    traced: bool = False                        # spans wanted (moed.obs.trace)
    started_ns: int = 0                         # accepted (wall clock), when traced
    marks: list[tuple[int, int]] = field(default_factory=list)   # (ns, computed) per chunk

    def move(self, new: JobState) -> None:
        if new not in JOB_TRANSITIONS[self.state]:
            raise RuntimeError(f"illegal prefill job transition {self.state.value} -> {new.value}")
        self.state = new

    @property
    def terminal(self) -> bool:
        return not JOB_TRANSITIONS[self.state]


class PrefillComponent:
    """Serves /internal/prefill on a prefill node (a moed.app Component)."""

    name = "prefill"

    def __init__(self, cfg: Config, node: str) -> None:
        self.cfg = cfg
        self.node = node
        self.incarnation = new_incarnation()
        self.engine: EngineClient | None = None
        self.worker: TransferWorker | None = None
        self._unsubscribe: Callable[[], None] = lambda: None
        self.jobs: dict[str, PrefillJob] = {}
        self._aborts: set[asyncio.Future] = set()
        self.draining = False
        self.reuse: PrefixReuse | None = None       # set by KVShareComponent (tiers.peer_reuse)

    # ---- Component ---------------------------------------------------------------------------
    def add_routes(self, web_app: web.Application) -> None:
        web_app.router.add_post("/internal/prefill", self.handle_job)
        web_app.router.add_delete("/internal/prefill/{job_id}", self.handle_cancel)
        web_app.router.add_get("/internal/transfer", self.handle_info)

    async def start(self, app: App) -> None:
        self.engine = app.state.engine
        self.worker = await start_worker(self.cfg.transfer.backend, self.node, self.engine)
        advertise_transfer(app, self.worker)
        self._unsubscribe = self.engine.subscribe_prefill_progress(self._on_progress)
        if self.cfg.speculative.method == "mtp":
            log.info("prefill_mtp_kv", serves="decode nodes with speculative.method mtp only",
                     sends="the MTP layer's KV over each prompt and the first draft")

    async def drain(self) -> None:
        self.draining = True     # running jobs finish; their decode nodes own the requests

    async def stop(self) -> None:
        self._unsubscribe()
        for job in list(self.jobs.values()):
            if job.task is not None:
                job.task.cancel()
        if self.worker is not None:
            await self.worker.close()

    def prepare_reload(self, old: Config, new: Config) -> Callable[[], None]:
        """Reload hook (moed.ops): transfer.* live fields apply to the next job."""
        def commit() -> None:
            self.cfg = new
        return commit

    # ---- engine hook (event loop thread, inside the step loop) ------------------------------
    def _on_progress(self, engine_id: str, block_ids: list[int], num_computed: int) -> None:
        job = self.jobs.get(engine_id.removeprefix("pf-"))
        if job is not None:
            job.inbox.put_nowait(("progress", block_ids, num_computed))
            if job.traced:             # stamped here, at the step's end, not when _run reads it
                job.marks.append((trace.now_ns(), num_computed))

    # ---- HTTP --------------------------------------------------------------------------------
    async def handle_info(self, request: web.Request) -> web.Response:
        return web.json_response({"node": self.node, "incarnation": self.incarnation,
                                  "agent": self.worker.name if self.worker else None,
                                  "jobs": {j: s.state.value for j, s in self.jobs.items()}})

    async def handle_cancel(self, request: web.Request) -> web.Response:
        require_signed(request)
        job = self.jobs.get(request.match_info["job_id"])
        if job is None or job.task is None:
            return web.json_response({"cancelled": False}, status=404)
        job.task.cancel()
        return web.json_response({"cancelled": True})

    async def handle_job(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        caller = require_signed(request, raw)        # the cluster secret, never an API key
        if self.draining or self.worker is None:
            return _error(503, "unavailable", "prefill node is draining or not started")
        try:
            spec = PrefillJobSpec.from_json(json.loads(raw))
            spec.check_blocks(self.engine.block_size)
            params = first_token_params(spec.sampling)
        except (ProtocolError, ValueError, RecursionError) as e:
            return _error(400, "bad_job", str(e))
        ours = request.app[STATE].model_id
        if spec.model_id and ours and spec.model_id != ours:
            metrics.TRANSFER_FAILURES.labels("incompatible_model").inc()
            return _error(409, "incompatible_model", "this prefill node serves another "
                          "checkpoint (model id differs): KV would not match")
        mtp = self.cfg.speculative.method == "mtp"     # restart-only: the runner's layout
        if spec.mtp != mtp:     # said before the layout handshake, which would refuse it too
            metrics.TRANSFER_FAILURES.labels("incompatible_mtp").inc()
            return _error(409, "incompatible_mtp", mtp_mismatch(spec.mtp))
        if params.grammar is not None:     # on the grammar pool, under the budget; then a hit
            try:
                await request.app[STATE].grammar.compile(self.engine.tokenizer, params.grammar)
            except APIError as e:       # 400 grammar_too_complex / bad grammar, 429 grammar_busy
                return _error(e.status, "bad_job" if e.status == 400 else e.code or "busy",
                              f"grammar: {e.message}")
        refused = request.app[STATE].internal_auth.check_capability(
            spec.capability, spec.job_id, spec.decode_node, spec.decode_incarnation,
            spec.skip_blocks, spec.dst_block_ids, spec.expires_ms)
        if refused is not None:
            metrics.TRANSFER_FAILURES.labels("bad_capability").inc()
            log.warning("prefill_job_refused", job=spec.job_id, caller=caller,
                        decode=spec.decode_node, reason=refused)
            return _error(403, "bad_capability", refused)
        if spec.job_id in self.jobs:
            return _error(409, "duplicate", f"job {spec.job_id} is already running")
        known = await self.worker.has_peer(spec.decode_node)
        if known != spec.decode_incarnation:
            if spec.metadata is None:
                return _error(409, "need_metadata", "send transfer metadata for this incarnation")
            try:
                with trace.span("kv.add_peer", decode=spec.decode_node):   # once per incarnation
                    await self.worker.add_peer(spec.decode_node, spec.metadata,
                                               spec.decode_incarnation)
            except StalePeer as e:
                return _error(409, "stale_incarnation", str(e))
            except (BadMetadata, IncompatibleLayout, TransferError) as e:
                return _error(400, "bad_metadata", str(e))
        lease = min(spec.timeout_s, self.cfg.transfer.lease_s)
        loop = asyncio.get_running_loop()
        job = PrefillJob(spec, f"pf-{spec.job_id}", loop.time() + lease,
                         task=asyncio.current_task(), traced=trace.recording(),
                         started_ns=trace.now_ns())
        self.jobs[spec.job_id] = job        # from here a DELETE cancels it (the prefetch too)
        try:
            if self.reuse is not None and params.prompt_logprobs is None:
                # a peer's cached prefix, read into our blocks before the engine sees the job;
                # bounded by the lease (what the read leaves unfinished cleans up on its own)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout_at(job.expires_at):
                        await self.reuse.prefetch(job.engine_id, spec.token_ids, params.cache_salt)
            stream = self.engine.add_request(job.engine_id, spec.token_ids, params,
                                             prefill_only=True)
        except ValueError as e:
            self.jobs.pop(spec.job_id, None)
            return _error(400, "bad_prompt", str(e))
        except BaseException:
            self.jobs.pop(spec.job_id, None)
            raise
        metrics.TRANSFER_JOBS_INFLIGHT.labels("prefill").set(len(self.jobs))
        pump = asyncio.create_task(_pump(stream, job.inbox), name=f"prefill-pump-{spec.job_id}")
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        t0 = time.perf_counter()
        try:
            await resp.prepare(request)
            await resp.write(line("accepted", node=self.node, incarnation=self.incarnation,
                                  lease_s=lease))
            try:
                async with asyncio.timeout_at(job.expires_at):
                    tok = await self._run(job)
            except TimeoutError:
                self._end(job, JobState.EXPIRED, "lease expired")
                metrics.TRANSFER_LEASES_EXPIRED.inc()
                await resp.write(line("error", kind="expired", message="prefill lease expired"))
            except JobFailed as e:
                self._end(job, JobState.FAILED, str(e))
                metrics.TRANSFER_FAILURES.labels(e.kind).inc()
                await resp.write(line("error", kind=e.kind, message=str(e)))
            else:
                job.move(JobState.DONE)
                await resp.write(line("done", token_id=tok.token_id, logprob=tok.logprob,
                                      seconds=round(time.perf_counter() - t0, 4)))
            await resp.write_eof()
        except (asyncio.CancelledError, ConnectionError) as e:
            self._end(job, JobState.CANCELLED, "decode node went away or cancelled")
            if isinstance(e, asyncio.CancelledError):
                raise
        finally:
            self._cleanup(job, pump)
        return resp

    # ---- the job -----------------------------------------------------------------------------
    async def _run(self, job: PrefillJob) -> FirstToken:
        bs = self.engine.block_size
        n_prompt_blocks = -(-len(job.spec.token_ids) // bs)
        while True:
            item = await job.inbox.get()
            if item[0] == "progress":
                _, job.table, num_computed = item
                await self._send(job, num_computed // bs)
                continue
            ev: TokenEvent = item[1]
            # "length": the prompt reached the context limit; token one is still valid (the
            # decode node finishes the request itself)
            if ev.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH) or not ev.token_ids:
                raise JobFailed("engine", ev.error or f"prefill ended with {ev.finish_reason}")
            job.move(JobState.FINISHING)
            capacity.METER.on_finish(ev.timings)    # this node's queue vs compute time
            if job.traced:
                _trace_chunks(job, ev)
            if not job.table:
                job.table = self.engine.kv_block_table(job.engine_id)
            tok = FirstToken(job.spec.job_id, ev.token_ids[0],
                             ev.logprobs[0] if ev.logprobs else None,
                             ev.top_logprobs[0] if ev.top_logprobs else (), job.spec.capability,
                             ev.draft)
            await self._send(job, n_prompt_blocks, tok.encode())
            return tok

    async def _send(self, job: PrefillJob, upto: int, notif: bytes = b"") -> None:
        """WRITE prompt blocks [max(sent, skip), upto) and wait for them (or fail the job)."""
        skip = job.spec.skip_blocks
        lo = max(job.sent, skip)
        if upto <= lo and not notif:
            return
        src = job.table[lo:upto]
        dst = list(job.spec.dst_block_ids[lo - skip:upto - skip])
        if len(src) != len(dst):
            raise JobFailed("internal", f"block table has {len(job.table)} blocks, need {upto}")
        with (trace.span("kv.write", blocks=len(src), first_block=lo, notify=bool(notif))
              if job.traced else trace.NO_SPAN) as span:
            try:
                job.handle = await self.worker.write_blocks(job.spec.decode_node, src, dst,
                                                            notif)
            except (TransferError, ValueError) as e:
                span.error("transfer_rejected", str(e))
                raise JobFailed("transfer_rejected", str(e)) from None
            remaining = job.expires_at - asyncio.get_running_loop().time()
            st = await self.worker.wait(job.handle, max(remaining, 0.001))
            span.set(bytes=getattr(job.handle, "nbytes", 0), state=st.state.value)
            job.handle = None
        if st.state is not TransferState.DONE:
            if st.reason == "timeout":
                # the wait was bounded by the lease: it ran out, the handler's expiry (the
                # same instant as its own timer, which this wait may beat)
                raise TimeoutError
            if st.reason == "peer_disconnected":
                # the decode node is gone: drop its metadata so a restart re-sends it
                await self.worker.remove_peer(job.spec.decode_node)
            raise JobFailed(st.reason or "transfer_failed",
                            f"KV write {st.state.value}: {st.reason}")
        job.sent = max(job.sent, upto)

    def _end(self, job: PrefillJob, state: JobState, why: str) -> None:
        if not job.terminal:
            job.move(state)
            log.info("prefill_job_ended", job=job.spec.job_id, state=state.value, reason=why,
                     decode=job.spec.decode_node)

    def _cleanup(self, job: PrefillJob, pump: asyncio.Task) -> None:
        """Synchronous on purpose: a second cancellation (DELETE and a closed connection
        both cancel the handler) must not skip any of it."""
        self.engine.abort(job.engine_id)       # frees held or running blocks at the next step
        pump.cancel()
        if job.handle is not None:             # a write still in flight: cancel it off the loop
            t = asyncio.ensure_future(self.worker.abort(job.handle))
            self._aborts.add(t)
            t.add_done_callback(self._abort_done)
        self.jobs.pop(job.spec.job_id, None)
        metrics.TRANSFER_JOBS_INFLIGHT.labels("prefill").set(len(self.jobs))
        metrics.TRANSFER_JOBS.labels("prefill", job.state.value).inc()

    def _abort_done(self, t: asyncio.Future) -> None:
        self._aborts.discard(t)
        if not t.cancelled() and t.exception() is not None:
            log.warning("prefill_abort_failed", error=repr(t.exception()))


def mtp_mismatch(decode_mtp: bool) -> str:
    """Why a job and this prefill node disagree on the MTP layer (their KV layouts differ)."""
    if decode_mtp:
        return ("the decode node drafts with speculative.method mtp and needs the MTP layer's "
                "KV over the prompt; this prefill node has no MTP layer (set [speculative] "
                "method = \"mtp\" and num_speculative_tokens = 1 on it)")
    return ("this prefill node computes the MTP layer (speculative.method mtp) and the decode "
            "node's KV has no such layer: their KV layouts differ (set method mtp on both "
            "roles, or on neither)")


def _trace_chunks(job: PrefillJob, ev: TokenEvent) -> None:
    """The job's engine queue wait and each prefill chunk (one engine step's share of the
    prompt) as spans, from the times stamped at each step's end."""
    t = ev.timings
    at = job.started_ns
    if t is not None and t.queue_s is not None:
        end = at + int(t.queue_s * 1e9)
        trace.record("engine.queue", at, end, engine_request=job.engine_id)
        at = end
    done = 0
    for i, (ns, computed) in enumerate(job.marks):
        trace.record("prefill.chunk", min(at, ns), ns, chunk=i, tokens=computed - done,
                     computed_tokens=computed)
        at, done = ns, computed


async def _pump(stream: RequestStream, inbox: asyncio.Queue) -> None:
    async for ev in stream:
        if ev.finished:
            inbox.put_nowait(("event", ev))
            return


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": kind, "message": message}, status=status)
