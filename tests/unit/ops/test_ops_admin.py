"""Admin API auth in-process: disabled (403) without a token, 401 with missing/wrong tokens."""
from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from moed.api import admin
from moed.api.middleware import request_context


async def _client(tokens: tuple[bytes, ...], drained: list[int]) -> TestClient:
    app = web.Application(middlewares=[request_context])
    admin.add_routes(app, admin.AdminHooks(
        tokens=lambda: tokens, drain=lambda: drained.append(1) or {"status": "draining"},
        config=lambda: {"version": 3}))
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    return client


async def test_admin_disabled_without_tokens() -> None:
    drained: list[int] = []
    c = await _client((), drained)
    try:
        r = await c.post("/admin/drain", headers={"Authorization": "Bearer x"})
        assert r.status == 403 and (await r.json())["error"]["code"] == "admin_disabled"
        assert drained == []
    finally:
        await c.close()


async def test_admin_token_checks() -> None:
    drained: list[int] = []
    c = await _client((b"t1", b"t2"), drained)
    try:
        assert (await c.post("/admin/drain")).status == 401
        assert (await c.get("/admin/config", headers={"Authorization": "Bearer no"})).status == 401
        r = await c.get("/admin/config", headers={"Authorization": "Bearer t2"})
        assert r.status == 200 and (await r.json()) == {"version": 3}
        r = await c.post("/admin/drain", headers={"Authorization": "Bearer t1"})
        assert r.status == 202 and drained == [1]
    finally:
        await c.close()


async def test_a_tenant_api_key_on_admin_is_403_not_401() -> None:
    """A valid API key authenticates, but never for /admin (OpenAI's and vLLM's split: 401 for
    a bad credential, 403 for a good one where it may not go)."""
    from moed.api.state import STATE, ServerState
    from moed.config import Config, ModelConfig

    app = web.Application(middlewares=[request_context])
    app[STATE] = ServerState(config=Config(model=ModelConfig(path="/m")), api_keys=(b"tenant",))
    drained: list[int] = []
    admin.add_routes(app, admin.AdminHooks(tokens=lambda: (b"adm",),
                                           drain=lambda: drained.append(1) or {}, config=dict))
    c = TestClient(TestServer(app, host="127.0.0.1"))
    await c.start_server()
    try:
        r = await c.post("/admin/drain", headers={"Authorization": "Bearer tenant"})
        assert r.status == 403 and (await r.json())["error"]["code"] == "key_not_allowed"
        assert (await c.post("/admin/drain", headers={"Authorization": "Bearer x"})).status == 401
        assert drained == []
    finally:
        await c.close()
