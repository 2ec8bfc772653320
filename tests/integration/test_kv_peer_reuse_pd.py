"""Cluster prefix reuse between prefill nodes, real processes on 127.0.0.1 (one gossip
membership, HMAC key, real NIXL; tiny Qwen3-MoE, fp32, blocks of 4 tokens): prefill nodes P1
and P2 with `tiers.peer_reuse`, decode node D (which finds both in the view). D sends a prompt
to P1 (idle nodes: ties go by URL, P1's sorts first); then, while P1 runs a long job of D's
(so D's fewest-jobs choice is P2), the same prompt again: P2 READs P1's cached blocks (P2's
metrics: a hit, blocks read) before computing the rest and pushing the whole prompt's KV to D,
and the greedy text equals P1's computed one. Then P1 prefills a second prompt and is killed
(-9) before it is asked again: D's attempt at P1 fails and goes to P2, whose lease call to P1
fails: P2 recomputes (a counted, logged failure), same text, and no block stays in use on P2
or D."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from moed_server import ServerProcess, free_port, started_together

pytestmark = pytest.mark.timeout(120)

KEY_ENV = "CLUSTER_KEY_HEX"
COMMON = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_BLOCK_SIZE": "4",
          "MOED_SERVER_CACHE_METRICS_BATCH": "1",      # the peer counters at every request
          # room for the long job next to the cached prompts (P1 must still hold the first
          # prompt's blocks when P2 asks for them)
          "MOED_ENGINE_NUM_KV_BLOCKS": "640", "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "16",
          "MOED_MODEL_SERVED_NAME": "tiny", "MOED_CLUSTER_LOAD_UPDATE_INTERVAL_MS": "200",
          # the recompute prediction pinned (the token policy: no fitted cost model) well above
          # a loopback lease, so the read is taken; the rule itself: test_tiers_policy
          "MOED_BALANCE_POLICY": "tokens", "MOED_TIERS_RECOMPUTE_US_PER_TOKEN": "2000"}
REUSE = {"MOED_TIERS_PEER_REUSE": "true"}
FIRST = ("Prefill one: the quick brown fox jumps over the lazy dog while the cat sat on the mat "
         "and the dog barked at the moon all night long")
SECOND = ("Prefill two: a long way down the river the boats drift slowly past the old grey "
          "mill, and the miller counts the sacks of flour while the children run along the "
          "bank shouting at the ducks, the geese and the herons that stand still in the reeds")
LONG = list(range(10, 1210))        # token ids: a job of ~75 steps of 16 tokens on P1


def complete(srv: ServerProcess, prompt, max_tokens: int = 6) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["choices"][0]["text"]


def wait_until(cond, timeout: float, what: str, step: float = 0.05) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def metric(srv: ServerProcess, name: str) -> float:
    return srv.metrics().get(name, 0.0)


def total(srv: ServerProcess, prefix: str) -> float:
    return sum(v for k, v in srv.metrics().items() if k.startswith(prefix))


def jobs(srv: ServerProcess) -> dict:
    return json.loads(srv.get("/internal/transfer")[1])["jobs"]


DONE = 'moed_transfer_jobs_total{result="done",role="prefill"}'


def test_a_prefill_node_reads_another_prefill_nodes_prefix(tiny_qwen3, tmp_path) -> None:
    seed = free_port()
    p1, p2 = sorted((free_port(), free_port()), key=lambda p: f"http://127.0.0.1:{p}")
    base = {**COMMON, "MOED_CLUSTER_ENABLED": "true", "MOED_CLUSTER_KEY_ENV": KEY_ENV,
            KEY_ENV: os.urandom(32).hex(), "MOED_CLUSTER_SEEDS": f"127.0.0.1:{seed}"}
    specs = {"P1": ("prefill", p1, {**REUSE, "MOED_CLUSTER_BIND_PORT": str(seed)}),
             "P2": ("prefill", p2, {**REUSE, "MOED_CLUSTER_BIND_PORT": str(free_port())}),
             "D": ("decode", None, {"MOED_CLUSTER_BIND_PORT": str(free_port()),
                                    "MOED_TRANSFER_PEER_ERROR_COOLDOWN_S": "30"})}
    with started_together(specs, tiny_qwen3, tmp_path, base) as s:
        P1, P2, D = s["P1"], s["P2"], s["D"]

        def sees_both() -> bool:
            ms = json.loads(D.get("/cluster")[1])["members"]
            return sum(m["role"] == "prefill" and m["state"] == "alive" for m in ms) == 2
        wait_until(sees_both, 20, "D to see both prefill nodes")

        want = complete(D, FIRST)                       # computed on P1 (no peer holds it)
        assert metric(P1, DONE) == 1 and metric(P2, DONE) == 0
        assert total(P1, "moed_kv_peer_lookups_total") == 0
        time.sleep(1.0)     # P1's next load ticks (200 ms) carry its digest to P2

        # P1 busy with a long job of D's: D's next job goes to P2 (fewest jobs in flight)
        long_done = threading.Event()
        threading.Thread(target=lambda: (complete(D, LONG, 1), long_done.set()),
                         daemon=True).start()
        wait_until(lambda: jobs(P1), 10, "the long job to run on P1", step=0.01)
        assert complete(D, FIRST) == want
        assert metric(P2, DONE) == 1, P2.tail()
        m = P2.metrics()
        assert m.get("moed_kv_peer_hits_total") == 1, P2.tail()
        assert m["moed_kv_peer_read_blocks_total"] >= 8         # the prompt's 8+ full blocks
        assert m['moed_kv_peer_lookups_total{decision="load"}'] == 1
        assert total(P2, "moed_kv_peer_failures_total") == 0
        assert metric(P1, "moed_kv_peer_leases_granted_total") == 1
        wait_until(long_done.is_set, 30, "the long request")
        wait_until(lambda: metric(P1, "moed_kv_peer_lent_blocks") == 0, 5,
                   "P1 to unpin the lent blocks (P2's DELETE)")

        # the lender dies after computing a prompt, before P2 is asked for it
        again = complete(D, SECOND)                     # on P1: both idle again
        assert metric(P1, DONE) == 3, P1.tail()
        time.sleep(1.0)
        P1.stop(signal.SIGKILL, timeout=5)
        assert complete(D, SECOND) == again             # D: P1 refused, retried on P2
        failed = [r for r in P2.log_records() if r.get("event") == "kv_peer_reuse_failed"]
        assert failed and failed[0]["reason"].startswith("lease_unreachable"), P2.tail()
        m = P2.metrics()
        assert m['moed_kv_peer_failures_total{reason="lease_unreachable"}'] == 1
        assert m["moed_kv_peer_hits_total"] == 1 and m[DONE] == 2
        for srv in (P2, D):
            wait_until(lambda: metric(srv, "moed_kv_blocks_used") == 0, 5,
                       f"{srv.url}'s KV blocks to return to 0")
