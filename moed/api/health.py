"""Probes and metrics: GET /health (liveness, no work), /ready (can take work; with its queue and
batch size, which the router balances on), /metrics."""
from __future__ import annotations

from aiohttp import web

from moed import __version__
from moed.api.state import STATE
from moed.obs import metrics


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is not None and not state.engine.alive:
        # the step loop crashed (or stopped): nothing here can serve; let the balancer move on
        return web.json_response({"status": "engine_failed", "role": state.config.server.role},
                                 status=503)
    why = state.unready_reason() if state.unready_reason is not None else ""
    if state.ready and not state.draining and why:
        return web.json_response({"status": why, "role": state.config.server.role}, status=503)
    if state.ready and not state.draining:
        body = {"status": "ready", "role": state.config.server.role}
        if state.engine is not None:   # the router's static-backend mode balances on these
            s = state.engine.stats()
            body.update(waiting=s.waiting + s.waiting_remote_kv, running=s.running)
        return web.json_response(body)
    reason = "draining" if state.draining else "starting"
    return web.json_response({"status": reason, "role": state.config.server.role}, status=503)


async def metrics_handler(request: web.Request) -> web.Response:
    state = request.app[STATE]
    stats = None
    if state.engine is not None:
        stats = state.engine.stats()
        metrics.observe_engine_stats(stats, state.config.server.cache_metrics_batch)
        if state.capacity is not None:
            metrics.observe_capacity(state.capacity(), stats.queued_prompt_tokens)
    alive = state.engine is None or state.engine.alive
    why = state.unready_reason() if state.unready_reason is not None else ""
    metrics.READY.set(1 if state.ready and not state.draining and alive and not why else 0)
    metrics.HTTP_INFLIGHT.set(state.inflight)
    cfg = state.config   # only this role's areas: no router gauge on an engine node, etc.
    body, ctype = metrics.render(cfg.server.role, cluster=cfg.cluster.enabled)
    if cfg.server.vllm_metrics_path == "/metrics" and stats is not None:
        body += metrics.render_vllm(stats, state.engine.block_size)
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = ctype
    return resp


async def vllm_metrics(request: web.Request) -> web.Response:
    """server.vllm_metrics_path (other than /metrics): the vLLM-named gauges alone."""
    state = request.app[STATE]
    if state.engine is None:            # still loading (a router refuses the path)
        return web.json_response({"status": "starting"}, status=503)
    body = metrics.render_vllm(state.engine.stats(), state.engine.block_size)
    resp = web.Response(body=body)
    resp.headers["Content-Type"] = metrics.CONTENT_TYPE_LATEST
    return resp


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_handler)
    path = app[STATE].config.server.vllm_metrics_path
    if path and path != "/metrics":
        app.router.add_get(path, vllm_metrics)
