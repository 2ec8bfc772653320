"""Node-to-node auth (moed.api.internal): signed calls, replays, tenant keys, capabilities."""
from __future__ import annotations

import json

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from moed.api.admin import ADMIN, AdminHooks
from moed.api.internal import H_SIG, H_TS, InternalAuth, require_signed
from moed.api.middleware import auth, request_context
from moed.api.state import STATE, ServerState
from moed.cluster.wire import Keyring
from moed.config import ClusterConfig, Config, ConfigError, ModelConfig, ServerConfig

KEY = b"k" * 32
OTHER = b"o" * 32


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _auth(key: bytes = KEY, clock: Clock | None = None, secondary: tuple = (),
          insecure: bool = False, node: str = "d1") -> InternalAuth:
    return InternalAuth(Keyring(key, secondary), node, insecure=insecure, window_s=60,
                        clock=clock or Clock())


async def _client(server_auth: InternalAuth, api_keys: tuple[bytes, ...] = (b"tenant",),
                  admin: tuple[bytes, ...] = (b"admin",)) -> TestClient:
    cfg = Config(model=ModelConfig(path="/m"))
    state = ServerState(config=cfg, api_keys=api_keys)
    state.internal_auth = server_auth
    app = web.Application(middlewares=[request_context, auth])
    app[STATE] = state
    app[ADMIN] = AdminHooks(tokens=lambda: admin, drain=dict, config=dict)

    async def job(request: web.Request) -> web.Response:
        raw = await request.read()
        return web.json_response({"caller": require_signed(request, raw)})

    async def info(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.router.add_post("/internal/prefill", job)
    app.router.add_delete("/internal/prefill/{job}", job)
    app.router.add_get("/internal/transfer", info)
    app.router.add_get("/cluster", info)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_signed_call_accepted_and_everything_else_refused() -> None:
    clock = Clock()
    srv, me = _auth(clock=clock), _auth(clock=clock, node="decode-7")
    c = await _client(srv)
    try:
        body = json.dumps({"job_id": "j1"}).encode()
        h = me.sign("POST", "/internal/prefill", body)
        r = await c.post("/internal/prefill", data=body, headers=h)
        assert r.status == 200 and (await r.json())["caller"] == "decode-7"
        # the same request again: a replay
        r = await c.post("/internal/prefill", data=body, headers=h)
        assert r.status == 401 and (await r.json())["error"]["code"] == "replayed_request"
        # no credentials; a tenant API key (valid for /v1, never for /internal): 401 / 403
        r = await c.post("/internal/prefill", data=body)
        assert r.status == 401 and (await r.json())["error"]["code"] == "missing_signature"
        r = await c.post("/internal/prefill", data=body,
                         headers={"Authorization": "Bearer tenant"})
        assert r.status == 403
        # another body, route or method under a good signature; another cluster's key
        h = me.sign("POST", "/internal/prefill", body)
        r = await c.post("/internal/prefill", data=body + b" ", headers=h)
        assert r.status == 401 and (await r.json())["error"]["code"] == "bad_signature"
        h = me.sign("POST", "/internal/prefill", body)
        r = await c.delete("/internal/prefill/x", headers=h)
        assert r.status == 401
        h = _auth(OTHER, clock=clock).sign("POST", "/internal/prefill", body)
        r = await c.post("/internal/prefill", data=body, headers=h)
        assert r.status == 401
        # a signature from outside the window, or older than this node
        old = me.sign("POST", "/internal/prefill", body)
        clock.t += 61
        r = await c.post("/internal/prefill", data=body, headers=old)
        assert r.status == 401 and (await r.json())["error"]["code"] == "stale_signature"
        before_start = dict(me.sign("POST", "/internal/prefill", body))
        before_start[H_TS] = str(int((srv._not_before - 5) * 1000))
        r = await c.post("/internal/prefill", data=body, headers=before_start)
        assert r.status == 401
        # garbage headers
        r = await c.post("/internal/prefill", data=body,
                         headers={H_SIG: "zz", H_TS: "nan", "X-Moed-Nonce": "x"})
        assert r.status == 401 and (await r.json())["error"]["code"] == "bad_signature"
        # a path with a job id: signed as the server sees it
        h = me.sign("DELETE", "/internal/prefill/n.1.req-9.1")
        r = await c.delete("/internal/prefill/n.1.req-9.1", headers=h)
        assert r.status == 200
    finally:
        await c.close()


async def test_rotation_secondary_key_verifies() -> None:
    clock = Clock()
    c = await _client(_auth(KEY, clock=clock, secondary=(OTHER,)))
    try:
        h = _auth(OTHER, clock=clock).sign("POST", "/internal/prefill", b"{}")
        assert (await c.post("/internal/prefill", data=b"{}", headers=h)).status == 200
    finally:
        await c.close()


async def test_operator_routes_take_admin_token_or_signature_not_tenant_keys() -> None:
    clock = Clock()
    c = await _client(_auth(clock=clock))
    try:
        for path in ("/cluster", "/internal/transfer"):
            assert (await c.get(path)).status == 401
            assert (await c.get(path, headers={"Authorization": "Bearer tenant"})).status == 403
            assert (await c.get(path, headers={"Authorization": "Bearer wrong"})).status == 401
            assert (await c.get(path, headers={"Authorization": "Bearer admin"})).status == 200
            h = _auth(clock=clock).sign("GET", path)
            assert (await c.get(path, headers=h)).status == 200
    finally:
        await c.close()


async def test_insecure_accepts_unsigned_but_checks_a_signature_it_is_given() -> None:
    c = await _client(_auth(b"", insecure=True))
    try:
        assert (await c.post("/internal/prefill", data=b"{}")).status == 200
        assert (await c.get("/cluster")).status == 200
        h = _auth(KEY).sign("POST", "/internal/prefill", b"{}")     # signed with a real key
        assert (await c.post("/internal/prefill", data=b"{}", headers=h)).status == 401
    finally:
        await c.close()


def test_capability_binds_node_blocks_and_expiry() -> None:
    clock = Clock()
    a = _auth(clock=clock)
    exp = int((clock.t + 10) * 1000)
    cap = a.capability("j1", "d1", 5, 2, [7, 8, 9], exp)
    assert a.check_capability(cap, "j1", "d1", 5, 2, [7, 8, 9], exp) is None
    assert a.check_capability(cap, "j1", "d1", 5, 2, [7, 8, 10], exp) is not None   # blocks
    assert a.check_capability(cap, "j1", "d2", 5, 2, [7, 8, 9], exp) is not None    # node
    assert a.check_capability(cap, "j1", "d1", 6, 2, [7, 8, 9], exp) is not None    # incarnation
    assert a.check_capability(cap, "j1", "d1", 5, 1, [7, 8, 9], exp) is not None    # skip
    assert a.check_capability(cap, "j2", "d1", 5, 2, [7, 8, 9], exp) is not None    # job
    assert a.check_capability(cap, "j1", "d1", 5, 2, [7, 8, 9], exp + 1) is not None
    assert a.check_capability("", "j1", "d1", 5, 2, [7, 8, 9], exp) is not None
    assert _auth(OTHER, clock=clock).check_capability(cap, "j1", "d1", 5, 2, [7, 8, 9],
                                                      exp) is not None
    clock.t += 11
    assert a.check_capability(cap, "j1", "d1", 5, 2, [7, 8, 9], exp) == "capability expired"


def _cfg(role: str, host: str = "127.0.0.1", **cluster) -> Config:
    return Config(server=ServerConfig(role=role, host=host), model=ModelConfig(path="/m"),
                  cluster=ClusterConfig(**cluster))


def test_from_config_needs_a_key_or_loopback_insecure() -> None:
    with pytest.raises(ConfigError, match="cluster key"):
        InternalAuth.from_config(_cfg("prefill"), "p", environ={})
    with pytest.raises(ConfigError, match="loopback"):
        InternalAuth.from_config(_cfg("decode", host="0.0.0.0", insecure=True), "d",
                                 environ={})
    assert InternalAuth.from_config(_cfg("decode", insecure=True), "d", environ={}).insecure


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode", "router"])
@pytest.mark.parametrize("host,bind", [("0.0.0.0", "127.0.0.1"), ("10.1.2.3", "127.0.0.1"),
                                       ("", "127.0.0.1"), ("127.0.0.1", "0.0.0.0")])
def test_insecure_is_refused_off_loopback_for_every_role(role, host, bind) -> None:
    """Every role with a cluster key serves /internal/* or /cluster (and a colocated node with
    tiers.peer_reuse lends KV); an unsigned gossip socket off loopback lets anyone join."""
    cfg = Config(server=ServerConfig(role=role, host=host),
                 model=ModelConfig(path="" if role == "router" else "/m"),
                 cluster=ClusterConfig(enabled=True, bind_host=bind, insecure=True))
    with pytest.raises(ConfigError, match=f"cluster.insecure: a {role} node"):
        InternalAuth.from_config(cfg, "n", environ={})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_insecure_on_any_loopback_address_is_allowed(host) -> None:
    cfg = Config(server=ServerConfig(role="colocated", host=host), model=ModelConfig(path="/m"),
                 cluster=ClusterConfig(enabled=True, bind_host="127.0.0.5", insecure=True))
    assert InternalAuth.from_config(cfg, "n", environ={}).insecure
    a = InternalAuth.from_config(_cfg("prefill", key_env="K"), "p", environ={"K": KEY.hex()})
    assert not a.insecure and a.window_s == 120.0


def test_reload_rotates_the_key(tmp_path) -> None:
    f = tmp_path / "key"
    f.write_text(KEY.hex())
    old = _cfg("prefill", key_file=str(f))
    a = InternalAuth.from_config(old, "p")
    b = InternalAuth.from_config(old, "d")
    assert a.check_capability(b.capability("j", "d", 1, 0, [1], 10**15), "j", "d", 1, 0, [1],
                              10**15) is None
    f2 = tmp_path / "key2"
    f2.write_text(OTHER.hex())
    commit = a.prepare_reload(old, _cfg("prefill", key_file=str(f2)))
    assert commit is not None
    commit()
    assert a.check_capability(b.capability("j", "d", 1, 0, [1], 10**15), "j", "d", 1, 0, [1],
                              10**15) is not None
    with pytest.raises(ConfigError):
        a.prepare_reload(old, _cfg("prefill", key_file=str(tmp_path / "missing")))


def test_reload_rereads_a_key_rotated_under_the_same_name(tmp_path) -> None:
    f = tmp_path / "key"
    f.write_text(KEY.hex())
    cfg = _cfg("prefill", key_file=str(f))
    a, b = InternalAuth.from_config(cfg, "p"), InternalAuth.from_config(cfg, "d")
    f.write_text(OTHER.hex())
    a.prepare_reload(cfg, cfg)()
    assert a.check_capability(b.capability("j", "d", 1, 0, [1], 10**15), "j", "d", 1, 0, [1],
                              10**15) is not None
