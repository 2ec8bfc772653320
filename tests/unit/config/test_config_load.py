"""Loading (moed/config/loading.py): precedence of the layers, bad files, shipped files, and
every edge case of reading the file (never a traceback, never a blocked read)."""
from __future__ import annotations

from pathlib import Path

import pytest

from moed import config, safefile
from moed.config import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "moed.toml"
    p.write_text(text)
    return p


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


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(tmp_path / "nope.toml", environ={})


def test_shipped_config_files_are_valid() -> None:
    root = Path(__file__).resolve().parents[3] / "conf"
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
    with pytest.raises(safefile.FileRefused, match="more than 10 bytes"):
        safefile.read_regular_file("/proc/self/status", 10)     # a regular file of size 0
    real = tmp_path / "real.toml"
    real.write_text('[model]\npath = "m"\n')
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    assert config.load(link, environ={}).model.path == "m"
    assert safefile.read_regular_file(real, len(real.read_bytes())) == real.read_bytes()


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
    monkeypatch.setattr(safefile.os, "open", denied)
    with pytest.raises(ConfigError, match="cannot read: Permission denied"):
        config.load(p, environ={})


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, "9" * 5000])
def test_tomllib_limits_are_config_errors(tmp_path: Path, value: str) -> None:
    # deep nesting (RecursionError) and > 4300-digit integers (ValueError) escape tomllib
    with pytest.raises(ConfigError, match="not valid TOML"):
        config.load(write(tmp_path, f'[model]\npath = "m"\nx = {value}\n'), environ={})
