"""The safe-file reader (moed/safefile.py): regular files only, bounded, never a blocked open.
Its use for the config file: tests/unit/config/test_config_load.py."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from moed.safefile import FileRefused, check_regular_file, read_regular_file


def test_a_fifo_is_refused_without_blocking(tmp_path: Path, within) -> None:
    fifo = tmp_path / "keys"
    os.mkfifo(fifo)
    try:
        with pytest.raises(FileRefused, match=r"not a regular file \(a FIFO\)"):
            within(lambda: read_regular_file(fifo, 100))
        with pytest.raises(FileRefused, match=r"not a regular file \(a FIFO\)"):
            check_regular_file(fifo, 100)
    finally:
        with contextlib.suppress(OSError):       # a blocked reader, if any, gets a writer
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))


def test_the_limit_is_inclusive_and_the_stat_check_passes_what_it_cannot_see(
        tmp_path: Path) -> None:
    p = tmp_path / "key"
    p.write_bytes(b"x" * 10)
    assert read_regular_file(p, 10) == b"x" * 10
    with pytest.raises(FileRefused, match=r"too large \(10 bytes, at most 9\)"):
        read_regular_file(p, 9)
    with pytest.raises(FileRefused, match=r"too large \(10 bytes, at most 9\)"):
        check_regular_file(p, 9)
    with pytest.raises(FileRefused, match=r"not a regular file \(a directory\)"):
        check_regular_file(tmp_path, 9)
    check_regular_file(tmp_path / "missing", 9)      # its reader says so in its own words
    with pytest.raises(FileNotFoundError):
        read_regular_file(tmp_path / "missing", 9)
