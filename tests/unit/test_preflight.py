"""The pre-flight (moed/preflight.py) applies the config's rules (moed/config/rules.py) and the
checks that read the world; it runs without the app (no app <-> pre-flight circle)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moed import config, preflight
from moed.config import ConfigError


def _router(**env: str) -> config.Config:
    return config.load(environ={"MOED_SERVER_ROLE": "router", **env})


def test_check_applies_the_parallel_rules() -> None:
    with pytest.raises(ConfigError) as e:
        preflight.check(_router(MOED_PARALLEL_EP_RANK="1"))
    assert str(e.value) == "parallel.ep_rank: 1 is not below parallel.ep_size 1"
    preflight.check(_router())


def test_tiers_applies_the_rule_then_reads_the_directory(tmp_path: Path) -> None:
    m = {"MOED_MODEL_PATH": "m"}
    with pytest.raises(ConfigError, match="tiers.disk_bytes: a disk tier needs tiers.disk_dir"):
        preflight.tiers(config.load(environ={**m, "MOED_TIERS_DISK_BYTES": "1"}))
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match="tiers.disk_dir: .* is not a directory this node"):
        preflight.tiers(config.load(environ={**m, "MOED_TIERS_DISK_BYTES": "1",
                                             "MOED_TIERS_DISK_DIR": f"{f}/sub"}))
    preflight.tiers(config.load(environ={**m, "MOED_TIERS_DISK_BYTES": "1",
                                         "MOED_TIERS_DISK_DIR": str(tmp_path / "new")}))


def test_the_cluster_key_check_runs_without_importing_the_app() -> None:
    """The node name the key check passes comes from moed.config, not moed.app."""
    code = ("import sys\n"
            "from moed import config, preflight\n"
            "cfg = config.load(environ={'MOED_SERVER_ROLE': 'router', 'MOED_CLUSTER_ENABLED': '1',"
            " 'MOED_CLUSTER_INSECURE': '1'})\n"
            "assert config.needs_cluster_key(cfg)\n"
            "preflight.check(cfg)\n"
            "assert 'moed.app' not in sys.modules, 'the pre-flight imported the app'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
