"""GET /cluster on a node that does not gossip (cluster.enabled = false: the colocated default,
a router with static backends): the one-node view, in the shape membership answers, so the
operator's tools (`moed plan`, curl | jq) read a lone node as they read a cluster.

Lifecycle: the route answers 503 "Node is starting." until the node is ready; then one member,
this node, `alive`, with the load it would gossip (moed.cluster.service.load_of); `left` while
it drains (what its peers would see after a graceful leave).
"""
from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from moed.config import Config

from .service import PrefixDigest, load_of, node_meta
from .state import ClusterView, LoadVector, MemberInfo, MemberState


class SoloClusterComponent:
    """App component (see moed.app); added instead of the membership when it is off."""

    name = "cluster-solo"

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self._app: Any = None
        self._since = time.time()
        self._digest = PrefixDigest()     # its own: the tick state of what this node caches

    def view(self) -> ClusterView | None:
        """The one-node view, or None before the node is ready."""
        app = self._app
        if app is None or not (app.state.ready or app.state.draining):
            return None
        cfg = getattr(app, "config", self.cfg)     # live after a SIGHUP
        engine = app.state.engine
        load = LoadVector()
        if engine is not None:
            capacity = app.state.capacity
            load = load_of(engine, self._digest, cfg.balance.prefix_digest_size,
                           capacity() if capacity is not None else None)
        state = MemberState.LEFT if app.state.draining else MemberState.ALIVE
        me = MemberInfo(app.node, state, 0, "", node_meta(cfg, app), load, 0, self._since)
        return ClusterView.build(app.node, [me], 1)

    def add_routes(self, web_app: web.Application) -> None:
        async def cluster(request: web.Request) -> web.Response:
            view = self.view()
            if view is None:
                return web.json_response({"error": {
                    "message": "Node is starting.", "type": "server_error",
                    "param": None, "code": "not_ready"}}, status=503)
            return web.json_response(view.to_json())
        web_app.router.add_get("/cluster", cluster)

    async def start(self, app: Any) -> None:
        self._app = app
        self._since = time.time()

    async def drain(self) -> None:
        pass

    async def stop(self) -> None:
        pass
