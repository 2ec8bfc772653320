"""systemd notification protocol (sd_notify) without libsystemd, and the watchdog pinger.

The protocol is one AF_UNIX datagram per message, newline-separated KEY=VALUE lines, sent to
the path in $NOTIFY_SOCKET ('@' at the start means a Linux abstract socket). With no
$NOTIFY_SOCKET (not started by systemd, or Type=simple) every call is a cheap no-op.

Messages moed sends over its life:
  STATUS=starting, loading model  while the checkpoint loads (TimeoutStartSec bounds it)
  READY=1 + STATUS=serving      once the model is loaded and the node has joined
  WATCHDOG=1                    every WatchdogSec/2 from the event loop (see `watchdog_loop`)
  RELOADING=1 + MONOTONIC_USEC  at SIGHUP, then READY=1 when the reload is done, whatever
                                its result (else the unit stays "reloading")
  STOPPING=1 + STATUS=draining  at SIGTERM / POST /admin/drain
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Callable, Mapping

import structlog

log = structlog.get_logger(__name__)


def _address(raw: str) -> str | bytes | None:
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()  # abstract namespace: leading NUL, no terminator
    if raw.startswith("/"):
        return raw
    return None  # vsock:... and other transports are not supported here


class Notifier:
    """Sends sd_notify messages. Never raises: a broken socket must not take the node down."""

    def __init__(self, socket_path: str | None) -> None:
        self._addr = _address(socket_path) if socket_path else None
        if socket_path and self._addr is None:
            log.warning("sdnotify_unsupported_socket", notify_socket=socket_path)
        self._sock: socket.socket | None = None
        if self._addr is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.setblocking(False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Notifier":
        env = os.environ if environ is None else environ
        return cls(env.get("NOTIFY_SOCKET") or None)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, **fields: object) -> bool:
        """notify(READY=1, STATUS="serving") → 'READY=1\\nSTATUS=serving'. True if sent."""
        if self._sock is None:
            return False
        lines = []
        for key, value in fields.items():
            text = str(value)
            if "\n" in text:  # one field per line: a newline would forge another field
                text = text.replace("\n", " ")
            lines.append(f"{key}={text}")
        try:
            self._sock.sendto("\n".join(lines).encode(), self._addr)  # type: ignore[arg-type]
            return True
        except OSError as e:  # socket gone (manager restarted) or full: log, keep serving
            log.warning("sdnotify_send_failed", error=str(e), fields=",".join(fields))
            return False

    # The messages moed uses, named so call sites read as the lifecycle.
    def ready(self, status: str = "serving") -> bool:
        return self.send(READY=1, STATUS=status)

    def status(self, text: str) -> bool:
        return self.send(STATUS=text)

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets Type=notify-reload (systemd >= 253) match this to its SIGHUP.
        return self.send(RELOADING=1, STATUS="reloading configuration",
                         MONOTONIC_USEC=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self, status: str = "draining") -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)

    def extend_timeout(self, seconds: float) -> bool:
        return self.send(EXTEND_TIMEOUT_USEC=int(seconds * 1_000_000))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: Mapping[str, str] | None = None, pid: int | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None when not asked for.

    systemd sets WATCHDOG_USEC, and WATCHDOG_PID when the variable is meant for one process
    only: a child that inherited the environment must not ping on its parent's behalf.
    """
    env = os.environ if environ is None else environ
    raw = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if owner and owner.isdigit() and int(owner) != (os.getpid() if pid is None else pid):
        return None
    try:
        usec = int(raw)
    except ValueError:
        return None
    return usec / 2_000_000 if usec > 0 else None


async def watchdog_loop(notifier: Notifier, interval: float,
                        healthy: Callable[[], bool] | None = None) -> None:
    """Ping WATCHDOG=1 every `interval` seconds from this event loop until cancelled.

    Running on the event loop is the point: if the loop is blocked, pings stop and systemd
    restarts the node. `healthy` can veto a ping (e.g. the engine's step loop made no progress
    while work is queued), so a wedged engine is restarted too.
    """
    while True:
        if healthy is None or healthy():
            notifier.watchdog()
        else:
            log.warning("watchdog_ping_withheld", reason="health check failed")
        await asyncio.sleep(interval)
