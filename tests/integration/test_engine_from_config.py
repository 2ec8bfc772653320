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


async def test_kv_sized_by_a_share_of_the_memory_left(tiny_qwen3, monkeypatch):
    """engine.kv_cache_memory_fraction: the blocks are that share of what the host says is
    available beside the weights, and the start log says so."""
    from structlog.testing import capture_logs

    from moed.engine import memory
    monkeypatch.setattr(memory, "host_memory_available", lambda root=None: 600 << 20)
    cfg = Config(model=ModelConfig(path=str(tiny_qwen3), max_model_len=64),
                 engine=EngineConfig(kv_cache_memory_fraction=0.01, num_threads=1))
    with capture_logs() as logs:
        eng = Engine.from_config(cfg)
    sized = next(e for e in logs if e["event"] == "kv_cache_sized")
    assert sized["sized_by"] == "engine.kv_cache_memory_fraction"
    want_mb = memory.kv_share_mb(0.01, 600 << 20, int(sized["weights_mb"] * (1 << 20)))
    assert want_mb >= 1 and sized["available_mb"] == 600.0
    assert eng.kv.num_blocks == auto_num_blocks(eng.spec, 16, eng.runner.dtype, want_mb)
    await eng.shutdown()
