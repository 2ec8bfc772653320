"""Forged prefill jobs against a real prefill/decode pair (real NIXL): each is refused and the
decode node's outputs do not change, also for a request that is decoding while they arrive.

A forged job is dangerous here: after the first real request the prefill node holds the
decode node's NIXL metadata, so a job it accepted would WRITE into the decode node's blocks.
"""
from __future__ import annotations

import json
import random
import signal
import threading
import time

import openai
import pytest
import urllib.request
import urllib.error

from moed.api.internal import InternalAuth
from moed.cluster.wire import Keyring
from moed.roles.protocol import PrefillJobSpec
from moed_server import ADMIN_HEADERS, CLUSTER_KEY, ServerProcess, parse_metrics

pytestmark = pytest.mark.timeout(240)

TENANT = "tenant-key-1"
ENV = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
       "MOED_ENGINE_BLOCK_SIZE": "4", "MOED_MODEL_SERVED_NAME": "tiny",
       "MOED_SERVER_API_KEYS_ENV": "TENANT_KEYS", "TENANT_KEYS": TENANT}
BS = 4


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, {"lines": r.read().decode()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _greedy(srv: ServerProcess, prompt: list[int], n: int) -> list[int]:
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key=TENANT, max_retries=0, timeout=60)
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                             extra_body={"return_token_ids": True, "ignore_eos": True})
    return list(r.choices[0].token_ids)


def test_forged_prefill_jobs_are_refused_and_outputs_unchanged(moed_server, tiny_qwen3) -> None:
    p = moed_server(model=tiny_qwen3, role="prefill", wait=None, env=ENV)
    d = moed_server(model=tiny_qwen3, role="decode", ready_timeout=150,
                    env={**ENV, "MOED_TRANSFER_PREFILL_PEERS": p.url})
    deadline = time.monotonic() + 150
    while p.get("/ready")[0] != 200:
        assert time.monotonic() < deadline and p.alive, p.tail()
        time.sleep(0.2)
    rnd = random.Random(7)
    prompt = [rnd.randrange(3, 1000) for _ in range(40)]
    baseline = _greedy(d, prompt, 48)             # also hands P the decode node's metadata
    info = json.loads(d.get("/internal/transfer")[1])
    node, inc = info["node"], info["incarnation"]
    every_block = list(range(len(prompt) // BS))  # what an attacker would aim at

    key = Keyring(bytes.fromhex(CLUSTER_KEY))
    member = InternalAuth(key, "member", insecure=False, window_s=120)
    outsider = InternalAuth(Keyring(b"x" * 32), "outsider", insecure=False, window_s=120)
    exp = int((time.time() + 30) * 1000)

    def job(decode: str, incarnation: int, cap: str, job_id: str = "evil.1") -> bytes:
        other = [rnd.randrange(3, 1000) for _ in range(len(prompt))]
        spec = PrefillJobSpec(job_id, tuple(other), 0, tuple(every_block), decode, incarnation,
                              10.0, {"temperature": 0.0}, capability=cap, expires_ms=exp)
        return json.dumps(spec.to_json()).encode()

    url = p.url + "/internal/prefill"
    outcomes: dict[str, tuple[int, str]] = {}

    def forge() -> None:
        body = job(node, inc, "0" * 64)
        st, r = _post(url, body, {})
        outcomes["no credentials"] = (st, r["error"]["message"] if "error" in r else "")
        st, r = _post(url, body, {"Authorization": f"Bearer {TENANT}"})
        outcomes["tenant API key"] = (st, str(r))
        st, r = _post(url, body, outsider.sign("POST", "/internal/prefill", body))
        outcomes["another cluster's key"] = (st, str(r))
        st, r = _post(url, body, member.sign("POST", "/internal/prefill", body))
        outcomes["signed, forged capability"] = (st, str(r))
        # a valid job for a decode node P does not know (P answers 409 need_metadata, nothing
        # is written) — then the same request replayed, and the same capability re-aimed at D
        ghost_cap = member.capability("ghost.1", "ghost", 1, 0, every_block, exp)
        ghost = job("ghost", 1, ghost_cap, "ghost.1")
        headers = member.sign("POST", "/internal/prefill", ghost)
        st, r = _post(url, ghost, headers)
        outcomes["valid job (unknown decode node)"] = (st, str(r))
        st, r = _post(url, ghost, headers)
        outcomes["replayed valid job"] = (st, str(r))
        aimed = job(node, inc, ghost_cap, "ghost.1")
        st, r = _post(url, aimed, member.sign("POST", "/internal/prefill", aimed))
        outcomes["capability re-aimed at another node's blocks"] = (st, str(r))

    # a stream decoding on D while the forgeries arrive keeps its tokens
    during: list[int] = []
    t = threading.Thread(target=lambda: during.extend(_greedy(d, prompt, 48)))
    t.start()
    forge()
    t.join(60)
    after = _greedy(d, prompt, 48)

    print("\n" + "\n".join(f"{k}: {v[0]}" for k, v in outcomes.items()))
    assert outcomes["no credentials"][0] == 401
    assert outcomes["tenant API key"][0] == 403
    assert outcomes["another cluster's key"][0] == 401
    assert outcomes["signed, forged capability"][0] == 403
    assert outcomes["valid job (unknown decode node)"][0] == 409        # auth passed
    assert outcomes["replayed valid job"][0] == 401
    assert "replayed" in outcomes["replayed valid job"][1]
    assert outcomes["capability re-aimed at another node's blocks"][0] == 403
    assert during == baseline and after == baseline
    m = parse_metrics(p.get("/metrics")[1])
    assert m['moed_transfer_jobs_total{result="done",role="prefill"}'] == 3   # the real ones
    assert m['moed_transfer_failures_total{kind="bad_capability"}'] == 2
    assert not any(r.get("event") == "transfer_notif_unmatched" for r in d.log_records())
    # the disclosure routes: admin token (or a signed call) only
    for srv in (p, d):
        assert srv.get("/internal/transfer", headers={})[0] == 401
        assert srv.get("/internal/transfer",
                       headers={"Authorization": f"Bearer {TENANT}"})[0] == 403
        assert srv.get("/internal/transfer", headers=ADMIN_HEADERS)[0] == 200
    # the prefill node's lines for a job carry the client's request id
    c = openai.OpenAI(base_url=d.url + "/v1", api_key=TENANT, max_retries=0, timeout=60)
    c.completions.create(model="tiny", prompt=prompt[:30], max_tokens=2,
                         extra_headers={"X-Request-Id": "client-rid-42"})
    assert any(r.get("request_id") == "client-rid-42" for r in p.log_records()), p.tail()
    # a clean stop of both nodes logs nothing at error level (it used to log
    # transfer_poll_failed with a traceback: a tick polled the backend while it closed)
    d.send_signal(signal.SIGTERM)       # both at once: each sees its peer go away
    p.send_signal(signal.SIGTERM)
    assert d.stop() == 0 and p.stop() == 0
    for srv in (p, d):
        bad = [r for r in srv.log_records() if r.get("level") in ("error", "critical")
               or r.get("event") == "transfer_poll_failed"]
        assert not bad, bad
