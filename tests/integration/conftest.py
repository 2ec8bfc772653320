"""Integration fixtures: real `moed serve` processes on 127.0.0.1 (helpers in moed_server.py).

- `moed_server` (function scope) is a factory; every server it starts is stopped at teardown:
      srv = moed_server(model=tiny_qwen3, role="colocated", env={"MOED_...": "..."},
                        args=["--log-format", "console"], config=path, toml="[server]...",
                        wait="ready" | "health" | None, ready_timeout=90)
      srv.url, srv.port, srv.get(path), srv.metrics(), srv.log_records(), srv.logs(),
      srv.send_signal(sig), srv.stop() -> exit code
- For module/session scope: `from moed_server import serve_process` (a context manager).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from moed_server import ServerProcess, start_server  # noqa: E402


@pytest.fixture
def moed_server(tmp_path: Path):
    """Factory: moed_server(**start_server kwargs) -> ServerProcess; all are stopped at teardown."""
    started: list[ServerProcess] = []

    def start(**kw) -> ServerProcess:
        kw.setdefault("log_dir", tmp_path / "servers")
        srv = start_server(**kw)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop(timeout=15.0)
