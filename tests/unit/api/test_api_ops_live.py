"""Daemon-side live behaviour over real loopback HTTP with the engine double: /ready reports the
node's load (and the router's static-backend mode reads it), and server.max_body_bytes follows
the live config both ways."""
from __future__ import annotations

import asyncio
import dataclasses

import aiohttp
from api_harness import running_app

from moed.api.proxy import StaticBackends
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
        assert [(b.waiting, b.running) for b in src.backends()] == [(0, 1)]
        (await task).close()         # disconnect: the request is aborted, the drain is quick
