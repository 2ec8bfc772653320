"""Decode role: own the request end to end; get its prompt's KV from a prefill node.

A request's lifecycle on a decode node (queues as in the engine):

    prealloc   add_request(remote_kv=True): the engine allocates blocks for the whole prompt,
               reusing prefix-cache hits (WAITING → WAITING_REMOTE_KV)
    transfer   pick a prefill peer (moed.balance.prefill: breaker and KV layout first; then
               the predicted finish time of the job from each node's gossiped queue per
               length bucket and cost coefficients, power of balance.prefill_choices choices,
               or the fewest jobs when no candidate advertises a fitted model; members on
               another checkpoint or protocol are never candidates), POST
               the job (token ids, destination blocks past the cached prefix, our transfer
               endpoint, a deadline); the peer WRITEs blocks chunk by chunk and notifies with
               the first token
    waiting    FirstToken notification → engine.complete_remote_prefill (→ RUNNING)
    running    continuous-batching decode; tokens stream to the client as usual
    (prompts of at most transfer.local_prefill_max_tokens tokens, and requests that want
    prompt logprobs, are prefilled here instead)

With speculative.method mtp the job says so (`mtp`): the prefill node, built with the MTP layer
too (the KV layouts agree, one more layer), sends that layer's KV over the prompt and its first
draft; a prefill node without it refuses the job (409 incompatible_mtp), like any other
failed attempt, so the request goes to another peer or fails with a clear error, never
decodes from half a KV.

Failures: the peer's RPC stream closing, an error line, a failed write or the deadline count
against that peer and the job is retried on another one (transfer.max_prefill_retries) into
the same blocks; past that the request fails with a clear error and its blocks are freed. A
client that goes away cancels the job (connection closed + DELETE) and frees the blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import random
import time
from typing import TYPE_CHECKING, Callable, Sequence
from urllib.parse import quote

import aiohttp
import structlog
from aiohttp import web

from moed.config import Config
from moed.engine.client import EngineClient
from moed.engine.stream import RequestStream
from moed.obs import metrics, trace
from moed.balance import breaker
from moed.balance.breaker import PeerHealth
from moed.balance.candidate import Candidate, incompatibility, protocol_range
from moed.cluster.state import GRAMMAR_JOBS
from moed.balance.prefill import CostCandidate, advertised_of, pick_prefill, pick_prefill_cost
from moed.roles.common import advertise_transfer, new_incarnation, start_worker
from moed.roles.protocol import FirstToken, PrefillJobSpec, ProtocolError, sampling_fields
from moed.roles.sources import RemotePrefill
from moed.transfer.worker import TransferWorker
from moed.types import ErrorKind, FinishReason, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from moed.api.internal import InternalAuth
    from moed.app import App
    from moed.cluster.service import MembershipComponent

log = structlog.get_logger(__name__)

NOTIF_GRACE_S = 2.0        # "done" on the RPC but no notification yet: how long to wait for it


# What a client is told about a failed attempt, by kind (the log line has the peer and detail)
_SAYS = {"expired": "the prefill lease expired", "timeout": "prefill missed the deadline",
         "rpc_error": "a prefill node could not be reached",
         "rejected": "a prefill node refused the job",
         "unauthorized": "a prefill node refused this node's credentials",
         "notif_mismatch": "the prompt's KV did not arrive", "engine": "prefill failed"}


class AttemptFailed(Exception):
    def __init__(self, kind: str, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.kind, self.retry = kind, retry


class DecodeComponent:
    """Drives remote prefill for every request of a decode node (a moed.app Component)."""

    name = "decode"

    def __init__(self, cfg: Config, node: str) -> None:
        self.cfg = cfg
        self.node = node
        self.incarnation = new_incarnation()
        self.engine: EngineClient | None = None
        self.worker: TransferWorker | None = None
        self.session: aiohttp.ClientSession | None = None
        self.health: dict[str, PeerHealth] = {u: PeerHealth() for u in cfg.transfer.prefill_peers}
        self.layout = ""                           # our KV layout id: peers must match it
        self.inflight: dict[str, int] = {}
        self.inflight_tokens: dict[str, int] = {}  # prompt tokens of our jobs there, in flight
        self._rng = random.Random()
        self.md_sent: set[str] = set()             # peers that hold our current metadata
        self.jobs: dict[str, asyncio.Task] = {}    # request id → its remote-prefill task
        self.current: dict[str, tuple[str, str]] = {}   # request id → (peer, job id) in flight
        self.expect: dict[str, tuple[str, asyncio.Future[FirstToken]]] = {}   # job → (cap, fut)
        self.auth: InternalAuth | None = None      # signs every job call
        self._app: App | None = None
        self._membership: MembershipComponent | None = None    # when membership is enabled

    # ---- Component ---------------------------------------------------------------------------
    def add_routes(self, web_app: web.Application) -> None:
        web_app.router.add_get("/internal/transfer", self.handle_info)

    async def start(self, app: App) -> None:
        from moed.cluster.service import MembershipComponent

        self._membership = next((c for c in app.components

                                 if isinstance(c, MembershipComponent)), None)
        if not self.cfg.transfer.prefill_peers and self._membership is None:
            log.warning("decode_without_prefill_peers",
                        hint="set transfer.prefill_peers (or enable membership)")
        self._app = app
        self.engine = app.state.engine
        self.worker = await start_worker(self.cfg.transfer.backend, self.node, self.engine)
        self.worker.on_notif = self._on_notif
        self.layout = self.engine.kv_layout_id
        advertise_transfer(app, self.worker)
        self.auth = app.state.internal_auth      # signs every job call with the cluster secret
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        self.engine.use_prompt_source(RemotePrefill(self))

    async def drain(self) -> None:
        pass                     # in-flight requests finish; the API refuses new ones

    async def stop(self) -> None:
        for t in list(self.jobs.values()):
            t.cancel()
        if self.jobs:
            await asyncio.wait(set(self.jobs.values()), timeout=5)
        if self.session is not None:
            await self.session.close()
        if self.worker is not None:
            await self.worker.close()

    def prepare_reload(self, old: Config, new: Config) -> Callable[[], None]:
        """Reload hook (moed.ops): transfer.* live fields apply to the next job."""
        def commit() -> None:
            self.cfg = new
            for u in new.transfer.prefill_peers:
                self.health.setdefault(u, PeerHealth())
        return commit

    async def handle_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "node": self.node, "incarnation": self.incarnation,
            "agent": self.worker.name if self.worker else None,
            "peers": {u: {"state": h.state.value, "failures": h.total_failures,
                          "inflight": self.inflight.get(u, 0)} for u, h in self.health.items()},
            "jobs": len(self.jobs)})

    # ---- prefill peers ---------------------------------------------------------------------
    def candidates(self, protocol: int = 1) -> list[Candidate]:
        """Prefill peers to choose from now: the static list plus, with membership, every
        alive prefill member serving the same model that this node may pair with (same
        checkpoint, KV layout and a common protocol: moed.balance.candidate.incompatibility)
        and that speaks node-to-node protocol `protocol` (a job with a grammar needs
        GRAMMAR_JOBS: an older prefill node would sample token one unconstrained); health is
        kept across views, by URL."""
        found: dict[str, Candidate] = {u: Candidate(u, u, "prefill")
                                       for u in self.cfg.transfer.prefill_peers}
        view = self._membership.view() if self._membership is not None else None
        if view is not None:
            model = getattr(self._app.state, "model_name", "")
            me = view.get(view.self_name)
            for m in view.alive("prefill"):
                if (me is not None and incompatibility(me.meta, m.meta)) or \
                        _speaks(m.meta.protocol) < protocol:
                    found.pop(m.meta.http, None)   # also when it is a static peer
                    continue
                if m.meta.http and (not model or m.meta.model in ("", model)):
                    found[m.meta.http] = Candidate(m.meta.http, m.meta.http, "prefill",
                                                   m.meta.layout, m.meta.transfer, m.load)
        out = []
        for url, c in found.items():
            health = self.health.setdefault(url, PeerHealth())
            out.append(dataclasses.replace(c, health=health, inflight=self.inflight.get(url, 0)))
        return out

    def choose(self, peers: Sequence[Candidate], tried: set[str], prompt_tokens: int
               ) -> Candidate | None:
        """The prefill node for a job of `prompt_tokens` (see the module docstring). Our own
        jobs in flight there count on top of its advertisement, which lags by up to a
        second."""
        t, now = self.cfg.transfer, time.monotonic()
        costs = [CostCandidate(p, advertised_of(p.load), True, self.inflight_tokens.get(p.url, 0))
                 for p in peers]
        if any(c.cost is not None for c in costs):
            got = pick_prefill_cost(costs, prompt_tokens, tried, now, t.peer_error_cooldown_s,
                                    self._rng, self.layout, self.cfg.balance.prefill_choices)
            if got is not None:
                metrics.TRANSFER_PREFILL_CHOICES.labels("cost").inc()
            return got.node if got is not None else None
        pick = pick_prefill(peers, tried, now, t.peer_error_cooldown_s, self.layout)
        if pick is not None:
            metrics.TRANSFER_PREFILL_CHOICES.labels("fewest_jobs").inc()
        return pick

    # ---- per request -------------------------------------------------------------------------
    def launch(self, rid: str, prompt: list[int], params: SamplingParams,
               stream: RequestStream) -> None:
        task = asyncio.create_task(self._remote_prefill(rid, prompt, params, stream),
                                   name=f"remote-prefill-{rid}")
        self.jobs[rid] = task
        metrics.TRANSFER_JOBS_INFLIGHT.labels("decode").set(len(self.jobs))
        task.add_done_callback(lambda _t: self._job_done(rid))

    def _job_done(self, rid: str) -> None:
        self.jobs.pop(rid, None)
        metrics.TRANSFER_JOBS_INFLIGHT.labels("decode").set(len(self.jobs))

    def cancel(self, rid: str) -> None:
        task = self.jobs.get(rid)
        # not the job itself: its _fail aborts the request (and so reaches here) as it ends
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        cur = self.current.pop(rid, None)
        if cur is not None and self.session is not None:   # belt and braces next to the close
            peer, job_id = cur
            asyncio.ensure_future(self._delete(peer, job_id))

    async def _delete(self, peer: str, job_id: str) -> None:
        assert self.session is not None
        headers = self.auth.sign("DELETE", f"/internal/prefill/{job_id}")
        with contextlib.suppress(Exception):
            async with self.session.delete(f"{peer}/internal/prefill/{quote(job_id, safe='')}",
                                           headers=headers,
                                           timeout=aiohttp.ClientTimeout(total=1.0)):
                pass

    async def _remote_prefill(self, rid: str, prompt: list[int], params: SamplingParams,
                              stream: RequestStream) -> None:
        loop = asyncio.get_running_loop()
        t = self.cfg.transfer
        deadline = loop.time() + min(t.prefill_timeout_s, self.cfg.server.request_timeout_s)
        try:
            assert stream.kv_blocks is not None
            blocks, cached = await asyncio.wait_for(asyncio.shield(stream.kv_blocks),
                                                   deadline - loop.time())
        except asyncio.CancelledError:
            if stream.kv_blocks.cancelled():
                return      # the request ended before allocation (an error event says why)
            raise
        except TimeoutError:
            return self._fail(rid, stream, prompt, 0, "timeout",
                              "no KV blocks became free for the prompt before the deadline")
        bs = self.engine.block_size
        skip = cached // bs
        dst = blocks[skip:-(-len(prompt) // bs)]
        tried: set[str] = set()
        errors: list[str] = []
        attempts = t.max_prefill_retries + 1
        for attempt in range(1, attempts + 1):
            peers = self.candidates(GRAMMAR_JOBS if params.grammar is not None else 1)
            pick = self.choose(peers, tried, len(prompt) - skip * bs)
            now = loop.time()
            if pick is None or now >= deadline:
                break
            peer = pick.url
            # a stalled peer may use an equal share of what is left (the last try: all of it)
            left = min(attempts - attempt + 1, sum(1 for p in peers if p.name not in tried))
            until = now + (deadline - now) / max(left, 1)
            tried.add(peer)
            self.health[peer] = breaker.on_pick(self.health[peer])
            job_id = f"{self.node}.{self.incarnation}.{rid}.{attempt}"   # unique cluster-wide
            lease = max(until - now, 0.001)
            expires_ms = int((time.time() + lease) * 1000) + 1000   # +1 s: clocks, latency
            cap = self.auth.capability(job_id, self.node, self.incarnation, skip, dst,
                                       expires_ms)
            spec = PrefillJobSpec(job_id, tuple(prompt), skip, tuple(dst), self.node,
                                  self.incarnation, lease, sampling_fields(params),
                                  capability=cap, expires_ms=expires_ms,
                                  model_id=getattr(self._app.state, "model_id", "") or "",
                                  mtp=self.cfg.speculative.method == "mtp")
            job_tokens = len(prompt) - skip * bs
            self.inflight_tokens[peer] = self.inflight_tokens.get(peer, 0) + job_tokens
            try:
                with trace.span("prefill.remote", kind="client", peer=peer, attempt=attempt,
                                job=job_id, prompt_tokens=job_tokens) as span:
                    try:
                        tok = await self._attempt(rid, peer, spec, until)
                    except AttemptFailed as e:
                        span.error(e.kind, str(e))
                        raise
            except AttemptFailed as e:
                self.health[peer] = breaker.on_failure(self.health[peer], time.monotonic())
                metrics.TRANSFER_FAILURES.labels(e.kind).inc()
                errors.append(e.kind)
                log.warning("remote_prefill_attempt_failed", request_id=rid, peer=peer,
                            attempt=attempt, kind=e.kind, error=str(e))
                if not e.retry:
                    break
                metrics.TRANSFER_JOBS.labels("decode", "retried").inc()
                continue
            finally:
                rest = self.inflight_tokens.get(peer, 0) - job_tokens
                if rest > 0:
                    self.inflight_tokens[peer] = rest
                else:
                    self.inflight_tokens.pop(peer, None)
            self.health[peer] = breaker.on_success(self.health[peer])
            metrics.TRANSFER_JOBS.labels("decode", "done").inc()
            self.engine.complete_remote_prefill(rid, tok.token_id, tok.logprob, tok.top_logprobs,
                                                tok.draft)
            return
        # the client hears what kind of failure, never a peer's address or an exception text
        # (those are on the remote_prefill_attempt_failed lines, with the request id)
        why = ("; ".join(f"{_SAYS.get(k, k)} [{k}]" for k in errors) if errors else
               "no prefill node available" + ("" if self.candidates() else
                                              " (none configured or alive)"))
        self._fail(rid, stream, prompt, cached, "prefill_failed", f"remote prefill failed: {why}")

    def _fail(self, rid: str, stream: RequestStream, prompt: list[int], cached: int, kind: str,
              message: str) -> None:
        metrics.TRANSFER_JOBS.labels("decode", "failed").inc()
        log.error("remote_prefill_failed", request_id=rid, kind=kind, error=message)
        stream.fail(TokenEvent.finish(rid, FinishReason.ERROR, prompt_tokens=len(prompt),
                                      cached_tokens=cached, error=message,
                                      error_kind=ErrorKind.UNAVAILABLE))   # the API answers 503
        self.engine.abort(rid)          # frees the destination blocks

    async def _attempt(self, rid: str, peer: str, spec: PrefillJobSpec,
                       deadline: float) -> FirstToken:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[FirstToken] = loop.create_future()
        self.expect[spec.job_id] = (spec.capability, fut)
        self.current[rid] = (peer, spec.job_id)
        self.inflight[peer] = self.inflight.get(peer, 0) + 1
        try:
            with self.worker.expecting():
                async with asyncio.timeout_at(deadline):
                    await self._rpc(rid, peer, spec, fut)
                    # "done" on the RPC: the notification is on its way (or was lost)
                    try:
                        return await asyncio.wait_for(asyncio.shield(fut), NOTIF_GRACE_S)
                    except TimeoutError:
                        raise AttemptFailed("notif_mismatch", "prefill reported done but no "
                                            "first-token notification arrived") from None
        except TimeoutError:
            with contextlib.suppress(Exception):
                await self._delete(peer, spec.job_id)
            raise AttemptFailed("timeout", "prefill did not finish before the deadline") from None
        except (aiohttp.ClientError, ConnectionError, OSError) as e:
            self.md_sent.discard(peer)          # it may come back as a new incarnation
            raise AttemptFailed("rpc_error", f"{type(e).__name__}: {e}") from None
        finally:
            self.expect.pop(spec.job_id, None)
            self.current.pop(rid, None)
            self.inflight[peer] -= 1

    async def _rpc(self, rid: str, peer: str, spec: PrefillJobSpec,
                   fut: asyncio.Future) -> None:
        """POST the job and follow its line stream to "done"; raises AttemptFailed otherwise."""
        assert self.session is not None
        for _ in range(2):
            body = spec
            if peer not in self.md_sent:
                body = dataclasses.replace(spec, metadata=await self.worker.local_metadata())
            data = json.dumps(body.to_json()).encode()
            headers = {**self.auth.sign("POST", "/internal/prefill", data),
                       "Content-Type": "application/json",
                       # the client's id (bound by the API middleware; the task inherited
                       # it), so the prefill node's lines carry it
                       "X-Request-Id": structlog.contextvars.get_contextvars().get(
                           "request_id", rid)}
            trace.inject(headers)          # unsigned on purpose: the signature covers the body
            async with self.session.post(f"{peer}/internal/prefill", data=data,
                                         headers=headers) as r:
                if r.status == 409 and (await r.json()).get("error") == "need_metadata":
                    self.md_sent.discard(peer)
                    continue
                if r.status != 200:
                    text = await r.text()
                    # 400 for the job itself (bad prompt) fails everywhere; the rest may not
                    retry = r.status != 400 or '"bad_metadata"' in text
                    kind = "unauthorized" if r.status in (401, 403) else "rejected"
                    raise AttemptFailed(kind, f"HTTP {r.status}: {text[:300]}", retry)
                self.md_sent.add(peer)
                while True:
                    raw = await r.content.readline()
                    if not raw:
                        if fut.done():
                            return
                        raise AttemptFailed("rpc_error", "prefill node closed the job stream")
                    try:
                        msg = json.loads(raw)
                    except ValueError:
                        raise AttemptFailed("rpc_error", f"bad line {raw[:100]!r}") from None
                    ev = msg.get("event")
                    if ev == "done":
                        return
                    if ev == "error":
                        raise AttemptFailed(str(msg.get("kind", "error")),
                                            str(msg.get("message", "")))
        raise AttemptFailed("rejected", "prefill node keeps asking for metadata")

    # ---- NIXL notifications (event loop) -----------------------------------------------------
    def _on_notif(self, agent: str, msg: bytes) -> None:
        try:
            tok = FirstToken.decode(msg)
        except ProtocolError as e:
            metrics.TRANSFER_FAILURES.labels("bad_notif").inc()
            log.warning("transfer_bad_notif", agent=agent, error=str(e))
            return
        cap, fut = self.expect.get(tok.job_id, ("", None))
        if fut is None or fut.done():
            metrics.TRANSFER_FAILURES.labels("notif_unmatched").inc()
            log.warning("transfer_notif_unmatched", agent=agent, job=tok.job_id)
            return
        if not hmac.compare_digest(cap, tok.capability):
            # not the job we issued (a forged or crossed notification): the request keeps
            # waiting for the real one, or fails at its deadline
            metrics.TRANSFER_FAILURES.labels("bad_capability").inc()
            log.warning("transfer_notif_bad_capability", agent=agent, job=tok.job_id)
            return
        fut.set_result(tok)


def _speaks(protocol: str) -> int:
    """The newest node-to-node protocol a member advertises (not advertised: the first
    release, which spoke version 1)."""
    r = protocol_range(protocol) if protocol else (1, 1)
    return r[1] if r is not None else 0
