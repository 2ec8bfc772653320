"""Two model versions in one cluster on 127.0.0.1: prefill P1 and decode D1 run one checkpoint,
P2 and D2 another of the same architecture (same KV layout, same served name, other weights).
Every request's prefill goes to the node of its own checkpoint, never across (the prefill
nodes' job counts match the requests sent to their decode node exactly, and a decode node
never even holds the other prefill node as a candidate); /cluster lists each node's versions;
the incompatible member is counted."""
from __future__ import annotations

import json
import os
import time

import openai
import pytest

from moed.cluster.state import PROTOCOL
from moed_server import _wait_ready, free_port, start_server

from test_disagg import COMMON, _metric, _prompt, _wait_until

pytestmark = pytest.mark.timeout(300)

KEY_ENV = "CLUSTER_KEY_HEX"
REQUESTS = 3


@pytest.fixture(scope="module")
def two_versions(make_checkpoint, tmp_path_factory):
    ckpt = {1: make_checkpoint("qwen3_moe", seed=0), 2: make_checkpoint("qwen3_moe", seed=1)}
    gossip = {n: free_port() for n in ("P1", "P2", "D1", "D2")}
    common = {**COMMON, "MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_KEY_ENV": KEY_ENV,
              KEY_ENV: os.urandom(32).hex(), "MOED_CLUSTER_SEEDS": f"127.0.0.1:{gossip['P1']}",
              "MOED_CLUSTER_PROBE_INTERVAL_MS": "200", "MOED_CLUSTER_GOSSIP_INTERVAL_MS": "50"}
    log_dir = tmp_path_factory.mktemp("versions")
    servers = {}
    try:
        for name in gossip:                          # start all, then wait: in parallel
            servers[name] = start_server(
                model=ckpt[int(name[1])], role="prefill" if name[0] == "P" else "decode",
                env={**common, "MOED_CLUSTER_BIND_PORT": str(gossip[name]),
                     "MOED_SERVER_NODE_NAME": name,
                     "MOED_RELEASE_VERSION_LABEL": f"model-v{name[1]}"},
                log_dir=log_dir, wait=None)
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 200)
        yield servers
    finally:
        for s in servers.values():
            s.stop(timeout=10)


def _members(srv) -> dict[str, dict]:
    status, body = srv.get("/cluster")
    assert status == 200, body
    return {m["name"]: m for m in json.loads(body)["members"]}


def test_cluster_lists_versions_and_counts_the_incompatible(two_versions) -> None:
    s = two_versions
    for d in ("D1", "D2"):
        _wait_until(lambda: sum(m["state"] == "alive" for m in _members(s[d]).values()) == 4,
                    30, f"{d} sees all four alive", step=0.1)
    m = _members(s["D1"])
    for name, info in m.items():
        assert info["version"] and info["protocol"] == PROTOCOL and len(info["config"]) == 12
        assert info["label"] == f"model-v{name[1]}" and len(info["model_id"]) == 12
    assert m["P1"]["model_id"] == m["D1"]["model_id"] != m["P2"]["model_id"] == m["D2"]["model_id"]
    assert len({i["layout"] for i in m.values()}) == 1      # the layout alone cannot tell them
    for n in s:                # each counts its one prefill/decode partner of the other model
        _wait_until(lambda: _metric(s[n], 'moed_cluster_incompatible_members{reason="model"}')
                    == 1, 10, f"{n} counts the other checkpoint's node", step=0.2)
    assert _metric(s["D1"], 'moed_cluster_incompatible_members{reason="protocol"}') == 0
    rel = s["D2"].metrics()
    assert any(k.startswith("moed_release_info{") and 'label="model-v2"' in k and
               f'model_id="{m["D2"]["model_id"]}"' in k for k in rel)


def test_no_request_is_prefilled_across_checkpoints(two_versions) -> None:
    s = two_versions
    for d in ("D1", "D2"):
        _wait_until(lambda: sum(m["role"] == "prefill" and m["state"] == "alive"
                                for m in _members(s[d]).values()) == 2,
                    30, f"{d} sees both prefill nodes", step=0.1)
    before = {p: _metric(s[p], 'moed_transfer_jobs_total{result="done",role="prefill"}')
              for p in ("P1", "P2")}
    for i in range(REQUESTS):
        for d in ("D1", "D2"):
            c = openai.OpenAI(base_url=s[d].url + "/v1", api_key="x", max_retries=0, timeout=60)
            r = c.completions.create(model="tiny", prompt=_prompt(40, 100 * i + int(d[1])),
                                     max_tokens=2, temperature=0)
            assert r.usage.completion_tokens == 2
    for p in ("P1", "P2"):
        done = _metric(s[p], 'moed_transfer_jobs_total{result="done",role="prefill"}')
        assert done - before[p] == REQUESTS, (p, done, before[p])   # its own decode node's only
    for d, p in (("D1", "P1"), ("D2", "P2")):
        status, body = s[d].get("/internal/transfer")
        assert status == 200, body
        assert list(json.loads(body)["peers"]) == [s[p].url]      # the other was never a candidate
