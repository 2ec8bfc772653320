"""No single request blocks the event loop: while huge prompts are refused, another client's
stream keeps its pace (inter-token gap < 100 ms), on a real server.

Two kinds of hopeless prompt: a 3.9 MB one (refused by the length bound before any tokenizing)
and a 300k-character one that only the tokenizer can judge (tokenized in the offload pool, then
refused with its exact token count)."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def slow_model(make_checkpoint):
    return make_checkpoint("qwen3_moe", num_layers=12, hidden_size=512)


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _victim(url: str, arrivals: list[float], started: threading.Event) -> None:
    body = {"prompt": "def fib(n):", "max_tokens": 1800, "stream": True, "ignore_eos": True,
            "temperature": 0}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                arrivals.append(time.perf_counter())
                started.set()


def test_huge_prompts_do_not_stall_other_streams(moed_server, slow_model) -> None:
    srv = moed_server(model=slow_model, env={"MOED_SERVER_MAX_BODY_BYTES": str(4 << 20)})
    arrivals: list[float] = []
    started = threading.Event()
    t = threading.Thread(target=_victim, args=(srv.url, arrivals, started), daemon=True)
    t.start()
    assert started.wait(60), srv.tail()
    time.sleep(0.3)
    results = []
    t0 = time.perf_counter()
    for _ in range(2):
        results.append(_post(srv.url, {"prompt": "x y " * 975_000, "max_tokens": 4}))  # 3.9 MB
        results.append(_post(srv.url, {"prompt": "def fib(n): return n " * 14_300,
                                       "max_tokens": 4}))                           # 300k chars
    t1 = time.perf_counter()
    t.join(120)
    window = [b - a for a, b in zip(arrivals, arrivals[1:]) if t0 - 0.05 <= a <= t1]
    print(f"\nattacks took {t1 - t0:.2f} s; victim chunks in that window: {len(window)}, "
          f"max gap {max(window) * 1000:.1f} ms")
    for status, body in results:
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "more than" in results[0][1]["error"]["message"]        # refused before tokenizing
    assert "more than" not in results[1][1]["error"]["message"]    # tokenized, then refused
    assert len(window) > 5 and max(window) < 0.1
    assert len(arrivals) == 1800
