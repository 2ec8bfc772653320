"""A decode node never sends a prefill job to a member whose KV layout differs from its own.

Three real processes in one gossip cluster, all serving the model name "tiny": the decode node
D and prefill node P_same load the same checkpoint; P_other loads one with another KV shape
(4 KV heads instead of 2). Every request D serves goes to P_same, none to P_other (which would
have failed with bad_metadata only after the attempt), and /cluster shows each member's layout
id and transfer endpoint."""
from __future__ import annotations

import json
import os
import time

import openai
import pytest

from moed_server import free_port, parse_metrics

pytestmark = pytest.mark.timeout(240)

KEY_ENV = "CLUSTER_KEY_HEX"


def _wait(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_decode_sends_jobs_only_to_prefill_nodes_with_its_kv_layout(moed_server,
                                                                     make_checkpoint) -> None:
    same = make_checkpoint("qwen3_moe")
    other = make_checkpoint("qwen3_moe", num_kv_heads=4)
    key = os.urandom(32).hex()
    ports = [free_port() for _ in range(3)]
    common = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
              "MOED_MODEL_SERVED_NAME": "tiny", "MOED_CLUSTER_ENABLED": "true",
              "MOED_CLUSTER_KEY_ENV": KEY_ENV, KEY_ENV: key,
              "MOED_CLUSTER_SEEDS": f"127.0.0.1:{ports[0]}"}

    def env(i: int) -> dict[str, str]:
        return {**common, "MOED_CLUSTER_BIND_PORT": str(ports[i])}

    # P_other's URL sorts first: idle peers tie and go by name, so without the layout rule
    # every job would be offered to P_other first
    http_other, http_same = sorted((free_port(), free_port()), key=lambda p: f"{p}")
    p_same = moed_server(model=same, role="prefill", wait=None, env=env(0), port=http_same,
                         args=["--node-name", "p-same"])
    p_other = moed_server(model=other, role="prefill", wait=None, env=env(1), port=http_other,
                          args=["--node-name", "p-other"])
    d = moed_server(model=same, role="decode", ready_timeout=150, env=env(2),
                    args=["--node-name", "d"])
    for p in (p_same, p_other):
        _wait(lambda p=p: p.get("/ready")[0] == 200, 150, f"{p.url} ready")

    def members() -> dict[str, dict]:
        return {m["name"]: m for m in json.loads(d.get("/cluster")[1])["members"]}

    _wait(lambda: all(members().get(n, {}).get("state") == "alive"
                      for n in ("p-same", "p-other", "d")), 30, "all three alive")
    _wait(lambda: all(members()[n]["transfer"] for n in ("p-same", "p-other", "d")),
          30, "transfer endpoints gossiped")
    view = members()
    layouts = {n: view[n]["layout"] for n in view}
    assert all(layouts.values()), view
    assert layouts["d"] == layouts["p-same"] != layouts["p-other"], layouts

    c = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=60)
    for i in range(6):
        r = c.completions.create(model="tiny", prompt=list(range(5 + i, 45 + i)),
                                 max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason == "length"
    done = 'moed_transfer_jobs_total{result="done",role="prefill"}'
    assert parse_metrics(p_same.get("/metrics")[1]).get(done) == 6
    assert parse_metrics(p_other.get("/metrics")[1]).get(done, 0) == 0
    assert not any(r.get("event") == "remote_prefill_attempt_failed" for r in d.log_records())
