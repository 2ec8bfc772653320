"""RouterComponent: the router role's wiring of moed.api.proxy (no model on this node); the
choice of backend is moed.balance.router.

Backends come from the membership view when a cluster component exposes one (`view()`), else
from router.backends polled on /ready. Every proxied request counts as in flight, so a draining
router finishes its streams (up to server.shutdown_grace_s) before it exits.
"""
from __future__ import annotations

import asyncio
from typing import Any

import structlog
from aiohttp import web

from moed.api.proxy import BackendSource, MembershipBackends, Proxy, StaticBackends
from moed.api.state import STATE
from moed.config import Config
from moed.obs import metrics

log = structlog.get_logger(__name__)


class RouterComponent:
    name = "router"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._app: Any = None
        self.proxy: Proxy | None = None

    def _config(self) -> Config:
        return self._app.config if self._app is not None else self.cfg

    def add_routes(self, web_app: web.Application) -> None:
        async def proxied(request: web.Request) -> web.StreamResponse:
            if self.proxy is None:   # routes exist before start: answer like a loading node
                from moed.api.errors import APIError
                raise APIError(503, "Router is starting.", code="not_ready")
            with request.app[STATE].track():
                return await self.proxy.handle(request)

        web_app.router.add_route("*", "/v1/{tail:.*}", proxied)

    def _source(self, app: Any) -> BackendSource:
        for c in app.components:
            view = getattr(c, "view", None)
            if callable(view) and self._config().cluster.enabled:
                log.info("router_backends", source="membership", component=c.name)
                return MembershipBackends(view, self._config)
        log.info("router_backends", source="static", backends=list(self._config().router.backends))
        return StaticBackends(self._config)

    async def start(self, app: Any) -> None:
        self._app = app
        source = self._source(app)
        proxy = Proxy(source, self._config, draining=lambda: app.state.draining)
        await proxy.start()
        self.proxy = proxy
        if isinstance(source, MembershipBackends):   # the static source keeps its own gauge
            app.spawn(self._gauge_loop(source), "router-backends-gauge")

    async def _gauge_loop(self, source: MembershipBackends) -> None:
        while True:
            metrics.ROUTER_BACKENDS.set(len(source.backends()))
            await asyncio.sleep(0.5)

    async def drain(self) -> None:
        pass   # readiness is false and new requests get 503; in-flight streams keep going

    async def stop(self) -> None:
        if self.proxy is not None:
            await self.proxy.close()
