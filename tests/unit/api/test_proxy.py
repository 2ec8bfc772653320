"""Router proxy over real loopback HTTP (the pick itself: tests/unit/balance), streaming passthrough, retry before
the first byte (dead node, draining 503), clean errors after it, client disconnects propagate."""
from __future__ import annotations

import asyncio
import json
import re
from typing import Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from moed.api.backends import StaticBackends
from moed.api.middleware import request_context
from moed.api.proxy import Proxy
from moed.balance.candidate import Candidate
from moed.balance.router import pick_backend
from moed.config import load

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


class FakeNode:
    """A loopback HTTP node with /ready and a streaming /v1/completions."""

    def __init__(self, name: str, ready: int = 200, status: int = 200, chunks: int = 3,
                 die_after: int | None = None, waiting: int = 0, running: int = 0) -> None:
        self.name, self.ready_status, self.status = name, ready, status
        self.chunks, self.die_after, self.waiting = chunks, die_after, waiting
        self.running = running
        self.hits = 0
        self.headers: list = []
        self.peers: set = set()
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_post("/v1/completions", self._complete)
        self.app = app

    async def _ready(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "x", "waiting": self.waiting,
                                  "running": self.running}, status=self.ready_status)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.peers.add(request.transport.get_extra_info("peername"))
        self.headers.append(request.headers.copy())
        body = await request.json()
        if self.status != 200:
            return web.json_response({"error": {"message": "draining"}}, status=self.status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Node": self.name})
        await resp.prepare(request)
        try:
            for i in range(self.chunks):
                if self.die_after is not None and i == self.die_after:
                    request.transport.close()
                    return resp
                await resp.write(f"data: {json.dumps({'i': i, 'p': body['prompt']})}\n\n".encode())
                await self.release.wait()
            await resp.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return resp


@pytest.fixture
async def cluster():
    runners: list[web.AppRunner] = []
    proxies: list[Proxy] = []

    async def make(*nodes: FakeNode, extra: list[str] = (), attempts: int = 3):
        urls = []
        for n in nodes:
            r, url = await _serve(n.app)
            runners.append(r)
            n.url = url
            urls.append(url)
        cfg = load(environ={}, overrides={"server": {"role": "router"},
                                          "router": {"backends": urls + list(extra),
                                                     "max_attempts": attempts,
                                                     "health_interval_s": 0.05}})
        src = StaticBackends(lambda: cfg)
        proxy = Proxy(src, lambda: cfg)
        await proxy.start()
        proxies.append(proxy)
        app = web.Application(middlewares=[request_context])
        proxy.add_routes(app)
        r, url = await _serve(app)
        runners.append(r)
        return url, proxy

    yield make
    for p in proxies:
        await p.close()
    for r in runners:
        await r.cleanup()


async def _post(url: str, prompt: str = "hi", **kw) -> tuple[int, str, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"prompt": prompt}, **kw) as r:
            return r.status, await r.text(), dict(r.headers)


async def test_streams_through_with_headers_and_request_id(cluster) -> None:
    node = FakeNode("a")
    node.release.clear()
    url, _ = await cluster(node)
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"prompt": "x"},
                          headers={"X-Request-Id": "rid-1", "Authorization": "Bearer k",
                                   "Connection": "keep-alive, X-Hop", "X-Hop": "1",
                                   "X-Forwarded-For": "10.1.1.1"}) as r:
            assert r.status == 200 and r.headers["X-Node"] == "a"
            first = await asyncio.wait_for(r.content.readline(), 5)   # before the node finishes
            assert json.loads(first[6:]) == {"i": 0, "p": "x"}
            node.release.set()
            rest = await r.text()
    assert rest.rstrip().endswith("data: [DONE]") and rest.count("data: {") == 2
    assert node.headers[0]["X-Request-Id"] == "rid-1"
    assert node.headers[0]["Authorization"] == "Bearer k"
    assert "X-Hop" not in node.headers[0]                       # named by Connection: hop-by-hop
    assert node.headers[0]["X-Forwarded-For"] == "10.1.1.1, 127.0.0.1"


async def test_generated_request_id_reaches_the_backend(cluster) -> None:
    """No X-Request-Id from the client: the router's own id goes to the node (and back)."""
    ok, refusing = FakeNode("ok"), FakeNode("busy", status=503)
    url, _ = await cluster(ok)
    status, _, _ = await _post(url)
    assert status == 200 and re.fullmatch(r"[0-9a-f]{32}", ok.headers[0]["X-Request-Id"])
    url, _ = await cluster(refusing)
    status, _, headers = await _post(url)   # the router's own answer carries its id
    rid = CIMultiDict(headers)["X-Request-Id"]
    assert status == 503 and rid == refusing.headers[0]["X-Request-Id"]
    assert ok.headers[0]["X-Request-Id"] != rid


async def test_dead_or_draining_nodes_are_skipped_before_the_first_byte(cluster) -> None:
    draining, good = FakeNode("d", status=503), FakeNode("g")
    url, proxy = await cluster(draining, good, extra=["http://127.0.0.1:9"])
    # The dead URL never passed /ready; force it in to exercise the connect-failure path too.
    proxy._source._up["http://127.0.0.1:9"] = Candidate("http://127.0.0.1:9", "http://127.0.0.1:9")
    for _ in range(6):
        status, text, _ = await _post(url)
        assert status == 200 and text.rstrip().endswith("[DONE]")
    assert good.hits == 6
    assert "http://127.0.0.1:9" not in {b.name for b in proxy._source.backends()}


async def test_all_refusing_passes_the_refusal_and_none_is_503(cluster) -> None:
    url, _ = await cluster(FakeNode("d1", status=503), FakeNode("d2", status=503))
    status, text, _ = await _post(url)
    assert status == 503 and "draining" in text
    url, _ = await cluster(FakeNode("down", ready=503))
    status, text, headers = await _post(url)
    assert status == 503 and json.loads(text)["error"]["code"] == "no_backend"
    assert headers["Retry-After"] == "1"


async def test_node_dying_mid_stream_ends_with_an_error_event(cluster) -> None:
    url, _ = await cluster(FakeNode("a", chunks=5, die_after=2))
    status, text, _ = await _post(url)
    assert status == 200 and text.count('"i"') == 2
    assert '"backend_failed"' in text and "[DONE]" not in text
    assert '"type": "server_error"' in text and "127.0.0.1" not in text   # issue 33, item 4


async def test_node_dying_before_first_byte_is_replaced(cluster) -> None:
    url, _ = await cluster(FakeNode("early", die_after=0), FakeNode("ok"))
    for _ in range(4):
        status, text, _ = await _post(url)
        assert status == 200 and text.rstrip().endswith("[DONE]")


async def test_client_disconnect_aborts_the_backend_request(cluster) -> None:
    node = FakeNode("a", chunks=50)
    node.release.clear()
    url, _ = await cluster(node)
    async with aiohttp.ClientSession() as s:
        r = await s.post(url + "/v1/completions", json={"prompt": "x"})
        await r.content.readline()
        r.close()
    await asyncio.wait_for(node.cancelled.wait(), 5)


async def test_health_poll_follows_readiness_and_load(cluster) -> None:
    a, b = FakeNode("a", waiting=5), FakeNode("b", waiting=0, running=3)
    url, proxy = await cluster(a, b)
    assert proxy.pick().name == b.url
    assert {x.name: x.load.running for x in proxy._source.backends()} == {a.url: 0, b.url: 3}
    b.ready_status = 503
    for _ in range(100):
        await asyncio.sleep(0.02)
        if [x.name for x in proxy._source.backends()] == [a.url]:
            break
    assert [x.load.waiting for x in proxy._source.backends()] == [5]


async def test_finished_streams_reuse_pooled_connections(cluster) -> None:
    node = FakeNode("a")
    url, _ = await cluster(node)
    for _ in range(4):
        status, text, _ = await _post(url)
        assert status == 200 and text.rstrip().endswith("[DONE]")
    assert node.hits == 4 and len(node.peers) == 1


def test_membership_backends_from_the_cluster_view() -> None:
    from moed.api.backends import MembershipBackends
    from moed.cluster.state import ClusterView, LoadVector, MemberInfo, MemberState, NodeMeta

    def member(name, role, state=MemberState.ALIVE, waiting=0, http="http://h:1/"):
        return MemberInfo(name, state, 1, "h:7946", NodeMeta(role=role, http=http),
                          LoadVector(waiting=waiting), 0, 0.0)

    view = ClusterView.build("r", [
        member("r", "router"), member("d1", "decode", waiting=4), member("d2", "decode"),
        member("c1", "colocated", waiting=1), member("p1", "prefill"),
        member("d3", "decode", MemberState.SUSPECT), member("d4", "decode", MemberState.LEFT),
        member("d5", "decode", http="")], version=1)
    cfg = load(environ={}, overrides={"server": {"role": "router"}})
    src = MembershipBackends(lambda: view, lambda: cfg)
    got = {b.name: (b.url, b.load.waiting) for b in src.backends()}
    assert got == {"d1": ("http://h:1", 4), "d2": ("http://h:1", 0), "c1": ("http://h:1", 1)}
    assert pick_backend(src.backends()).name == "d2"
    src.mark_failed("d2")                      # a refused connect: skipped until gossip catches up
    assert pick_backend(src.backends()).name == "c1"
    assert MembershipBackends(lambda: None, lambda: cfg).backends() == []
