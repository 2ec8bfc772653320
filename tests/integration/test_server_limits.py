"""Bad input, overload and disconnects against a real `moed serve` (real engine, tiny model).

After each scenario the server must still be up and hold no running request and no KV block
(read from /metrics, which samples engine.stats() at scrape time).
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from moed_server import serve_process

MAX_LEN = 128
MAX_WAITING = 4


@pytest.fixture(scope="module")
def srv(tiny_qwen3, tmp_path_factory):
    toml = f"""
[server]
max_body_bytes = 65536
[model]
served_name = "tiny"
max_model_len = {MAX_LEN}
[engine]
kv_cache_memory_mb = 16
max_num_seqs = 2
[admission]
max_waiting_requests = {MAX_WAITING}
retry_after_s = 3
"""
    with serve_process(model=tiny_qwen3, toml=toml, log_dir=tmp_path_factory.mktemp("lim")) as s:
        yield s


def _settled(srv, timeout: float = 15.0) -> dict[str, float]:
    """Wait until the engine holds nothing; return the metrics then."""
    deadline = time.monotonic() + timeout
    while True:
        m = srv.metrics()
        if (m["moed_requests_running"] == 0 and m["moed_requests_waiting"] == 0
                and m["moed_kv_blocks_used"] == 0 and m["moed_http_inflight_requests"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"engine did not settle: {m}")
        time.sleep(0.05)


BAD = [
    # (name, path, body bytes or JSON, status, param)
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("body not an object", "/v1/completions", [1, 2], 400, None),
    ("wrong type max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": "3"}, 400,
     "max_tokens"),
    ("wrong type prompt", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("wrong type stop", "/v1/completions", {"prompt": "x", "stop": 3}, 400, "stop"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "x", "content": "a"}]}, 400,
     "messages"),
    ("negative max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": -5}, 400,
     "max_tokens"),
    ("huge max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400,
     "max_tokens"),
    ("prompt over context", "/v1/completions", {"prompt": [5] * (MAX_LEN + 10)}, 400, "prompt"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("oversized body", "/v1/completions", b'{"prompt": "' + b"a" * 100_000 + b'"}', 413, None),
    ("temperature out of range", "/v1/completions", {"prompt": "x", "temperature": 7}, 400,
     "temperature"),
]


async def test_bad_input_gets_4xx_and_leaks_nothing(srv):
    async with aiohttp.ClientSession() as http:
        for name, path, body, status, param in BAD:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with http.post(srv.url + path, data=data,
                                 headers={"Content-Type": "application/json"}) as r:
                assert r.status == status, (name, r.status, await r.text())
                err = (await r.json())["error"]
                assert set(err) == {"message", "type", "param", "code"}, name
                assert err["message"] and err["param"] == param, (name, err)
                assert "Traceback" not in err["message"]
        async with http.post(srv.url + "/v1/completions",
                             json={"prompt": [5] * (MAX_LEN + 10)}) as r:
            msg = (await r.json())["error"]["message"]
        assert str(MAX_LEN) in msg, msg            # the limit is in the message
        async with http.post(srv.url + "/v1/completions",
                             json={"prompt": "still alive", "max_tokens": 3}) as r:
            assert r.status == 200
    assert srv.alive and srv.get("/health")[0] == 200
    m = _settled(srv)
    assert not [k for k, v in m.items()
                if k.startswith('moed_http_requests_total{route="/v1') and 'status="5' in k and v > 0]


async def test_burst_over_admission_bound(srv):
    before = srv.metrics()["process_resident_memory_bytes"]

    async def one(http: aiohttp.ClientSession, i: int) -> tuple[int, str | None, int]:
        body = {"prompt": f"request number {i}", "max_tokens": 12, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        async with http.post(srv.url + "/v1/completions", json=body) as r:
            raw = await r.read()
            return r.status, r.headers.get("Retry-After"), raw.count(b"data: ")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        results = await asyncio.gather(*[one(http, i) for i in range(24)])
    statuses = [s for s, _, _ in results]
    assert 429 in statuses and 200 in statuses, statuses
    assert set(statuses) <= {200, 429}, statuses          # no 5xx
    assert all(ra == "3" for s, ra, _ in results if s == 429)
    # every success streamed 12 tokens + a usage chunk + [DONE]
    assert all(n == 14 for s, _, n in results if s == 200)
    m = _settled(srv)
    assert m['moed_admission_rejected_total{reason="too_many_waiting"}'] >= statuses.count(429)
    assert m["process_resident_memory_bytes"] - before < 300e6


async def test_disconnects_mid_stream_leave_nothing_running(srv):
    before = srv.metrics().get("moed_client_disconnects_total", 0.0)
    for _ in range(3):
        async with aiohttp.ClientSession() as http:
            async with http.post(srv.url + "/v1/completions",
                                 json={"prompt": "a long story", "max_tokens": 100,
                                       "ignore_eos": True, "stream": True}) as r:
                assert r.status == 200
                await r.content.readuntil(b"\n\n")      # one token, then hang up
    m = _settled(srv)
    assert m["moed_client_disconnects_total"] - before == 3
    assert m['moed_requests_finished_total{finish_reason="abort",model_name="tiny"}'] >= 3


def test_model_info_metric_says_what_runs(srv):
    """Operators can see from /metrics what serves: arch, dtype, device, backend, CPU kernels."""
    from moed.model.kernels import cpu_kernels

    status, text = srv.get("/metrics")
    assert status == 200
    line = next(ln for ln in text.splitlines() if ln.startswith("moed_model_info{"))
    kernels = "on" if cpu_kernels() is not None else "off"      # what this machine can do
    for label in ('arch="qwen3_moe"', 'dtype="bfloat16"', 'device="cpu"', 'backend="torch"',
                  f'cpu_kernels="{kernels}"'):
        assert label in line, line
