"""Engine.from_config: runner + tokenizer from the config sections, KV sized from memory."""
from __future__ import annotations

from moed.config import Config, EngineConfig, ModelConfig
from moed.engine.engine import Engine
from moed.model.runner import auto_num_blocks
from moed.types import FinishReason, SamplingParams


async def test_from_config_serves_text(tiny_qwen3):
    cfg = Config(model=ModelConfig(path=str(tiny_qwen3), max_model_len=64),
                 engine=EngineConfig(kv_cache_memory_mb=2, num_threads=1))
    eng = Engine.from_config(cfg)
    assert eng.max_model_len == 64
    assert eng.kv.num_blocks == auto_num_blocks(eng.spec, 16, eng.runner.dtype, 2)
    prompt = eng.tokenizer.encode("def hello(name):\n    return")
    await eng.start()
    try:
        evs = [e async for e in eng.add_request("a", prompt, SamplingParams(max_tokens=80, temperature=0.8,
                                                                               seed=1, ignore_eos=True))]
    finally:
        await eng.shutdown()
    toks = [t for e in evs for t in e.token_ids]
    assert evs[-1].finish_reason is FinishReason.LENGTH
    assert len(prompt) + len(toks) == 64                       # stopped by the context length
    assert "".join(e.text for e in evs) == eng.tokenizer.decode(toks)
    assert eng.stats().kv_blocks_used == 0
