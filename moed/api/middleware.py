"""aiohttp middlewares: request id + access log + error shaping (outermost), auth, body read.

- request_id: X-Request-Id if sane, else generated; bound in structlog contextvars for the life
  of the request and echoed in the response header. With tracing on (moed.obs.trace) the
  request is this node's server span, a child of the caller's W3C traceparent; its trace_id
  and span_id are bound beside request_id; status, finish reason and error kind go on it.
- Body size: server.max_body_bytes from the *live* config (aiohttp's client_max_size is fixed
  when the app is built, so the request is re-bound to the current limit): a declared
  Content-Length over it is refused at once, a chunked body when reading passes it; both 413.
- Every error leaves as OpenAI-shaped JSON; an unexpected exception is logged with its
  traceback and answered 500 with only the request id.
- Auth guards /v1/*; /metrics as server.metrics_access says (`check_metrics`); /health and
  /ready stay open; /cluster and /internal/transfer take the admin token or a call signed
  with the cluster secret (moed.api.internal; /internal/prefill checks its signature over
  the body it reads).
- A connection on a probe slot (moed.api.limits: the node is at server.max_connections) gets
  /health, /ready and /metrics only, and is closed after its response.
- read_body (innermost, so only authenticated requests are buffered) reads the body within the
  live server.body_timeout_s: past it 408 and the connection closes; a malformed body
  (chunked framing, compression) is a 400, not a handler's 500.
"""
from __future__ import annotations

import asyncio
import re
import time
import uuid
from typing import Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from moed.api import limits
from moed.api.admin import ADMIN
from moed.api.auth import bearer_token, check_bearer, key_matches
from moed.api.errors import APIError
from moed.api.internal import require_operator
from moed.api.state import FINISH, PRIORITY, REQUEST_ID, STATE, USAGE, ServerState
from moed.obs import metrics, trace

log = structlog.get_logger("moed.access")
_RID_OK = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Routes that never need a key (orchestrator probes, the version).
OPEN_PATHS = frozenset({"/health", "/ready", "/version"})
# Tenant routes outside /v1 (vLLM's utility endpoints): the API key, like /v1/*.
TENANT_PATHS = frozenset({"/tokenize", "/detokenize"})
# Routes that disclose the cluster: the admin token or a call signed with the cluster secret.
# (/internal/prefill checks its signature in the handler, over the body it reads.)
OPERATOR_PATHS = frozenset({"/cluster", "/internal/transfer"})


def request_id_of(request: web.Request) -> str:
    """The id bound by `request_context` (from X-Request-Id or generated)."""
    return request.get(REQUEST_ID, "")


def _route_label(request: web.Request) -> str:
    info = request.match_info
    route = getattr(info, "route", None)
    res = getattr(route, "resource", None) if route is not None else None
    return res.canonical if res is not None else "unmatched"


def _body_limit(request: web.Request) -> web.Request:
    """The request bound to the live body limit (413 now if it declares a larger body)."""
    state = request.app.get(STATE)
    if state is None:
        return request
    limit = state.config.server.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    if request.client_max_size != limit:   # changed by a reload since the app was built
        request = request.clone(client_max_size=limit)
    return request


def _too_large(limit: int) -> APIError:
    return APIError(413, f"Request body too large (limit {limit} bytes, "
                         f"server.max_body_bytes).", code="body_too_large")


def _from_http_exception(e: web.HTTPException, request: web.Request) -> APIError:
    if e.status == 413:
        return _too_large(request.client_max_size)
    if e.status == 404:
        return APIError(404, "Not found.", code="not_found")
    if e.status == 405:
        allow = e.headers.get("Allow")
        return APIError(405, "Method not allowed.", code="method_not_allowed",
                        headers={"Allow": allow} if allow else None)
    return APIError(e.status, e.reason or "HTTP error",   # a 5xx: server_error (errors.py)
                    err_type=None if e.status >= 500 else "invalid_request_error")


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    rid = request.headers.get("X-Request-Id", "")
    if not _RID_OK.match(rid):
        rid = uuid.uuid4().hex
    request[REQUEST_ID] = rid
    start = time.perf_counter()
    status = 500
    err_kind = ""
    # probes and scrapes (the vLLM-named gauges' path too: a router scrapes it often): no log,
    # no span; they may use a probe slot
    state = request.app.get(STATE)
    vllm_path = state.config.server.vllm_metrics_path if state is not None else ""
    scrape = request.path == "/metrics" or (bool(vllm_path) and request.path == vllm_path)
    quiet = request.path in OPEN_PATHS or scrape
    # the server span (a child of the caller's traceparent), its ids on every log line inside
    span_cm = trace.NO_SPAN if quiet else trace.server_span(
        f"{request.method} {_route_label(request)}", request.headers)
    with structlog.contextvars.bound_contextvars(request_id=rid), span_cm as span, \
            structlog.contextvars.bound_contextvars(**trace.log_ids()):
        try:
            try:
                if (limits.probe_only(request) and request.path not in limits.PROBE_PATHS
                        and not scrape):
                    raise limits.connection_limit_error()
                request = _body_limit(request)
                resp = await handler(request)
            except APIError as e:
                err_kind = e.code or e.err_type
                resp = e.response()
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                resp = _from_http_exception(e, request).response()
            except Exception:
                log.exception("unhandled_error", method=request.method, path=request.path)
                err_kind = "internal_error"
                resp = APIError(500, f"Internal server error (request id {rid}).",
                                code="internal_error").response()
            except asyncio.CancelledError:
                status = 499             # client closed the connection (nginx's convention)
                raise
            if not resp.prepared:
                resp.headers["X-Request-Id"] = rid
                if limits.probe_only(request):
                    resp.force_close()       # a probe slot serves one request
            status = resp.status
            return resp
        finally:
            usage = request.get(USAGE) or (0, 0)
            elapsed = time.perf_counter() - start
            metrics.HTTP_REQUESTS.labels(_route_label(request), str(status)).inc()
            if span.recording:
                span.set(**{"http.request.method": request.method,
                            "http.route": _route_label(request),
                            "http.response.status_code": status},
                         request_id=rid, finish_reason=request.get(FINISH),
                         prompt_tokens=usage[0], completion_tokens=usage[1])
                if status >= 400:
                    span.error(err_kind or ("client_disconnect" if status == 499
                                            else f"http_{status}"))
            if not quiet:
                prio = request.get(PRIORITY)      # generation requests: (priority, class)
                log.info("access", method=request.method, path=request.path, status=status,
                         prompt_tokens=usage[0], completion_tokens=usage[1],
                         latency_ms=round(elapsed * 1000, 2), peer=request.remote,
                         finish=request.get(FINISH),
                         **({} if prio is None else {"priority": prio[0],
                                                     "priority_class": prio[1]}))


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    path = request.path
    if path == "/metrics" or path == state.config.server.vllm_metrics_path:
        check_metrics(request, state)
    elif path.startswith("/v1/") or path in TENANT_PATHS:
        check_bearer(request.headers.get("Authorization"), state.api_keys)
    elif path in OPERATOR_PATHS:
        require_operator(request)     # members, addresses, jobs: not for tenants
    return await handler(request)


def check_metrics(request: web.Request, state: ServerState) -> None:
    """server.metrics_access: open; api_key (a tenant key, the metrics token or the admin
    token); operator (the metrics token or the admin token: the cache counters are a side
    channel on other tenants' prompts, moed.api.salt)."""
    mode = state.config.server.metrics_auth
    if mode == "open":
        return
    hooks = request.app.get(ADMIN)
    staff = state.metrics_tokens + (hooks.tokens() if hooks is not None else ())
    token = bearer_token(request.headers.get("Authorization"))
    if token is not None and staff and key_matches(token, staff):
        return
    if mode == "api_key":
        check_bearer(request.headers.get("Authorization"), state.api_keys)
        return
    if token is not None and state.api_keys and key_matches(token, state.api_keys):
        raise APIError(403, "API keys do not open /metrics here (server.metrics_access = "
                            "\"operator\"): use the metrics token or the admin token.",
                       code="key_not_allowed")
    raise APIError(401, "/metrics needs the metrics token (server.metrics_token_file) or the "
                        "admin token: send 'Authorization: Bearer <token>'.",
                   code="invalid_api_key" if token is not None else "missing_api_key",
                   headers={"WWW-Authenticate": "Bearer"})


@web.middleware
async def read_body(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Read the body within the live server.body_timeout_s (handlers call request.read(), which
    returns this copy). Unrouted requests (404/405) are not read."""
    if request.body_exists and request.match_info.http_exception is None:
        timeout = request.app[STATE].config.server.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                await request.read()
        except TimeoutError:
            limits.body_timed_out(request)
            raise APIError(408, f"Request body not received within {timeout:g} s "
                                f"(server.body_timeout_s).", code="body_timeout") from None
        except RequestPayloadError:
            raise APIError(400, "Malformed request body (chunked framing or content "
                                "encoding).", code="bad_body") from None
    return await handler(request)
