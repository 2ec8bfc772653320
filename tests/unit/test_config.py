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

    root = Path(__file__).resolve().parents[2]
    settings = {config.env_name(sec.name, f.name) for sec in dataclasses.fields(config.Config)
                for f in dataclasses.fields(sec.default_factory)}
    named = {m for d in ("moed", "bench") for f in (root / d).rglob("*.py")
             for m in re.findall(r"(?<![A-Za-z0-9_])MOED_[A-Z0-9][A-Z0-9_]*", f.read_text())}
    assert named - settings == set(config.OTHER_ENV)


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


# ---- file edge cases: never a traceback, never a blocked read ----------------------------



def _unblock(fifo: Path) -> None:
    # if a reader did block in open(), give it a writer so the thread ends
    import contextlib
    import os

    with contextlib.suppress(OSError):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_non_utf8_file_is_a_one_line_error(tmp_path: Path) -> None:
    p = tmp_path / "moed.toml"
    p.write_bytes(b'[model]\npath = "m\xff"\n')
    with pytest.raises(ConfigError) as e:
        config.load(p, environ={})
    assert str(e.value) == f"{p}: not UTF-8 text at byte 17"


def test_fifo_is_refused_without_blocking(tmp_path: Path, within) -> None:
    import os

    fifo = tmp_path / "moed.toml"
    os.mkfifo(fifo)
    try:
        with pytest.raises(ConfigError, match=r"not a regular file \(a FIFO\)"):
            within(lambda: config.load(fifo, environ={}))
    finally:
        _unblock(fifo)


@pytest.mark.parametrize("kind", ["directory", "/dev/zero", "/dev/null", "huge", "sparse"])
def test_only_small_regular_files_are_read(tmp_path: Path, kind: str, within) -> None:
    p = tmp_path / "moed.toml"
    if kind == "directory":
        p.mkdir()
        msg = r"not a regular file \(a directory\)"
    elif kind.startswith("/dev/"):
        p = Path(kind)
        msg = r"not a regular file \(a character device\)"
    elif kind == "huge":
        p.write_text("# padding\n" * (config.MAX_CONFIG_BYTES // 10 + 1))
        msg = "too large"
    else:
        with open(p, "wb") as f:
            f.truncate(1 << 40)            # 1 TiB, no blocks: refused from its size alone
        msg = r"too large \(1099511627776 bytes, at most 1048576\)"
    with pytest.raises(ConfigError, match=msg):
        within(lambda: config.load(p, environ={}))


def test_reader_bounds_files_whose_size_lies_and_follows_symlinks(tmp_path: Path) -> None:
    with pytest.raises(config.FileRefused, match="more than 10 bytes"):
        config.read_regular_file("/proc/self/status", 10)     # a regular file of size 0
    real = tmp_path / "real.toml"
    real.write_text('[model]\npath = "m"\n')
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    assert config.load(link, environ={}).model.path == "m"
    assert config.read_regular_file(real, len(real.read_bytes())) == real.read_bytes()


def test_unreadable_file_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    import errno
    import os

    p = write(tmp_path, '[model]\npath = "m"\n')
    sub = tmp_path / "sub"
    sub.write_text("")
    with pytest.raises(ConfigError, match="cannot read: Not a directory"):
        config.load(sub / "moed.toml", environ={})
    if os.geteuid() != 0:           # a real mode-0000 file (root would read it anyway)
        p.chmod(0)
        with pytest.raises(ConfigError, match="cannot read: Permission denied"):
            config.load(p, environ={})
        p.chmod(0o600)
    # the same refusal for every user, root included: the open itself is denied
    def denied(path, *a, **kw):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    monkeypatch.setattr(config.os, "open", denied)
    with pytest.raises(ConfigError, match="cannot read: Permission denied"):
        config.load(p, environ={})


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, "9" * 5000])
def test_tomllib_limits_are_config_errors(tmp_path: Path, value: str) -> None:
    # deep nesting (RecursionError) and > 4300-digit integers (ValueError) escape tomllib
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(write(tmp_path, f'[model]\npath = "m"\nx = {value}\n'), environ={})


def test_non_utf8_environment_and_flags_are_refused() -> None:
    bad = b"m\xff".decode("utf-8", "surrogateescape")      # what os.environ holds for it
    with pytest.raises(ConfigError, match="environment: model.path: not UTF-8 text"):
        config.load(environ={"MOED_MODEL_PATH": bad})
    with pytest.raises(ConfigError, match="command line: model.path: not UTF-8 text"):
        config.load(environ={}, overrides={"model": {"path": bad}})
    with pytest.raises(ConfigError, match="environment: cluster.seeds: not UTF-8"):
        config.load(environ={"MOED_MODEL_PATH": "m", "MOED_CLUSTER_SEEDS": "a:1," + bad})


# ---- bounds: every number of every section ---------------------------------------------

NUMERIC = config.numeric_fields()


def test_every_numeric_field_has_bounds_within_64_bits() -> None:
    import dataclasses
    import typing

    every = set()                                       # enumerated here, independently
    for sec in dataclasses.fields(config.Config):
        hints = typing.get_type_hints(sec.default_factory)
        every |= {(sec.name, f.name) for f in dataclasses.fields(sec.default_factory)
                  if hints[f.name] in (int, float)}
    assert {(s, n) for s, n, *_ in NUMERIC} == every and len(every) > 40
    for sec, name, tp, bounds in NUMERIC:
        assert bounds is not None, f"{sec}.{name} has no bounds"
        lo, hi = bounds
        assert -(1 << 63) <= lo <= hi <= (1 << 63) - 1, (sec, name, bounds)
        if tp is int:
            assert isinstance(lo, int) and isinstance(hi, int), (sec, name, bounds)


def test_a_field_cannot_be_declared_without_sane_bounds() -> None:
    with pytest.raises(TypeError, match="needs bounds"):
        config._f(1)
    with pytest.raises(TypeError, match="needs bounds"):
        config._f(1.5, live=True)
    with pytest.raises(TypeError, match="take none"):
        config._f("x", bounds=(0, 1))
    with pytest.raises(TypeError, match="outside bounds"):
        config._f(5, bounds=(0, 1))
    with pytest.raises(TypeError, match="64 bits"):
        config._f(5, bounds=(0, 1 << 64))
    config._f(True)                                     # bools are not numbers here


def _toml_number(v: float) -> str:
    if v != v:
        return "nan"
    if v in (float("inf"), float("-inf")):
        return "inf" if v > 0 else "-inf"
    return repr(v)


def _bad_values(tp: type, lo: float, hi: float) -> list[float]:
    out: list[float] = [10 ** 20, -(10 ** 20), 2 ** 62, 10 ** 400]
    out += [hi + 1, lo - 1] if tp is int else [hi * 2 + 1, lo - 1, 1e300, -1e300]
    return out + [float("nan"), float("inf"), float("-inf")]


@pytest.mark.parametrize("sec,name,tp,bounds", NUMERIC, ids=[f"{s}.{n}" for s, n, *_ in NUMERIC])
def test_out_of_bounds_values_are_refused_naming_the_field(
        tmp_path: Path, sec: str, name: str, tp: type, bounds: tuple[float, float]) -> None:
    lo, hi = bounds
    p = tmp_path / "moed.toml"
    model = {"model": {"path": "m"}}
    for ok in (lo, hi):                                 # both ends are inclusive
        p.write_text(f"[{sec}]\n{name} = {_toml_number(ok)}\n")
        assert getattr(getattr(config.load(p, environ={}, overrides=model), sec), name) == ok
    for bad in _bad_values(tp, lo, hi):
        p.write_text(f"[{sec}]\n{name} = {_toml_number(bad)}\n")
        with pytest.raises(ConfigError, match=f"{sec}.{name}"):
            config.load(p, environ={}, overrides=model)
        env = {f"MOED_{sec.upper()}_{name.upper()}": _toml_number(bad), "MOED_MODEL_PATH": "m"}
        with pytest.raises(ConfigError, match=f"{sec}.{name}"):
            config.load(environ=env)


def test_structured_budget_from_env_and_its_bound_under_the_collective_timeout() -> None:
    env = {"MOED_MODEL_PATH": "/m", "MOED_STRUCTURED_COMPILE_TIMEOUT_S": "0.5",
           "MOED_STRUCTURED_MAX_ITEMS_IN_ROW": "500", "MOED_STRUCTURED_MASK_TIMEOUT_MS": "40"}
    cfg = config.load(environ=env)
    st = cfg.structured
    assert (st.compile_timeout_s, st.max_items_in_row, st.mask_timeout_ms) == (0.5, 500, 40)
    with pytest.raises(config.ConfigError, match="structured.compile_timeout_s"):
        config.load(environ={**env, "MOED_STRUCTURED_COMPILE_TIMEOUT_S": "0"})
    with pytest.raises(config.ConfigError, match="MOED_STRUCTURED_MASK_TIMEOUT"):
        config.load(environ={**env, "MOED_STRUCTURED_MASK_TIMEOUT": "40"})   # misspelt
    ep = {**env, "MOED_PARALLEL_EP_SIZE": "2", "MOED_PARALLEL_EP_INIT": "tcp://127.0.0.1:9",
          "MOED_PARALLEL_COLLECTIVE_TIMEOUT_S": "0.5", "MOED_STRUCTURED_MASK_TIMEOUT_MS": "300"}
    with pytest.raises(config.ConfigError, match="mask_timeout_ms must stay under half"):
        config.load(environ=ep)
