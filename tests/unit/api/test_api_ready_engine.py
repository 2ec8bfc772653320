"""/ready follows the real engine's liveness: 503 once its step loop has crashed."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from api_harness import running_app

from moed.config import EngineConfig
from moed.engine.engine import Engine
from moed.types import FinishReason, SamplingParams
from moed.engine.runner import RunnerDefaults


class _Runner(RunnerDefaults):
    """Minimal runner: always prefers token 1."""
    num_blocks, block_size = 16, 4
    spec = SimpleNamespace(vocab_size=8, max_position_embeddings=64, eos_token_ids=(7,))

    def forward(self, batch):
        out = torch.zeros(batch.num_seqs, 8)
        out[:, 1] = 5.0
        return out


async def test_ready_is_503_once_the_engine_loop_crashed(http):
    eng = Engine(_Runner(), None, EngineConfig(block_size=4))
    async with running_app(eng) as (app, url, _):
        async with http.get(f"{url}/ready") as r:
            assert r.status == 200
        assert eng.alive

        def broken():
            raise RuntimeError("scheduler bug")
        eng.scheduler.schedule = broken
        stream = eng.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2))
        evs = [ev async for ev in stream]       # the loop crashed: the request fails, no hang
        assert evs[-1].finish_reason is FinishReason.ERROR and not eng.alive
        async with http.get(f"{url}/ready") as r:
            assert r.status == 503 and (await r.json())["status"] == "engine_failed"
        async with http.get(f"{url}/metrics") as r:
            assert "moed_ready 0.0" in await r.text()
        async with http.get(f"{url}/health") as r:
            assert r.status == 200          # liveness of the process, not the engine
