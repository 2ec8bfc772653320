"""The router's migration of a stream (moed.api.migrate, migrating.py) over real loopback
HTTP with fake nodes: a node that dies mid-stream is replaced by a signed continuation and
the client sees every token once, in order, with no error; router.migration_limit = 0 and an
exhausted limit end with one server_error event."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from moed.api.backends import StaticBackends
from moed.api.generate import MIGRATABLE
from moed.api.middleware import request_context
from moed.api.proxy import Proxy
from moed.config import load
from moed.obs import metrics

from test_proxy import _serve

pytestmark = pytest.mark.timeout(30)

PROMPT_IDS = [1, 2, 3]
TOKENS = 6


SEED = 7                # n = 2 tests: choice c's continuation comes seeded SEED + c


def _text(choice: int, i: int) -> str:
    return f"t{i} " if not choice else f"c{choice}t{i} "


def _chunk(i: int, first: bool, ids: bool, choice: int = 0, index: int = 0) -> bytes:
    c = {"index": index, "text": _text(choice, i), "logprobs": None,
         "finish_reason": "length" if i == TOKENS - 1 else None}
    if ids:
        c["token_ids"] = [100 + 10 * choice + i]
        if first:
            c["prompt_token_ids"] = PROMPT_IDS
    body = {"id": f"cmpl-{id(c)}", "object": "text_completion", "created": 1, "model": "m",
            "choices": [c]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Node:
    """Streams tokens 100.. (text t0 t1 ...); dies after `die_after` chunks when set; serves
    continuations from where the caller says the client is."""

    def __init__(self, die_after: int | None = None, always: bool = False,
                 how: str = "cut") -> None:
        self.die_after = die_after      # fresh requests die after this many chunks
        self.always = always            # continuations too
        self.how = how                  # cut | error (a server_error event) | stall (unready)
        self.ready = 200
        self.then: Node | None = None   # stall: this node turns ready instead
        self.hand_back = [0]            # non-streamed: answer this many with a drain's 503
        self.migratable: list[bool] = []    # per non-streamed request: the router's header
        self.continued: list[dict] = []
        self.signed: list[bool] = []
        app = web.Application()
        app.router.add_get("/ready", self._ready)
        app.router.add_post("/v1/completions", self._fresh)
        app.router.add_post("/internal/continue/v1/completions", self._continue)
        self.app = app

    async def _ready(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"}, status=self.ready)

    async def _fresh(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            self.migratable.append(request.headers.get(MIGRATABLE) == "1")
            if self.hand_back[0] and self.migratable[-1]:    # as a real node: only then
                self.hand_back[0] -= 1
                return web.json_response({"error": {"type": "server_error",
                                                    "code": "handed_off"}}, status=503)
            return web.json_response({"choices": [{"index": 0, "text": "whole"}]})
        if self.how == "hang":            # no headers either (SIGSTOP before it answered)
            self.ready = 503
            if self.then is not None:
                self.then.ready = 200
            await asyncio.sleep(30)
        if body.get("n", 1) > 1:
            return await self._stream_n(request, body)
        return await self._stream(request, 0, bool(body.get("return_token_ids")), self.die_after)

    async def _stream_n(self, request: web.Request, body: dict) -> web.StreamResponse:
        """n choices interleaved token by token; cut after `die_after` events when set."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        events = [_chunk(i, i == 0, True, c, c) for i in range(TOKENS) for c in range(body["n"])]
        for k, ev in enumerate(events):
            if k == self.die_after:
                await resp.write(b'data: {"id": "cut')
                request.transport.close()
                return resp
            await resp.write(ev)
            await asyncio.sleep(0.002)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _continue(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.continued.append(body)
        self.signed.append("X-Test-Signed" in request.headers and   # + the tenant's salt
                           request.headers.get("Authorization") == "Bearer tenant")
        req = body["request"]
        choice = req["seed"] - SEED if "seed" in req else 0
        return await self._stream(request, len(body["output_token_ids"]),
                                  bool(req.get("return_token_ids")),
                                  self.die_after if self.always else None, choice,
                                  (req.get("stream_options") or {}).get("include_usage"))

    async def _stream(self, request: web.Request, start: int, ids: bool,
                      die_after: int | None, choice: int = 0, usage: bool = False
                      ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n, i in enumerate(range(start, TOKENS)):
            if die_after is not None and n == die_after and self.how == "error":
                await resp.write(b'data: {"error": {"type": "server_error", "code": "x"}}\n\n')
                return resp
            if die_after is not None and n == die_after and self.how == "stall":
                self.ready = 503          # membership / the health poll drops it; no byte more
                if self.then is not None:
                    self.then.ready = 200
                await asyncio.sleep(30)
            if die_after is not None and n == die_after:
                await resp.write(b'data: {"id": "cut')          # an event cut in half
                request.transport.close()
                return resp
            await resp.write(_chunk(i, i == 0, ids, choice))
            await asyncio.sleep(0.005)
        if die_after is not None and die_after >= TOKENS - start:   # after the finish chunk
            request.transport.close()
            return resp
        if usage:                   # as a node's continuation: the sent tokens count too
            await resp.write(b"data: " + json.dumps({"id": "x", "choices": [], "usage": {
                "prompt_tokens": 3, "completion_tokens": TOKENS,
                "total_tokens": 3 + TOKENS}}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


class Signer:
    def sign(self, method: str, path: str, body: bytes) -> dict[str, str]:
        return {"X-Test-Signed": f"{method} {path}"}


@pytest.fixture
async def router():
    runners: list[web.AppRunner] = []
    proxies: list[Proxy] = []

    async def make(*nodes: Node, limit: int = 3) -> str:
        urls = []
        for n in nodes:
            r, url = await _serve(n.app)
            runners.append(r)
            urls.append(url)
        cfg = load(environ={}, overrides={"server": {"role": "router"},
                                          "router": {"backends": urls, "migration_limit": limit,
                                                     "health_interval_s": 0.05}})
        proxy = Proxy(StaticBackends(lambda: cfg), lambda: cfg, signer=Signer)
        await proxy.start()
        proxies.append(proxy)
        app = web.Application(middlewares=[request_context])
        proxy.add_routes(app)
        r, url = await _serve(app)
        runners.append(r)
        return url

    yield make
    for p in proxies:
        await p.close()
    for r in runners:
        await r.cleanup()


async def _stream(url: str, **extra) -> list[dict | str]:
    body = {"prompt": "hi", "stream": True, "max_tokens": TOKENS, **extra}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=body,
                          headers={"Authorization": "Bearer tenant"}) as r:
            assert r.status == 200
            text = await r.text()
    out: list[dict | str] = []
    for ev in text.split("\n\n"):
        if ev.startswith("data: "):
            data = ev[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _migrations() -> float:
    return sum(s.value for m in metrics.ROUTER_MIGRATIONS.collect() for s in m.samples
               if s.name.endswith("_total"))


async def test_a_stream_whose_node_dies_continues_on_another(router) -> None:
    a, b = Node(die_after=3), Node(die_after=3)    # whichever is picked dies after 3 tokens
    url = await router(a, b)
    before = _migrations()
    events = await _stream(url)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events if isinstance(e, dict)]
    assert not any("error" in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(
        f"t{i} " for i in range(TOKENS))
    assert len({c["id"] for c in chunks}) == 1              # the first node's id throughout
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c["choices"][0]
               for c in chunks)                             # the client did not ask for them
    conts = a.continued + b.continued
    assert len(conts) == 1 and len(a.continued) != len(b.continued)   # the other node
    assert conts[0]["output_token_ids"] == [100, 101, 102]
    assert conts[0]["prompt_token_ids"] == PROMPT_IDS and conts[0]["replay"] == "decode"
    assert a.signed + b.signed == [True]             # signed, the tenant's key for its salt
    assert _migrations() == before + 1


async def test_the_client_that_asked_for_token_ids_gets_them_once(router) -> None:
    url = await router(Node(die_after=2), Node(die_after=2))
    events = await _stream(url, return_token_ids=True)
    chunks = [e["choices"][0] for e in events if isinstance(e, dict)]
    assert [t for c in chunks for t in c["token_ids"]] == [100 + i for i in range(TOKENS)]
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [PROMPT_IDS]
    assert events[-1] == "[DONE]"


async def test_limit_zero_ends_with_one_server_error(router) -> None:
    url = await router(Node(die_after=3), limit=0)
    events = await _stream(url)
    assert "[DONE]" not in events
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["type"] == "server_error"
    assert "127.0.0.1" not in errors[0]["message"]


async def test_every_node_failing_ends_with_one_server_error_after_the_limit(router) -> None:
    nodes = [Node(die_after=1, always=True) for _ in range(4)]
    url = await router(*nodes, limit=2)
    events = await _stream(url)
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and errors[0]["type"] == "server_error"
    assert errors[0]["code"] == "backend_failed" and "[DONE]" not in events
    assert sum(len(n.continued) for n in nodes) == 2        # the limit: two resubmissions
    texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict) and "choices" in e]
    assert texts == ["t0 ", "t1 ", "t2 "]                   # each token once, in order


@pytest.mark.parametrize("how,reason", [("error", "error_event"), ("stall", "node_dead")])
async def test_an_error_event_or_a_silent_dropped_node_moves_the_stream(router, how,
                                                                        reason) -> None:
    a, b = Node(die_after=2, how=how), Node(die_after=2, how=how)
    url = await router(a, b)
    before = metrics.ROUTER_MIGRATIONS.labels(reason=reason)._value.get()
    events = await asyncio.wait_for(_stream(url), 10)
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e
                                              for e in events)
    assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)) == "".join(
        f"t{i} " for i in range(TOKENS))
    assert metrics.ROUTER_MIGRATIONS.labels(reason=reason)._value.get() == before + 1


async def test_a_node_dying_after_the_last_token_is_closed_by_the_router(router) -> None:
    a, b = Node(die_after=TOKENS), Node(die_after=TOKENS)   # cut after the finish chunk
    url = await router(a, b)
    events = await _stream(url, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e
                                              for e in events)
    usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
    assert usage == [{"prompt_tokens": 3, "completion_tokens": TOKENS,
                      "total_tokens": 3 + TOKENS}]
    assert not a.continued and not b.continued               # nothing left to continue


@pytest.mark.parametrize("limit", [3, 0])
async def test_a_non_streamed_request_a_draining_node_hands_back_is_resubmitted(router, limit
                                                                              ) -> None:
    """Drain (issue 33 item 2): the router marks a non-streamed request as movable too; a
    draining node answers it 503 handed_off before any byte, and the router resubmits it to
    the other node. With migration_limit 0 the router does not ask for that."""
    a, b = Node(), Node()
    a.hand_back = b.hand_back = [1]         # shared: whichever is picked first hands it back
    url = await router(a, b, limit=limit)
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 9},
                          headers={MIGRATABLE: "1"}) as r:     # a client's own is dropped
            status, body = r.status, await r.json()
    if limit:
        assert status == 200 and body["choices"][0]["text"] == "whole"
        assert a.migratable == b.migratable == [True]         # one each: moved once
    else:
        assert status == 200 and a.migratable + b.migratable == [False]   # never handed back


@pytest.mark.parametrize("how", ["stall", "hang"])
async def test_a_node_silent_before_its_first_token_is_left_for_another(router, how) -> None:
    """A stream's node hangs after its headers before any event (stall: SIGSTOP with a stream
    queued there) or before its headers (hang): once the node is no longer listed the router
    resubmits the request elsewhere instead of waiting for the total timeout."""
    a, b = Node(die_after=0, how=how), Node()
    b.ready, a.then = 503, b                # a is picked; b turns ready when a hangs
    url = await router(a, b)
    events = await asyncio.wait_for(_stream(url), 10)
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e
                                              for e in events)
    assert "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)) == "".join(
        f"t{i} " for i in range(TOKENS))
    assert not a.continued and not b.continued              # nothing was sent: a fresh retry


@pytest.mark.parametrize("die_after", [5, 7, 11])
async def test_an_n2_stream_whose_node_dies_continues_each_unfinished_choice(router, die_after
                                                                           ) -> None:
    """n = 2 (issue 33): the node dies after `die_after` interleaved events (11: choice 0 has
    finished, choice 1 has one token left); each unfinished choice continues alone, seeded as
    the node seeds that choice, re-indexed, and the router ends with one usage chunk (the
    prompt once, both choices' tokens) and one [DONE]."""
    a, b = Node(die_after=die_after), Node(die_after=die_after)
    url = await router(a, b, limit=1)         # one failure moving two choices: one migration
    before = _migrations()
    events = await _stream(url, n=2, seed=SEED, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events if isinstance(e, dict)]
    assert not any("error" in c for c in chunks)
    for c in (0, 1):
        assert "".join(ch["text"] for e in chunks for ch in e["choices"] if ch["index"] == c
                       ) == "".join(_text(c, i) for i in range(TOKENS))
    finishes = [ch["index"] for e in chunks for ch in e["choices"] if ch["finish_reason"]]
    assert sorted(finishes) == [0, 1]
    assert [e["usage"] for e in chunks if e.get("usage")] == [
        {"prompt_tokens": 3, "completion_tokens": 2 * TOKENS, "total_tokens": 3 + 2 * TOKENS}]
    assert len({e["id"] for e in chunks}) == 1
    conts = a.continued + b.continued
    sent = {0: (die_after + 1) // 2, 1: die_after // 2}
    moved = [c for c in (0, 1) if sent[c] < TOKENS]
    assert [x["request"]["seed"] - SEED for x in conts] == moved
    assert all(x["request"]["n"] == 1 for x in conts)
    assert [x["output_token_ids"] for x in conts] == [
        [100 + 10 * c + i for i in range(sent[c])] for c in moved]
    assert _migrations() == before + 1
