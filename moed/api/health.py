"""Probes and metrics: GET /health (liveness, no work), /ready (can take work), /metrics."""
from __future__ import annotations

from aiohttp import web

from moed.api.state import STATE
from moed.obs import metrics


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.ready and not state.draining:
        return web.json_response({"status": "ready", "role": state.config.server.role})
    reason = "draining" if state.draining else "starting"
    return web.json_response({"status": reason, "role": state.config.server.role}, status=503)


async def metrics_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is not None:
        metrics.observe_engine_stats(state.engine.stats())
    metrics.READY.set(1 if state.ready and not state.draining else 0)
    metrics.HTTP_INFLIGHT.set(state.inflight)
    body, ctype = metrics.render()
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = ctype
    return resp


def add_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_handler)
