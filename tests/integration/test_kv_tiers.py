"""KV tiers through a real colocated `moed serve` (tiny Qwen3-MoE, fp32, an L1 of 16 blocks of
4 tokens and an L3 disk tier): prompts that fall out of L1 are written to L3; after a restart
(a new process on the same directory) the node finds its L3 again, skips and counts a truncated
file, answers the same prompts with the same greedy text, logs each load-or-recompute
decision with both predictions, and exports the tier metrics."""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from moed_server import ServerProcess

pytestmark = pytest.mark.timeout(240)

PROMPTS = [f"Session {i}: the quick brown fox jumps over the lazy dog while the cat {i} sat "
           f"on the mat and watched the rain" for i in range(5)]


def complete(srv: ServerProcess, prompt: str) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.loads(r.read())
    return out["choices"][0]["text"]


def test_l3_survives_a_restart_and_answers_the_same(moed_server, tiny_qwen3, tmp_path: Path):
    l3 = tmp_path / "l3"
    env = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_BLOCK_SIZE": "4",
           "MOED_ENGINE_NUM_KV_BLOCKS": "16", "MOED_MODEL_MAX_MODEL_LEN": "60",
           "MOED_MODEL_SERVED_NAME": "tiny", "MOED_TIERS_DISK_BYTES": str(1 << 24),
           "MOED_TIERS_DISK_DIR": str(l3),
           "MOED_SERVER_CACHE_METRICS_BATCH": "1"}     # the tier counters at every request
    srv = moed_server(model=tiny_qwen3, env=env)
    first = [complete(srv, p) for p in PROMPTS]
    assert srv.metrics()['moed_kv_tier_capacity_bytes{tier="disk"}'] == 1 << 24
    assert srv.stop() == 0
    files = sorted(l3.glob("*/*.kvb"))
    assert len(files) >= 5
    files[0].write_bytes(files[0].read_bytes()[:40])        # truncated

    again = moed_server(model=tiny_qwen3, env=env)
    restored = [r for r in again.log_records() if r.get("event") == "kv_tier_restored"]
    assert restored and restored[0]["blocks"] == len(files) - 1 and restored[0]["skipped"] == 1
    assert restored[0]["io"] in ("nixl-posix", "file")
    assert [complete(again, p) for p in PROMPTS] == first
    m = again.metrics()
    assert m['moed_kv_tier_corrupt_blocks_total{tier="disk"}'] == 1
    assert m['moed_kv_tier_used_bytes{tier="disk"}'] > 0
    assert m['moed_kv_tier_hit_blocks_total{tier="disk"}'] > 0
    decisions = [r for r in again.log_records() if r.get("event") == "kv_tier_decision"]
    assert decisions and all({"decision", "predicted_load_s", "predicted_recompute_s",
                              "request_id"} <= set(r) for r in decisions)
    assert sum(m.get(f'moed_kv_tier_decisions_total{{decision="{d}"}}', 0)
               for d in ("load", "recompute")) == len(decisions)
