"""Daemon-side behaviour of one real decode node (`moed serve --role decode`) whose only prefill
peer is down (nothing listens on its port):
- a SIGHUP sent while the process is still importing is held, not fatal, and reloads once ready;
- a remote prefill that fails reaches the client as 503 with the reason (non-stream), or as an
  in-band SSE error event (stream), and leaves no KV block in use;
- the node allocates its tensors in transparent huge pages (for NIXL KV transfer speed).
"""
from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from moed_server import ServerProcess, _wait_ready, free_port, start_server

pytestmark = pytest.mark.timeout(120)

ENV = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
       "MOED_ENGINE_BLOCK_SIZE": "4", "MOED_MODEL_SERVED_NAME": "tiny",
       "MOED_ADMISSION_RETRY_AFTER_S": "2"}


def _sighup_caught(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) & (1 << (signal.SIGHUP - 1)))


@pytest.fixture(scope="module")
def node(tiny_qwen3, tmp_path_factory):
    dead_peer = f"http://127.0.0.1:{free_port()}"      # nothing listens there
    srv = start_server(model=tiny_qwen3, role="decode", wait=None,
                       log_dir=tmp_path_factory.mktemp("decode-node"),
                       env={**ENV, "MOED_TRANSFER_PREFILL_PEERS": dead_peer})
    try:
        deadline = time.monotonic() + 10
        while not _sighup_caught(srv.proc.pid):    # `moed serve` holds SIGHUP from its start
            assert srv.alive and time.monotonic() < deadline, srv.tail()
            time.sleep(0.001)
        srv.send_signal(signal.SIGHUP)                 # long before the reload handler exists
        _wait_ready(srv, "/ready", time.monotonic() + 90)
        yield srv
    finally:
        srv.stop(timeout=10)


def _events(srv: ServerProcess, name: str) -> list[dict]:
    return [r for r in srv.log_records() if r.get("event") == name]


def test_sighup_during_import_is_held_then_reloaded(node) -> None:
    assert node.alive
    deferred = _events(node, "config_reload_deferred")
    assert [r["reason"] for r in deferred] == ["signal during process start"], node.tail()
    deadline = time.monotonic() + 10
    while node.metrics().get('moed_config_reloads_total{result="unchanged"}', 0) < 1:
        assert time.monotonic() < deadline, node.tail()
        time.sleep(0.05)


def _post(srv: ServerProcess, body: dict) -> tuple[int, dict, str]:
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_failed_remote_prefill_is_503_with_the_reason(node) -> None:
    prompt = list(range(3, 43))
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=30)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
    e = err.value
    assert e.status_code == 503 and e.response.headers["Retry-After"] == "2"
    body = e.body if isinstance(e.body, dict) and "message" in e.body else e.body["error"]
    assert body["code"] == "unavailable" and body["type"] == "server_error"
    assert "remote prefill failed" in body["message"] and "rpc_error" in body["message"]
    # no internal address or exception text reaches the client (both are in the log)
    for leak in ("127.0.0.1", "http://", "Error", "Connector"):
        assert leak not in body["message"], body["message"]
    assert any("ClientConnectorError" in r.get("error", "")
               for r in _events(node, "remote_prefill_attempt_failed"))
    # a stream has sent its headers by then: the reason comes as an SSE error event, no [DONE]
    status, headers, text = _post(node, {"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                         "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert len(events) == 1 and events[0]["error"]["code"] == "unavailable", text
    assert "remote prefill failed" in events[0]["error"]["message"] and "[DONE]" not in text
    m = node.metrics()
    assert m["moed_kv_blocks_used"] == 0
    assert m['moed_transfer_jobs_total{result="failed",role="decode"}'] == 2


def test_tensors_use_transparent_huge_pages(node) -> None:
    assert [r["thp_alloc"] for r in _events(node, "cpu_huge_pages")] == [True]
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" not in mode:          # the kernel may have THP off; then only the setting counts
        rollup = Path(f"/proc/{node.proc.pid}/smaps_rollup").read_text()
        huge_kb = next(int(line.split()[1]) for line in rollup.splitlines()
                       if line.startswith("AnonHugePages:"))
        assert huge_kb >= 2048, rollup


def test_sighup_while_stopping_is_harmless(node) -> None:
    """Last in the module: SIGTERM, then SIGHUPs until the process is gone → still exit 0 (the
    reload handler is removed before the other components stop; SIGHUP is held again)."""
    node.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while node.alive:
        assert time.monotonic() < deadline, node.tail()
        node.send_signal(signal.SIGHUP)
        time.sleep(0.002)
    assert node.proc.wait() == 0, node.tail()
