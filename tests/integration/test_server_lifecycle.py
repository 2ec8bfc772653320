"""Process lifecycle of `moed serve`: drain on SIGTERM, grace expiry, router role, bad starts."""
from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

import pytest


def _stream_in_thread(url: str, body: dict, out: dict, first: threading.Event) -> threading.Thread:
    def run() -> None:
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        chunks: list[bytes] = []
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                out["status"] = r.status
                for line in r:
                    if line.startswith(b"data: "):
                        chunks.append(line[6:].strip())
                        first.set()
        except Exception as e:   # recorded for the assertion below
            out["error"] = repr(e)
        finally:
            out["chunks"] = chunks
            first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _serve_one_stream(moed_server, model, grace_s: str, prompt: str, max_tokens: int):
    """A node with the given drain grace, one streaming request running on it (first token
    seen) -> (server, the stream's result dict, its thread)."""
    srv = moed_server(model=model, env={"MOED_SERVER_SHUTDOWN_GRACE_S": grace_s,
                                        "MOED_ENGINE_KV_CACHE_MEMORY_MB": "16"})
    out: dict = {}
    first = threading.Event()
    t = _stream_in_thread(srv.url, {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                                    "ignore_eos": True}, out, first)
    assert first.wait(30), "no first token"
    return srv, out, t


def _wait(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def slow_model(make_checkpoint):
    """Deep and wide enough that a few hundred tokens take about a second even on the fast CPU
    kernels: the tiny model streams them in ~0.1 s, which can end a request before the test has
    looked at the node while it drains."""
    return make_checkpoint("qwen3_moe", num_layers=12, hidden_size=512)


def test_sigterm_drains_inflight_then_exits_zero(moed_server, slow_model):
    srv, out, t = _serve_one_stream(moed_server, slow_model, "30", "drain me", 400)
    srv.send_signal(signal.SIGTERM)
    _wait(lambda: srv.get("/ready")[0] == 503, 10, "/ready to turn 503")
    status, body = _post(srv.url, {"prompt": "late", "max_tokens": 2})
    assert status == 503 and json.loads(body)["error"]["code"] == "draining"
    assert srv.get("/health")[0] == 200
    t.join(60)
    assert out.get("status") == 200 and "error" not in out, out
    assert out["chunks"][-1] == b"[DONE]" and len(out["chunks"]) == 401   # 400 tokens + DONE
    assert srv.proc.wait(30) == 0
    events = [r["event"] for r in srv.log_records()]
    assert events.index("draining") < events.index("stopped")


def test_grace_expiry_cuts_long_requests_and_exits_zero(moed_server, slow_model):
    srv, out, t = _serve_one_stream(moed_server, slow_model, "0.5", "forever", 1500)
    t0 = time.monotonic()
    srv.send_signal(signal.SIGINT)
    assert srv.proc.wait(20) == 0
    assert time.monotonic() - t0 < 15
    t.join(10)
    assert b"[DONE]" not in out.get("chunks", [])
    assert any(r["event"] == "grace_expired" for r in srv.log_records())


def test_router_role_starts_without_model(moed_server):
    srv = moed_server(role="router", args=["--log-format", "console", "--node-name", "r1"])
    assert srv.get("/health")[0] == 200
    status, body = srv.get("/ready")      # no serving node is alive: not ready for traffic
    assert status == 503 and "no_backend" in body, (status, body)
    status, text = srv.get("/metrics")
    assert status == 200 and 'moed_node_info{' in text and 'role="router"' in text
    assert 'node="r1"' in text
    assert "torch" not in srv.logs()
    assert srv.stop(signal.SIGTERM) == 0
    logs = srv.logs()
    assert "ready" in logs and not logs.lstrip().startswith("{")     # console renderer


def test_bad_model_dir_fails_start_with_clear_error(moed_server, tmp_path):
    # refused by the pre-flight checks, before listening (exit 2, like any config error)
    with pytest.raises(AssertionError, match="exited with 2") as e:
        moed_server(model=tmp_path / "no-such-model", ready_timeout=60)
    assert "not a Hugging Face checkpoint directory" in str(e.value)


def test_invalid_config_exits_2_before_listening(moed_server, tmp_path):
    with pytest.raises(AssertionError, match="exited with 2") as e:
        moed_server(role="router", toml="[server]\nbogus = 1\n", ready_timeout=30)
    assert "unknown key server.bogus" in str(e.value)


def _post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
