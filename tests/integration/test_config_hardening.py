"""Config files gone bad, on real processes: no traceback, no blocked event loop, no unit
stuck in "reloading".

- `moed serve` and `moed check-config` on a config that is not UTF-8, a FIFO or a directory
  exit 2 with one line saying why (a FIFO does not block the start);
- a running node whose config becomes non-UTF-8 bytes, then a FIFO, then a directory, and is
  SIGHUPed: every reload is logged as rejected and counted as invalid, systemd sees
  RELOADING=1 then READY=1 each time, /health keeps answering, the running config stays, and
  a good file afterwards applies.
Every wait has a deadline.
"""
from __future__ import annotations

import json

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from moed_server import ROOT, NotifyListener, free_port

pytestmark = pytest.mark.timeout(150)

GOOD = "[admission]\nmax_waiting_requests = {n}\n"
LATIN1 = GOOD.format(n=2).encode() + b"# caf\xe9\n"            # a Latin-1 é in a comment
BAD = {  # kind → the reason in the error
    "not-utf8": f"not UTF-8 text at byte {LATIN1.index(0xE9)}",
    "fifo": "not a regular file (a FIFO)",
    "directory": "not a regular file (a directory)",
}


def make_bad(p: Path, kind: str) -> None:
    if p.is_dir():
        p.rmdir()
    elif p.exists() or p.is_fifo():
        p.unlink()
    if kind == "not-utf8":
        p.write_bytes(LATIN1)
    elif kind == "fifo":
        os.mkfifo(p)
    else:
        p.mkdir()


def make_good(p: Path, n: int) -> None:
    if p.is_dir():
        p.rmdir()
    elif p.is_fifo():
        p.unlink()
    p.write_text(GOOD.format(n=n))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOED_")}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("kind", sorted(BAD))
@pytest.mark.parametrize("command", ["serve", "check-config"])
def test_cli_refuses_a_bad_config_in_one_line(tmp_path: Path, command: str, kind: str) -> None:
    p = tmp_path / "node.toml"
    make_bad(p, kind)
    args = (["serve", "--role", "router", "--port", str(free_port()), "--config", str(p)]
            if command == "serve" else ["check-config", "--role", "router", str(p)])
    try:
        r = subprocess.run([sys.executable, "-m", "moed", *args], cwd=ROOT, env=_env(),
                           capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"moed {command} blocked on a {kind} config")   # run() killed it
    finally:
        if kind == "fifo":   # anything that did open the FIFO blocking gets a writer
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    out = (r.stdout + r.stderr).decode(errors="replace")
    assert r.returncode == 2, out
    if kind == "directory":     # on the command line: most likely the model's directory
        flag = "--config" if command == "serve" else "CONFIG"
        want = (f"moed: config error: command line: {flag} {p} is a directory: {flag} is a TOML "
                f"file; the model goes in --model (moed {command} --model {p})")
    else:
        want = f"moed: config error: {p}: {BAD[kind]}"
    assert out.splitlines() == [want], out
    assert "Traceback" not in out


@pytest.fixture
def notify(tmp_path: Path):
    ns = NotifyListener(tmp_path / "notify")
    yield ns
    ns.close()


def _reloads(srv, result: str) -> float:
    return srv.metrics().get(f'moed_config_reloads_total{{result="{result}"}}', 0.0)


def _health_within(srv, seconds: float) -> None:
    t0 = time.monotonic()
    status, _ = srv.get("/health", timeout=seconds)
    assert status == 200 and time.monotonic() - t0 < seconds


def test_running_node_refuses_bad_files_on_sighup(moed_server, notify, tmp_path: Path) -> None:
    conf = tmp_path / "node.toml"
    make_good(conf, 8)
    srv = moed_server(role="router", config=conf, env={"NOTIFY_SOCKET": notify.path})
    ready = notify.wait_for("READY", after=0, timeout=15.0)
    mark = ready + 1
    # a router with no backend alive is not ready (503 no_backend); a bad reload changes nothing
    status0, body0 = srv.get("/ready")
    assert status0 == 503 and "no_backend" in json.dumps(body0), body0
    for kind in ("not-utf8", "fifo", "directory"):
        make_bad(conf, kind)
        before = _reloads(srv, "invalid")
        srv.send_signal(signal.SIGHUP)
        i = notify.wait_for("RELOADING", after=mark, timeout=15.0)
        j = notify.wait_for("READY", after=i + 1, timeout=15.0)        # the unit does not stay "reloading"
        assert notify.fields(j)["STATUS"] == "serving, config v1 (invalid)", kind
        mark = j + 1
        _health_within(srv, 2.0)                          # the event loop is not blocked
        deadline = time.monotonic() + 10
        while _reloads(srv, "invalid") < before + 1:
            assert time.monotonic() < deadline, f"{kind}: reload not counted\n{srv.tail()}"
            time.sleep(0.05)
        assert _reloads(srv, "invalid") == before + 1
        rejected = [r for r in srv.log_records() if r.get("event") == "config_reload_rejected"]
        assert rejected and BAD[kind] in rejected[-1]["error"], srv.tail()
        assert rejected[-1]["level"] == "error" and str(conf) in rejected[-1]["error"]
        assert srv.alive and srv.get("/ready") == (status0, body0)

    make_good(conf, 4)                                    # a good file applies again
    srv.send_signal(signal.SIGHUP)
    i = notify.wait_for("RELOADING", after=mark, timeout=15.0)
    j = notify.wait_for("READY", after=i + 1, timeout=15.0)
    assert notify.fields(j)["STATUS"] == "serving, config v2 (applied)"
    assert _reloads(srv, "applied") == 1 and _reloads(srv, "invalid") == 3
    logs = srv.logs()
    assert "Traceback" not in logs and "config_reload_crashed" not in logs
    assert srv.stop(signal.SIGTERM, timeout=30) == 0
