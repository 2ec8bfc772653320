"""Decode role: own the request end to end; get its prompt's KV from a prefill node.

A request's lifecycle on a decode node (queues as in the engine):

    prealloc   add_request(remote_kv=True): the engine allocates blocks for the whole prompt,
               reusing prefix-cache hits (WAITING → WAITING_REMOTE_KV)
    transfer   pick a prefill peer (pure policy: fewest jobs, per-peer half-open breaker), POST
               the job (token ids, destination blocks past the cached prefix, our transfer
               endpoint, a deadline); the peer WRITEs blocks chunk by chunk and notifies with
               the first token
    waiting    FirstToken notification → engine.complete_remote_prefill (→ RUNNING)
    running    continuous-batching decode; tokens stream to the client as usual
    (prompts of at most transfer.local_prefill_max_tokens tokens are prefilled here instead)

Failures: the peer's RPC stream closing, an error line, a failed write or the deadline count
against that peer and the job is retried on another one (transfer.max_prefill_retries) into
the same blocks; past that the request fails with a clear error and its blocks are freed. A
client that goes away cancels the job (connection closed + DELETE) and frees the blocks.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from typing import Any, Sequence
from urllib.parse import quote

import aiohttp
import structlog
from aiohttp import web

from moed.config import Config
from moed.obs import metrics
from moed.roles import policy
from moed.roles.common import new_incarnation, start_worker
from moed.roles.protocol import FirstToken, PrefillJobSpec, ProtocolError, sampling_fields
from moed.types import ErrorKind, FinishReason, SamplingParams, TokenEvent

log = structlog.get_logger(__name__)

NOTIF_GRACE_S = 2.0        # "done" on the RPC but no notification yet: how long to wait for it


class AttemptFailed(Exception):
    def __init__(self, kind: str, message: str, retry: bool = True) -> None:
        super().__init__(message)
        self.kind, self.retry = kind, retry


class DecodeStream:
    """The engine's RequestStream, plus a way to end it with an error event of our own."""

    def __init__(self, inner: Any, on_close: Any) -> None:
        self.request_id = inner.request_id
        self._inner = inner
        self._on_close = on_close
        self._failure: asyncio.Future[TokenEvent] = asyncio.get_running_loop().create_future()
        self._next: asyncio.Future | None = None
        self._done = False

    def fail(self, ev: TokenEvent) -> None:
        if not self._failure.done():
            self._failure.set_result(ev)

    def __aiter__(self) -> "DecodeStream":
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        if self._next is None:
            self._next = asyncio.ensure_future(self._inner.__anext__())
        await asyncio.wait({self._next, self._failure}, return_when=asyncio.FIRST_COMPLETED)
        if self._failure.done():
            self._next.cancel()
            ev = self._failure.result()
        else:
            ev = self._next.result()
            self._next = None
        self._done = ev.finished
        return ev

    async def aclose(self) -> None:
        if not self._done:
            self._on_close(self.request_id)
        self._done = True


class DisaggEngine:
    """What the HTTP layer sees on a decode node: the engine, with prompts prefilled remotely.
    Everything but add_request/abort is the engine's own."""

    def __init__(self, engine: Any, role: "DecodeComponent") -> None:
        self._engine = engine
        self._role = role

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams, **_: Any) -> Any:
        if len(prompt_token_ids) <= self._role.cfg.transfer.local_prefill_max_tokens:
            # short prompts: a remote round trip (and the prefill node's queue) costs more
            # TTFT than the few tokens cost this node's decode steps
            return self._engine.add_request(request_id, prompt_token_ids, params)
        inner = self._engine.add_request(request_id, prompt_token_ids, params, remote_kv=True)
        stream = DecodeStream(inner, self.abort)
        self._role.launch(request_id, list(prompt_token_ids), params, inner, stream)
        return stream

    def abort(self, request_id: str) -> None:
        self._role.cancel(request_id)
        self._engine.abort(request_id)


class DecodeComponent:
    """Drives remote prefill for every request of a decode node (a moed.app Component)."""

    name = "decode"

    def __init__(self, cfg: Config, node: str) -> None:
        self.cfg = cfg
        self.node = node
        self.incarnation = new_incarnation()
        self.engine: Any = None
        self.worker: Any = None
        self.session: aiohttp.ClientSession | None = None
        self.health: dict[str, policy.PeerHealth] = {u: policy.PeerHealth()
                                                     for u in cfg.transfer.prefill_peers}
        self.inflight: dict[str, int] = {}
        self.md_sent: set[str] = set()             # peers that hold our current metadata
        self.jobs: dict[str, asyncio.Task] = {}    # request id → its remote-prefill task
        self.current: dict[str, tuple[str, str]] = {}   # request id → (peer, job id) in flight
        self.expect: dict[str, asyncio.Future[FirstToken]] = {}
        self._app: Any = None
        self._membership: Any = None               # moed.cluster's component when enabled

    # ---- Component ---------------------------------------------------------------------------
    def add_routes(self, web_app: web.Application) -> None:
        web_app.router.add_get("/internal/transfer", self.handle_info)

    async def start(self, app: Any) -> None:
        self._membership = next((c for c in app.components
                                 if getattr(c, "name", "") == "cluster"), None)
        if not self.cfg.transfer.prefill_peers and self._membership is None:
            log.warning("decode_without_prefill_peers",
                        hint="set transfer.prefill_peers (or enable membership)")
        self._app = app
        self.engine = app.state.engine
        self.worker = await start_worker(self.cfg.transfer.backend, self.node, self.engine)
        self.worker.on_notif = self._on_notif
        keys = app.state.api_keys       # internal routes take the cluster's API key
        headers = {"Authorization": f"Bearer {keys[0].decode()}"} if keys else None
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             headers=headers)
        app.state.engine = DisaggEngine(self.engine, self)

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

    def prepare_reload(self, old: Config, new: Config) -> Any:
        """Reload hook (moed.ops): transfer.* live fields apply to the next job."""
        def commit() -> None:
            self.cfg = new
            for u in new.transfer.prefill_peers:
                self.health.setdefault(u, policy.PeerHealth())
        return commit

    async def handle_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "node": self.node, "incarnation": self.incarnation,
            "agent": self.worker.name if self.worker else None,
            "peers": {u: {"state": h.state.value, "failures": h.total_failures,
                          "inflight": self.inflight.get(u, 0)} for u, h in self.health.items()},
            "jobs": len(self.jobs)})

    # ---- prefill peers ---------------------------------------------------------------------
    def candidates(self) -> dict[str, policy.PeerHealth]:
        """Prefill peers to choose from now: the static list plus, with membership, every
        alive prefill member serving the same model (health kept across views)."""
        urls = list(self.cfg.transfer.prefill_peers)
        view = self._membership.view() if self._membership is not None else None
        if view is not None:
            model = getattr(self._app.state, "model_name", "")
            urls += [m.meta.http for m in view.alive("prefill")
                     if m.meta.http and (not model or m.meta.model in ("", model))]
        for u in urls:
            self.health.setdefault(u, policy.PeerHealth())
        return {u: self.health[u] for u in dict.fromkeys(urls)}

    # ---- per request -------------------------------------------------------------------------
    def launch(self, rid: str, prompt: list[int], params: SamplingParams, inner: Any,
               stream: DecodeStream) -> None:
        task = asyncio.create_task(self._remote_prefill(rid, prompt, params, inner, stream),
                                   name=f"remote-prefill-{rid}")
        self.jobs[rid] = task
        metrics.TRANSFER_JOBS_INFLIGHT.labels("decode").set(len(self.jobs))
        task.add_done_callback(lambda _t: self._job_done(rid))

    def _job_done(self, rid: str) -> None:
        self.jobs.pop(rid, None)
        metrics.TRANSFER_JOBS_INFLIGHT.labels("decode").set(len(self.jobs))

    def cancel(self, rid: str) -> None:
        task = self.jobs.get(rid)
        if task is not None and not task.done():
            task.cancel()
        cur = self.current.pop(rid, None)
        if cur is not None and self.session is not None:   # belt and braces next to the close
            peer, job_id = cur
            asyncio.ensure_future(self._delete(peer, job_id))

    async def _delete(self, peer: str, job_id: str) -> None:
        assert self.session is not None
        with contextlib.suppress(Exception):
            async with self.session.delete(f"{peer}/internal/prefill/{quote(job_id, safe='')}",
                                           timeout=aiohttp.ClientTimeout(total=1.0)):
                pass

    async def _remote_prefill(self, rid: str, prompt: list[int], params: SamplingParams,
                              inner: Any, stream: DecodeStream) -> None:
        loop = asyncio.get_running_loop()
        t = self.cfg.transfer
        deadline = loop.time() + min(t.prefill_timeout_s, self.cfg.server.request_timeout_s)
        try:
            blocks, cached = await asyncio.wait_for(asyncio.shield(inner.kv_blocks),
                                                   deadline - loop.time())
        except asyncio.CancelledError:
            if inner.kv_blocks.cancelled():
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
            peers = self.candidates()
            peer = policy.pick_peer(peers, self.inflight, tried, time.monotonic(),
                                    t.peer_error_cooldown_s)
            now = loop.time()
            if peer is None or now >= deadline:
                break
            # a stalled peer may use an equal share of what is left (the last try: all of it)
            left = min(attempts - attempt + 1, sum(1 for p in peers if p not in tried))
            until = now + (deadline - now) / max(left, 1)
            tried.add(peer)
            self.health[peer] = policy.on_pick(self.health[peer])
            job_id = f"{self.node}.{self.incarnation}.{rid}.{attempt}"   # unique cluster-wide
            spec = PrefillJobSpec(job_id, tuple(prompt), skip, tuple(dst), self.node,
                                  self.incarnation, max(until - now, 0.001),
                                  sampling_fields(params))
            try:
                tok = await self._attempt(rid, peer, spec, until)
            except AttemptFailed as e:
                self.health[peer] = policy.on_failure(self.health[peer], time.monotonic())
                metrics.TRANSFER_FAILURES.labels(e.kind).inc()
                errors.append(f"{peer}: {e.kind}: {e}")
                log.warning("remote_prefill_attempt_failed", request_id=rid, peer=peer,
                            attempt=attempt, kind=e.kind, error=str(e))
                if not e.retry:
                    break
                metrics.TRANSFER_JOBS.labels("decode", "retried").inc()
                continue
            self.health[peer] = policy.on_success(self.health[peer])
            metrics.TRANSFER_JOBS.labels("decode", "done").inc()
            self.engine.complete_remote_prefill(rid, tok.token_id, tok.logprob, tok.top_logprobs)
            return
        why = "; ".join(errors) if errors else (
            "no prefill node available" + ("" if self.candidates() else
                                           " (no prefill peers configured or alive)"))
        self._fail(rid, stream, prompt, cached, "prefill_failed", f"remote prefill failed: {why}")

    def _fail(self, rid: str, stream: DecodeStream, prompt: list[int], cached: int, kind: str,
              message: str) -> None:
        metrics.TRANSFER_JOBS.labels("decode", "failed").inc()
        log.error("remote_prefill_failed", request_id=rid, kind=kind, error=message)
        self.engine.abort(rid)          # frees the destination blocks
        stream.fail(TokenEvent(rid, (), "", (), FinishReason.ERROR, len(prompt), cached, message,
                               error_kind=ErrorKind.UNAVAILABLE))   # the API answers 503

    async def _attempt(self, rid: str, peer: str, spec: PrefillJobSpec,
                       deadline: float) -> FirstToken:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[FirstToken] = loop.create_future()
        self.expect[spec.job_id] = fut
        self.current[rid] = (peer, spec.job_id)
        self.inflight[peer] = self.inflight.get(peer, 0) + 1
        try:
            with self.worker.expecting():
                async with asyncio.timeout_at(deadline):
                    await self._rpc(peer, spec, fut)
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

    async def _rpc(self, peer: str, spec: PrefillJobSpec, fut: asyncio.Future) -> None:
        """POST the job and follow its line stream to "done"; raises AttemptFailed otherwise."""
        assert self.session is not None
        for _ in range(2):
            body = spec
            if peer not in self.md_sent:
                body = dataclasses.replace(spec, metadata=await self.worker.local_metadata())
            async with self.session.post(f"{peer}/internal/prefill", json=body.to_json()) as r:
                if r.status == 409 and (await r.json()).get("error") == "need_metadata":
                    self.md_sent.discard(peer)
                    continue
                if r.status != 200:
                    text = await r.text()
                    # 400 for the job itself (bad prompt) fails everywhere; the rest may not
                    retry = r.status != 400 or '"bad_metadata"' in text
                    raise AttemptFailed("rejected", f"HTTP {r.status}: {text[:300]}", retry)
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
        fut = self.expect.get(tok.job_id)
        if fut is None or fut.done():
            metrics.TRANSFER_FAILURES.labels("notif_unmatched").inc()
            log.warning("transfer_notif_unmatched", agent=agent, job=tok.job_id)
            return
        fut.set_result(tok)
