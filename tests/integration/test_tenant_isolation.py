"""Tenants cannot confirm each other's prompts (real processes on 127.0.0.1, the `openai`
client): with `server.prefix_cache_isolation = "api_key"` a prompt cached for one key is never
a hit for another (also through a peer's cache, `tiers.peer_reuse`); `cache_salt` (vLLM's
field) separates requests of one key; `server.metrics_access = "operator"` keeps tenant keys off
/metrics while the scraper's metrics token and the admin token read it. The operator's view of
the prefix-cache and peer counters (batch 1 here) is the evidence of each hit or miss."""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from moed_server import ADMIN_TOKEN, ServerProcess, _wait_ready, free_port, start_server

pytestmark = pytest.mark.timeout(180)

T1, T2, SCRAPER = "sk-tenant-one", "sk-tenant-two", "metrics-scraper-token"
KEY_ENV = "CLUSTER_KEY_HEX"
# a system-prompt-like prefix: 40+ tokens, many blocks of 4
PROMPT = ("Confidential: the merger of the northern and southern divisions closes on the "
          "first of March, and the price agreed for the shares is forty two each")


def _env(tmp_path: Path) -> dict[str, str]:
    keys, scrape = tmp_path / "api-keys", tmp_path / "metrics-token"
    keys.write_text(f"{T1}\n{T2}\n")
    scrape.write_text(SCRAPER + "\n")
    return {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_BLOCK_SIZE": "4",
            "MOED_ENGINE_NUM_KV_BLOCKS": "256", "MOED_MODEL_SERVED_NAME": "tiny",
            "MOED_SERVER_API_KEYS_FILE": str(keys),
            "MOED_SERVER_METRICS_TOKEN_FILE": str(scrape),
            "MOED_SERVER_METRICS_ACCESS": "operator",
            "MOED_SERVER_PREFIX_CACHE_ISOLATION": "api_key",
            "MOED_SERVER_CACHE_METRICS_BATCH": "1"}


def complete(srv: ServerProcess, key: str, salt: str | None = None) -> str:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)
    extra = {"cache_salt": salt} if salt is not None else None
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0,
                                    extra_body=extra)
    return out.choices[0].text


def chat(srv: ServerProcess, key: str, salt: str) -> str:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)
    out = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": PROMPT},
                                {"role": "user", "content": "When?"}],
        max_tokens=4, temperature=0, extra_body={"cache_salt": salt})
    return out.choices[0].message.content or ""


def scrape(srv: ServerProcess) -> dict[str, float]:
    return srv.metrics(headers={"Authorization": f"Bearer {SCRAPER}"})


def hit_tokens(srv: ServerProcess) -> float:
    return scrape(srv).get("moed_prefix_cache_hit_tokens_total", 0.0)


def status_of(srv: ServerProcess, path: str, token: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    code, body = srv.get(path, headers=headers)
    try:
        return code, json.loads(body)
    except ValueError:
        return code, {}


def test_a_tenants_cached_prompt_is_no_hit_for_another(moed_server, tiny_qwen3, tmp_path):
    srv = moed_server(model=tiny_qwen3, env=_env(tmp_path))
    want = complete(srv, T1)
    h0 = hit_tokens(srv)
    assert complete(srv, T1) == want
    h1 = hit_tokens(srv)
    assert h1 - h0 >= 32, "the same tenant's repeat is a prefix hit"
    # tenant two's correct guess: the same answer, and no hit
    assert complete(srv, T2) == want
    assert hit_tokens(srv) == h1
    # cache_salt splits one tenant's requests; the same salt shares; another key's same salt
    # does not
    assert complete(srv, T1, salt="project-x") == want
    h2 = hit_tokens(srv)
    assert h2 == h1
    assert complete(srv, T1, salt="project-x") == want
    h3 = hit_tokens(srv)
    assert h3 - h2 >= 32
    assert complete(srv, T2, salt="project-x") == want
    assert hit_tokens(srv) == h3
    # chat: the same rules (one tenant's salted conversation is a hit only for itself)
    said = [chat(srv, T1, "project-y") for _ in range(2)]
    h4 = hit_tokens(srv)
    assert chat(srv, T2, "project-y") == said[0] and hit_tokens(srv) == h4
    assert chat(srv, T1, "project-z") == said[0] and hit_tokens(srv) == h4
    assert said[0] == said[1] and h4 > h3

    # /metrics: a tenant key is refused by name, no credential is told what to send
    code, body = status_of(srv, "/metrics", T1)
    assert code == 403 and body["error"]["code"] == "key_not_allowed"
    code, body = status_of(srv, "/metrics", None)
    assert code == 401 and "metrics token" in body["error"]["message"]
    assert status_of(srv, "/metrics", ADMIN_TOKEN)[0] == 200
    # a malformed cache_salt is a 400 naming it
    for bad in ("", 7, "x" * 600):
        req = urllib.request.Request(
            srv.url + "/v1/completions", method="POST",
            data=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 1,
                             "cache_salt": bad}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {T1}"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        err = json.loads(e.value.read())["error"]
        assert e.value.code == 400 and err["param"] == "cache_salt", err


def test_a_peers_cached_prompt_is_read_only_for_its_own_tenant(tiny_qwen3, tmp_path):
    """Two colocated nodes with cluster prefix reuse: tenant one's prompt cached on A. Tenant
    two's guess on B reads nothing from A (B's peer-read counter stays 0) and is computed;
    tenant one's repeat on B reads A's blocks."""
    seed = free_port()
    base = {**_env(tmp_path), "MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_KEY_ENV": KEY_ENV,
            KEY_ENV: os.urandom(32).hex(), "MOED_CLUSTER_SEEDS": f"127.0.0.1:{seed}",
            "MOED_CLUSTER_LOAD_UPDATE_INTERVAL_MS": "200", "MOED_TIERS_PEER_REUSE": "true",
            # a recompute prediction well above a loopback lease (as test_kv_peer_reuse)
            "MOED_BALANCE_POLICY": "tokens", "MOED_TIERS_RECOMPUTE_US_PER_TOKEN": "2000"}
    servers: dict[str, ServerProcess] = {}
    try:
        for name, gossip in (("A", seed), ("B", free_port())):
            servers[name] = start_server(model=tiny_qwen3, log_dir=tmp_path, wait=None,
                                         args=["--node-name", name],
                                         env={**base, "MOED_CLUSTER_BIND_PORT": str(gossip)})
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 90)
        a, b = servers["A"], servers["B"]
        want = complete(a, T1)
        time.sleep(1.5)          # A's load ticks (200 ms) carry its prefix digest to B
        assert complete(b, T2) == want
        m = scrape(b)
        assert m.get("moed_kv_peer_read_blocks_total", 0) == 0, b.tail()
        assert scrape(a).get("moed_kv_peer_leases_granted_total", 0) == 0
        assert complete(b, T1) == want
        m = scrape(b)
        assert m["moed_kv_peer_read_blocks_total"] >= 8, b.tail()   # the prompt's blocks
    finally:
        for s in servers.values():
            s.stop(timeout=10)
