"""Start and observe real `moed serve` processes on 127.0.0.1 (used by tests/integration/conftest.py).

Two ways to get one:
- `moed_server` fixture (function scope): a factory; every server it starts is killed at teardown.
      srv = moed_server(model=tiny_qwen3, role="colocated", env={"MOED_...": "..."},
                        args=["--log-level", "debug"], config=path_or_None, toml="...")
      srv.url, srv.port, srv.logs(), srv.log_records(), srv.metrics(), srv.stop() -> exit code
- `serve_process(...)`: the same as a context manager, for module/session-scoped fixtures.

The server listens on a free port, logs JSON to a file under the test's tmp dir (srv.log_path),
and the start waits for GET /ready == 200 (a router: until it has started, see start_server;
or `wait="health"` for nodes that are not ready alone) within `ready_timeout` seconds; a server that exits or misses the deadline fails the
test with the tail of its log.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServerProcess:
    url: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    argv: list[str] = field(default_factory=list)

    # ---- observing ----
    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_records(self) -> list[dict]:
        """The JSON log lines (non-JSON lines, e.g. a console renderer's, are skipped)."""
        out = []
        for line in self.logs().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rec = json.loads(line)
                if isinstance(rec, dict):
                    out.append(rec)
        return out

    def get(self, path: str, timeout: float = 5.0,
            headers: Mapping[str, str] | None = None) -> tuple[int, str]:
        """GET; operator routes (/cluster, /internal/*) carry the harness's admin token unless
        `headers` are given."""
        if headers is None and path.startswith(("/cluster", "/internal/")):
            headers = ADMIN_HEADERS
        req = urllib.request.Request(self.url + path, headers=dict(headers or {}))
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self, headers: Mapping[str, str] | None = None) -> dict[str, float]:
        """/metrics as {'name{labels}': value} (labels as printed by prometheus-client)."""
        status, text = self.get("/metrics", headers=headers)
        assert status == 200, f"/metrics answered {status}: {text[:200]}"
        return parse_metrics(text)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    # ---- stopping ----
    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal, wait up to `timeout`, then SIGKILL. Returns the exit code."""
        if self.alive:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(10)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.logs().splitlines()[-n:])


# Every server the harness starts shares one cluster secret (prefill/decode nodes refuse to
# start without one) and one admin token, unless the test configures its own.
CLUSTER_KEY = os.urandom(32).hex()
ADMIN_TOKEN = "test-admin-" + os.urandom(8).hex()
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _secrets_env(role: str | None, env: Mapping[str, str], toml: str | None) -> dict[str, str]:
    """Default secrets for a child, for what the test's env or TOML leaves unset."""
    out: dict[str, str] = {}
    text = toml or ""
    if role in ("prefill", "decode") and not any(
            k in env for k in ("MOED_CLUSTER_KEY_ENV", "MOED_CLUSTER_KEY_FILE",
                               "MOED_CLUSTER_INSECURE")) and \
            not any(k in text for k in ("key_file", "key_env", "insecure")):
        out.update({"MOED_CLUSTER_KEY_ENV": "TEST_MOED_CLUSTER_KEY",
                    "TEST_MOED_CLUSTER_KEY": CLUSTER_KEY})
    if not any(k.startswith("MOED_SERVER_ADMIN_TOKEN") for k in env) and "admin_token" not in text:
        out.update({"MOED_SERVER_ADMIN_TOKEN_ENV": "TEST_MOED_ADMIN_TOKEN",
                    "TEST_MOED_ADMIN_TOKEN": ADMIN_TOKEN})
    return out


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free 127.0.0.1 port never handed out before in this test process.

    The kernel may give a just-closed port again before the child that was told to use it has
    bound it (servers started with wait=None load for seconds): two servers then race for one
    port, the loser exits and the winner answers for both."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class NotifyListener:
    """A fake systemd: the sd_notify datagrams a node sends to NOTIFY_SOCKET, as
    (arrival time, fields), collected on a thread so a test can block. `on_message` is a hook
    for subclasses (called on that thread before the message is stored)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict[str, str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def on_message(self, fields: dict[str, str]) -> None:
        pass

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096).decode()
            except (socket.timeout, OSError):
                continue
            fields = dict(line.split("=", 1) for line in data.split("\n") if "=" in line)
            self.on_message(fields)
            self.messages.append((time.monotonic(), fields))

    def fields(self, i: int) -> dict[str, str]:
        return self.messages[i][1]

    def wait_for(self, key: str, value: str = "1", after: int = 0, timeout: float = 30.0) -> int:
        """Index of the first message at or after `after` with key=value (fails after timeout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, (_, f) in enumerate(self.messages[after:], start=after):
                if f.get(key) == value:
                    return i
            time.sleep(0.02)
        raise AssertionError(f"no {key}={value} after #{after} within {timeout} s: "
                             f"{[f for _, f in self.messages]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


_METRIC = re.compile(r"^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and not line.startswith("#"):
            out[m.group(1)] = float(m.group(2))
    return out


def _ready_reason(body: str) -> str | None:
    try:
        got = json.loads(body)
    except ValueError:
        return None
    return got.get("status") if isinstance(got, dict) else None


def _wait_ready(srv: ServerProcess, path: str, deadline: float, started: bool = False) -> None:
    """Until GET `path` is 200; with `started`, /ready's 503 for a reason other than
    starting/draining counts too (a router that is up but knows no serving node yet)."""
    while time.monotonic() < deadline:
        if not srv.alive:
            raise AssertionError(f"moed serve exited with {srv.proc.returncode} before {path} "
                                 f"was 200; log tail:\n{srv.tail()}")
        with contextlib.suppress(OSError):
            status, body = srv.get(path, timeout=1.0)
            if status == 200 or (started and status == 503 and _ready_reason(body) not in
                                 ("starting", "draining", None)):
                return
        time.sleep(0.1)
    raise AssertionError(f"moed serve not ready within the deadline; log tail:\n{srv.tail()}")


def start_server(*, model: str | Path | None = None, role: str | None = None,
                 config: str | Path | None = None, toml: str | None = None,
                 env: Mapping[str, str] | None = None, args: Sequence[str] = (),
                 port: int | None = None, log_dir: str | Path | None = None,
                 wait: str | None = "ready", ready_timeout: float = 90.0) -> ServerProcess:
    """Start `python -m moed serve` (caller must stop it). `toml` writes a config file.

    The child gets this process's environment minus any MOED_* variable (tests stay
    independent of the shell), plus OMP_NUM_THREADS=1, MOED_ENGINE_NUM_THREADS=1, the
    harness's cluster key (prefill/decode) and admin token (see `_secrets_env`), and `env`.
    """
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="moed-srv-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    if toml is not None:
        config = log_dir / f"moed-{port}.toml"
        Path(config).write_text(toml)
    argv = [sys.executable, "-m", "moed", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if config:
        argv += ["--config", str(config)]
    if model:
        argv += ["--model", str(model)]
    if role:
        argv += ["--role", role]
    argv += list(args)
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    full_env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                     "MOED_ENGINE_NUM_THREADS": "1"})
    full_env.update(_secrets_env(role, env or {}, toml))
    full_env.update(env or {})
    log_path = log_dir / f"moed-{port}.log"
    log_file = open(log_path, "wb")
    try:
        proc = subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log_file.close()
    srv = ServerProcess(f"http://127.0.0.1:{port}", port, proc, log_path, argv)
    # a router's /ready needs a live serving node, which one started first (a seed) does not
    # know yet: wait until it has started (every component up), not until it is ready
    started = wait == "ready" and role == "router"
    if wait:
        try:
            _wait_ready(srv, "/ready" if wait == "ready" else "/health",
                        time.monotonic() + ready_timeout, started)
        except BaseException:
            srv.stop(signal.SIGKILL)
            raise
    return srv


@contextlib.contextmanager
def serve_process(**kw) -> Iterator[ServerProcess]:
    srv = start_server(**kw)
    try:
        yield srv
    finally:
        srv.stop(timeout=15.0)


@contextlib.contextmanager
def started_together(specs: Mapping[str, tuple[str, int | None, Mapping[str, str]]],
                     model: str | Path, log_dir: Path, common: Mapping[str, str],
                     ready_timeout: float = 150.0) -> Iterator[dict[str, ServerProcess]]:
    """Start every node of `specs` (name -> (role, port or None, env)) at once, then wait for
    each to be ready (they load in parallel); stop them all on exit."""
    servers: dict[str, ServerProcess] = {}
    try:
        for name, (role, port, env) in specs.items():
            servers[name] = start_server(model=model, role=role, port=port,
                                         env={**common, **env}, log_dir=log_dir, wait=None)
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + ready_timeout)
        yield servers
    finally:
        for s in servers.values():
            s.stop(timeout=10)
