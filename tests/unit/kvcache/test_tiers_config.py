"""[tiers]: validated like every section (bounds, unknown keys), and across fields by the
pre-flight (a disk tier needs a writable directory); refused without prefix caching or on a
router; the engine builds no tiers when every capacity is 0."""
from __future__ import annotations

from pathlib import Path

import pytest

from moed import config, preflight
from moed.config import ConfigError


def load(tmp_path: Path, text: str, role: str = "colocated") -> config.Config:
    p = tmp_path / "moed.toml"
    p.write_text(f'[server]\nrole = "{role}"\n' + text)
    return config.load(p, environ={}, overrides={} if role == "router"
                       else {"model": {"path": "m"}})


def test_tiers_section_loads_and_misspelt_keys_are_errors(tmp_path: Path) -> None:
    c = load(tmp_path, f'[tiers]\nhost_bytes = 4096\ndisk_bytes = 8192\ndisk_dir = "{tmp_path}"\n')
    assert c.tiers.enabled and c.tiers.host_bytes == 4096 and c.tiers.disk_dir == str(tmp_path)
    preflight.tiers(c)
    with pytest.raises(ConfigError, match="host_byte"):
        load(tmp_path, "[tiers]\nhost_byte = 1\n")
    with pytest.raises(ConfigError, match="tiers.host_bytes"):
        load(tmp_path, "[tiers]\nhost_bytes = -1\n")
    assert not load(tmp_path, "").tiers.enabled


def test_disk_tier_needs_a_writable_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tiers.disk_bytes: a disk tier needs tiers.disk_dir"):
        preflight.tiers(load(tmp_path, "[tiers]\ndisk_bytes = 8192\n"))
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="tiers.disk_dir"):
        preflight.tiers(load(tmp_path, f'[tiers]\ndisk_bytes = 1\ndisk_dir = "{f}/sub"\n'))
    preflight.tiers(load(tmp_path, f'[tiers]\ndisk_bytes = 1\ndisk_dir = "{tmp_path}/new/l3"\n'))


def test_tiers_refused_without_prefix_caching_and_on_a_router(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        load(tmp_path, "[engine]\nenable_prefix_caching = false\n[tiers]\nhost_bytes = 1\n")
    with pytest.raises(ConfigError, match="router holds no KV cache"):
        load(tmp_path, "[tiers]\nhost_bytes = 1\n", role="router")
