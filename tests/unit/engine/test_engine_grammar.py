"""The engine and a request's grammar (moed.engine.masks): a mask that overruns
structured.mask_timeout_ms, or a grammar past a limit, ends that request alone (ErrorKind.GRAMMAR,
the API's 400 grammar_too_complex) while its batch mates keep stepping; the step never waits on
the slow mask."""
from __future__ import annotations

import asyncio
import threading

import torch

from moed.config import EngineConfig, StructuredConfig
from moed.engine.engine import Engine
from moed.types import ErrorKind, FinishReason, GrammarSpec, SamplingParams

from engine_fakes import VOCAB, FakeRunner

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
GRAMMAR = SamplingParams(max_tokens=6, temperature=0.0, grammar=GrammarSpec("regex", "x"))


class FakeMatcher:
    """Allows every token; fill() waits on `gate` first (a grammar whose mask is slow), or the
    matcher reports a limit hit after its first mask (`limit`)."""

    def __init__(self, gate: threading.Event | None = None, limit: bool = False) -> None:
        self.words = (VOCAB + 31) // 32
        self.gate, self.limit, self.masks = gate, limit, 0
        self.failed = self.too_complex = False
        self.error = ""
        self.stopped = False

    def fill(self, bm: torch.Tensor, row: int) -> None:
        if self.gate is not None:
            assert self.gate.wait(30)
        bm[row] = -1
        self.masks += 1
        if self.limit:
            self.failed = self.too_complex = True
            self.error = "Parser Error: Current row has 2007 items; max is 2000"

    def accept(self, token_id: int) -> bool:
        return True


class GrammarEngine(Engine):
    def __init__(self, matcher: FakeMatcher, **kw) -> None:
        cfg = EngineConfig(max_num_batched_tokens=16, max_num_seqs=8, block_size=4)
        super().__init__(FakeRunner(64, 4), None, cfg, max_model_len=256, **kw)
        self.matcher = matcher

    def _grammar(self, params):
        return None if params.grammar is None else self.matcher


async def _collect(stream):
    return [ev async for ev in stream]


async def test_a_late_mask_fails_its_request_alone_and_the_batch_does_not_wait(ref_greedy):
    gate = threading.Event()
    eng = GrammarEngine(FakeMatcher(gate),
                        structured=StructuredConfig(mask_timeout_ms=50))
    await eng.start()
    try:
        slow = eng.add_request("slow", [1, 2, 3], GRAMMAR)
        plain = eng.add_request("plain", [4, 5, 6], GREEDY)
        # the plain request finishes while the slow mask is still blocked: nobody waited on it
        plain_evs = await asyncio.wait_for(_collect(plain), 20)
        assert not gate.is_set()
        assert [t for e in plain_evs for t in e.token_ids] == ref_greedy([4, 5, 6], 6)
        slow_evs = await asyncio.wait_for(_collect(slow), 20)
        last = slow_evs[-1]
        assert last.finish_reason is FinishReason.ERROR and last.error_kind is ErrorKind.GRAMMAR
        assert "mask_timeout_ms" in last.error
        assert not [t for e in slow_evs for t in e.token_ids]       # its token was dropped
    finally:
        gate.set()
        await eng.shutdown()


async def test_a_grammar_past_a_limit_mid_generation_fails_its_request_alone(ref_greedy):
    eng = GrammarEngine(FakeMatcher(limit=True))
    await eng.start()
    try:
        bad = eng.add_request("bad", [1, 2, 3], GRAMMAR)
        plain = eng.add_request("plain", [4, 5, 6], GREEDY)
        bad_evs, plain_evs = await asyncio.wait_for(
            asyncio.gather(_collect(bad), _collect(plain)), 20)
        assert bad_evs[-1].error_kind is ErrorKind.GRAMMAR and "max is 2000" in bad_evs[-1].error
        assert [t for e in plain_evs for t in e.token_ids] == ref_greedy([4, 5, 6], 6)
        assert eng.stats().kv_blocks_used == 0
    finally:
        await eng.shutdown()
