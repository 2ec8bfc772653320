"""Config: precedence, validation, unknown keys, reload diff."""
from __future__ import annotations

from pathlib import Path

import pytest

from moed import config
from moed.config import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "moed.toml"
    p.write_text(text)
    return p


def test_defaults_need_a_model_except_for_router() -> None:
    with pytest.raises(ConfigError, match="model.path is required"):
        config.load(environ={})
    cfg = config.load(environ={}, overrides={"server": {"role": "router"}})
    assert cfg.server.role == "router" and cfg.server.port == 8000


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    p = write(tmp_path, '[server]\nport = 9001\nhost = "127.0.0.2"\n[model]\npath = "m"\n')
    env = {"MOED_SERVER_PORT": "9002", "MOED_ENGINE_MAX_NUM_SEQS": "7"}
    cfg = config.load(p, environ=env, overrides={"server": {"port": 9003, "host": None}})
    assert cfg.server.port == 9003            # flag beats env
    assert cfg.server.host == "127.0.0.2"     # None flag = not given, file wins
    assert cfg.engine.max_num_seqs == 7       # env beats default
    cfg2 = config.load(p, environ=env)
    assert cfg2.server.port == 9002           # env beats file


@pytest.mark.parametrize("text,msg", [
    ("[server]\nprot = 1\n", "unknown key server.prot"),
    ("[serverz]\n", "unknown section"),
    ("[server]\nport = 'x'\n", "expected a number"),
    ("[server]\nport = 70000\n", "server.port"),
    ("[server]\nrole = 'boss'\n", "server.role"),
    ("[engine]\nblock_size = 1.5\n", "expected an integer"),
    ("[cluster]\nseeds = ['nohostport']\n", "host:port"),
    ("[server\n", "not valid TOML"),
])
def test_bad_files_give_clear_errors(tmp_path: Path, text: str, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        config.load(write(tmp_path, text + '\n[model]\npath = "m"\n' if "[server\n" not in text
                          else text), environ={})


def test_env_types_are_parsed_and_checked() -> None:
    env = {"MOED_MODEL_PATH": "m", "MOED_CLUSTER_SEEDS": "a:1, b:2", "MOED_CLUSTER_ENABLED": "yes"}
    cfg = config.load(environ=env)
    assert cfg.cluster.seeds == ("a:1", "b:2") and cfg.cluster.enabled is True
    with pytest.raises(ConfigError, match="environment: server.port"):
        config.load(environ={**env, "MOED_SERVER_PORT": "eighty"})
    with pytest.raises(ConfigError, match="unknown key"):
        config.load(environ={**env, "MOED_SERVER_PROT": "1"})


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml", environ={})


def test_diff_and_apply_live_keep_cold_fields() -> None:
    old = config.load(environ={"MOED_MODEL_PATH": "m"})
    new = config.load(environ={"MOED_MODEL_PATH": "other", "MOED_ADMISSION_MAX_WAITING_REQUESTS": "3",
                               "MOED_SERVER_PORT": "9999"})
    changes = {c.key: c for c in config.diff(old, new)}
    assert set(changes) == {"model.path", "admission.max_waiting_requests", "server.port"}
    assert changes["admission.max_waiting_requests"].live
    assert not changes["model.path"].live and not changes["server.port"].live
    adopted = config.apply_live(old, new)
    assert adopted.admission.max_waiting_requests == 3
    assert adopted.model.path == "m" and adopted.server.port == old.server.port
    assert adopted.digest() != old.digest()
    assert config.diff(old, old) == []


def test_shipped_config_files_are_valid() -> None:
    root = Path(__file__).resolve().parents[2] / "conf"
    for toml in sorted(root.glob("*.toml")):
        cfg = config.load(toml, environ={"MOED_MODEL_PATH": "m"})
        assert cfg.server.role in config.ROLES, toml
