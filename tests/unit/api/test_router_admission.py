"""The router's use of the placement policy over real loopback HTTP: admission (429 +
Retry-After when every serving node is saturated, nothing forwarded), prefix affinity with the
router's tokenizer, and /ready false while no serving node is alive."""
from __future__ import annotations

import aiohttp
from aiohttp import web

from moed.api import health
from moed.api.middleware import request_context
from moed.api.offload import Offload
from moed.api.proxy import Proxy
from moed.api.state import STATE, ServerState
from moed.balance.candidate import Candidate
from moed.cluster.state import LoadVector, digest_key
from moed.config import load
from moed.kvcache.manager import leading
from moed.kvcache.pool import hash_block
from moed.obs import metrics


class _Tok:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


class _Source:
    def __init__(self) -> None:
        self.cands: list[Candidate] = []

    def backends(self) -> list[Candidate]:
        return list(self.cands)

    def mark_failed(self, name: str) -> None:
        pass


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _digest(tokens: list[int], bs: int) -> tuple[int, ...]:
    hashes, parent = [], None
    for i in range(len(tokens) // bs):
        parent = hash_block(parent, tokens[i * bs:(i + 1) * bs])
        hashes.append(parent)
    return tuple(digest_key(h) for h in leading(hashes))


async def test_saturated_cluster_is_refused_and_affinity_picks_the_holder() -> None:
    hits: dict[str, int] = {"a": 0, "b": 0}
    runners = []
    urls = {}
    for name in hits:
        async def ok(request: web.Request, name: str = name) -> web.Response:
            hits[name] += 1
            return web.json_response({"node": name})
        app = web.Application()
        app.router.add_post("/v1/completions", ok)
        r, urls[name] = await _serve(app)
        runners.append(r)
    cfg = load(environ={}, overrides={"server": {"role": "router"},
                                      "balance": {"router_max_waiting": 4},
                                      "admission": {"retry_after_s": 3}})
    src = _Source()
    proxy = Proxy(src, lambda: cfg, offload=Offload(1, 4), tokenizer=_Tok())
    await proxy.start()
    front = web.Application(middlewares=[request_context])
    proxy.add_routes(front)
    r, url = await _serve(front)
    runners.append(r)
    prompt = "the shared system prompt, then the question"
    try:
        busy = [Candidate(n, urls[n], "decode", load=LoadVector(waiting=4, block_size=4,
                                                                 free_kv_blocks=100))
                for n in hits]
        src.cands = busy
        before = metrics.ROUTER_REQUESTS.labels(result="saturated")._value.get()
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": prompt}) as resp:
                body = await resp.json()
                assert resp.status == 429 and resp.headers["Retry-After"] == "3"
                assert body["error"]["code"] == "overloaded"
        assert hits == {"a": 0, "b": 0}                     # nothing was forwarded
        assert metrics.ROUTER_REQUESTS.labels(result="saturated")._value.get() == before + 1

        # b holds the prompt's prefix: every request with it goes there
        digest = _digest([ord(c) for c in prompt], 4)
        src.cands = [Candidate("a", urls["a"], "decode",
                               load=LoadVector(block_size=4, free_kv_blocks=100)),
                     Candidate("b", urls["b"], "decode",
                               load=LoadVector(waiting=1, block_size=4, free_kv_blocks=100,
                                               prefix_digest=digest))]
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(url + "/v1/completions",
                                  json={"prompt": prompt + " again?"}) as resp:
                    assert resp.status == 200 and resp.headers["X-Moed-Backend"] == "b"
            async with s.post(url + "/v1/completions", json={"prompt": "unrelated"}) as resp:
                assert resp.headers["X-Moed-Backend"] == "a"    # by load: a has no queue
        assert hits == {"a": 1, "b": 3}
    finally:
        await proxy.close()
        for r in runners:
            await r.cleanup()


async def test_ready_is_false_while_no_serving_node_is_alive() -> None:
    cfg = load(environ={}, overrides={"server": {"role": "router"}})
    state = ServerState(config=cfg, ready=True)
    backends: list[str] = []
    state.unready_reason = lambda: "" if backends else "no_backend"
    app = web.Application()
    app[STATE] = state
    health.add_routes(app)
    r, url = await _serve(app)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/ready") as resp:
                assert resp.status == 503 and (await resp.json())["status"] == "no_backend"
            backends.append("d1")
            async with s.get(url + "/ready") as resp:
                assert resp.status == 200
    finally:
        await r.cleanup()
