"""engine.num_threads: 0 is auto (moed.engine.build.step_threads), a number is taken as is."""
from __future__ import annotations

from moed.engine.build import step_threads


def test_a_configured_count_wins_over_everything():
    assert step_threads(3, 16, {"OMP_NUM_THREADS": "8"}) == (3, "engine.num_threads")


def test_auto_leaves_a_core_for_the_event_loop():
    assert step_threads(0, 2, {})[0] == 1
    assert step_threads(0, 16, {})[0] == 15


def test_auto_on_one_core_still_computes():
    assert step_threads(0, 1, {})[0] == 1


def test_auto_keeps_the_operators_omp_num_threads():
    n, why = step_threads(0, 16, {"OMP_NUM_THREADS": "4"})
    assert n == 0 and why == "OMP_NUM_THREADS"      # 0: torch already read it; not overridden
    assert step_threads(0, 16, {"OMP_NUM_THREADS": ""})[0] == 15     # empty = unset


def test_from_config_logs_its_threads_and_what_the_kv_budget_buys(tiny_qwen3):
    import structlog
    import torch

    from moed.config import Config, EngineConfig, ModelConfig
    from moed.engine.engine import Engine

    before = torch.get_num_threads()
    cfg = Config(model=ModelConfig(path=str(tiny_qwen3), max_model_len=64),
                 engine=EngineConfig(kv_cache_memory_mb=2, num_threads=1))
    try:
        with structlog.testing.capture_logs() as logs:
            eng = Engine.from_config(cfg)
    finally:
        torch.set_num_threads(before)
    by = {e["event"]: e for e in logs}
    assert by["engine_threads"]["torch_threads"] == 1
    assert by["engine_threads"]["chosen_by"] == "engine.num_threads"
    kv = by["kv_cache_sized"]
    assert kv["kv_blocks"] == eng.kv.num_blocks and kv["sized_by"] == "engine.kv_cache_memory_mb"
    assert kv["kv_tokens"] == eng.kv.num_blocks * 16
    assert kv["max_concurrency_at_max_len"] == round(eng.kv.num_blocks * 16 / 64, 2)
    assert 0 < kv["kv_mb"] <= 2
