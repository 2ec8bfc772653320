"""sd_notify over a real AF_UNIX datagram socket (path and abstract), and the watchdog pinger."""
from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import pytest

from moed.ops.sdnotify import Notifier, watchdog_interval, watchdog_loop


def _recv_all(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


@pytest.fixture
def notify_socket(tmp_path: Path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.setblocking(False)
    yield path, sock
    sock.close()


def test_messages_arrive_as_newline_separated_fields(notify_socket) -> None:
    path, sock = notify_socket
    n = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready()
    assert n.status("loading\nREADY=1")  # a newline cannot forge a second field
    assert n.reloading()
    assert n.stopping()
    assert n.watchdog()
    assert n.extend_timeout(2.5)
    msgs = _recv_all(sock)
    assert msgs[0] == "READY=1\nSTATUS=serving"
    assert msgs[1] == "STATUS=loading READY=1"
    fields = dict(line.split("=", 1) for line in msgs[2].split("\n"))
    assert fields["RELOADING"] == "1" and int(fields["MONOTONIC_USEC"]) > 0
    assert msgs[3] == "STOPPING=1\nSTATUS=draining"
    assert msgs[4] == "WATCHDOG=1"
    assert msgs[5] == "EXTEND_TIMEOUT_USEC=2500000"
    n.close()


def test_abstract_socket() -> None:
    name = f"moed-test-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2)
    try:
        n = Notifier("@" + name)
        assert n.ready("up")
        assert sock.recv(100) == b"READY=1\nSTATUS=up"
    finally:
        sock.close()


def test_unset_or_unsupported_socket_is_a_noop() -> None:
    assert not Notifier.from_env({}).ready()
    assert not Notifier("vsock:2:1234").enabled


def test_vanished_socket_does_not_raise(tmp_path: Path) -> None:
    n = Notifier(str(tmp_path / "gone"))
    assert n.enabled and n.watchdog() is False


def test_watchdog_interval_is_half_and_respects_pid() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, pid=2) is None
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "x"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None


async def test_watchdog_loop_pings_and_health_can_withhold(notify_socket) -> None:
    path, sock = notify_socket
    n = Notifier(path)
    healthy = True
    task = asyncio.create_task(watchdog_loop(n, 0.01, lambda: healthy))
    await asyncio.sleep(0.1)
    pings = _recv_all(sock)
    assert len(pings) >= 3 and set(pings) == {"WATCHDOG=1"}
    healthy = False
    await asyncio.sleep(0.02)  # let an in-flight iteration finish
    _recv_all(sock)
    await asyncio.sleep(0.1)
    assert _recv_all(sock) == []
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
