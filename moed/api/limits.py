"""HTTP connection limits: bounded client connections, deadlines, and JSON for parser errors.

aiohttp's defaults hold a connection for an hour (keep-alive 3630 s) and set no deadline for the
request line, headers or body, so idle or slow clients (slowloris) pin descriptors until the
fd limit; there uvloop (libuv) accepts and closes every new connection without a callback or a
log line, /health included. Here:

- ConnectionGuard: at most server.max_connections client connections. The last `reserve` slots
  are probe slots: a connection given one may only use /health, /ready and /metrics, and is
  closed after one response, so a node whose regular slots all serve requests still answers
  its probes. When every slot is taken, the connection that has waited longest for a request
  (keep-alive idle, or headers still incomplete) is closed to make room (shed reason
  "idle_evicted"); only when none waits is the new one closed at once ("limit"). Both are
  counted (moed_http_connections_shed_total) and logged at most once a second.
- GuardedRequestHandler (aiohttp's per-connection protocol): the first request's line and
  headers must be complete within server.header_timeout_s of the accept; after a response the
  next one must be complete within server.keepalive_timeout_s (aiohttp's keep-alive timer);
  max_header_bytes bounds the request line and each header field, max_headers their count;
  parser errors are answered with OpenAI-shaped JSON that never echoes the client's bytes.
- Bodies: the `read_body` middleware reads them within the live server.body_timeout_s; on
  expiry the 408 is sent and the connection closed (`body_timed_out`). A body no handler reads
  (404, 401, ...) is drained for at most body_timeout_s after the response (aiohttp's
  lingering_time), then the connection is closed.
- watch_fds: a once-a-second probe for a free descriptor, the only way to see EMFILE under
  uvloop (see above).
"""
from __future__ import annotations

import asyncio
import collections
import contextvars
import errno
import math
import os
import resource
from typing import Any, Callable

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from moed.api.errors import APIError, unparsed_request_error
from moed.config import ServerConfig
from moed.obs import metrics

log = structlog.get_logger(__name__)

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})
# Descriptors a node needs besides client connections: listener, loop, logs, peers, model files.
FD_HEADROOM = 64
# Accept queue (the kernel caps it at net.core.somaxconn): aiohttp's 128 overflows under a burst
# of connects, and each overflow costs that client a 1 s SYN retransmit.
BACKLOG = 2048


def probe_reserve(max_connections: int) -> int:
    """Slots (out of max_connections) kept for probes: 1/64th, at least 4, at most half."""
    return min(max_connections // 2, max(4, max_connections // 64))


class _Tally:
    """Counts events by reason; logs them as one line at most every `every` seconds (a flood of
    shed connections is a line a second, not a line per connection)."""

    def __init__(self, event: str, level: str, every: float,
                 context: Callable[[], dict[str, Any]]) -> None:
        self.event, self.level, self.every, self.context = event, level, every, context
        self.counts: collections.Counter[str] = collections.Counter()
        self._last = -math.inf
        self._pending: asyncio.TimerHandle | None = None

    def note(self, reason: str) -> None:
        self.counts[reason] += 1
        if self._pending is None:
            loop = asyncio.get_running_loop()
            # a fresh context: the line sums many connections, not the request that came first
            self._pending = loop.call_later(max(0.0, self._last + self.every - loop.time()),
                                            self._flush, context=contextvars.Context())

    def _flush(self) -> None:
        self._pending = None
        self._last = asyncio.get_running_loop().time()
        getattr(log, self.level)(self.event, counts=dict(self.counts), **self.context())
        self.counts.clear()


class ConnectionGuard:
    """The client connection slots of one listener (see the module docstring)."""

    def __init__(self, max_connections: int) -> None:
        self.limit = max_connections
        self.reserve = probe_reserve(max_connections)
        self._open: dict[GuardedRequestHandler, None] = {}
        self._idle: dict[GuardedRequestHandler, None] = {}   # waiting for a request, oldest first
        self._probes = 0
        self._shed = _Tally("http_connections_shed", "warning", 1.0, self._log_context)
        self._timeouts = _Tally("http_connections_timed_out", "info", 1.0, self._log_context)

    @property
    def open(self) -> int:
        return len(self._open)

    def admit(self, conn: GuardedRequestHandler) -> bool:
        """Give `conn` a slot: a free one, else the slot of the connection idle the longest
        (closed now). False when every connection is serving a request."""
        if len(self._open) >= self.limit:
            victim = next(iter(self._idle), None)
            if victim is None:
                self._count_shed("limit")
                return False
            self.release(victim)
            victim.force_close()
            self._count_shed("idle_evicted")
        # A free regular slot is taken first, so `conn` inherits the class of an evicted one.
        conn.probe_only = len(self._open) - self._probes >= self.limit - self.reserve
        self._probes += conn.probe_only
        self._open[conn] = None
        self._idle[conn] = None
        metrics.HTTP_CONNECTIONS.set(len(self._open))
        return True

    def busy(self, conn: GuardedRequestHandler) -> None:
        self._idle.pop(conn, None)

    def idle(self, conn: GuardedRequestHandler) -> None:
        if conn in self._open:
            self._idle.pop(conn, None)
            self._idle[conn] = None           # to the end: idle the shortest

    def release(self, conn: GuardedRequestHandler) -> None:
        if conn in self._open:
            del self._open[conn]
            self._idle.pop(conn, None)
            self._probes -= conn.probe_only
            metrics.HTTP_CONNECTIONS.set(len(self._open))

    def timed_out(self, phase: str) -> None:
        metrics.HTTP_CONNECTIONS_TIMED_OUT.labels(phase).inc()
        self._timeouts.note(phase)

    def _log_context(self) -> dict[str, Any]:
        return {"open": len(self._open), "max_connections": self.limit}

    def _count_shed(self, reason: str) -> None:
        metrics.HTTP_CONNECTIONS_SHED.labels(reason).inc()
        self._shed.note(reason)


class GuardedRequestHandler(RequestHandler):
    """aiohttp's connection protocol with a guard slot, the header deadline, the idle/busy marks
    eviction needs, and JSON where aiohttp answers in text.

    Reads one aiohttp (3.14) internal: `_request_count`, the messages parsed on this connection
    (parse errors included); a request is in progress while it exceeds `_answered`."""

    def __init__(self, manager: web.Server, guard: ConnectionGuard, header_timeout: float,
                 **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.guard = guard
        self.header_timeout = header_timeout
        self.probe_only = False
        self._answered = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._close_after_response = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self.guard.admit(self):
            transport.close()
            return
        super().connection_made(transport)
        # Until the first request the header deadline applies, not aiohttp's keep-alive timer
        # (armed at accept); aiohttp arms that again after each response.
        self.keep_alive(True)
        self._header_timer = asyncio.get_running_loop().call_later(self.header_timeout,
                                                                   self._header_timed_out)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.guard.release(self)
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._request_count > self._answered:
            self.guard.busy(self)
            self._cancel_header_timer()

    async def finish_response(self, request: BaseRequest, resp: StreamResponse,
                              start_time: float | None) -> tuple[StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._answered += 1
            if self._close_after_response:
                self.force_close()
            elif self._answered >= self._request_count:
                self.guard.idle(self)

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> StreamResponse:
        err = unparsed_request_error(status, exc)
        if err.status >= 500:
            log.error("unhandled_error", peer=request.remote, exc_info=exc)
        else:   # a parse error: the middleware never saw it, so count it here
            log.info("http_bad_request", status=err.status, code=err.code, peer=request.remote)
            metrics.HTTP_REQUESTS.labels("unparsed", str(err.status)).inc()
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error response")
        resp = err.response()
        resp.force_close()
        return resp

    def close_after_response(self) -> None:
        self._close_after_response = True

    def _header_timed_out(self) -> None:
        self._header_timer = None
        self.guard.timed_out("header")
        self.force_close()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None


class GuardedSite(web.BaseSite):
    """A TCP site whose connections are GuardedRequestHandlers (aiohttp's TCPSite hands every
    connection to the runner's plain Server). `live` returns the running config's server section
    (body_timeout_s may change on reload; a new connection drains unread bodies that long)."""

    def __init__(self, runner: web.BaseRunner, cfg: ServerConfig,
                 live: Callable[[], ServerConfig]) -> None:
        super().__init__(runner, backlog=BACKLOG)
        self.cfg = cfg
        self.live = live
        self.guard = ConnectionGuard(cfg.max_connections)

    @property
    def name(self) -> str:
        return f"http://{self.cfg.host}:{self.cfg.port}"

    async def start(self) -> None:
        await super().start()
        check_fd_budget(self.cfg.max_connections)
        self._server = await asyncio.get_running_loop().create_server(
            self._connection, self.cfg.host, self.cfg.port, backlog=self._backlog)

    def _connection(self) -> GuardedRequestHandler:
        server = self._runner.server
        assert server is not None, "runner.setup() comes first"
        c = self.cfg
        return GuardedRequestHandler(
            server, self.guard, c.header_timeout_s, loop=asyncio.get_running_loop(),
            keepalive_timeout=c.keepalive_timeout_s, max_line_size=c.max_header_bytes,
            max_field_size=c.max_header_bytes, max_headers=c.max_headers,
            lingering_time=self.live().body_timeout_s, access_log=None)


# ---- used by the middleware ----------------------------------------------------------------

def probe_only(request: web.Request) -> bool:
    """The request came on a probe slot (see ConnectionGuard)."""
    proto = request.protocol
    return isinstance(proto, GuardedRequestHandler) and proto.probe_only


def connection_limit_error() -> APIError:
    return APIError(503, "The server is at its connection limit (server.max_connections): this "
                         "connection may only use /health, /ready and /metrics. Retry shortly.",
                    code="connection_limit", headers={"Retry-After": "1"})


def body_timed_out(request: web.Request) -> None:
    """Count a body past its deadline; close the connection once the 408 is out rather than
    drain a body that may never end."""
    proto = request.protocol
    if isinstance(proto, GuardedRequestHandler):
        proto.guard.timed_out("body")
        proto.close_after_response()
    else:
        metrics.HTTP_CONNECTIONS_TIMED_OUT.labels("body").inc()


# ---- file descriptors ----------------------------------------------------------------------

def check_fd_budget(max_connections: int) -> None:
    """Warn at start when the fd limit cannot hold max_connections plus the node's own."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = max_connections + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("fd_limit_low", nofile_limit=soft, max_connections=max_connections,
                    needed=need, hint="raise LimitNOFILE or lower server.max_connections: at "
                    "the fd limit new connections (probes included) are closed unseen")


async def watch_fds(guard: ConnectionGuard, interval: float = 1.0) -> None:
    """Probe for a free descriptor every `interval` s; count and log (every 10 s at most) the
    probes that find none."""
    tally = _Tally("fd_limit_reached", "error", 10.0, lambda: {
        "open_connections": guard.open,
        "nofile_limit": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "effect": "new connections are accepted and closed by the event loop, unseen"})
    while True:
        await asyncio.sleep(interval)
        try:
            os.close(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        except OSError as e:
            if e.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            metrics.HTTP_FD_EXHAUSTED.inc()
            tally.note(errno.errorcode[e.errno])
