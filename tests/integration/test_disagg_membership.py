"""With membership on and no static peer list, a decode node finds its prefill node in the
gossip view (real UDP, HMAC key) and serves through it over real NIXL."""
from __future__ import annotations

import json
import os

import openai

from moed_server import free_port

from test_disagg import COMMON, _jobs, _metric, _prompt, _wait_until

KEY_ENV = "CLUSTER_KEY_HEX"


def test_decode_discovers_prefill_via_membership(moed_server, tiny_qwen3) -> None:
    key = os.urandom(32).hex()
    g_p, g_d = free_port(), free_port()
    common = {**COMMON, "MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_KEY_ENV": KEY_ENV,
              KEY_ENV: key}
    p = moed_server(model=tiny_qwen3, role="prefill", wait=None, ready_timeout=150,
                    env={**common, "MOED_CLUSTER_BIND_PORT": str(g_p)})
    d = moed_server(model=tiny_qwen3, role="decode", ready_timeout=150,
                    env={**common, "MOED_CLUSTER_BIND_PORT": str(g_d),
                         "MOED_CLUSTER_SEEDS": f"127.0.0.1:{g_p}"})
    _wait_until(lambda: p.get("/ready")[0] == 200, 150, "prefill ready")

    def sees_prefill() -> bool:
        members = json.loads(d.get("/cluster")[1])["members"]
        return any(m["role"] == "prefill" and m["state"] == "alive" for m in members)

    _wait_until(sees_prefill, 20, "decode sees the prefill node alive", step=0.1)
    c = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.completions.create(model="tiny", prompt=_prompt(50, 1), max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert _metric(p, 'moed_transfer_jobs_total{result="done",role="prefill"}') == 1
    assert not _jobs(p)
    info = json.loads(d.get("/internal/transfer")[1])
    assert list(info["peers"]) == [p.url] and info["peers"][p.url]["state"] == "closed"
