"""The router role's /v1/* proxy: pick a live serving node, pass the stream through.

Lifecycle of one proxied request:
  read body → pick the backend with the fewest waiting requests (its reported queue plus what
  this router has outstanding there; the report is up to a second old), then the fewest
  running ones (a smaller batch decodes faster) → forward → on a connect
  error, a dropped connection or a 429/503 (draining, overloaded) *before any byte reached the
  client*, try another backend (router.max_attempts in all) → stream the response through
  chunk by chunk → if the client goes away, close the backend connection so the node aborts
  the request and frees its KV blocks.
Retrying is safe because nothing has been shown to the client yet and generation has no side
effects. After the first byte is sent a failure can only end the stream: an SSE stream gets an
OpenAI-shaped error event (and no [DONE]), so the client sees it did not finish.

Backends come from the membership view (alive members whose role is in router.backend_roles,
with their gossiped load) or, with membership off, from router.backends polled on /ready.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import Callable, Iterable, Mapping, Protocol

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

from moed.api.errors import APIError
from moed.api.middleware import request_id_of
from moed.balance.candidate import Candidate
from moed.balance.router import pick_backend
from moed.cluster.state import LoadVector
from moed.config import Config, RouterConfig
from moed.obs import metrics

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


class BackendSource(Protocol):
    def backends(self) -> list[Candidate]: ...
    def mark_failed(self, name: str) -> None: ...


class MembershipBackends:
    """Alive members of the cluster view with a serving role and an HTTP address."""

    def __init__(self, view: Callable[[], object | None], config: Callable[[], Config]) -> None:
        self._view = view
        self._config = config
        self._failed: dict[str, float] = {}   # name → until (a refused connect, before gossip knows)

    def backends(self) -> list[Candidate]:
        view = self._view()
        if view is None:
            return []
        roles = self._config().router.backend_roles
        now = time.monotonic()
        out = []
        for m in view.alive():  # type: ignore[attr-defined]
            if m.meta.role in roles and m.meta.http and self._failed.get(m.name, 0.0) < now:
                out.append(Candidate(m.name, m.meta.http.rstrip("/"), m.meta.role,
                                     m.meta.layout, m.meta.transfer, m.load))
        return out

    def mark_failed(self, name: str) -> None:
        self._failed[name] = time.monotonic() + 2.0


class StaticBackends:
    """router.backends, each up or down by its last /ready answer (or a failed connect)."""

    def __init__(self, config: Callable[[], Config]) -> None:
        self._config = config
        self._up: dict[str, Candidate] = {}
        self._task: asyncio.Task[None] | None = None

    def backends(self) -> list[Candidate]:
        urls = {u.rstrip("/") for u in self._config().router.backends}
        return [b for u, b in self._up.items() if u in urls]

    def mark_failed(self, name: str) -> None:
        self._up.pop(name, None)   # until the next successful /ready

    def start(self, session: aiohttp.ClientSession) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll(session), name="router-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        rc = self._config().router
        urls = [u.rstrip("/") for u in rc.backends]
        results = await asyncio.gather(*(self._ready(session, u, rc) for u in urls))
        for url, load in zip(urls, results):
            if load is None:
                self._up.pop(url, None)
            else:
                waiting, running = load
                self._up[url] = Candidate(url, url, load=LoadVector(waiting=waiting,
                                                                    running=running))

    async def _ready(self, session: aiohttp.ClientSession, url: str, rc: RouterConfig
                     ) -> tuple[int, int] | None:
        """(waiting, running) from the node's /ready, or None when it cannot take work."""
        try:
            async with session.get(url + "/ready", timeout=aiohttp.ClientTimeout(
                    total=max(rc.health_interval_s, rc.connect_timeout_s))) as r:
                if r.status != 200:
                    return None
                body = await r.json(content_type=None)
                if not isinstance(body, dict):
                    return 0, 0
                return int(body.get("waiting", 0)), int(body.get("running", 0))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError):
            return None

    async def _poll(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.poll_once(session)
            metrics.ROUTER_BACKENDS.set(len(self.backends()))
            await asyncio.sleep(self._config().router.health_interval_s)


class Proxy:
    """aiohttp handler for /v1/* on the router role."""

    def __init__(self, source: BackendSource, config: Callable[[], Config],
                 draining: Callable[[], bool] = lambda: False) -> None:
        self._source = source
        self._config = config
        self._draining = draining
        self._outstanding: dict[str, int] = {}
        self._turn = 0
        self._session: aiohttp.ClientSession | None = None

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

    def pick(self, exclude: Iterable[str] = ()) -> Candidate | None:
        self._turn += 1
        cands = [replace(c, inflight=self._outstanding.get(c.name, 0))
                 for c in self._source.backends()]
        return pick_backend(cands, set(exclude), self._turn)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self._draining():
            raise APIError(503, "This router is draining; retry on another.", code="draining",
                           headers={"Retry-After": "1"})
        assert self._session is not None, "Proxy.start() was not awaited"
        body = await request.read()
        headers = _forwardable(request.headers)
        rid = request_id_of(request)
        if rid:
            headers["X-Request-Id"] = rid
        prior = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{prior}, {request.remote}" if prior else (request.remote or "")
        rc = self._config().router
        timeout = aiohttp.ClientTimeout(total=self._config().server.request_timeout_s,
                                        sock_connect=rc.connect_timeout_s)
        tried: list[str] = []
        last: tuple[int, bytes, CIMultiDict[str]] | None = None
        for _ in range(rc.max_attempts):
            backend = self.pick(exclude=tried)
            if backend is None:
                break
            tried.append(backend.name)
            self._outstanding[backend.name] = self._outstanding.get(backend.name, 0) + 1
            try:
                outcome = await self._forward(request, backend, body, headers, timeout)
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
        metrics.ROUTER_REQUESTS.labels(result="no_backend").inc()
        raise APIError(503, "No serving node is available." if not tried else
                       f"No serving node could take the request (tried {len(tried)}).",
                       code="no_backend", headers={"Retry-After": "1"})

    async def _forward(self, request: web.Request, backend: Candidate, body: bytes,
                       headers: CIMultiDict[str], timeout: aiohttp.ClientTimeout
                       ) -> web.StreamResponse | tuple[int, bytes, CIMultiDict[str]] | None:
        """The client's response, or (status, body, headers) for a retryable refusal, or None
        for a failure before any byte reached the client (both mean: try another backend)."""
        assert self._session is not None
        url = backend.url + request.rel_url.raw_path_qs
        try:
            resp = await self._session.request(request.method, url, data=body, headers=headers,
                                               timeout=timeout, allow_redirects=False)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.warning("router_backend_unreachable", backend=backend.name, error=repr(e))
            self._source.mark_failed(backend.name)
            return None
        try:
            out_headers = _forwardable(resp.headers)
            if resp.status in _RETRY_STATUS:
                data = await resp.read()
                log.info("router_backend_refused", backend=backend.name, status=resp.status)
                return resp.status, data, out_headers
            # Hold the client's headers until the backend's first bytes (or its end) arrive,
            # so a node that dies right after answering can still be replaced.
            try:
                first = await resp.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                log.warning("router_backend_failed_early", backend=backend.name, error=repr(e))
                self._source.mark_failed(backend.name)
                return None
            out = web.StreamResponse(status=resp.status, reason=resp.reason, headers=out_headers)
            out.headers["X-Moed-Backend"] = backend.name
            await out.prepare(request)
            await self._pump(request, out, resp, first, backend)
            return out
        finally:
            if resp.content.at_eof():
                resp.release()   # read to the end: the connection goes back to the pool
            else:
                resp.close()     # cut short: the backend must see the disconnect and abort

    async def _pump(self, request: web.Request, out: web.StreamResponse,
                    resp: aiohttp.ClientResponse, first: bytes, backend: Candidate) -> None:
        sse = resp.headers.get("Content-Type", "").startswith("text/event-stream")
        try:
            chunk = first
            while chunk:
                await out.write(chunk)
                chunk = await resp.content.readany()
        except _CLIENT_GONE:
            # Closing the backend connection (the caller's finally) aborts the request there.
            metrics.ROUTER_REQUESTS.labels(result="client_gone").inc()
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            log.error("router_backend_failed_mid_stream", backend=backend.name, error=repr(e))
            metrics.ROUTER_REQUESTS.labels(result="failed_mid_stream").inc()
            if sse:
                err = APIError(502, f"The serving node {backend.name} failed mid-stream.",
                               code="backend_failed").body()
                await out.write(b"data: " + json.dumps(err).encode() + b"\n\n")
            elif request.transport is not None:
                request.transport.abort()   # a cut body must not look complete to the client
            return
        await out.write_eof()
