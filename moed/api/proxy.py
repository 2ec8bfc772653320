"""The router role's /v1/* proxy: pick a live serving node, pass the stream through.

Lifecycle of one proxied request:
  read body → (with a tokenizer: the prompt's leading-block hashes, moed.api.affinity) →
  place it (moed.balance.router.place: fewest waiting requests — the node's report plus what
  this router has outstanding there — less the prefix-affinity bonus, then the fewest
  running; saturated nodes skipped; every node saturated → 429 + Retry-After) → forward →
  on a connect error, a dropped connection or a 429/503 (draining, overloaded) *before any
  byte reached the client*, try another backend (router.max_attempts in all) → stream the
  response through chunk by chunk → if the client goes away, close the backend connection so
  the node aborts the request and frees its KV blocks.
Retrying is safe because nothing has been shown to the client yet and generation has no side
effects. After the first byte is sent a failure can only end the stream: an SSE stream gets an
OpenAI-shaped error event (and no [DONE]), so the client sees it did not finish.

Backends come from the membership view or, with membership off, from router.backends polled
on /ready (moed.api.backends).

Canary (moed.balance.canary): with canary.label set, each request first gets a side — the
canary nodes (that version label) for a canary.share of requests or for those whose
canary.header asks for it, the baseline (every other node) for the rest — and backends are
picked, and retried, on that side. Every attempt's outcome (error or not, TTFT and
inter-token gaps of a stream) is counted per version label of the node that served it.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

from moed.api import affinity, migrate, migrating
from moed.api.backends import BackendSource, StaticBackends
from moed.api.auth import bearer_token
from moed.api.errors import APIError
from moed.api.generate import MIGRATABLE
from moed.api.middleware import request_id_of
from moed.api.priority import routing_priority
from moed.api.salt import effective_salt, tenant_tag
from moed.api.state import STATE
from moed.balance import canary
from moed.balance.candidate import Candidate
from moed.balance.canary import Side
from moed.balance.router import Placement, PlacementLimits, PromptPrefix, place
from moed.config import Config
from moed.kvcache.pool import salt_root
from moed.obs import metrics, trace

log = structlog.get_logger(__name__)

# Not forwarded in either direction (RFC 9110 §7.6.1), plus what aiohttp recomputes.
_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
    "Transfer-Encoding", "Upgrade", "Host", "Content-Length", "Accept-Encoding"))
_RETRY_STATUS = frozenset({429, 503})
_CLIENT_GONE = (ConnectionResetError, ConnectionError)


def _forwardable(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """Headers minus hop-by-hop ones, including any the Connection header names."""
    named = {t.strip().lower() for t in headers.get("Connection", "").split(",") if t.strip()}
    return CIMultiDict((k, v) for k, v in headers.items()
                       if k.lower() not in _HOP and k.lower() not in named)


class Proxy:
    """aiohttp handler for /v1/* on the router role."""

    def __init__(self, source: BackendSource, config: Callable[[], Config],
                 draining: Callable[[], bool] = lambda: False, offload: Any = None,
                 tokenizer: Any = None, signer: Callable[[], Any] = lambda: None) -> None:
        self._source = source
        self.signer = signer             # the InternalAuth a continuation is signed with
        self._config = config
        self._draining = draining
        self._offload = offload          # moed.api.offload.Offload: prompt hashing off the loop
        self.tokenizer = tokenizer       # for prefix affinity; None = placement by load only
        self._outstanding: dict[str, int] = {}
        self._turn = 0
        self._session: aiohttp.ClientSession | None = None
        self._rng = random.Random()
        self.window = canary.Window()             # per-version outcomes (GET /admin/canary)

    async def start(self) -> None:
        rc = self._config().router
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=rc.max_connections, limit_per_host=0),
            auto_decompress=False)
        if isinstance(self._source, StaticBackends):
            await self._source.poll_once(self._session)   # ready with backends known
            self._source.start(self._session)

    async def close(self) -> None:
        if isinstance(self._source, StaticBackends):
            await self._source.close()
        if self._session is not None:
            await self._session.close()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_route("*", "/v1/{tail:.*}", self.handle)

    def migration_limit(self) -> int:
        return self._config().router.migration_limit

    def replay(self) -> str:
        return self._config().router.migration_replay

    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Proxy.start() was not awaited"
        return self._session

    def is_listed(self, name: str) -> bool:
        """The node is still a serving backend (membership has not declared it dead)."""
        return any(c.name == name for c in self._source.backends())

    def mark_failed(self, name: str) -> None:
        self._source.mark_failed(name)

    @staticmethod
    def timing(backend: Candidate, t0: float) -> _StreamTiming:
        """TTFT and inter-chunk gaps of one node's part of a stream (canary figures)."""
        return _StreamTiming(t0, backend.label or "unknown")

    def pick(self, exclude: Iterable[str] = (), side: Side | None = None,
             pinned: bool = False) -> Candidate | None:
        """The next backend by load alone (see place)."""
        return self.place(exclude, side, pinned).node

    def place(self, exclude: Iterable[str] = (), side: Side | None = None,
              pinned: bool = False, prefix: PromptPrefix | None = None,
              prompt_tokens: int = 0, priority: int | None = None) -> Placement:
        """The next backend (moed.balance.router.place), on `side` when a canary is
        configured (see candidates_for: when the side has no untried node left, a retry goes
        to the other side unless pinned)."""
        self._turn += 1
        tried = set(exclude)
        cands = [replace(c, inflight=self._outstanding.get(c.name, 0))
                 for c in self._source.backends() if c.name not in tried]
        if side is not None:
            cands = canary.candidates_for(cands, self._config().canary.label, side, pinned)
        bc = self._config().balance
        limits = PlacementLimits(bc.affinity_weight, bc.router_max_waiting)
        return place(cands, prefix or {}, prompt_tokens, limits, self._turn, priority)

    async def prompt_prefix(self, request: web.Request, body: bytes
                            ) -> tuple[PromptPrefix, int]:
        """(the prompt's leading-block hashes per backend block size, its tokens), or ({}, 0)
        when affinity is off, there is no tokenizer or no backend advertises a digest."""
        if self.tokenizer is None or self._offload is None or \
                self._config().balance.affinity_weight <= 0 or request.method != "POST":
            return {}, 0
        sizes = {c.load.block_size for c in self._source.backends()
                 if c.load.block_size > 0 and c.load.prefix_digest}
        if not sizes:
            return {}, 0

        # salted as the serving node salts it (the same server.prefix_cache_isolation)
        tenant = tenant_tag(self._config().server.prefix_cache_isolation,
                            request.headers.get("Authorization"))

        def work() -> tuple[PromptPrefix, int]:
            ids = affinity.prompt_ids(body, request.path, self.tokenizer)
            root = salt_root(effective_salt(tenant, affinity.client_salt(body)))
            return (affinity.prompt_prefix(ids, sizes, root), len(ids)) if ids else ({}, 0)
        try:
            return await self._offload.run(work)
        except APIError:             # the pool is full: place by load rather than refuse
            return {}, 0

    def choose_side(self, request: web.Request) -> tuple[Side | None, bool]:
        """(side, pinned) for a request; (None, False) when no canary is configured."""
        cc = self._config().canary
        if not cc.label:
            return None, False
        try:
            pin = canary.parse_pin(request.headers.get(cc.header)) if cc.header else None
        except ValueError as e:
            raise APIError(400, f"Header {cc.header}: {e}.", code="bad_canary_header") from None
        return canary.choose_side(cc.share, self._rng.random(), pin), pin is not None

    def _count_side(self, side: Side, pinned: bool, backend: Candidate) -> None:
        used = canary.side_of(backend.label, self._config().canary.label)
        how = "header" if pinned else ("share" if used is side else "fallback")
        metrics.ROUTER_CANARY_REQUESTS.labels(side=used.value, how=how).inc()

    def record(self, backend: Candidate, result: str, ttft: float | None = None,
               itl: float | None = None) -> None:
        """One attempt's outcome, per version label of the node that served it."""
        label = backend.label or "unknown"
        metrics.ROUTER_VERSION_ATTEMPTS.labels(version=label, result=result).inc()
        if result in ("ok", "error"):      # refusals and client errors say nothing of health
            self.window.add(label, canary.Outcome(time.monotonic(), result == "error",
                                                  ttft, itl))

    def canary_report(self) -> dict[str, object]:
        """Canary vs baseline over canary.window_s, per version, and the verdict."""
        return canary.report(self.window, self._config().canary, time.monotonic())

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self._draining():
            raise APIError(503, "This router is draining; retry on another.", code="draining",
                           headers={"Retry-After": "1"})
        assert self._session is not None, "Proxy.start() was not awaited"
        body = await request.read()
        # a single-choice stream, relayed event by event so it may migrate (moed.api.migrate;
        # with router.migration_limit 0 it still ends in one whole error event)
        ledger = req = None
        if request.method == "POST":
            req = migrate.eligible(request.path, body)
            if req is not None:
                ledger = migrate.Ledger.open(request.path, req)
                body = ledger.backend_body()
        headers = _forwardable(request.headers)
        headers.pop(MIGRATABLE, None)         # only this router says so, never its client
        if self.migration_limit() > 0 and (ledger is not None or
                                           migrate.non_streamed(request.path, body)):
            headers[MIGRATABLE] = "1"         # a draining node may hand the request back
        rid = request_id_of(request)
        if rid:
            headers["X-Request-Id"] = rid
        prior = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{prior}, {request.remote}" if prior else (request.remote or "")
        rc = self._config().router
        timeout = aiohttp.ClientTimeout(total=self._config().server.request_timeout_s,
                                        sock_connect=rc.connect_timeout_s)
        side, pinned = self.choose_side(request)
        prefix, prompt_tokens = await self.prompt_prefix(request, body)
        state = request.app.get(STATE)      # the class queue it joins (balance.router)
        priority = routing_priority(req, body, bearer_token(request.headers.get("Authorization")),
                                    state.api_keys if state else (),
                                    state.key_classes if state else (), self._config().priority)
        tried: list[str] = []
        last: tuple[int, bytes, CIMultiDict[str]] | None = None
        saturated = False
        for _ in range(rc.max_attempts):
            placed = self.place(tried, side, pinned, prefix, prompt_tokens, priority)
            backend = placed.node
            if backend is None:
                saturated = placed.reason == "saturated"
                break
            metrics.ROUTER_PLACEMENTS.labels(placed.reason).inc()
            if side is not None and not tried:
                self._count_side(side, pinned, backend)
            tried.append(backend.name)
            self._outstanding[backend.name] = self._outstanding.get(backend.name, 0) + 1
            try:
                # one client span per attempt; its traceparent replaces the client's (off:
                # the client's passes through unchanged)
                with trace.span("router.attempt", kind="client", backend=backend.name,
                                attempt=len(tried), placement=placed.reason) as span:
                    trace.inject(headers)
                    outcome = await self._forward(request, backend, body, headers, timeout,
                                                  ledger)
                    span.set(outcome="streamed" if isinstance(outcome, web.StreamResponse)
                             else "refused" if outcome is not None else "failed")
            finally:
                left = self._outstanding[backend.name] - 1
                if left:
                    self._outstanding[backend.name] = left
                else:
                    del self._outstanding[backend.name]
            if isinstance(outcome, web.StreamResponse):
                metrics.ROUTER_REQUESTS.labels(
                    result="proxied" if len(tried) == 1 else "retried").inc()
                return outcome
            if outcome is not None:   # a 429/503 we may retry elsewhere; kept if none is left
                last = outcome
            metrics.ROUTER_RETRIES.inc()
        if last is not None:
            metrics.ROUTER_REQUESTS.labels(result="backend_refused").inc()
            status, data, hdrs = last
            return web.Response(status=status, body=data, headers=hdrs)
        if saturated and not tried:
            # router admission: every serving node is at balance.router_max_waiting or out of
            # KV for this prompt; queueing more onto them only grows everyone's wait
            metrics.ROUTER_PLACEMENTS.labels("saturated").inc()
            metrics.ROUTER_REQUESTS.labels(result="saturated").inc()
            retry = str(self._config().admission.retry_after_s)
            raise APIError(429, "Every serving node is at capacity; retry after "
                                f"{retry}s.", code="overloaded", headers={"Retry-After": retry})
        metrics.ROUTER_REQUESTS.labels(result="no_backend").inc()
        if pinned and not tried:
            raise APIError(503, f"No serving node on the {side.value} side (canary.label "
                                f"{self._config().canary.label!r}) is available.",
                           code="no_backend", headers={"Retry-After": "1"})
        raise APIError(503, "No serving node is available." if not tried else
                       f"No serving node could take the request (tried {len(tried)}).",
                       code="no_backend", headers={"Retry-After": "1"})

    async def _forward(self, request: web.Request, backend: Candidate, body: bytes,
                       headers: CIMultiDict[str], timeout: aiohttp.ClientTimeout,
                       ledger: migrate.Ledger | None = None
                       ) -> web.StreamResponse | tuple[int, bytes, CIMultiDict[str]] | None:
        """The client's response, or (status, body, headers) for a retryable refusal, or None
        for a failure before any byte reached the client (both mean: try another backend)."""
        assert self._session is not None
        url = backend.url + request.rel_url.raw_path_qs
        t0 = time.monotonic()
        sent = self._session.request(request.method, url, data=body, headers=headers,
                                     timeout=timeout, allow_redirects=False)
        try:
            # a migratable stream answers its headers at once: a node that hangs first (no
            # headers, no first token, no longer listed) is left for another
            got = await migrating.unless_silent(self, backend, sent) if ledger is not None \
                else await sent
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            got, why = None, repr(e)
        else:
            why = "silent while no longer listed"
        if got is None:
            log.warning("router_backend_unreachable", backend=backend.name, error=why)
            self._source.mark_failed(backend.name)
            self.record(backend, "error")
            return None
        resp = got
        try:
            out_headers = _forwardable(resp.headers)
            if resp.status in _RETRY_STATUS:
                data = await resp.read()
                log.info("router_backend_refused", backend=backend.name, status=resp.status)
                self.record(backend, "refused" if resp.status == 429 else "error")
                return resp.status, data, out_headers
            # Hold the client's headers until the backend's first bytes (or its end) arrive,
            # so a node that dies right after answering can still be replaced.
            try:
                read = resp.content.readany()
                first = await migrating.unless_silent(self, backend, read) \
                    if ledger is not None else await read
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                first, why = None, repr(e)
            if first is None:
                log.warning("router_backend_failed_early", backend=backend.name, error=why)
                self._source.mark_failed(backend.name)
                self.record(backend, "error")
                return None
            out = web.StreamResponse(status=resp.status, reason=resp.reason, headers=out_headers)
            out.headers["X-Moed-Backend"] = backend.name
            if backend.label:
                out.headers["X-Moed-Version"] = backend.label
            if ledger is not None and resp.status == 200 and \
                    resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                out.headers.pop("Content-Length", None)
                await out.prepare(request)
                await migrating.relay(self, request, out, resp, first, ledger, backend,
                                      headers, timeout, t0)
                return out
            await out.prepare(request)
            await self._pump(request, out, resp, first, backend, t0)
            return out
        finally:
            if resp.content.at_eof():
                resp.release()   # read to the end: the connection goes back to the pool
            else:
                resp.close()     # cut short: the backend must see the disconnect and abort

    async def _pump(self, request: web.Request, out: web.StreamResponse,
                    resp: aiohttp.ClientResponse, first: bytes, backend: Candidate,
                    t0: float) -> None:
        sse = resp.headers.get("Content-Type", "").startswith("text/event-stream")
        timing = _StreamTiming(t0, backend.label or "unknown") if sse else None
        try:
            chunk = first
            while chunk:
                if timing is not None:
                    timing.chunk(chunk, time.monotonic())
                await out.write(chunk)
                chunk = await resp.content.readany()
        except _CLIENT_GONE:
            # Closing the backend connection (the caller's finally) aborts the request there.
            metrics.ROUTER_REQUESTS.labels(result="client_gone").inc()
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.error("router_backend_failed_mid_stream", backend=backend.name, error=repr(e))
            metrics.ROUTER_REQUESTS.labels(result="failed_mid_stream").inc()
            self.record(backend, "error")
            if sse:
                err = APIError(502, "The serving node failed mid-stream.",   # server_error
                               code="backend_failed").body()
                await out.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            elif request.transport is not None:
                request.transport.abort()   # a cut body must not look complete to the client
            return
        if resp.status >= 500 or (timing is not None and timing.failed):
            self.record(backend, "error")        # a 500, or a stream that ended in an error event
        elif resp.status >= 400:
            self.record(backend, "client_error")
        else:
            self.record(backend, "ok", *(timing.figures() if timing is not None else (None, None)))
        await out.write_eof()


_SSE_ERROR = b'data: {"error"'


class _StreamTiming:
    """TTFT and inter-chunk gaps of one streamed response, and whether an in-band error event
    (OpenAI's shape: `data: {"error": ...}`) came through: a node that fails after sending its
    headers answers 200 and says so in the stream."""

    def __init__(self, t0: float, label: str) -> None:
        self.t0 = t0
        self._ttft = metrics.ROUTER_VERSION_TTFT.labels(label)   # bound once, not per chunk
        self._itl = metrics.ROUTER_VERSION_ITL.labels(label)
        self.first: float | None = None
        self.last = 0.0
        self.gaps = 0
        self.failed = False
        self._tail = b""

    def chunk(self, data: bytes, now: float) -> None:
        seen = self._tail + data
        self.failed = self.failed or _SSE_ERROR in seen
        self._tail = seen[-len(_SSE_ERROR):]          # an event split across two reads
        if b"data: " not in data or data.lstrip().startswith(b"data: [DONE]"):
            return
        if self.first is None:
            self.first = now
            self._ttft.observe(now - self.t0)
        else:
            self.gaps += 1
            self._itl.observe(now - self.last)
        self.last = now

    def figures(self) -> tuple[float | None, float | None]:
        """(TTFT, mean inter-chunk gap) of this stream."""
        if self.first is None:
            return None, None
        return self.first - self.t0, ((self.last - self.first) / self.gaps if self.gaps else None)
