"""Secret files (cluster key, API keys, admin token): a FIFO, a directory, a device, a huge
file or bytes that are not text give a one-line ConfigError and never block the reader."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from moed.cluster.service import MAX_KEY_BYTES, ClusterError, load_keyring
from moed.config import ClusterConfig, ConfigError
from moed.ops.daemon import load_key_source




@pytest.fixture
def special(tmp_path: Path):
    """special(kind) -> a path that is a FIFO, a directory, a device or too large."""
    fifos: list[Path] = []

    def make(kind: str, limit: int = MAX_KEY_BYTES) -> Path:
        p = tmp_path / f"secret-{kind}"
        if kind == "fifo":
            os.mkfifo(p)
            fifos.append(p)
        elif kind == "directory":
            p.mkdir()
        elif kind == "device":
            p = Path("/dev/zero")
        elif kind == "huge":
            p.write_bytes(b"ab" * limit)
        return p

    yield make
    for f in fifos:   # a reader that did block in open() gets a writer, so its thread ends
        with contextlib.suppress(OSError):
            os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))


REASONS = {"fifo": r"not a regular file \(a FIFO\)",
           "directory": r"not a regular file \(a directory\)",
           "device": r"not a regular file \(a character device\)",
           "huge": "too large"}


@pytest.mark.parametrize("kind", sorted(REASONS))
@pytest.mark.parametrize("field", ["key_file", "secondary_key_file"])
def test_cluster_key_file_must_be_a_small_regular_file(special, kind: str, field: str,
                                                       within) -> None:
    p = special(kind)
    cc = ClusterConfig(**{"key_env": "K", field: str(p)})
    with pytest.raises(ClusterError, match=f"cluster.{field} {p}: {REASONS[kind]}"):
        within(lambda: load_keyring(cc, {"K": "ab" * 16}))


def test_cluster_key_bytes_that_are_not_text(tmp_path: Path) -> None:
    # A raw key is bytes, not text (head -c 32 /dev/urandom): not UTF-8 is fine, short is not
    raw = tmp_path / "raw"
    raw.write_bytes(bytes(range(256))[128:160])
    assert load_keyring(ClusterConfig(key_file=str(raw))).primary == bytes(range(128, 160))
    raw.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ClusterError, match=f"cluster.key_file {raw}: .*at least 16 bytes"):
        load_keyring(ClusterConfig(key_file=str(raw)))
    # an environment variable that is not UTF-8 reaches Python as surrogates: its own bytes
    env = {"K": (b"\xff" * 20).decode("utf-8", "surrogateescape")}
    assert load_keyring(ClusterConfig(key_env="K"), env).primary == b"\xff" * 20
    with pytest.raises(ClusterError, match=r"not a regular file \(a directory\)"):
        load_keyring(ClusterConfig(key_file=str(tmp_path)))


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
@pytest.mark.parametrize("what", ["api_keys", "admin_token"])
def test_api_and_admin_key_files_must_be_regular_files(special, kind: str, what: str,
                                                       within) -> None:
    p = special(kind)
    with pytest.raises(ConfigError, match=f"server.{what}_file {p}: {REASONS[kind]}"):
        within(lambda: load_key_source(str(p), "", what))


@pytest.mark.parametrize("what", ["api_keys", "admin_token"])
def test_api_and_admin_key_files_that_are_not_utf8(tmp_path: Path, what: str) -> None:
    p = tmp_path / "keys"
    p.write_bytes(b"good\nk\xe9y\n")
    with pytest.raises(ConfigError, match=f"server.{what}_file {p}: not UTF-8 text at byte 6"):
        load_key_source(str(p), "", what)
    p.write_text("k1\n")
    assert load_key_source(str(p), "", what) == (b"k1",)
    with pytest.raises(ConfigError, match=f"server.{what}_file .*cannot read"):
        load_key_source(str(tmp_path / "missing"), "", what)


def test_api_keys_variable_that_is_not_utf8(monkeypatch) -> None:
    monkeypatch.setenv("T_API_KEYS", "k1")
    assert load_key_source("", "T_API_KEYS", "api_keys") == (b"k1",)
    monkeypatch.setitem(os.environ, "T_API_KEYS", b"k\xff".decode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError, match="api_keys_env: variable T_API_KEYS is not UTF-8"):
        load_key_source("", "T_API_KEYS", "api_keys")
