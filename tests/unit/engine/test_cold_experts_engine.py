"""Cold experts in the serving loop (the real runner, tiny Qwen3-MoE bf16, 30% of the expert
bytes resident, layer-ahead prefetch on as by default): greedy outputs equal the all-resident
engine's; a disk read that fails (the checkpoint truncated under the running node) fails the
requests of that step with a clear error and no path in it, every KV block comes back, and once
the file is whole again the same engine serves the next requests with the all-resident output
(no slot was left stale). The store sees the checkpoint as not page-cached (as under a memory
cap), so that prefetch reads and stages: a page-cached expert is left to its miss."""
from __future__ import annotations

import asyncio
import shutil

import torch

from moed.config import EngineConfig
from moed.engine.engine import Engine
from moed.model.cold import ColdSettings, ExpertIndex
from moed.model.runner import ModelRunner
from moed.types import FinishReason, SamplingParams

torch.set_num_threads(1)
BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPTS = [[3, 14, 15, 92, 65, 35], [2, 71, 82, 81, 82, 8, 45, 90], [11, 12, 13, 14, 15, 16, 17]]


def _engine(ck, cold: ColdSettings | None) -> Engine:
    r = ModelRunner(str(ck), dtype="bfloat16", device="cpu", num_blocks=64, block_size=BS, cold=cold)
    return Engine(r, None, EngineConfig(block_size=BS, max_num_batched_tokens=64, max_num_seqs=8),
                  max_model_len=128)


def _budget(ck) -> int:
    full = ModelRunner(str(ck), dtype="bfloat16", device="cpu", num_blocks=4, block_size=BS)
    return int(0.3 * full.resident_expert_bytes())


async def _run(eng: Engine, tag: str) -> list[list]:
    streams = [eng.add_request(f"{tag}{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]

    async def collect(s):
        return [ev async for ev in s]
    return await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)


def _tokens(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


async def test_cold_engine_equals_all_resident_and_survives_a_failed_read(tiny_qwen3, tmp_path, monkeypatch):
    monkeypatch.setattr(ExpertIndex, "cached", lambda self, layer, expert: False)
    ck = tmp_path / "ck"
    shutil.copytree(tiny_qwen3, ck)
    want = _engine(ck, None).generate(PROMPTS, GREEDY)
    eng = _engine(ck, ColdSettings(_budget(ck), 1 << 20, 4.0, -1))     # prefetch auto, the default
    store = eng.runner.cold
    assert store is not None and store.slots < store.spec.num_experts and store.prefetch is not None
    await eng.start()
    try:
        assert [_tokens(evs) for evs in await _run(eng, "a")] == want
        assert store.stats.misses > 0 and store.stats.prefetch_reads > 0

        (shard,) = sorted(ck.glob("*.safetensors"))
        whole = shard.read_bytes()
        with open(shard, "r+b") as f:       # truncated under the running node
            f.truncate(4096)
        failed = await _run(eng, "b")
        last = [evs[-1] for evs in failed]
        assert any(e.finish_reason == FinishReason.ERROR for e in last)
        for e in last:
            if e.finish_reason == FinishReason.ERROR:
                assert "could not be read from disk" in e.error and str(tmp_path) not in e.error
        assert store.stats.read_failures > 0
        assert eng.kv.num_free_blocks == eng.kv.num_blocks       # nothing leaked

        with open(shard, "r+b") as f:       # whole again: the same engine serves correctly
            f.write(whole)
        assert [_tokens(evs) for evs in await _run(eng, "c")] == want
    finally:
        await eng.shutdown()
