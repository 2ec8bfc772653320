"""`moed check-config` and flag/env/TOML precedence, in-process."""
from __future__ import annotations

import tomllib
from pathlib import Path

from moed import cli
from moed.config import load

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf" / "moed.toml"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_check_config_prints_effective_toml(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("MOED_SERVER_PORT", raising=False)
    rc, out, _ = _run(capsys, "check-config", str(CONF), "--model", "/models/x")
    assert rc == 0
    parsed = tomllib.loads(out)
    assert parsed["model"]["path"] == "/models/x" and parsed["server"]["port"] == 8000
    # the printed config is a valid config file that loads back to the same effective config
    printed = tmp_path / "printed.toml"
    printed.write_text(out)
    assert load(printed, environ={}) == load(CONF, environ={},
                                             overrides={"model": {"path": "/models/x"}})


def test_precedence_flag_over_env_over_toml(capsys, monkeypatch, tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('[server]\nport = 8100\nhost = "0.0.0.0"\n[model]\npath = "/m"\n')
    monkeypatch.setenv("MOED_SERVER_PORT", "8200")
    rc, out, _ = _run(capsys, "check-config", str(f))
    assert rc == 0 and tomllib.loads(out)["server"]["port"] == 8200
    assert tomllib.loads(out)["server"]["host"] == "0.0.0.0"
    rc, out, _ = _run(capsys, "check-config", str(f), "--port", "8300", "--role", "router")
    parsed = tomllib.loads(out)
    assert (parsed["server"]["port"], parsed["server"]["role"]) == (8300, "router")


def test_errors_exit_2_with_a_clear_message(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("MOED_SERVER_PORT", raising=False)
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nprot = 1\n")
    rc, out, err = _run(capsys, "check-config", str(bad))
    assert rc == 2 and out == "" and "unknown key server.prot" in err
    rc, _, err = _run(capsys, "check-config", str(CONF))
    assert rc == 2 and "model.path is required" in err
    rc, _, err = _run(capsys, "check-config", str(tmp_path / "none.toml"))
    assert rc == 2 and "does not exist" in err
    monkeypatch.setenv("MOED_SERVER_API_KEYS_FILE", str(tmp_path / "nokeys"))
    rc, _, err = _run(capsys, "check-config", str(CONF), "--model", "/m")
    assert rc == 2 and "api_keys_file" in err


def test_documented_default_file_matches_builtin_defaults():
    """conf/moed.toml documents the defaults: loading it changes nothing but what it must."""
    o = {"model": {"path": "/m"}}
    assert load(CONF, environ={}, overrides=o) == load(None, environ={}, overrides=o)


def test_kv_transfer_nodes_get_huge_pages_unless_the_operator_chose():
    for role, expect in (("prefill", "1"), ("decode", "1"), ("colocated", None), ("router", None)):
        env: dict[str, str] = {}
        assert cli.kv_transfer_env(role, env) is (expect == "1")
        assert env.get(cli.THP_ENV) == expect
    env = {cli.THP_ENV: "0"}                       # an explicit opt-out is kept
    assert cli.kv_transfer_env("decode", env) is False and env[cli.THP_ENV] == "0"
