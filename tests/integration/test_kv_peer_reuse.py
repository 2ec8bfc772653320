"""Cluster prefix reuse between two real colocated nodes on 127.0.0.1 (one gossip membership,
HMAC key, real NIXL; tiny Qwen3-MoE and Mixtral, fp32, blocks of 4 tokens, `tiers.peer_reuse`
on both): node A serves a long prompt; once B sees A's prefix digest, B serves the same prompt
by READing A's blocks (B's peer metrics: a hit, blocks and bytes read; A lent them and holds
none pinned after) and its greedy text equals A's. Then A serves a second prompt and is killed
(-9) before B asks for it: B's lease call fails, B recomputes (a counted, logged failure) and
still answers the same text, with no block left in use."""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest

from moed_server import ServerProcess, _wait_ready, free_port, start_server

pytestmark = pytest.mark.timeout(120)

KEY_ENV = "CLUSTER_KEY_HEX"
COMMON = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_BLOCK_SIZE": "4",
          "MOED_SERVER_CACHE_METRICS_BATCH": "1",      # the peer counters at every request
          "MOED_ENGINE_NUM_KV_BLOCKS": "64", "MOED_MODEL_SERVED_NAME": "tiny",
          "MOED_CLUSTER_LOAD_UPDATE_INTERVAL_MS": "200", "MOED_TIERS_PEER_REUSE": "true",
          # the recompute prediction pinned (the token policy: no fitted cost model, whose
          # calibration on a shared CPU is noisy) at a figure well above a loopback lease, so
          # the path under test is taken; the rule itself: tests/unit/kvcache/test_tiers_policy
          "MOED_BALANCE_POLICY": "tokens", "MOED_TIERS_RECOMPUTE_US_PER_TOKEN": "2000"}
FIRST = "Peer one: the quick brown fox jumps over the lazy dog while the cat sat on the mat"
# longer: recomputing it must cost clearly more than a lease round trip, so B asks for it
SECOND = ("Peer two: a long way down the river the boats drift slowly past the old grey mill, "
          "and the miller counts the sacks of flour while the children run along the bank "
          "shouting at the ducks, the geese and the herons that stand still in the reeds")


def complete(srv: ServerProcess, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["choices"][0]["text"]


def gossiped(b: ServerProcess, name: str) -> None:
    """Give A's next load ticks (every 200 ms here, each carrying its digest) time to reach B.
    /cluster shows only a digest's size, which the calibration's prompts have already filled,
    so the wait is a bound: 5 ticks."""
    time.sleep(1.0)
    alive = {m["name"]: m["state"] for m in json.loads(b.get("/cluster")[1])["members"]}
    assert alive.get(name) == "alive"


def wait_until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def total(srv: ServerProcess, prefix: str) -> float:
    return sum(v for k, v in srv.metrics().items() if k.startswith(prefix))


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_mixtral"])
def test_a_peers_prefix_is_read_not_recomputed(arch: str, request: pytest.FixtureRequest,
                                               tmp_path) -> None:
    ckpt = request.getfixturevalue(arch)
    seed = free_port()
    base = {**COMMON, "MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_KEY_ENV": KEY_ENV,
            KEY_ENV: os.urandom(32).hex(), "MOED_CLUSTER_SEEDS": f"127.0.0.1:{seed}"}
    servers: dict[str, ServerProcess] = {}
    try:
        for name, gossip in (("A", seed), ("B", free_port())):
            servers[name] = start_server(model=ckpt, log_dir=tmp_path, wait=None,
                                         args=["--node-name", name],
                                         env={**base, "MOED_CLUSTER_BIND_PORT": str(gossip)})
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 60)
        a, b = servers["A"], servers["B"]

        want = complete(a, FIRST)
        gossiped(b, "A")
        assert complete(b, FIRST) == want
        m = b.metrics()
        assert m.get("moed_kv_peer_hits_total") == 1, b.tail()
        assert m["moed_kv_peer_read_blocks_total"] >= 8       # the prompt's 8+ full blocks
        assert m["moed_kv_peer_read_bytes_total"] > 0
        assert m['moed_kv_peer_lookups_total{decision="load"}'] == 1
        assert total(b, "moed_kv_peer_failures_total") == 0
        read = [r for r in b.log_records() if r.get("event") == "kv_peer_read"]
        assert read and read[0]["blocks"] == m["moed_kv_peer_read_blocks_total"]
        ma = a.metrics()
        # A computed the prompt itself (it had no peer to read from): the peer path off
        assert ma["moed_kv_peer_leases_granted_total"] == 1 and \
            total(a, "moed_kv_peer_lookups_total") == 0
        wait_until(lambda: a.metrics()["moed_kv_peer_lent_blocks"] == 0, 5,
                   "A to unpin the lent blocks (the reader's DELETE)")

        # the lender dies before the reader's lease call: the reader recomputes, same text
        again = complete(a, SECOND)
        gossiped(b, "A")
        a.stop(signal.SIGKILL, timeout=5)
        assert complete(b, SECOND) == again
        failed = [r for r in b.log_records() if r.get("event") == "kv_peer_reuse_failed"]
        assert failed and failed[0]["reason"].startswith("lease_unreachable"), b.tail()
        m = b.metrics()
        assert m['moed_kv_peer_failures_total{reason="lease_unreachable"}'] == 1
        assert m["moed_kv_peer_hits_total"] == 1
        wait_until(lambda: b.metrics().get("moed_kv_blocks_used", 0) == 0, 5,
                   "B's KV blocks to return to 0")
    finally:
        for s in servers.values():
            s.stop(timeout=10)
