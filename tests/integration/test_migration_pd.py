"""Stream migration in a P/D cluster (issue 33): router R, prefill node P, decode nodes D1 and
D2 on 127.0.0.1 (gossip, one cluster key). Eight concurrent greedy streams, their prompts
prefilled on P; SIGKILL of the decode node serving one under way: every stream finishes on
the other decode node with exactly the tokens of an undisturbed run (the continuation is
prefilled on the new decode node itself), no error event, one [DONE]."""
from __future__ import annotations

import os
import signal
import time

import pytest

from moed_server import _wait_ready, free_port, start_server

from test_disagg import _wait_until
from test_migration import KEY_ENV, ROUTER, TENANT, TOKENS, Stream, _alive, _run

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def pd(tiny_qwen3, tmp_path_factory):
    d = tmp_path_factory.mktemp("migrate-pd")
    key = os.urandom(32).hex()
    g = {n: free_port() for n in ("P", "D1", "D2", "R")}
    common = {"MOED_MODEL_SERVED_NAME": "tiny", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "64",
              "MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_KEY_ENV": KEY_ENV, KEY_ENV: key,
              "MOED_CLUSTER_SEEDS": f"127.0.0.1:{g['P']}",
              "MOED_CLUSTER_PROBE_INTERVAL_MS": "200", "MOED_CLUSTER_GOSSIP_INTERVAL_MS": "50",
              "MOED_SERVER_API_KEYS_ENV": "TEST_TENANT_KEYS", "TEST_TENANT_KEYS": TENANT,
              "MOED_ENGINE_MAX_NUM_SEQS": "1"}      # batch-free: see test_migration.py
    conf = d / "router.toml"
    conf.write_text(ROUTER.format(port=g["R"], seed=g["P"], key_env=KEY_ENV))
    servers = {}
    try:
        for name, role in (("P", "prefill"), ("D1", "decode"), ("D2", "decode")):
            servers[name] = start_server(
                model=tiny_qwen3, role=role, log_dir=d, wait=None,
                env={**common, "MOED_CLUSTER_BIND_PORT": str(g[name]),
                     "MOED_SERVER_NODE_NAME": name})
        servers["R"] = start_server(role="router", config=conf, log_dir=d, wait=None,
                                    env={KEY_ENV: key, "MOED_SERVER_NODE_NAME": "R",
                                         "MOED_SERVER_API_KEYS_ENV": "TEST_TENANT_KEYS",
                                         "TEST_TENANT_KEYS": TENANT})
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 150)
        _wait_until(lambda: _alive(servers["R"], {"P", "D1", "D2"}), 30, "router sees all", 0.1)
        yield servers
    finally:
        for s in servers.values():
            if s.alive:
                s.stop(timeout=10)


def test_streams_survive_a_decode_node_killed_mid_way(pd) -> None:
    r = pd["R"]
    base = _run(r.url)
    killed: list[str] = []

    def kill(streams: list[Stream]) -> None:
        live = [s for s in streams if s.is_alive() and s.tokens() >= 20
                and "messages" not in s.body]
        assert live, "every stream had already finished"
        killed.append(live[0].backend)
        assert killed[0] in ("D1", "D2")
        pd[killed[0]].proc.send_signal(signal.SIGKILL)

    got = _run(r.url, kill)
    for i, (a, b) in enumerate(zip(base, got)):
        assert not b["errors"] and b["done"], (i, b["errors"])
        assert b["text"] == a["text"] and b["usage"] == a["usage"], i
        assert b["usage"][0]["completion_tokens"] == TOKENS
    lines = [x for x in r.log_records() if x.get("event") == "router_stream_migrated"]
    assert any(x["kind"] == "continue" and x["from_node"] == killed[0] for x in lines)
    jobs = pd["P"].metrics().get('moed_transfer_jobs_total{result="done",role="prefill"}', 0)
    assert jobs >= 8       # the undisturbed run's prompts were prefilled on P
