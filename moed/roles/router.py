"""RouterComponent: the router role's wiring of moed.api.proxy (no model on this node); the
choice of backend is moed.balance.router.

Backends come from the membership view when a cluster component exposes one (`view()`), else
from router.backends polled on /ready. Placement is moed.balance.router.place (load, prefix
affinity, saturation → 429); with model.path set the router loads that checkpoint's tokenizer
(no weights) to hash prompts for affinity. /ready is 503 `no_backend` while no serving node is
alive. Every proxied request counts as in flight, so a draining
router finishes its streams (up to server.shutdown_grace_s) before it exits.

Canary: GET /admin/canary (admin token) reports the canary and the baseline over
canary.window_s, per version label, with the verdict by the configured thresholds
(moed.balance.canary); `moed canary` prints it. moed_router_canary_health follows the verdict.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from moed.api import admin
from moed.api.errors import APIError
from moed.api.backends import BackendSource, MembershipBackends, StaticBackends
from moed.api.proxy import Proxy
from moed.api.state import STATE
from moed.config import Config, ConfigError
from moed.obs import metrics

if TYPE_CHECKING:
    from moed.app import App

log = structlog.get_logger(__name__)


class RouterComponent:
    name = "router"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._app: App | None = None
        self.proxy: Proxy | None = None

    def _config(self) -> Config:
        return self._app.config if self._app is not None else self.cfg

    def add_routes(self, web_app: web.Application) -> None:
        async def proxied(request: web.Request) -> web.StreamResponse:
            if self.proxy is None:   # routes exist before start: answer like a loading node
                raise APIError(503, "Router is starting.", code="not_ready")
            with request.app[STATE].track():
                return await self.proxy.handle(request)

        async def canary_report(request: web.Request) -> web.Response:
            admin.authorize(request)
            if self.proxy is None:
                raise APIError(503, "Router is starting.", code="not_ready")
            return web.json_response(self.proxy.canary_report())

        web_app.router.add_route("*", "/v1/{tail:.*}", proxied)
        web_app.router.add_get("/admin/canary", canary_report)

    def _source(self, app: App) -> BackendSource:
        from moed.cluster.service import MembershipComponent

        membership = next((c for c in app.components if isinstance(c, MembershipComponent)), None)
        if membership is not None and self._config().cluster.enabled:
            log.info("router_backends", source="membership", component=membership.name)
            return MembershipBackends(membership.view, self._config)
        log.info("router_backends", source="static", backends=list(self._config().router.backends))
        return StaticBackends(self._config)

    async def start(self, app: App) -> None:
        self._app = app
        source = self._source(app)
        proxy = Proxy(source, self._config, draining=lambda: app.state.draining,
                      offload=app.state.offload, tokenizer=await self._tokenizer(),
                      signer=lambda: app.state.internal_auth)   # continuations are signed
        await proxy.start()
        self.proxy = proxy
        # not ready while no serving node is alive: a load balancer in front sends elsewhere
        app.state.unready_reason = lambda: "" if source.backends() else "no_backend"
        if isinstance(source, MembershipBackends):   # the static source keeps its own gauge
            app.spawn(self._gauge_loop(source), "router-backends-gauge")
        app.spawn(self._canary_loop(proxy), "router-canary-health")

    async def _tokenizer(self) -> Any:
        """The checkpoint's tokenizer when model.path is set (prefix affinity: the router
        hashes prompts as the nodes do, moed.api.affinity); no weights are read. A path
        without one is an error: the operator asked for affinity."""
        path = self._config().model.path
        if not path:
            log.info("router_affinity", enabled=False, reason="model.path not set")
            return None
        from moed.model.tokenizer import Tokenizer, TokenizerError   # no torch in there
        try:
            tok = await asyncio.to_thread(Tokenizer.from_dir, path)
        except (TokenizerError, OSError, ValueError) as e:
            raise ConfigError(f"model.path {path}: the router reads only its tokenizer for "
                              f"prefix affinity, and cannot: {e}") from None
        log.info("router_affinity", enabled=True, tokenizer=path)
        return tok

    async def _gauge_loop(self, source: MembershipBackends) -> None:
        while True:
            metrics.ROUTER_BACKENDS.set(len(source.backends()))
            await asyncio.sleep(0.5)

    async def _canary_loop(self, proxy: Proxy) -> None:
        health = {"healthy": 1, "unhealthy": 0, "insufficient_data": -1}
        shown = ""                 # the canary label the gauge has a series for
        while True:
            report = proxy.canary_report()
            verdict, label = report.get("verdict"), str(report["label"])
            if shown and shown != label:      # canary changed or ended (SIGHUP): no stale series
                metrics.ROUTER_CANARY_HEALTH.remove(shown)
                shown = ""
            if isinstance(verdict, dict):
                metrics.ROUTER_CANARY_HEALTH.labels(label).set(health[verdict["health"]])
                shown = label
            await asyncio.sleep(5.0)

    async def drain(self) -> None:
        pass   # readiness is false and new requests get 503; in-flight streams keep going

    async def stop(self) -> None:
        if self.proxy is not None:
            await self.proxy.close()
