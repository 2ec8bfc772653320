"""The environment layer (moed/config/env.py): MOED_<SECTION>_<FIELD> parsed and checked, and
every other MOED_* variable a setting, one moed reads itself, or named by a *_env field."""
from __future__ import annotations

from pathlib import Path

import pytest

from moed import config
from moed.config import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "moed.toml"
    p.write_text(text)
    return p


def test_env_types_are_parsed_and_checked() -> None:
    env = {"MOED_MODEL_PATH": "m", "MOED_CLUSTER_SEEDS": "a:1, b:2", "MOED_CLUSTER_ENABLED": "yes"}
    cfg = config.load(environ=env)
    assert cfg.cluster.seeds == ("a:1", "b:2") and cfg.cluster.enabled is True
    with pytest.raises(ConfigError, match="environment: server.port"):
        config.load(environ={**env, "MOED_SERVER_PORT": "eighty"})
    with pytest.raises(ConfigError, match=r"unknown variable MOED_SERVER_PROT \(did you mean "
                                          r"MOED_SERVER_PORT\?\)"):
        config.load(environ={**env, "MOED_SERVER_PROT": "1"})


# ---- MOED_* variables: every one is a setting, one moed reads itself, or named by a *_env ----

@pytest.mark.parametrize("name,closest", [
    ("MOED_SERVR_PORT", "MOED_SERVER_PORT"),          # no section matches: once ignored
    ("MOED_SERVER_PORTT", "MOED_SERVER_PORT"),
    ("MOED_server_port", "MOED_SERVER_PORT"),
    ("MOED_ENGINE_MAX_NUM_SEQ", "MOED_ENGINE_MAX_NUM_SEQS"),
    ("MOED_CPU_KERNEL", "MOED_CPU_KERNELS"),           # the allow-list is suggested too
])
def test_misspelt_variables_are_errors_naming_the_closest_name(name: str, closest: str) -> None:
    with pytest.raises(ConfigError) as e:
        config.load(environ={"MOED_MODEL_PATH": "m", name: "1"})
    assert str(e.value) == f"environment: unknown variable {name} (did you mean {closest}?)"


def test_every_unknown_variable_is_named_in_one_line() -> None:
    env = {"MOED_MODEL_PATH": "m", "MOED_SERVR_PORT": "1", "MOED_XYZZY": "1"}
    with pytest.raises(ConfigError) as e:
        config.load(environ=env)
    assert str(e.value) == ("environment: unknown variables MOED_SERVR_PORT (did you mean "
                            "MOED_SERVER_PORT?), MOED_XYZZY (no setting is named like it)")


def test_variables_moed_reads_itself_are_allowed() -> None:
    env = {"MOED_MODEL_PATH": "m", **{name: "x" for name in config.OTHER_ENV},
           "MOED_CPU_ISA": "auto",                              # its value is checked too
           "OTHER_TOOL_PORT": "1", "moed_lowercase": "1"}       # not MOED_*: not ours
    assert config.load(environ=env).model.path == "m"


def test_variables_named_by_the_config_as_secret_holders_are_allowed(tmp_path: Path) -> None:
    p = write(tmp_path, '[server]\napi_keys_env = "MOED_KEYS"\n[model]\npath = "m"\n')
    env = {"MOED_KEYS": "k", "MOED_CLUSTER_KEY_ENV": "MOED_GOSSIP", "MOED_GOSSIP": "00" * 16}
    cfg = config.load(p, environ=env)
    assert (cfg.server.api_keys_env, cfg.cluster.key_env) == ("MOED_KEYS", "MOED_GOSSIP")
    cfg = config.load(environ={"MOED_MODEL_PATH": "m", "MOED_TOKEN": "t"},
                      overrides={"server": {"admin_token_env": "MOED_TOKEN"}})
    assert cfg.server.admin_token_env == "MOED_TOKEN"
    with pytest.raises(ConfigError, match="unknown variable MOED_KEYS"):   # named by nothing
        config.load(environ={"MOED_MODEL_PATH": "m", "MOED_KEYS": "k"})


def test_allow_list_holds_every_other_moed_variable_the_code_names() -> None:
    """Each MOED_* name in moed/ and bench/ is a setting or in OTHER_ENV (one place)."""
    import dataclasses
    import re

    root = Path(__file__).resolve().parents[3]
    settings = {config.env_name(sec.name, f.name) for sec in dataclasses.fields(config.Config)
                for f in dataclasses.fields(sec.default_factory)}
    named = {m for d in ("moed", "bench") for f in (root / d).rglob("*.py")
             for m in re.findall(r"(?<![A-Za-z0-9_])MOED_[A-Z0-9][A-Z0-9_]*", f.read_text())}
    assert named - settings == set(config.OTHER_ENV)
