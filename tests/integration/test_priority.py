"""Priority classes through a real server (one `moed serve` process, real HTTP with the `openai`
client and aiohttp-free urllib): the request's `priority` and its API key's class order the
engine's seating, a full admission queue sheds the least urgent pending requests first (a
streaming one gets a plain 429, never a broken stream), a key may not ask for more than its
class, and a key file naming an unknown class stops the node at start."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from moed_server import ServerProcess, free_port, start_server

pytestmark = pytest.mark.timeout(180)

INTER, BATCH = "sk-interactive-tenant", "sk-batch-tenant"


def _env(tmp_path: Path) -> dict[str, str]:
    keys = tmp_path / "api-keys"
    keys.write_text(f"{INTER}\n{BATCH} batch\n")       # INTER: the default class
    # one sequence at a time: everything admitted behind the running one waits, pending
    return {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_BLOCK_SIZE": "4",
            "MOED_ENGINE_NUM_KV_BLOCKS": "1024", "MOED_MODEL_SERVED_NAME": "tiny",
            "MOED_SERVER_API_KEYS_FILE": str(keys), "MOED_ENGINE_MAX_NUM_SEQS": "1",
            "MOED_ADMISSION_MAX_WAITING_REQUESTS": "4", "MOED_BALANCE_POLICY": "tokens"}


def _post(srv: ServerProcess, key: str, body: dict, timeout: float = 120) -> tuple[int, bytes]:
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {key}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _metric(srv: ServerProcess, name: str) -> float:
    return srv.metrics(headers={"Authorization": f"Bearer {INTER}"}).get(name, 0.0)


def _until(pred, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_priority_orders_seating_and_sheds_batch_first(moed_server, tiny_qwen3, tmp_path):
    srv = moed_server(model=tiny_qwen3, env=_env(tmp_path))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=BATCH, max_retries=0, timeout=120)
    # the engine's one seat: a long batch stream, read until it runs
    blocker = client.completions.create(model="tiny", prompt="hold the seat", max_tokens=1800,
                                        temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(blocker))
    done: list[tuple[str, int, bytes, float]] = []

    def send(name: str, key: str, body: dict) -> threading.Thread:
        def run() -> None:
            code, out = _post(srv, key, {"model": "tiny", "max_tokens": 2, "temperature": 0,
                                         **body})
            done.append((name, code, out, time.monotonic()))
        t = threading.Thread(target=run)
        t.start()
        return t

    pending = 'moed_priority_pending_requests{priority_class="batch"}'
    threads = []
    for i in range(4):     # the admission queue fills with batch work behind the blocker
        threads.append(send(f"batch{i}", BATCH, {"prompt": f"batch job {i}",
                                                 "stream": i % 2 == 1}))
        _until(lambda: _metric(srv, pending) == i + 1)
    code, out = _post(srv, BATCH, {"model": "tiny", "prompt": "one more", "max_tokens": 2})
    assert code == 429 and json.loads(out)["error"]["code"] == "too_many_waiting"
    # the same key may not jump its class; an interactive key may lower itself
    code, out = _post(srv, BATCH, {"model": "tiny", "prompt": "x", "priority": 0})
    assert code == 400 and json.loads(out)["error"]["param"] == "priority"
    assert json.loads(out)["error"]["code"] == "priority_not_allowed"
    code, out = _post(srv, INTER, {"model": "tiny", "prompt": "x", "priority": "high"})
    assert code == 400 and json.loads(out)["error"]["param"] == "priority"
    # two interactive arrivals: each displaces the newest pending batch request (3, then 2);
    # batch3 streams and still gets a plain 429 (nothing was sent)
    threads.append(send("inter0", INTER, {"prompt": "urgent one"}))
    _until(lambda: len(done) == 1)
    threads.append(send("inter1", INTER, {"prompt": "urgent two"}))
    _until(lambda: len(done) == 2)
    shed = {name: (code, json.loads(out)["error"]) for name, code, out, _ in done}
    assert set(shed) == {"batch3", "batch2"}
    for code, err in shed.values():
        assert code == 429 and err["code"] == "displaced"
    blocker.response.close()          # the seat frees: the queue runs, one at a time
    for t in threads:
        t.join(120)
    finished = [name for name, code, _, _ in sorted(done, key=lambda d: d[3]) if code == 200]
    # seated by priority: the interactive requests first although they arrived last
    assert finished == ["inter0", "inter1", "batch0", "batch1"]
    m = srv.metrics(headers={"Authorization": f"Bearer {INTER}"})
    assert m['moed_priority_requests_total{outcome="displaced",priority_class="batch"}'] == 2
    assert m['moed_priority_requests_total{outcome="rejected",priority_class="batch"}'] == 1
    assert m['moed_priority_time_to_first_token_seconds_count{priority_class="interactive"}'] == 2
    assert m['moed_admission_rejected_total{reason="displaced"}'] == 2
    _until(lambda: _metric(srv, "moed_kv_blocks_used") == 0, 10)     # no block held
    logs = [json.loads(ln) for ln in srv.logs().splitlines() if ln.startswith("{")]
    access = [e for e in logs if e.get("event") == "access" and e.get("path") == "/v1/completions"]
    assert {(e["status"], e.get("priority_class")) for e in access} >= {
        (200, "interactive"), (200, "batch"), (429, "batch")}


def test_a_key_file_naming_an_unknown_class_stops_the_node(tiny_qwen3, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"{INTER}\n{BATCH} bulk\n")
    srv = start_server(model=tiny_qwen3, env={"MOED_SERVER_API_KEYS_FILE": str(keys)},
                       port=free_port(), log_dir=tmp_path, wait=None)
    try:
        assert srv.proc.wait(60) != 0
    finally:
        srv.stop()
    assert "names priority class 'bulk'" in srv.logs() and BATCH not in srv.logs()
