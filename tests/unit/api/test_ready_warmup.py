"""Readiness stays false during warm-up: the HTTP site is up (probes answer) while the
components start — the engine's weight load, kernel build and cost-model calibration run in
EngineComponent.start (moed.app) — and /ready turns 200 only after the last one started."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from moed import config
from moed.app import App


class WarmingUp:
    """Stands in for EngineComponent: its start (calibration) finishes when released."""

    name = "warmup"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = asyncio.Event()

    def add_routes(self, web_app) -> None:
        pass

    async def start(self, app) -> None:
        self.started.set()
        await asyncio.wait_for(self.release.wait(), 10)

    async def drain(self) -> None:
        pass

    async def stop(self) -> None:
        pass


@pytest.mark.asyncio
async def test_ready_is_503_starting_until_warm_up_ends() -> None:
    cfg = config.from_dict({"server": {"role": "router", "host": "127.0.0.1", "port": 0}}, "t")
    warm = WarmingUp()
    app = App(cfg, [warm])
    starting = asyncio.ensure_future(app.start())
    try:
        await asyncio.wait_for(warm.started.wait(), 10)
        async with aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{app.port}"
            async with s.get(base + "/health") as r:
                assert r.status == 200                      # alive while warming up
            async with s.get(base + "/ready") as r:
                assert r.status == 503 and (await r.json())["status"] == "starting"
            async with s.get(base + "/metrics") as r:
                assert "moed_ready 0.0" in await r.text()
            warm.release.set()
            await asyncio.wait_for(starting, 10)
            async with s.get(base + "/ready") as r:
                assert r.status == 200, await r.text()
    finally:
        warm.release.set()
        await asyncio.gather(starting, return_exceptions=True)
        await app.drain()
