"""HTTP hardening in-process over raw sockets: parser errors as JSON without echo, header /
keep-alive / body deadlines, connection slots (probe slots, idle eviction, shedding), hostile
JSON bodies, the fd probe. The same against a real process under an fd limit:
tests/integration/test_http_hardening.py."""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import time

import pytest
import structlog
from api_harness import running_app

from moed.api import limits
from moed.api.errors import unparsed_request_error
from moed.obs import metrics


# ---- raw HTTP over asyncio streams (the server runs on this test's loop) --------------------

async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _read_all(r: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Everything until EOF (or a reset: what arrived before it is kept)."""
    out = b""
    async with asyncio.timeout(timeout):
        while True:
            try:
                chunk = await r.read(65536)
            except ConnectionResetError:
                return out
            if not chunk:
                return out
            out += chunk


async def _send(port: int, data: bytes) -> bytes:
    r, w = await _connect(port)
    try:
        w.write(data)
        try:
            await w.drain()
        except ConnectionError:      # the server answered and closed before taking it all
            pass
        return await _read_all(r)
    finally:
        w.close()


async def _response(r: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response with a Content-Length body, leaving the connection open."""
    async with asyncio.timeout(5.0):
        head = await r.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in
                   (ln.partition(":") for ln in lines[1:] if ln)}
        body = await r.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), headers, body


def _split(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


async def _closed_within(r: asyncio.StreamReader, timeout: float) -> float:
    """Seconds until the server closes the connection (fails after `timeout`)."""
    t0 = time.monotonic()
    await _read_all(r, timeout)
    return time.monotonic() - t0


def _sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels or None) or 0.0


# ---- parser errors: JSON, never the client's bytes -------------------------------------------

GET = b"GET /health HTTP/1.1\r\nHost: x\r\n"


@pytest.mark.parametrize("name,raw,status,code,marker", [
    ("1 MB header", GET + b"X-Big: " + b"Q" * (1 << 20) + b"\r\n\r\n", 431, "header_too_large",
     b"QQQQ"),
    ("5000 headers", GET + b"".join(b"X-Zz%d: v\r\n" % i for i in range(5000)) + b"\r\n", 431,
     "too_many_headers", b"X-Zz"),
    ("long URL", b"GET /" + b"u" * 20000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431,
     "header_too_large", b"uuuu"),
    ("unknown method", b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "unsupported_method",
     b"FOO"),
    ("method not a token", b"G@T /health HTTP/1.1\r\nHost: x\r\n\r\n", 400,
     "unsupported_method", b"G@T"),
    ("TLS on the HTTP port", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400,
     "unsupported_method", b"\x16\x03"),
    ("bad version", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", 400, "bad_http_request",
     b"9.9"),
    ("bad header name", GET + b"Ba d: x\r\n\r\n", 400, "bad_http_request", b"Ba d"),
    ("bad Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
     b"Content-Length: 12zz\r\n\r\n", 400, "bad_http_request", b"12zz"),
])
async def test_parser_errors_are_json_without_echo(server, name, raw, status, code, marker):
    app, _, _ = server
    before = _sample("moed_http_requests_total", route="unparsed", status=str(status))
    got, headers, body = _split(await _send(app.port, raw))
    assert got == status, name
    assert headers["content-type"].startswith("application/json")
    assert body["error"]["code"] == code and set(body["error"]) == {"message", "type", "param",
                                                                    "code"}
    assert marker not in json.dumps(body).encode() and marker not in str(headers).encode()
    assert _sample("moed_http_requests_total", route="unparsed",
                   status=str(status)) == before + 1


def test_failures_outside_the_middleware_name_nothing():
    assert unparsed_request_error(500, RuntimeError("secret detail")).body() == {"error": {
        "message": "Internal server error.", "type": "server_error", "param": None,
        "code": "internal_error"}}
    assert unparsed_request_error(504, None).status == 504


async def test_limits_follow_the_config():
    async with running_app(server={"max_header_bytes": 2048, "max_headers": 10}) as (app, _, _e):
        ok = GET + b"X-A: " + b"a" * 1500 + b"\r\n\r\n"
        assert _split(await _send(app.port, ok.replace(b"HTTP/1.1\r\n", b"HTTP/1.0\r\n")))[0] \
            == 200
        assert _split(await _send(app.port, GET + b"X-A: " + b"a" * 2100 + b"\r\n\r\n"))[0] \
            == 431
        many = GET + b"".join(b"X-%d: v\r\n" % i for i in range(12)) + b"\r\n"
        assert _split(await _send(app.port, many))[2]["error"]["code"] == "too_many_headers"


async def test_known_method_on_a_route_without_it_is_json_405(server):
    app, _, _ = server
    status, headers, body = _split(await _send(
        app.port, b"PATCH /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
    assert status == 405 and body["error"]["code"] == "method_not_allowed"
    assert "GET" in headers["allow"]
    assert headers["content-type"].startswith("application/json")


async def test_undecodable_body_is_400_not_500(server):
    app, _, _ = server
    garbage = b"not gzip at all"
    status, _, body = _split(await _send(
        app.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(garbage), garbage)))
    assert status == 400 and body["error"]["code"] == "bad_body"


async def test_malformed_chunk_after_the_headers_ends_at_the_body_timeout():
    # aiohttp's C parser drops the body stream of a request whose chunk framing breaks after the
    # headers were handed over (it never fails it): the body deadline ends it, with JSON.
    async with running_app(server={"body_timeout_s": 0.5}) as (app, _, _e):
        r, w = await _connect(app.port)
        try:
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n")
            await w.drain()
            await asyncio.sleep(0.2)          # the body is being read now
            w.write(b"5\r\n{\"a\":\r\nZZ\r\n")
            status, _, body = _split(await _read_all(r, 3.0))
        finally:
            w.close()
    assert status == 408 and body["error"]["code"] == "body_timeout"


# ---- hostile JSON bodies through the server ---------------------------------------------------

@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
    (b'{"prompt": "x", "stop": ["\\ud83d"]}', "stop"),
    (b'{"prompt": "x", "model": "\\ud800"}', "model"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
    (b'{"prompt": "x", "stop_token_ids": [1000000000000000000000000000000]}', "stop_token_ids"),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),     # over int digit limit
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),        # nesting
])
async def test_hostile_json_is_a_clean_400(server, http, raw, param):
    app, url, engine = server
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    async with http.post(url + path, data=raw,
                         headers={"Content-Type": "application/json"}) as r:
        assert r.status == 400, await r.text()
        body = await r.json()
    assert body["error"]["param"] == param
    assert not engine.reqs


# ---- deadlines -----------------------------------------------------------------------------

FAST = {"header_timeout_s": 0.5, "keepalive_timeout_s": 1.0, "body_timeout_s": 0.5}


async def test_idle_and_slowloris_connections_close_at_the_header_timeout():
    async with running_app(server=FAST) as (app, _, _e):
        before = _sample("moed_http_connections_timed_out_total", phase="header")
        r_idle, w_idle = await _connect(app.port)
        r_slow, w_slow = await _connect(app.port)
        t0 = time.monotonic()

        async def drip() -> None:
            w_slow.write(b"GET /health HTTP/1.1\r\n")
            for i in range(40):
                await asyncio.sleep(0.05)
                w_slow.write(b"X-%d: y\r\n" % i)
        dripping = asyncio.create_task(drip())
        try:
            await _read_all(r_idle, 3.0)
            await _read_all(r_slow, 3.0)
            elapsed = time.monotonic() - t0
        finally:
            dripping.cancel()
            w_idle.close()
            w_slow.close()
        assert 0.45 <= elapsed < 1.5
        assert _sample("moed_http_connections_timed_out_total",
                       phase="header") == before + 2


async def test_keepalive_connection_outlives_the_header_timeout_then_closes():
    async with running_app(server=FAST) as (app, _, _e):
        r, w = await _connect(app.port)
        try:
            for _ in range(2):        # the header deadline is for the first request only
                w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert (await _response(r))[0] == 200
                await asyncio.sleep(0.7)      # > header_timeout_s, < keepalive_timeout_s
            elapsed = await _closed_within(r, 3.0)
        finally:
            w.close()
        assert 0.2 <= elapsed < 1.5           # ~keepalive_timeout_s after the last response


async def test_slow_and_endless_bodies_get_408_and_the_connection_closes():
    async with running_app(server={"body_timeout_s": 1.0}) as (app, _, _e):
        before = _sample("moed_http_connections_timed_out_total", phase="body")
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        r1, w1 = await _connect(app.port)
        r2, w2 = await _connect(app.port)
        w1.write(head + b"Content-Length: 100\r\n\r\n{\"prompt\":")
        w2.write(head + b"Transfer-Encoding: chunked\r\n\r\n")

        async def endless() -> None:
            while True:
                w2.write(b"1\r\n \r\n")
                await asyncio.sleep(0.05)

        async def answer_then_close(r: asyncio.StreamReader) -> tuple[float, int, bytes, float]:
            t0 = time.monotonic()
            status, headers, body = await _response(r)
            assert headers["content-type"].startswith("application/json")
            return time.monotonic() - t0, status, body, await _closed_within(r, 3.0)
        feeding = asyncio.create_task(endless())
        try:
            results = await asyncio.gather(answer_then_close(r1), answer_then_close(r2))
        finally:
            feeding.cancel()
            w1.close()
            w2.close()
        for waited, status, body, gap in results:
            assert status == 408 and json.loads(body)["error"]["code"] == "body_timeout"
            assert 0.95 <= waited < 2.5
            assert gap < 0.5          # closed with the 408, not drained for another second
        assert _sample("moed_http_connections_timed_out_total", phase="body") == before + 2


async def test_body_timeout_is_live():
    async with running_app(server=FAST) as (app, _, _e):
        cfg = app.config
        app.set_config(dataclasses.replace(
            cfg, server=dataclasses.replace(cfg.server, body_timeout_s=0.2)))
        raw = await _send(app.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                    b"Content-Length: 10\r\n\r\n{")
        assert "0.2 s" in _split(raw)[2]["error"]["message"]


# ---- connection slots ------------------------------------------------------------------------

SLOTS = {"max_connections": 10}          # probe_reserve(10) == 4: 6 regular + 4 probe slots
BUSY = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 10\r\n\r\n")   # headers done, body pending: a request in progress


def test_probe_reserve_sizes():
    assert [limits.probe_reserve(n) for n in (1, 2, 8, 10, 900, 2048, 100_000)] == \
        [0, 1, 4, 4, 14, 32, 1562]


async def test_busy_regular_slots_leave_probe_slots_then_shed():
    async with running_app(server=SLOTS) as (app, _, _e):
        busy = []
        try:
            for _ in range(6):
                r, w = await _connect(app.port)
                w.write(BUSY)
                busy.append((r, w))
            await asyncio.sleep(0.2)
            # regular slots all serve requests: the next connections get probe slots
            r, w = await _connect(app.port)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, _ = await _response(r)
            assert status == 200 and headers["connection"].lower() == "close"
            w.close()
            status, headers, body = _split(await _send(
                app.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"))
            assert status == 503 and body["error"]["code"] == "connection_limit"
            assert headers["retry-after"] == "1"
            for _ in range(4):          # fill the probe slots with requests in progress too
                r, w = await _connect(app.port)
                w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n")
                busy.append((r, w))
            await asyncio.sleep(0.2)
            before = _sample("moed_http_connections_shed_total", reason="limit")
            with structlog.testing.capture_logs() as logs:
                r, w = await _connect(app.port)
                assert await _closed_within(r, 2.0) < 1.0     # closed at once, nothing sent
                w.close()
                await asyncio.sleep(0.05)
            assert _sample("moed_http_connections_shed_total", reason="limit") == before + 1
            shed = [e for e in logs if e["event"] == "http_connections_shed"]
            assert shed and shed[0]["counts"] == {"limit": 1} and shed[0]["max_connections"] == 10
            assert _sample("moed_http_connections_open") == 10
        finally:
            for _, w in busy:
                w.close()


async def test_idle_connections_are_evicted_oldest_first():
    async with running_app(server=SLOTS) as (app, _, _e):
        idle = [await _connect(app.port) for _ in range(10)]
        try:
            await asyncio.sleep(0.1)
            before = _sample("moed_http_connections_shed_total", reason="idle_evicted")
            r, w = await _connect(app.port)
            w.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await _response(r))[0] == 200      # took the oldest's regular slot
            w.close()
            await _closed_within(idle[0][0], 2.0)     # the oldest was closed for it
            assert not idle[1][0].at_eof()
            assert _sample("moed_http_connections_shed_total",
                           reason="idle_evicted") == before + 1
        finally:
            for _, w in idle:
                w.close()


# ---- file descriptors ------------------------------------------------------------------------

async def test_fd_probe_counts_and_logs_exhaustion(monkeypatch):
    def no_fd(*a, **k):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(limits.os, "open", no_fd)
    before = _sample("moed_http_fd_exhausted_total")
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(limits.watch_fds(limits.ConnectionGuard(10), interval=0.02))
        await asyncio.sleep(0.2)
        task.cancel()
    assert _sample("moed_http_fd_exhausted_total") >= before + 3
    lines = [e for e in logs if e["event"] == "fd_limit_reached"]
    assert len(lines) == 1 and lines[0]["log_level"] == "error" and "EMFILE" in lines[0]["counts"]


def test_fd_budget_warning(monkeypatch):
    monkeypatch.setattr(limits.resource, "getrlimit", lambda _: (1024, 4096))
    with structlog.testing.capture_logs() as logs:
        limits.check_fd_budget(900)
        limits.check_fd_budget(2048)
    assert [e["event"] for e in logs] == ["fd_limit_low"] and logs[0]["needed"] == 2048 + 64
