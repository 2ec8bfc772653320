"""Admin API behind a Bearer admin token: POST /admin/drain, GET /admin/config,
GET /admin/config/history, POST /admin/config/rollback?to=HASH, POST /admin/eplb/rebalance
(and, on a router, GET /admin/canary: moed.roles.router).

The token comes from server.admin_token_file / server.admin_token_env (several lines or
comma-separated values are all accepted, for rotation). With no token configured the admin API
is off: every call answers 403, so a node is never drainable by anyone who can reach its port.
The daemon supplies what the handlers do through AdminHooks (moed.api never imports moed.app).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from moed.api.auth import check_bearer
from moed.api.errors import APIError
from moed.api.state import STATE

_HASH = re.compile(r"[0-9a-f]{4,64}")


@dataclass(frozen=True)
class AdminHooks:
    tokens: Callable[[], tuple[bytes, ...]]   # the current admin tokens (reloaded on SIGHUP)
    drain: Callable[[], dict[str, Any]]       # start draining (idempotent); returns a status body
    config: Callable[[], dict[str, Any]]      # running config, version, hash, last reload
    # applied configs, oldest first (moed.ops.history)
    history: Callable[[], dict[str, Any]] | None = None
    # apply an earlier config by hash through the reload path: (HTTP status, body)
    rollback: Callable[[str], tuple[int, dict[str, Any]]] | None = None
    # ask the expert balancer for a decision now (rank 0 of an EP group): (HTTP status, body)
    rebalance: Callable[[], tuple[int, dict[str, Any]]] | None = None


ADMIN: web.AppKey[AdminHooks] = web.AppKey("moed_admin", AdminHooks)


def authorize(request: web.Request) -> AdminHooks:
    """The hooks, for a caller holding the admin token; APIError 401/403 otherwise."""
    hooks = request.app[ADMIN]
    tokens = hooks.tokens()
    if not tokens:
        raise APIError(403, "The admin API is disabled: set server.admin_token_file or "
                            "server.admin_token_env.", code="admin_disabled")
    # a tenant API key is valid, just not here: 403 (a wrong token: 401)
    check_bearer(request.headers.get("Authorization"), tokens,
                 elsewhere=request.app[STATE].api_keys if STATE in request.app else ())
    return hooks


async def drain(request: web.Request) -> web.Response:
    body = authorize(request).drain()
    return web.json_response(body, status=202)


async def config(request: web.Request) -> web.Response:
    return web.json_response(authorize(request).config())


async def history(request: web.Request) -> web.Response:
    hooks = authorize(request)
    if hooks.history is None:
        raise APIError(503, "The config history is not available yet.", code="not_ready")
    return web.json_response(hooks.history())


async def rollback(request: web.Request) -> web.Response:
    hooks = authorize(request)
    to = request.query.get("to", "")
    if not _HASH.fullmatch(to):
        raise APIError(400, "Give the config to roll back to as ?to=HASH (hex, from GET "
                            "/admin/config/history).", param="to", code="bad_hash")
    if hooks.rollback is None:
        raise APIError(503, "Config rollback is not available yet.", code="not_ready")
    status, body = hooks.rollback(to)
    return web.json_response(body, status=status)


async def eplb_rebalance(request: web.Request) -> web.Response:
    hooks = authorize(request)
    if hooks.rebalance is None:
        raise APIError(503, "The expert balancer is not available yet.", code="not_ready")
    status, body = hooks.rebalance()
    return web.json_response(body, status=status)


def add_routes(app: web.Application, hooks: AdminHooks) -> None:
    app[ADMIN] = hooks
    app.router.add_post("/admin/drain", drain)
    app.router.add_get("/admin/config", config)
    app.router.add_get("/admin/config/history", history)
    app.router.add_post("/admin/config/rollback", rollback)
    app.router.add_post("/admin/eplb/rebalance", eplb_rebalance)
