"""GET /cluster where membership is off (moed.cluster.solo): 503 until ready, then this node
alone and alive, `left` while it drains."""
from __future__ import annotations

from types import SimpleNamespace

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from moed.cluster.solo import SoloClusterComponent
from moed.config import Config, ServerConfig


async def test_starting_then_alive_then_left() -> None:
    cfg = Config(server=ServerConfig(role="router", node_name="n1"))
    comp = SoloClusterComponent(cfg)
    app = web.Application()
    comp.add_routes(app)
    client = TestClient(TestServer(app))
    await client.start_server()
    node = SimpleNamespace(node="n1", port=8123, config=cfg, state=SimpleNamespace(
        ready=False, draining=False, engine=None, capacity=None, model_name="", model_id=""))
    try:
        r = await client.get("/cluster")
        assert r.status == 503 and (await r.json())["error"]["message"] == "Node is starting."
        await comp.start(node)
        r = await client.get("/cluster")          # started, not ready yet
        assert r.status == 503
        node.state.ready = True
        body = await (await client.get("/cluster")).json()
        assert body["self"] == "n1" and body["counts"]["alive"] == 1
        assert body["members"][0]["http"] == "http://127.0.0.1:8123"
        node.state.ready, node.state.draining = False, True
        body = await (await client.get("/cluster")).json()
        assert body["members"][0]["state"] == "left"
    finally:
        await client.close()
