"""The engine's PromptSource (moed.engine.prompts): a source that holds a request parked, then
submits it, serves it like any other; an abort while parked ends its stream and a later submit
does nothing; the source is chosen once."""
from __future__ import annotations

import asyncio

import pytest

from moed.config import EngineConfig
from moed.engine.engine import Engine
from moed.engine.prompts import PendingPrompt
from moed.types import FinishReason, SamplingParams

from engine_fakes import FakeRunner

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


class Parking:
    """Holds every request until the test releases it; records cancellations."""

    def __init__(self) -> None:
        self.held: dict[str, PendingPrompt] = {}
        self.cancelled: list[str] = []

    def admit(self, pending: PendingPrompt) -> None:
        self.held[pending.request_id] = pending

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


def _engine() -> Engine:
    cfg = EngineConfig(max_num_batched_tokens=16, max_num_seqs=8, block_size=4)
    return Engine(FakeRunner(64, 4), None, cfg, max_model_len=256)


async def _collect(stream):
    return [ev async for ev in stream]


async def test_a_parked_request_runs_once_its_source_submits_it(ref_greedy) -> None:
    eng, src = _engine(), Parking()
    eng.use_prompt_source(src)
    await eng.start()
    try:
        stream = eng.add_request("p", [1, 2, 3, 4, 5], GREEDY)
        await asyncio.sleep(0.05)
        assert "p" not in eng.scheduler.requests and eng.steps == 0     # parked
        src.held["p"].submit()
        evs = await asyncio.wait_for(_collect(stream), 10)
        assert [t for e in evs for t in e.token_ids] == ref_greedy([1, 2, 3, 4, 5], 4)
        assert evs[-1].finish_reason is FinishReason.LENGTH
    finally:
        await eng.shutdown()


async def test_an_abort_while_parked_ends_the_stream_and_a_late_submit_does_nothing() -> None:
    eng, src = _engine(), Parking()
    eng.use_prompt_source(src)
    await eng.start()
    try:
        stream = eng.add_request("a", [1, 2, 3], GREEDY)
        eng.abort("a")
        evs = await asyncio.wait_for(_collect(stream), 10)
        assert evs[-1].finish_reason is FinishReason.ABORT and src.cancelled == ["a"]
        src.held["a"].submit()              # the source's work finished after the abort
        await asyncio.sleep(0.05)
        assert "a" not in eng.scheduler.requests and eng.kv.num_used_blocks == 0
        again = eng.add_request("a", [1, 2, 3], GREEDY)     # the id is free again
        src.held["a"].submit()
        assert (await asyncio.wait_for(_collect(again), 10))[-1].finish_reason \
            is FinishReason.LENGTH
    finally:
        await eng.shutdown()


async def test_a_bad_prompt_is_refused_before_the_source_sees_it() -> None:
    eng, src = _engine(), Parking()
    eng.use_prompt_source(src)
    with pytest.raises(ValueError):
        eng.add_request("e", [], GREEDY)
    assert not src.held


async def test_shutdown_ends_parked_requests() -> None:
    eng, src = _engine(), Parking()
    eng.use_prompt_source(src)
    await eng.start()
    stream = eng.add_request("s", [1, 2, 3], GREEDY)
    await eng.shutdown()
    evs = await asyncio.wait_for(_collect(stream), 10)
    assert evs[-1].finish_reason is FinishReason.ABORT
    src.held["s"].submit()                  # nothing: the engine has stopped


def test_the_prompt_source_is_chosen_once() -> None:
    eng = _engine()
    eng.use_prompt_source(Parking())
    with pytest.raises(RuntimeError, match="once"):
        eng.use_prompt_source(Parking())
