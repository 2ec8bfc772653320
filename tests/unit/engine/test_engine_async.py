"""Engine with the fake runner: streams, abort, errors, shutdown, on_step, generate(), remote KV,
an event loop that stays responsive while a step runs, and every block back in the pool."""
from __future__ import annotations

import asyncio
import time

import pytest

from moed.config import EngineConfig
from moed.engine.engine import Engine
from moed.engine.stream import StepStats
from moed.types import FinishReason, SamplingParams

from engine_fakes import FakeRunner, next_token

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


class LetterTokenizer:
    eos_token_ids = (63,)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


class SlowRunner(FakeRunner):
    def forward(self, batch):
        time.sleep(0.05)
        return super().forward(batch)


def _engine(runner=None, tokenizer=None, **kw):
    cfg = EngineConfig(**{"max_num_batched_tokens": 16, "max_num_seqs": 8, "block_size": 4, **kw})
    return Engine(runner or FakeRunner(64, 4), tokenizer, cfg, max_model_len=256)


async def _collect(stream):
    return [ev async for ev in stream]


async def _until(cond, timeout=10.0):
    """Poll until cond() holds (the engine applies commands at its next step boundary)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


async def test_concurrent_streams_match_reference(ref_greedy):
    eng = _engine()
    steps: list[StepStats] = []
    eng.subscribe_step(steps.append)
    await eng.start()
    try:
        prompts = [list(range(1, 4 + 7 * i)) for i in range(4)]
        streams = [eng.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        for p, evs in zip(prompts, results):
            assert [t for e in evs for t in e.token_ids] == ref_greedy(p, 6)
            assert evs[-1].finish_reason is FinishReason.LENGTH
            assert all(e.finish_reason is None for e in evs[:-1])
            assert evs[-1].num_prompt_tokens == len(p)
        st = eng.stats()
        assert st.kv_blocks_used == 0 and st.running == 0 and st.waiting == 0
        assert steps and all(s.num_prefill_tokens + s.num_decode_tokens <= 16 for s in steps)
        assert sum(s.num_sampled for s in steps) == 24 and st.steps == len(steps)
    finally:
        await eng.shutdown()


async def test_abort_mid_stream_frees_blocks():
    eng = _engine(SlowRunner(64, 4))
    await eng.start()
    try:
        s = eng.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=200, temperature=0.0))
        got = []
        async for ev in s:
            got.append(ev)
            if len(got) == 2:
                eng.abort("a")
        assert got[-1].finish_reason is FinishReason.ABORT and len(got) <= 4
        assert eng.stats().kv_blocks_used == 0
        eng.abort("a")                             # unknown by now: harmless
        eng.abort("never-existed")
    finally:
        await eng.shutdown()


async def test_bad_requests_raise_value_error():
    eng = _engine()
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("x", [], GREEDY)
    with pytest.raises(ValueError, match="maximum context length is 256"):
        eng.add_request("x", [1] * 257, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("x", [1, 64], GREEDY)
    eng.add_request("dup", [1], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("dup", [1], GREEDY)
    await eng.shutdown()


async def test_shutdown_aborts_everything():
    eng = _engine(SlowRunner(64, 4))
    await eng.start()
    streams = [eng.add_request(f"r{i}", [1, 2, i + 3], SamplingParams(max_tokens=500, temperature=0.0))
               for i in range(3)]
    await asyncio.sleep(0.12)
    await asyncio.wait_for(eng.shutdown(), 20)
    for s in streams:
        evs = await asyncio.wait_for(_collect(s), 1)
        assert evs[-1].finish_reason is FinishReason.ABORT
    assert eng.stats().kv_blocks_used == 0
    with pytest.raises(RuntimeError):
        eng.add_request("late", [1], GREEDY)


async def test_event_loop_stays_responsive_during_steps():
    eng = _engine(SlowRunner(64, 4))
    await eng.start()
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    t = asyncio.create_task(ticker())
    try:
        evs = await _collect(eng.add_request("a", [1, 2, 3], GREEDY))
        assert len(evs) == 6
        assert ticks >= 6            # >= 6 steps of 50 ms ran in the executor, not on the loop
    finally:
        t.cancel()
        await eng.shutdown()


async def test_idle_loop_waits_without_stepping():
    eng = _engine()
    await eng.start()
    await asyncio.sleep(0.05)
    assert eng.stats().steps == 0
    await _collect(eng.add_request("a", [1, 2], GREEDY))
    n = eng.stats().steps
    await asyncio.sleep(0.05)
    assert eng.stats().steps == n
    await eng.shutdown()


async def test_stop_string_through_engine():
    eng = _engine(tokenizer=LetterTokenizer())
    prompt = [1, 2, 3]
    ref = []
    seq = list(prompt)
    for _ in range(6):
        ref.append(next_token(seq))
        seq.append(ref[-1])
    text = "".join(chr(97 + t % 26) for t in ref)
    stop = text[2:4]
    await eng.start()
    try:
        evs = await _collect(eng.add_request(
            "s", prompt, SamplingParams(max_tokens=6, temperature=0.0, stop=(stop,))))
        out = "".join(e.text for e in evs)
        assert out == text[:text.index(stop)] and evs[-1].finish_reason is FinishReason.STOP
    finally:
        await eng.shutdown()


async def test_seeded_sampling_ignores_batch_mates():
    async def run(mates: int) -> list[int]:
        eng = _engine()
        await eng.start()
        try:
            for i in range(mates):
                eng.add_request(f"m{i}", [i + 1, 5, 9], SamplingParams(max_tokens=6, temperature=1.0))
            s = eng.add_request("me", [7, 7, 7], SamplingParams(max_tokens=6, temperature=3.0, seed=5))
            return [t for e in await _collect(s) for t in e.token_ids]
        finally:
            await eng.shutdown()

    assert await run(0) == await run(3)


def test_generate_sync_and_memory(ref_greedy):
    eng = _engine(max_num_batched_tokens=8)
    prompts = [list(range(1, 20)), [5, 6], list(range(30, 41))]
    outs = eng.generate(prompts, GREEDY)
    assert outs == [ref_greedy(p, 6) for p in prompts]
    assert eng.kv.num_used_blocks == 0
    outs2 = eng.generate(prompts, GREEDY)                   # prefix-cache hits this time
    assert outs2 == outs and eng.stats().prefix_cache_hits > 0


async def test_remote_kv_and_prefill_only_roundtrip(ref_greedy):
    """A 'prefill' engine runs the prompt and keeps its blocks; a 'decode' engine receives the KV
    (copied slot by slot, standing in for the transfer) and decodes on."""
    progress = []
    pre = _engine()
    pre.subscribe_prefill_progress(lambda rid, ids, n: progress.append((rid, list(ids), n)))
    dec = _engine()
    await pre.start()
    await dec.start()
    try:
        prompt = list(range(1, 15))
        d_stream = dec.add_request("r", prompt, GREEDY, remote_kv=True)
        blocks, cached = await asyncio.wait_for(d_stream.kv_blocks, 2)
        assert cached == 0 and len(blocks) == 4
        assert dec.stats().waiting_remote_kv == 1
        p_evs = await _collect(pre.add_request("r", prompt, GREEDY, prefill_only=True))
        assert p_evs[-1].finish_reason is FinishReason.STOP and len(p_evs[-1].token_ids) == 1
        rid, p_blocks, n = progress[-1]
        assert n == len(prompt) and pre.stats().kv_blocks_used == 4        # held for transfer
        for pos in range(len(prompt)):
            dec.runner.slots[(blocks[pos // 4], pos % 4)] = pre.runner.slots[(p_blocks[pos // 4], pos % 4)]
        pre.release_kv("r")
        dec.complete_remote_prefill("r", p_evs[-1].token_ids[0])
        d_evs = await _collect(d_stream)
        assert [t for e in d_evs for t in e.token_ids] == ref_greedy(prompt, 6)
        await _until(lambda: pre.stats().kv_blocks_used == 0 and dec.stats().kv_blocks_used == 0)
    finally:
        await pre.shutdown()
        await dec.shutdown()


async def test_apply_config_changes_budget_at_step_boundary():
    eng = _engine(SlowRunner(64, 4))
    steps: list[StepStats] = []
    eng.subscribe_step(steps.append)
    await eng.start()
    try:
        eng.apply_config(EngineConfig(block_size=4, max_num_batched_tokens=4, max_num_seqs=2))
        await _collect(eng.add_request("a", list(range(1, 13)), GREEDY))
        assert eng.scheduler.max_num_batched_tokens == 4 and eng.scheduler.max_num_seqs == 2
        assert max(s.num_prefill_tokens + s.num_decode_tokens for s in steps) == 4
    finally:
        await eng.shutdown()


class BrokenOnceRunner(FakeRunner):
    def __init__(self, *a):
        super().__init__(*a)
        self.broken = True

    def forward(self, batch):
        if self.broken:
            self.broken = False
            raise RuntimeError("device fell over")
        return super().forward(batch)


async def test_failed_step_fails_its_requests_not_the_engine(ref_greedy):
    eng = _engine(BrokenOnceRunner(64, 4))
    await eng.start()
    try:
        evs = await asyncio.wait_for(_collect(eng.add_request("a", [1, 2, 3], GREEDY)), 5)
        assert evs[-1].finish_reason is FinishReason.ERROR and "device fell over" in evs[-1].error
        assert eng.stats().kv_blocks_used == 0
        evs = await asyncio.wait_for(_collect(eng.add_request("b", [1, 2, 3], GREEDY)), 5)
        assert [t for e in evs for t in e.token_ids] == ref_greedy([1, 2, 3], 6)
    finally:
        await eng.shutdown()


def test_generate_reports_a_prompt_that_never_fits():
    eng = _engine(FakeRunner(4, 4))                  # 16 tokens of KV in all
    with pytest.raises(RuntimeError, match="needs 5 KV blocks but the whole cache has 4"):
        eng.generate([list(range(1, 18))], GREEDY)
    assert eng.kv.num_used_blocks == 0


async def test_stream_gets_error_for_a_prompt_that_never_fits():
    eng = _engine(FakeRunner(4, 4))
    await eng.start()
    try:
        evs = await asyncio.wait_for(_collect(eng.add_request("big", list(range(1, 18)), GREEDY)), 5)
        assert len(evs) == 1 and evs[0].finish_reason is FinishReason.ERROR
        assert "KV blocks" in evs[0].error and evs[0].num_prompt_tokens == 17
        ok = await asyncio.wait_for(_collect(eng.add_request("ok", [1, 2], GREEDY)), 5)
        assert ok[-1].finish_reason is FinishReason.LENGTH
    finally:
        await eng.shutdown()


async def test_at_step_boundary_runs_between_steps():
    runner = SlowRunner(64, 4)
    inflight = []
    orig = runner.forward

    def forward(batch):
        inflight.append(1)
        try:
            return orig(batch)
        finally:
            inflight.pop()

    runner.forward = forward
    eng = _engine(runner)
    await eng.start()
    try:
        s = eng.add_request("a", [1, 2, 3], GREEDY)
        await asyncio.sleep(0.02)
        seen = await asyncio.wait_for(eng.at_step_boundary(lambda: (len(inflight), eng.steps)), 5)
        assert seen[0] == 0
        with pytest.raises(ZeroDivisionError):
            await asyncio.wait_for(eng.at_step_boundary(lambda: 1 / 0), 5)
        await _collect(s)
    finally:
        await eng.shutdown()


async def test_stream_aclose_aborts_and_abort_releases_held_prefill():
    eng = _engine(SlowRunner(64, 4))
    await eng.start()
    try:
        s = eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0))
        async for _ in s:
            break
        await s.aclose()                              # client went away
        await _until(lambda: eng.stats().running == 0 and eng.stats().kv_blocks_used == 0)
        p = await _collect(eng.add_request("p", list(range(1, 10)), GREEDY, prefill_only=True))
        assert p[-1].finish_reason is FinishReason.STOP and eng.stats().kv_blocks_used == 3
        eng.abort("p")                                # the transfer gave up: blocks go back
        await _until(lambda: eng.stats().kv_blocks_used == 0)
    finally:
        await eng.shutdown()


async def test_seeded_remote_prefill_matches_colocated():
    """Token one sampled on a 'prefill' engine, the rest on a 'decode' engine: with a seed and
    temperature > 0 the tokens equal a colocated run's (the decode generator skips token one)."""
    prompt = list(range(3, 14))
    params = SamplingParams(max_tokens=8, temperature=2.0, seed=1234)
    col, pre, dec = _engine(), _engine(), _engine()
    for e in (col, pre, dec):
        await e.start()
    try:
        want = [t for e in await _collect(col.add_request("c", prompt, params)) for t in e.token_ids]
        d_stream = dec.add_request("r", prompt, params, remote_kv=True)
        blocks, _ = await asyncio.wait_for(d_stream.kv_blocks, 2)
        p_evs = await _collect(pre.add_request("r", prompt, params, prefill_only=True))
        first = p_evs[-1].token_ids[0]
        assert first == want[0]
        p_blocks = pre.kv_block_table("r")
        for pos in range(len(prompt)):
            dec.runner.slots[(blocks[pos // 4], pos % 4)] = pre.runner.slots[(p_blocks[pos // 4], pos % 4)]
        pre.release_kv("r")
        dec.complete_remote_prefill("r", first)
        got = [t for e in await _collect(d_stream) for t in e.token_ids]
        assert got == want
        assert len(set(want)) > 2          # really sampled, not the fake model's greedy path
    finally:
        for e in (col, pre, dec):
            await e.shutdown()


async def test_alive_until_the_loop_crashes_or_stops():
    eng = _engine()
    assert not eng.alive                              # not started
    await eng.start()
    try:
        assert eng.alive
        await _collect(eng.add_request("ok", [1, 2], GREEDY))
        assert eng.alive

        def broken():
            raise RuntimeError("scheduler bug")
        eng.scheduler.schedule = broken               # a bug outside the step's try: loop dies
        evs = await asyncio.wait_for(_collect(eng.add_request("x", [1, 2], GREEDY)), 5)
        assert evs[-1].finish_reason is FinishReason.ERROR and "scheduler bug" in evs[-1].error
        await _until(lambda: not eng.alive)
        with pytest.raises(RuntimeError, match="not running"):
            eng.add_request("y", [1], GREEDY)
    finally:
        await eng.shutdown()
    assert not eng.alive
    eng2 = _engine()
    await eng2.start()
    await eng2.shutdown()
    assert not eng2.alive


async def test_top_logprobs_in_token_events_local_and_remote():
    eng = _engine()
    await eng.start()
    try:
        p = SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=2)
        evs = [e for e in await _collect(eng.add_request("a", [1, 2, 3], p)) if e.token_ids]
        assert len(evs) == 3
        for e in evs:
            (top,) = e.top_logprobs
            assert len(top) == 2 and top[0][0] == e.token_ids[0] and top[0][1] == e.logprobs[0]
            assert top[0][1] >= top[1][1]
        plain = await _collect(eng.add_request("b", [1, 2, 3], GREEDY))
        assert all(e.top_logprobs == () for e in plain)
        d = eng.add_request("r", [4, 5, 6], p, remote_kv=True)   # first token from "elsewhere"
        await asyncio.wait_for(d.kv_blocks, 2)
        eng.complete_remote_prefill("r", 9, -0.1, ((9, -0.1), (4, -2.0), (5, -3.0)))
        first = (await d.__anext__())
        assert first.token_ids == (9,) and first.top_logprobs == (((9, -0.1), (4, -2.0)),)
        eng.abort("r")
    finally:
        await eng.shutdown()
