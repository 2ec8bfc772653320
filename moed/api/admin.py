"""Admin API: POST /admin/drain and GET /admin/config, behind a Bearer admin token.

The token comes from server.admin_token_file / server.admin_token_env (several lines or
comma-separated values are all accepted, for rotation). With no token configured the admin API
is off: every call answers 403, so a node is never drainable by anyone who can reach its port.
The daemon supplies what the handlers do through AdminHooks (moed.api never imports moed.app).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from moed.api.auth import check_bearer
from moed.api.errors import APIError
from moed.api.state import STATE


@dataclass(frozen=True)
class AdminHooks:
    tokens: Callable[[], tuple[bytes, ...]]   # the current admin tokens (reloaded on SIGHUP)
    drain: Callable[[], dict[str, Any]]       # start draining (idempotent); returns a status body
    config: Callable[[], dict[str, Any]]      # running config, version, hash, last reload


ADMIN: web.AppKey[AdminHooks] = web.AppKey("moed_admin", AdminHooks)


def _authorize(request: web.Request) -> AdminHooks:
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
    body = _authorize(request).drain()
    return web.json_response(body, status=202)


async def config(request: web.Request) -> web.Response:
    return web.json_response(_authorize(request).config())


def add_routes(app: web.Application, hooks: AdminHooks) -> None:
    app[ADMIN] = hooks
    app.router.add_post("/admin/drain", drain)
    app.router.add_get("/admin/config", config)
