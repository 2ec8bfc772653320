"""Reading a small file named by an operator without ever blocking on it.

The config file, API-key and token files, the cluster key, trace headers and the config
history are all read with `read_regular_file`: a FIFO, a device or a directory is refused from
its stat before it is opened, so neither a start nor a SIGHUP ever blocks on one.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path


class FileRefused(Exception):
    """`read_regular_file` will not read this path; str() says why (a FIFO, too large, …)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "an unknown kind"


def _check_regular(st: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"not a regular file ({_kind(st.st_mode)})")
    if st.st_size > limit:
        raise FileRefused(f"too large ({st.st_size} bytes, at most {limit})")


def check_regular_file(path: str | Path, limit: int) -> None:
    """FileRefused if `path` exists but is not a regular file of at most `limit` bytes. A stat
    only, for readers that open the file themselves; a missing or unreadable path passes (the
    reader then says so in its own words)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return
    _check_regular(st, limit)


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file at `path` (symlinks followed), at most `limit` of them.

    Never blocks: anything but a regular file (a FIFO, /dev/zero, a directory) is refused from
    its stat, before it is opened; the open is O_NONBLOCK and fstat checks the file it opened
    (the path may have been swapped meanwhile), and the read stops at limit + 1 bytes (a file
    that grows, or a /proc file whose size says 0). Raises FileRefused, or OSError (missing,
    permission denied) and ValueError (a NUL in the path) from the system.
    """
    _check_regular(os.stat(path), limit)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        _check_regular(os.fstat(fd), limit)
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(1 << 16, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise FileRefused(f"too large (more than {limit} bytes)")
        return b"".join(chunks)
    finally:
        os.close(fd)
