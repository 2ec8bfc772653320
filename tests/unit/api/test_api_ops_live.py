"""Daemon-side live behaviour over real loopback HTTP with the engine double: /ready reports the
node's load (and the router's static-backend mode reads it), and server.max_body_bytes follows
the live config both ways."""
from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
from api_harness import running_app

from moed.api.backends import StaticBackends
from moed.config import load


async def test_ready_reports_load_and_the_router_reads_it(http) -> None:
    async with running_app() as (_, url, engine):
        engine.step_s = 0.05          # slow enough to catch the request running
        task = asyncio.ensure_future(http.post(f"{url}/v1/completions", json={
            "prompt": "hold", "max_tokens": 40, "ignore_eos": True, "stream": True}))
        for _ in range(100):
            if engine.stats().running:
                break
            await asyncio.sleep(0.01)
        async with http.get(f"{url}/ready") as r:
            body = await r.json()
        assert r.status == 200 and (body["waiting"], body["running"]) == (0, 1)
        cfg = load(environ={}, overrides={"server": {"role": "router"},
                                          "router": {"backends": [url]}})
        src = StaticBackends(lambda: cfg)
        await src.poll_once(http)
        assert [(b.load.waiting, b.load.running) for b in src.backends()] == [(0, 1)]
        (await task).close()         # disconnect: the request is aborted, the drain is quick


async def _chunked(data: bytes):
    for i in range(0, len(data), 1024):    # no Content-Length: Transfer-Encoding: chunked
        yield data[i:i + 1024]


async def test_max_body_bytes_follows_the_live_config_both_ways(http) -> None:
    async with running_app(server={"max_body_bytes": 1000}) as (app, url, engine):
        body = b'{"prompt": "hi",' + b" " * 4000 + b'"max_tokens": 1}'

        async def post(chunked: bool) -> tuple[int, dict]:
            data = _chunked(body) if chunked else body
            async with http.post(f"{url}/v1/completions", data=data,
                                 headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json()

        def set_limit(n: int) -> None:
            cfg = app.config
            app.set_config(dataclasses.replace(
                cfg, server=dataclasses.replace(cfg.server, max_body_bytes=n)))

        status, err = await post(chunked=False)
        assert status == 413 and "limit 1000 bytes" in err["error"]["message"]
        set_limit(100_000)                      # raised live: above the build-time limit
        for chunked in (False, True):
            status, resp = await post(chunked)
            assert status == 200 and resp["usage"]["prompt_tokens"] == 2, resp
        set_limit(2000)                         # lowered live
        for chunked in (False, True):
            status, err = await post(chunked)
            assert status == 413 and err["error"]["code"] == "body_too_large", err
            assert "limit 2000 bytes" in err["error"]["message"]
        assert engine.stats().kv_blocks_used == 0 and not engine.reqs
