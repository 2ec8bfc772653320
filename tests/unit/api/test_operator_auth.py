"""/cluster's refusals say which credential the route takes (moed.api.internal.require_operator):
the admin token on every node; a node without a cluster key (colocated, cluster.enabled off)
never answers 503 "starting" for want of one, and no answer carries a token."""
from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from moed.api.admin import ADMIN, AdminHooks
from moed.api.internal import InternalAuth
from moed.api.middleware import auth, request_context
from moed.api.state import STATE, ServerState
from moed.cluster.wire import Keyring
from moed.config import ClusterConfig, Config, ModelConfig

ADMIN_TOKEN = b"admin-secret-1"


async def _client(cfg: Config, internal: InternalAuth | None,
                  admin: tuple[bytes, ...]) -> TestClient:
    state = ServerState(config=cfg, api_keys=(b"tenant",))
    state.internal_auth = internal
    app = web.Application(middlewares=[request_context, auth])
    app[STATE] = state
    app[ADMIN] = AdminHooks(tokens=lambda: admin, drain=dict, config=dict)

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.router.add_get("/cluster", info)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def _err(r) -> tuple[int, str, str]:
    body = await r.json()
    return r.status, body["error"]["code"], body["error"]["message"]


async def test_a_node_without_cluster_key_names_the_admin_token() -> None:
    c = await _client(Config(model=ModelConfig(path="/m")), None, (ADMIN_TOKEN,))
    try:
        status, code, msg = await _err(await c.get("/cluster"))
        assert (status, code) == (401, "missing_admin_token")
        assert msg == ("Unauthorized: /cluster takes the admin token (Authorization: Bearer; "
                       "server.admin_token_file or server.admin_token_env).")
        r = await c.get("/cluster", headers={"Authorization": "Bearer wrong"})
        status, code, msg = await _err(r)
        assert (status, code) == (401, "bad_admin_token") and "admin token" in msg
        assert r.headers["WWW-Authenticate"] == "Bearer"
        assert "admin-secret" not in msg
        r = await c.get("/cluster", headers={"Authorization": "Bearer tenant"})
        assert r.status == 403                      # a tenant key never opens it
        r = await c.get("/cluster", headers={"Authorization": "Bearer admin-secret-1"})
        assert r.status == 200
    finally:
        await c.close()


async def test_a_node_without_any_admin_token_says_so() -> None:
    c = await _client(Config(model=ModelConfig(path="/m")), None, ())
    try:
        status, code, msg = await _err(await c.get("/cluster"))
        assert (status, code) == (403, "admin_disabled")
        assert msg == ("/cluster takes the admin token, and this node has none: set "
                       "server.admin_token_file or server.admin_token_env.")
    finally:
        await c.close()


async def test_a_cluster_node_names_both_credentials() -> None:
    cfg = Config(model=ModelConfig(path="/m"), cluster=ClusterConfig(enabled=True))
    internal = InternalAuth(Keyring(b"k" * 32, ()), "n1", insecure=False, window_s=60)
    c = await _client(cfg, internal, (ADMIN_TOKEN,))
    try:
        status, code, msg = await _err(await c.get("/cluster"))
        assert (status, code) == (401, "missing_signature")
        assert msg == ("Unauthorized: /cluster takes the admin token (Authorization: Bearer; "
                       "server.admin_token_file or server.admin_token_env) or a call signed "
                       "with the cluster secret.")
        status, code, msg = await _err(await c.get(
            "/cluster", headers={"X-Moed-Signature": "zz", "X-Moed-Timestamp": "nan"}))
        assert (status, code) == (401, "bad_signature")
        assert msg.endswith("signed with the cluster secret (malformed signature headers).")
    finally:
        await c.close()


async def test_a_cluster_node_still_starting_is_503() -> None:
    """A node that will have a cluster key, before its auth component started."""
    cfg = Config(model=ModelConfig(path="/m"), cluster=ClusterConfig(enabled=True))
    c = await _client(cfg, None, ())
    try:
        status, code, _ = await _err(await c.get("/cluster"))
        assert (status, code) == (503, "not_ready")
    finally:
        await c.close()
