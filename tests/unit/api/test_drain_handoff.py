"""Drain hands streams over (issue 33 item 2): after server.drain_migrate_after_s a draining
node ends each stream a router relays for migration (X-Moed-Migratable) with one server_error
event, code handed_off, and no [DONE] (a non-streamed request: a 503 handed_off before any
byte); a client's own request runs on to its end."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from api_fake_engine import FakeEngine
from api_harness import running_app

from moed.api.generate import MIGRATABLE

pytestmark = pytest.mark.timeout(30)


async def _stream(url: str, headers: dict, got: list[str]) -> None:
    body = {"prompt": [1, 2, 3], "max_tokens": 60, "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
            async for line in r.content:
                if line.startswith(b"data: "):
                    got.append(line[6:].strip().decode())


async def test_a_drain_hands_back_only_the_router_relayed_streams() -> None:
    relayed: list[str] = []
    direct: list[str] = []
    async with running_app(FakeEngine(step_s=0.02),
                           server={"drain_migrate_after_s": 0.2, "shutdown_grace_s": 10}
                           ) as (app, url, _):
        tasks = [asyncio.create_task(_stream(url, {MIGRATABLE: "1"}, relayed)),
                 asyncio.create_task(_stream(url, {}, direct))]
        for _ in range(200):
            if relayed and direct:
                break
            await asyncio.sleep(0.01)
        assert relayed and direct, "both streams under way"
        drain = asyncio.create_task(app.drain())
        await asyncio.wait_for(asyncio.gather(*tasks), 20)
        await asyncio.wait_for(drain, 20)
    errors = [json.loads(e)["error"] for e in relayed if e.startswith('{"error"')]
    assert len(errors) == 1 and errors[0]["type"] == "server_error"
    assert errors[0]["code"] == "handed_off" and "[DONE]" not in relayed
    assert direct[-1] == "[DONE]" and not any(e.startswith('{"error"') for e in direct)
    assert sum(1 for e in direct if '"text"' in e) == 60      # ran to its end
    assert not app.state.handoffs                             # nothing left registered


async def test_a_drain_hands_back_a_relayed_non_streamed_request_with_a_503() -> None:
    async def post(url: str, headers: dict) -> tuple[int, dict]:
        body = {"prompt": [1, 2, 3], "max_tokens": 60}
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
                return r.status, await r.json()

    engine = FakeEngine(step_s=0.02)
    async with running_app(engine, server={"drain_migrate_after_s": 0.2,
                                           "shutdown_grace_s": 10}) as (app, url, _):
        relayed = asyncio.create_task(post(url, {MIGRATABLE: "1"}))
        direct = asyncio.create_task(post(url, {}))
        for _ in range(200):
            if len(app.state.handoffs) == 1 and app.state.inflight == 2:
                break
            await asyncio.sleep(0.01)
        assert len(app.state.handoffs) == 1, "only the relayed request may be handed back"
        drain = asyncio.create_task(app.drain())
        (s1, b1), (s2, b2) = await asyncio.wait_for(asyncio.gather(relayed, direct), 20)
        await asyncio.wait_for(drain, 20)
    assert s1 == 503 and b1["error"]["type"] == "server_error"
    assert b1["error"]["code"] == "handed_off"
    assert s2 == 200 and b2["usage"]["completion_tokens"] == 60      # ran to its end
    assert not app.state.handoffs
