"""Config history: every config a node applied (at start, on a reload, on a rollback), newest
last, at most release.config_history of them, kept in the state directory so it outlives a
restart. GET /admin/config/history lists it; POST /admin/config/rollback?to=HASH (moed config
rollback) applies an entry again through the reload path (moed.ops.reload.Reloader.apply_now).

    <state_dir>/config-history.json = {"format": 1, "entries": [Entry, ...]}

An entry holds the effective config (file < environment < flags, as it ran), which names key
files and variables but never holds a secret. The file is replaced atomically (temp file,
fsync, rename) on a writer thread: the event loop never waits on the disk, and a crash leaves
the old file or the new one, never half of one. A file that cannot be read at start is set
aside as config-history.json.bad (logged) and the history starts again.

The state directory: server.state_dir, else $STATE_DIRECTORY (systemd's StateDirectory=, the
first when it names several), else none: the history is then kept in memory only (logged).
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import structlog

from moed.config import Config, ConfigError
from moed.safefile import FileRefused, read_regular_file

log = structlog.get_logger(__name__)

FILE = "config-history.json"
FORMAT = 1
MAX_FILE_BYTES = 16 << 20          # 1000 entries of a few KiB each, with room
SOURCES = ("start", "reload", "rollback")


@dataclass(frozen=True)
class Entry:
    hash: str                      # Config.digest() of `config`
    at: float                      # unix seconds when it was applied
    source: str                    # start | reload | rollback
    config: Mapping[str, Any]      # Config.to_dict(), as JSON (lists for tuples)

    def to_json(self) -> dict[str, Any]:
        return {"hash": self.hash, "at": round(self.at, 3), "source": self.source,
                "config": self.config}

    @classmethod
    def from_json(cls, v: Any) -> Entry:
        if not isinstance(v, dict):
            raise ValueError("an entry is not an object")
        h, at, src, cfg = v.get("hash"), v.get("at"), v.get("source"), v.get("config")
        if not (isinstance(h, str) and isinstance(at, (int, float)) and src in SOURCES
                and isinstance(cfg, dict)):
            raise ValueError(f"malformed entry {str(v)[:80]!r}")
        return cls(h, float(at), src, cfg)


def entry_of(cfg: Config, source: str, now: float) -> Entry:
    # through JSON: the entry in memory is exactly what the file will hold
    return Entry(cfg.digest(), now, source, json.loads(json.dumps(cfg.to_dict(), default=list)))


def parse(data: bytes) -> list[Entry]:
    """The entries of a history file; ValueError if it is not one."""
    body = json.loads(data)
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ValueError(f"not a format-{FORMAT} config history")
    entries = body.get("entries")
    if not isinstance(entries, list):
        raise ValueError("no entries list")
    return [Entry.from_json(e) for e in entries]


def state_dir(cfg: Config, environ: Mapping[str, str] = os.environ) -> Path | None:
    """Where this node keeps state (see the module docstring); None: nowhere."""
    if cfg.server.state_dir:
        return Path(cfg.server.state_dir)
    first = environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(first) if first else None


class ConfigHistory:
    """The bounded history, and its file. `record` is called on the event loop; the file is
    written behind it, in order, on one thread."""

    def __init__(self, directory: Path | None, size: int, entries: list[Entry] = ()) -> None:
        self.directory = directory
        self.path = directory / FILE if directory is not None else None
        self.size = size
        self._entries: list[Entry] = list(entries)[-size:]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="config-history")
        self._last_write: Future[None] | None = None

    @classmethod
    def open(cls, directory: Path | None, size: int) -> ConfigHistory:
        """Blocking (a stat and one small read): call it off the event loop. ConfigError when
        the directory cannot be used (an operator named it: starting without it would be
        accepting a setting that does nothing)."""
        if directory is None:
            log.info("config_history", path=None,
                     detail="no state directory (server.state_dir, $STATE_DIRECTORY): the "
                            "history is kept in memory only")
            return cls(None, size)
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise ConfigError(f"server.state_dir {directory}: cannot create it: "
                              f"{e.strerror or e}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigError(f"server.state_dir {directory}: not writable by this user")
        path = directory / FILE
        entries: list[Entry] = []
        try:
            entries = parse(read_regular_file(path, MAX_FILE_BYTES))
        except FileNotFoundError:
            pass
        except (OSError, FileRefused, ValueError) as e:    # json errors are ValueErrors
            aside = path.with_name(FILE + ".bad")
            try:
                os.replace(path, aside)
            except OSError:
                aside = path
            log.warning("config_history_unreadable", path=str(path), set_aside=str(aside),
                        error=str(e)[:200], detail="the history starts again")
        log.info("config_history", path=str(path), entries=len(entries), size=size)
        return cls(directory, size, entries)

    # ---- reading ----

    def entries(self) -> tuple[Entry, ...]:
        return tuple(self._entries)

    def find(self, ref: str) -> Entry | None:
        """The newest entry whose hash is `ref`, or starts with it when only one hash does."""
        exact = [e for e in self._entries if e.hash == ref]
        if exact:
            return exact[-1]
        hashes = {e.hash for e in self._entries if e.hash.startswith(ref)}
        if len(hashes) != 1:
            return None
        return [e for e in self._entries if e.hash in hashes][-1]

    # ---- changing ----

    def resize(self, size: int) -> None:
        if size != self.size:
            self.size = size
            del self._entries[:-size]
            self._write_behind()

    def record(self, cfg: Config, source: str, now: float | None = None) -> Entry:
        entry = entry_of(cfg, source, time.time() if now is None else now)
        self._entries.append(entry)
        del self._entries[:-self.size]
        self._write_behind()
        return entry

    def _write_behind(self) -> None:
        if self.path is None:
            return
        body = json.dumps({"format": FORMAT, "entries": [e.to_json() for e in self._entries]},
                          separators=(",", ":")).encode()
        self._last_write = self._pool.submit(self._write, self.path, body)

    @staticmethod
    def _write(path: Path, body: bytes) -> None:
        tmp = path.with_name(f".{FILE}.{os.getpid()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:     # a full disk must not take the node down: say so, go on
            log.error("config_history_write_failed", path=str(path), error=str(e))

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for the last write to reach the disk."""
        if self._last_write is not None:
            await asyncio.wait_for(asyncio.wrap_future(self._last_write), timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
