"""HTTP limits against a real `moed serve` (router role: no model) under a 1024 fd limit.

- 1,100 idle connections against max_connections=900: /health still answers at once (idle
  connections are evicted, counted and logged), and every idle one is closed by the header
  timeout.
- slowloris, an idle keep-alive connection, slow and endless bodies: closed on their deadlines.
- max_connections above the fd limit: the node logs fd_limit_low at start and fd_limit_reached
  while descriptors run out, keeps answering on the connections it has, and recovers.
Every socket is bounded in time and closed.
"""
from __future__ import annotations

import contextlib
import json
import resource
import selectors
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import pytest

from moed_server import ServerProcess, parse_metrics, start_server

NOFILE = 1024
HEADER_S, KEEPALIVE_S, BODY_S = 4.0, 2.0, 1.5


@pytest.fixture(autouse=True)
def _enough_fds_here():
    """The client side opens ~2,500 sockets: raise this process's soft limit (up to the hard
    one) for the test and put it back after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4096 if hard == resource.RLIM_INFINITY else min(hard, 4096)
    assert want >= 2500, f"the hard fd limit {hard} is below the 2,500 this test needs"
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@contextlib.contextmanager
def _limited_server(tmp_path, max_connections: int, header_s: float = HEADER_S,
                    keepalive_s: float = KEEPALIVE_S) -> Iterator[ServerProcess]:
    """A router node under an fd limit of NOFILE (set on the child at once: it is still
    importing when its App reads the limit), up once /health answers."""
    toml = f"""
[server]
max_connections = {max_connections}
header_timeout_s = {header_s}
keepalive_timeout_s = {keepalive_s}
body_timeout_s = {BODY_S}
[router]
backends = ["http://127.0.0.1:9"]
"""
    srv = start_server(role="router", toml=toml, log_dir=tmp_path, wait=None)
    try:
        resource.prlimit(srv.proc.pid, resource.RLIMIT_NOFILE, (NOFILE, NOFILE))
        deadline = time.monotonic() + 60
        while not _health_ok(srv):
            assert srv.alive and time.monotonic() < deadline, srv.tail()
            time.sleep(0.1)
        yield srv
    finally:
        srv.stop(timeout=15.0)


def _health_ok(srv: ServerProcess) -> bool:
    with contextlib.suppress(OSError):
        return srv.get("/health", timeout=1.0)[0] == 200
    return False


def _open_idle(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5.0)
        socks.append(s)
    return socks


def _wait_closed(socks: list[socket.socket], timeout: float) -> int:
    """How many of `socks` the server closes within `timeout` seconds."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + timeout
    try:
        while closed < len(socks) and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(min(left, 0.5)):
                try:
                    data = key.fileobj.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    closed += 1
                    sel.unregister(key.fileobj)
    finally:
        sel.close()
    return closed


def _close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        s.close()


def _response(s: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Read one response with a Content-Length body; the connection stays open."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        assert chunk, f"closed before a response: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        chunk = s.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _timed_health(port: int) -> float:
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = _response(s)
    assert status == 200 and json.loads(body) == {"status": "ok"}
    return time.monotonic() - t0


def _shed_lines(srv: ServerProcess) -> list[dict]:
    return [r for r in srv.log_records() if r.get("event") == "http_connections_shed"]


# ---- 1,100 idle connections against max_connections=900 ----------------------------------

def test_idle_flood_cannot_silence_health(tmp_path):
    with _limited_server(tmp_path, max_connections=900) as srv:
        t0 = time.monotonic()
        idle = _open_idle(srv.port, 1100)
        try:
            assert time.monotonic() - t0 < HEADER_S - 1.5, "flood took too long to test"
            assert _timed_health(srv.port) < 2.0
            m = srv.metrics()
            assert m["moed_http_connections_open"] <= 900
            assert m['moed_http_connections_shed_total{reason="idle_evicted"}'] >= 200
            # the header deadline closes every one of them (evicted ones already are)
            assert _wait_closed(idle, HEADER_S + 3.0) == len(idle)
        finally:
            _close_all(idle)
        assert _timed_health(srv.port) < 2.0
        lines = _shed_lines(srv)
        assert lines and sum(r["counts"].get("idle_evicted", 0) for r in lines) >= 200
        assert all(r["max_connections"] == 900 for r in lines)
        assert len(lines) <= 5                  # rate-limited: about one line a second
        m = srv.metrics()
        assert m['moed_http_connections_timed_out_total{phase="header"}'] >= 1
        assert m["moed_http_connections_open"] <= 2


# ---- deadlines: slowloris, keep-alive idle, slow and endless bodies ------------------------

def _slowloris(port: int) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        for i in range(100):
            sel = selectors.DefaultSelector()
            sel.register(s, selectors.EVENT_READ)
            ready = sel.select(0.3)
            sel.close()
            try:
                if ready and not s.recv(4096):
                    break
                s.sendall(b"X-Drip-%d: y\r\n" % i)
            except OSError:
                break
        return time.monotonic() - t0


def _keepalive_idle(port: int) -> float:
    with socket.create_connection(("127.0.0.1", port), timeout=KEEPALIVE_S + 5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(s)[0] == 200
        t0 = time.monotonic()
        assert s.recv(4096) == b""
        return time.monotonic() - t0


def _body(port: int, chunked: bool) -> tuple[float, float, int, dict]:
    """(seconds to the response, seconds from it to the close, status, body) for a body that
    trickles (1 byte / 0.2 s of 1000) or never ends (chunks forever)."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as s:
        t0 = time.monotonic()
        s.sendall(head + (b"Transfer-Encoding: chunked\r\n\r\n" if chunked
                          else b"Content-Length: 1000\r\n\r\n"))
        out, answered = b"", None
        for _ in range(100):
            sel = selectors.DefaultSelector()
            sel.register(s, selectors.EVENT_READ)
            ready = sel.select(0.2)
            sel.close()
            try:
                if ready:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    out += chunk
                    answered = answered or time.monotonic()
                s.sendall(b"1\r\n \r\n" if chunked else b" ")
            except OSError:
                break
        closed = time.monotonic()
    head_, _, body = out.partition(b"\r\n\r\n")
    assert answered is not None, "no response"
    return answered - t0, closed - answered, int(head_.split()[1]), json.loads(body)


def test_slow_clients_are_closed_on_their_deadlines(tmp_path):
    with _limited_server(tmp_path, max_connections=900) as srv, ThreadPoolExecutor(4) as pool:
        slow = pool.submit(_slowloris, srv.port)
        keep = pool.submit(_keepalive_idle, srv.port)
        endless = pool.submit(_body, srv.port, True)
        trickle = pool.submit(_body, srv.port, False)
        assert HEADER_S - 0.1 <= slow.result(timeout=30) < HEADER_S + 2.0
        assert KEEPALIVE_S - 0.1 <= keep.result(timeout=30) < KEEPALIVE_S + 2.0
        for fut in (endless, trickle):
            waited, gap, status, body = fut.result(timeout=30)
            assert status == 408 and body["error"]["code"] == "body_timeout"
            assert BODY_S - 0.1 <= waited < BODY_S + 2.0
            assert gap < 0.6            # closed with the 408, not drained for another BODY_S
        m = srv.metrics()
        assert m['moed_http_connections_timed_out_total{phase="header"}'] >= 1
        assert m['moed_http_connections_timed_out_total{phase="body"}'] == 2
        timed = [r for r in srv.log_records() if r.get("event") == "http_connections_timed_out"]
        assert timed and all("request_id" not in r for r in timed)   # a summary, not a request


# ---- max_connections above the fd limit ------------------------------------------------------

def test_fd_exhaustion_is_logged_and_existing_connections_keep_answering(tmp_path):
    with _limited_server(tmp_path, max_connections=2000, header_s=3.0, keepalive_s=60.0) as srv:
        lines = {r.get("event") for r in srv.log_records()}
        assert "fd_limit_low" in lines
        keep = socket.create_connection(("127.0.0.1", srv.port), timeout=5.0)
        flood: list[socket.socket] = []
        try:
            keep.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _response(keep)[0] == 200
            flood = _open_idle(srv.port, 1100)          # more than the server has fds for
            time.sleep(1.5)                             # one fd probe at least
            keep.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _response(keep)[0] == 200            # the connection it has still answers
            keep.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            status, _, body = _response(keep)
            assert status == 200
            assert parse_metrics(body.decode())["moed_http_fd_exhausted_total"] > 0
            assert _wait_closed(flood, 3.0 + 3.0) == len(flood)
        finally:
            _close_all(flood)
            keep.close()
        assert _timed_health(srv.port) < 2.0            # descriptors back: new ones answer
        reached = [r for r in srv.log_records() if r.get("event") == "fd_limit_reached"]
        assert reached and reached[0]["level"] == "error" and reached[0]["nofile_limit"] == NOFILE
