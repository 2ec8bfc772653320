"""moed.api.grammar_pool: compilation on its own bounded pool; a full queue is a 429
grammar_busy, a compile past its budget a 400 grammar_too_complex naming the field, a cached
grammar (or refusal) answers without queueing."""
from __future__ import annotations

import asyncio
import threading

import pytest

from moed.api.errors import APIError
from moed.api.grammar_pool import GrammarPool
from moed.types import GrammarSpec


@pytest.fixture(scope="module")
def tok(tiny_qwen3):
    from moed.model.grammar import compiler_for
    from moed.model.tokenizer import Tokenizer

    t = Tokenizer.from_dir(tiny_qwen3)
    compiler_for(t)         # the LLTokenizer, built once
    return t


async def test_a_full_queue_is_429_grammar_busy(tok, monkeypatch) -> None:
    from moed.model.grammar import compiler_for

    comp = compiler_for(tok)
    gate = threading.Event()
    real = comp.compile

    def held(spec):         # a compile that takes as long as the test says
        assert gate.wait(30)
        return real(spec)

    monkeypatch.setattr(comp, "compile", held)
    pool = GrammarPool(workers=1, max_queued=1, queue_timeout_s=30)
    try:
        specs = [GrammarSpec("regex", f"[0-9]{{{k}}}", param="guided_regex") for k in (5, 6)]
        first = asyncio.ensure_future(pool.compile(tok, specs[0]))     # holds the worker
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(pool.compile(tok, specs[1]))    # waits for it
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as e:
            await pool.compile(tok, GrammarSpec("regex", "[0-9]{7}"))
        assert e.value.status == 429 and e.value.code == "grammar_busy"
        assert "Retry-After" in e.value.headers
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, second), 30)
        assert pool.queued == 0
    finally:
        gate.set()
        pool.shutdown()


async def test_a_compile_that_never_starts_is_429_not_a_hang(tok, monkeypatch) -> None:
    from moed.model.grammar import compiler_for

    comp = compiler_for(tok)
    gate = threading.Event()
    real = comp.compile
    monkeypatch.setattr(comp, "compile", lambda spec: (gate.wait(30), real(spec))[1])
    pool = GrammarPool(workers=1, max_queued=4, queue_timeout_s=0.2)
    try:
        first = asyncio.ensure_future(pool.compile(tok, GrammarSpec("regex", "[a-z]{8}")))
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as e:
            await pool.compile(tok, GrammarSpec("regex", "[a-z]{9}"))
        assert e.value.status == 429 and e.value.code == "grammar_busy"
        gate.set()
        await asyncio.wait_for(first, 30)
        assert pool.queued == 0
    finally:
        gate.set()
        pool.shutdown()


async def test_past_the_budget_is_400_and_a_cached_refusal_answers_at_once(tok) -> None:
    pool = GrammarPool(workers=1, compile_timeout_s=0.001)
    try:
        spec = GrammarSpec("regex", "z{1000}{1000}", param="structured_outputs")   # ~0.5 s+
        with pytest.raises(APIError) as e:
            await pool.compile(tok, spec)
        assert e.value.status == 400 and e.value.code == "grammar_too_complex"
        assert e.value.param == "structured_outputs" and "budget of 0.001 s" in e.value.message
        bad = GrammarSpec("regex", "((", param="guided_regex")
        roomy = GrammarPool(workers=1)
        try:
            for _ in range(2):          # the second is the cached refusal
                with pytest.raises(APIError) as e:
                    await roomy.compile(tok, bad)
                assert e.value.status == 400 and e.value.code is None
            await roomy.compile(tok, GrammarSpec("regex", "[0-9]{4}"))
            await roomy.compile(tok, GrammarSpec("regex", "[0-9]{4}"))
            assert roomy.queued == 0
        finally:
            roomy.shutdown()
    finally:
        pool.shutdown()
