"""engine.kv_cache_memory_fraction: the KV cache from a share of what the host (or its cgroup)
still has beside the weights (moed/engine/memory.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from moed.engine.memory import (cgroup_room, host_memory_available, kv_share_mb,
                                parse_meminfo_available)

MEMINFO = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


def test_meminfo_and_cgroup_parsing() -> None:
    assert parse_meminfo_available(MEMINFO) == 20000000 * 1024
    assert parse_meminfo_available("MemTotal: 1 kB\n") is None
    assert cgroup_room("max\n", "123\n") is None
    assert cgroup_room("1000\n", "400\n") == 600
    assert cgroup_room("1000", "4000") == 0
    assert cgroup_room(None, "1") is None


def test_the_cgroup_limit_caps_what_the_host_offers(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text(MEMINFO)
    assert host_memory_available(tmp_path) == 20000000 * 1024        # no cgroup files
    cg = tmp_path / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text(str(8 << 30))
    (cg / "memory.current").write_text(str(1 << 30))
    assert host_memory_available(tmp_path) == 7 << 30                # the unit's MemoryMax=
    (cg / "memory.max").write_text("max\n")
    assert host_memory_available(tmp_path) == 20000000 * 1024


def test_share_of_what_the_weights_leave() -> None:
    mb = 1 << 20
    assert kv_share_mb(0.5, 3000 * mb, 1000 * mb) == 1000
    with pytest.raises(ValueError, match="under 1 MB"):
        kv_share_mb(0.5, 1001 * mb, 1000 * mb)
    with pytest.raises(ValueError, match="does not hold the weights"):
        kv_share_mb(0.5, 900 * mb, 1000 * mb)


def test_fraction_config_sizes_the_cache_and_is_exclusive_with_blocks(make_checkpoint, monkeypatch) -> None:
    from moed import preflight
    from moed.config import Config, ConfigError, EngineConfig, ModelConfig
    from moed.engine import memory
    from moed.model.hf_config import load_spec

    path = str(make_checkpoint("qwen3_moe"))
    with pytest.raises(ConfigError, match="kv_cache_memory_fraction: set it or engine.num_kv_blocks"):
        EngineConfig(num_kv_blocks=64, kv_cache_memory_fraction=0.5)
    cfg = Config(model=ModelConfig(path=path, dtype="bfloat16"),
                 engine=EngineConfig(kv_cache_memory_fraction=0.5))
    import torch
    spec = load_spec(path)
    monkeypatch.setattr(memory, "host_memory_available", lambda root=None: 1 << 40)
    mb, key, figures = memory.kv_memory_mb(cfg, spec, torch.bfloat16, torch.device("cpu"))
    weights = figures["weights_mb"] * (1 << 20)
    assert key == "engine.kv_cache_memory_fraction"
    assert abs(mb - ((1 << 40) - weights) * 0.5 / (1 << 20)) <= 1
    # too little left: the pre-flight refuses it in one line, naming the key
    monkeypatch.setattr(memory, "host_memory_available", lambda root=None: 1 << 20)
    with pytest.raises(ConfigError, match="engine.kv_cache_memory_fraction: .* does not hold the weights"):
        preflight.model(cfg)
    # without the fraction, the MB figure decides, as before
    plain = Config(model=ModelConfig(path=path), engine=EngineConfig(kv_cache_memory_mb=64))
    assert memory.kv_memory_mb(plain, spec, torch.bfloat16, torch.device("cpu"))[:2] == \
        (64, "engine.kv_cache_memory_mb")
