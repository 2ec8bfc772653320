"""A migrated request resumed on another engine (moed.engine.resume): the sent tokens count as
output (max_tokens from the original start, the model's context), a decode replay forces them
as the next steps' tokens and publishes them, a prefill replay recomputes them without
publishing, a seeded generator is advanced by the tokens already drawn, and what is not a live
continuation is refused."""
from __future__ import annotations

import asyncio
from collections import deque

import pytest
import torch

from moed.config import EngineConfig
from moed.engine.engine import Engine
from moed.engine.plan import ScheduledChunk, StepPlan
from moed.engine.request import Request
from moed.engine.resume import force, prime
from moed.model.sampler import make_generator, seeded_noise
from moed.types import FinishReason, SamplingParams

from engine_fakes import FakeRunner

pytestmark = pytest.mark.timeout(30)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPT = [3, 1, 4, 1, 5]
SENT = [7, 7, 2]       # not what greedy would give: the continuation must read them as context


def _engine() -> Engine:
    cfg = EngineConfig(max_num_batched_tokens=16, max_num_seqs=8, block_size=4)
    return Engine(FakeRunner(64, 4), None, cfg, max_model_len=256)


async def _run(eng: Engine, rid: str, prompt: list[int], **kw) -> list:
    return [ev async for ev in eng.add_request(rid, prompt, GREEDY, **kw)]


@pytest.mark.parametrize("replay", ["decode", "prefill"])
async def test_a_resumed_request_continues_from_its_sent_tokens(ref_greedy, replay) -> None:
    eng = _engine()
    await eng.start()
    try:
        evs = await asyncio.wait_for(_run(eng, "r", PROMPT, resume=SENT, replay=replay), 10)
    finally:
        await eng.shutdown()
    got = [t for e in evs for t in e.token_ids]
    rest = ref_greedy(PROMPT + SENT, GREEDY.max_tokens - len(SENT))
    # decode: the sent tokens come back first (the API drops them); prefill: never published
    assert got == (SENT + rest if replay == "decode" else rest)
    assert evs[-1].finish_reason is FinishReason.LENGTH     # max_tokens from the original start
    assert not eng._forced                                  # nothing left behind


async def test_a_continuation_that_is_not_live_is_refused() -> None:
    eng = _engine()
    await eng.start()
    try:
        with pytest.raises(ValueError, match="vocabulary"):
            eng.add_request("a", PROMPT, GREEDY, resume=[10 ** 6])
        with pytest.raises(ValueError, match="room"):
            eng.add_request("b", PROMPT, GREEDY, resume=[1] * 251)
        with pytest.raises(ValueError, match="finished"):     # max_tokens already reached
            eng.add_request("c", PROMPT, GREEDY, resume=[1] * 8, replay="prefill")
        with pytest.raises(ValueError, match="replay"):
            eng.add_request("d", PROMPT, GREEDY, resume=[1], replay="sideways")
    finally:
        await eng.shutdown()


def test_prefill_replay_counts_output_and_advances_the_seeded_generator() -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=42, stop_token_ids=(9,))
    req = Request("r", PROMPT, params, rng=make_generator(42))
    prime(req, SENT, vocab_size=64)
    assert req.output_token_ids == SENT and req.num_prompt_tokens == len(PROMPT)
    assert req.first_token_time is None
    ref = make_generator(42)
    for _ in SENT:
        seeded_noise(ref, 64)
    assert torch.equal(seeded_noise(req.rng, 64), seeded_noise(ref, 64))
    with pytest.raises(ValueError, match="finished"):       # a stop token among the sent
        prime(Request("s", PROMPT, params, rng=make_generator(1)), [1, 9, 2], 64)


def test_force_replaces_only_the_forced_rows_in_sample_order() -> None:
    reqs = [Request(r, PROMPT, GREEDY) for r in ("a", "b", "c")]
    plan = StepPlan((ScheduledChunk(reqs[0], 1, True), ScheduledChunk(reqs[1], 4, False),
                     ScheduledChunk(reqs[2], 1, True)), None, 4, 2)
    forced = {"c": deque([11, 12]), "b": deque([5])}
    assert force(forced, plan, [1, 2]) == [1, 11]   # row 1 is c's (b samples nothing)
    assert forced == {"c": deque([12]), "b": deque([5])}
    assert force(forced, plan, [1, 2]) == [1, 12] and "c" not in forced


@pytest.mark.parametrize("replay", ["decode", "prefill"])
async def test_a_seeded_stream_continues_with_the_undisturbed_draws(replay) -> None:
    """What `seed` promises across a migration (docs/migration.md): with the same logits, the
    tokens after the move are the undisturbed run's."""
    params = SamplingParams(max_tokens=12, temperature=2.0, seed=5)

    async def run(eng: Engine, **kw) -> list[int]:
        await eng.start()
        try:
            evs = await asyncio.wait_for(_collect(eng.add_request("s", PROMPT, params, **kw)), 10)
        finally:
            await eng.shutdown()
        return [t for e in evs for t in e.token_ids]

    whole = await run(_engine())
    assert len(set(whole)) > 3                     # sampled, not the greedy argmax throughout
    got = await run(_engine(), resume=whole[:5], replay=replay)
    assert got[-7:] == whole[5:]
    other = await run(_engine(), resume=whole[:4] + [(whole[4] + 1) % 60], replay=replay)
    assert other[-7:] != whole[5:]                 # the sent tokens matter: the test can fail


async def _collect(stream) -> list:
    return [ev async for ev in stream]


def test_force_skips_a_drafting_chunk_as_the_sampled_rows_do() -> None:
    """A drafting chunk (speculative decoding) has no sampled row: its tokens come from
    verification, so the forced rows after it keep their place."""
    reqs = [Request(r, PROMPT, GREEDY) for r in ("a", "b")]
    plan = StepPlan((ScheduledChunk(reqs[0], 1, True, (4, 4)), ScheduledChunk(reqs[1], 1, True)),
                    None, 2, 2)
    forced = {"b": deque([11])}
    reqs[1].replaying = True
    assert force(forced, plan, [3]) == [11]       # b's row is the only sampled one
    assert not forced and not reqs[1].replaying   # replayed: b may draft again
