"""A real `moed serve` under a fake systemd: NOTIFY_SOCKET is a datagram socket this test binds.

Sees STATUS while starting, a SIGHUP during the model load deferred (not fatal), READY=1 only
once /ready is 200, WATCHDOG=1 at WatchdogSec/2 from
the event loop, RELOADING=1 … READY=1 around a SIGHUP, STOPPING=1 on SIGTERM, and exit 0.
"""
from __future__ import annotations

import signal
import time
import urllib.request
from pathlib import Path

import pytest

from moed_server import NotifyListener


class FakeSystemd(NotifyListener):
    """The harness's listener, plus /ready's status at the moment READY=1 arrived."""

    def __init__(self, path: Path) -> None:
        self.on_ready: list[int] = []          # /ready status seen right when READY=1 arrived
        self.ready_url = ""
        super().__init__(path)

    def on_message(self, fields: dict[str, str]) -> None:
        if fields.get("READY") == "1" and self.ready_url and not self.on_ready:
            try:
                with urllib.request.urlopen(self.ready_url, timeout=2) as r:
                    self.on_ready.append(r.status)
            except Exception as e:  # 503 raises HTTPError
                self.on_ready.append(getattr(e, "code", -1))


def _health(srv) -> int:
    try:
        return srv.get("/health", timeout=1)[0]
    except OSError:        # not listening yet
        return 0


@pytest.fixture
def fake_systemd(tmp_path: Path):
    fs = FakeSystemd(tmp_path / "notify")
    yield fs
    fs.close()


def test_notify_lifecycle(moed_server, tiny_qwen3, fake_systemd, tmp_path: Path) -> None:
    conf = tmp_path / "node.toml"
    conf.write_text("[admission]\nmax_waiting_requests = 64\n")
    srv = moed_server(model=tiny_qwen3, config=conf, wait=None,
                      env={"NOTIFY_SOCKET": fake_systemd.path, "WATCHDOG_USEC": "1000000"})
    fake_systemd.ready_url = srv.url + "/ready"
    # A SIGHUP while the model loads is deferred until ready (its default action would kill).
    deadline = time.monotonic() + 90
    while _health(srv) != 200:
        assert srv.alive and time.monotonic() < deadline, srv.tail()
        time.sleep(0.02)
    srv.send_signal(signal.SIGHUP)
    ready = fake_systemd.wait_for("READY", timeout=90)
    deferred = fake_systemd.wait_for("RELOADING", after=ready)
    fake_systemd.wait_for("READY", after=deferred)
    assert srv.alive
    first_status = fake_systemd.messages[0][1]
    assert "STATUS" in first_status and "READY" not in first_status   # status while starting
    assert fake_systemd.on_ready == [200], "READY=1 was sent before /ready answered 200"

    # Watchdog: WATCHDOG_USEC=1 s → a ping every 0.5 s, from the event loop.
    t_ready = fake_systemd.messages[ready][0]
    time.sleep(2.2)
    pings = [t for t, f in fake_systemd.messages[ready:] if f.get("WATCHDOG") == "1"]
    assert len(pings) >= 4, fake_systemd.messages
    gaps = [b - a for a, b in zip(pings, pings[1:])]
    assert max(gaps) < 1.0, gaps              # never a gap as long as WatchdogSec
    assert pings[0] - t_ready < 1.0

    # Reload: RELOADING=1 (with MONOTONIC_USEC for Type=notify-reload), then READY=1.
    conf.write_text("[admission]\nmax_waiting_requests = 32\n")
    mark = len(fake_systemd.messages)
    srv.send_signal(signal.SIGHUP)
    i = fake_systemd.wait_for("RELOADING", after=mark)
    assert int(fake_systemd.messages[i][1]["MONOTONIC_USEC"]) > 0
    j = fake_systemd.wait_for("READY", after=i + 1)
    assert "config v2" in fake_systemd.messages[j][1]["STATUS"]

    # Stop: STOPPING=1 first, then a clean exit.
    mark = len(fake_systemd.messages)
    assert srv.stop(signal.SIGTERM, timeout=30) == 0
    k = fake_systemd.wait_for("STOPPING", after=mark, timeout=5)
    assert not any(f.get("READY") for _, f in fake_systemd.messages[k:])
