"""The one step (moed.engine.step) under its drivers (moed.engine.drivers): generate and the
serving loop both go through Engine.step; run_sync drives a step that never waits and refuses
one that would."""
from __future__ import annotations

import asyncio

import pytest

from moed.config import EngineConfig
from moed.engine.drivers import run_sync
from moed.engine.engine import Engine
from moed.engine.step import Go, StepCore
from moed.types import SamplingParams

from engine_fakes import FakeRunner

GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def _engine() -> Engine:
    cfg = EngineConfig(max_num_batched_tokens=16, max_num_seqs=8, block_size=4)
    return Engine(FakeRunner(64, 4), None, cfg, max_model_len=256)


def _counting(monkeypatch) -> list[Go]:
    seen: list[Go] = []
    real = StepCore.step

    async def step(self, driver):
        go = await real(self, driver)
        seen.append(go)
        return go
    monkeypatch.setattr(StepCore, "step", step)
    return seen


def test_generate_runs_on_the_one_step(monkeypatch, ref_greedy) -> None:
    seen = _counting(monkeypatch)
    eng = _engine()
    assert eng.generate([[1, 2, 3, 4, 5]], GREEDY) == [ref_greedy([1, 2, 3, 4, 5], 3)]
    assert seen.count(Go.STEP) == eng.steps == 3      # one prefill step, two decode steps


async def test_the_serving_loop_runs_on_the_one_step(monkeypatch, ref_greedy) -> None:
    seen = _counting(monkeypatch)
    eng = _engine()
    await eng.start()
    try:
        stream = eng.add_request("r", [1, 2, 3, 4, 5], GREEDY)
        evs = [ev async for ev in stream]
        assert [t for e in evs for t in e.token_ids] == ref_greedy([1, 2, 3, 4, 5], 3)
        assert seen.count(Go.STEP) == eng.steps == 3 and Go.IDLE in seen
    finally:
        await eng.shutdown()


def test_run_sync_returns_a_result_and_refuses_a_step_that_waits() -> None:
    async def quick() -> int:
        return 7

    async def waits() -> None:
        await asyncio.sleep(0)

    assert run_sync(quick()) == 7
    with pytest.raises(RuntimeError, match="wait"):
        run_sync(waits())
