"""Cold experts in real `moed serve` processes (tiny Qwen3-MoE, bf16: the CPU kernels where
they load), each node keeping 30% of the routed-expert bytes resident (MOED_EXPERTS_RESIDENT_BYTES
on a colocated node, `--experts-resident-bytes` on a prefill and a decode node over real
NIXL): greedy tokens through the OpenAI client equal an all-resident colocated server's; the
node's /metrics count hits, misses and the resident bytes under the budget. Then the cold
colocated node's checkpoint is truncated under it: a request that misses gets a 500
server_error that names no path, the node stays up, and once the file is whole again it
serves the same tokens as before."""
from __future__ import annotations

import json
import random
import shutil
import time

import openai
import pytest

from moed_server import _wait_ready, free_port, start_server

pytestmark = pytest.mark.timeout(300)

COMMON = {"MOED_MODEL_DTYPE": "bfloat16", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
          "MOED_ENGINE_BLOCK_SIZE": "4", "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "32",
          "MOED_MODEL_SERVED_NAME": "tiny", "MOED_ENGINE_NUM_THREADS": "1"}


def _expert_bytes(model) -> int:
    c = json.loads((model / "config.json").read_text())
    per = 3 * c["hidden_size"] * c["moe_intermediate_size"] * 2          # bf16
    return per * c["num_local_experts"] * c["num_hidden_layers"]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, make_checkpoint):
    d = tmp_path_factory.mktemp("cold")
    src = make_checkpoint("qwen3_moe")
    own = d / "ck"
    shutil.copytree(src, own)           # the cold colocated node's copy (truncated later)
    budget = str(int(0.3 * _expert_bytes(src)))
    p_port = free_port()
    specs = {"C": (src, "colocated", None, {}, []),
             "K": (own, "colocated", None, {"MOED_EXPERTS_RESIDENT_BYTES": budget}, []),
             "P": (src, "prefill", p_port, {}, ["--experts-resident-bytes", budget]),
             "D": (src, "decode", None, {"MOED_TRANSFER_PREFILL_PEERS": f"http://127.0.0.1:{p_port}",
                                         "MOED_TRANSFER_PREFILL_TIMEOUT_S": "30"},
                   ["--experts-resident-bytes", budget])}
    servers: dict = {}
    try:
        for name, (model, role, port, extra, args) in specs.items():
            servers[name] = start_server(model=model, role=role, port=port, env={**COMMON, **extra},
                                         args=args, log_dir=d, wait=None)
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 150)
        yield {**servers, "_ck": own, "_budget": int(budget)}
    finally:
        for s in servers.values():
            s.stop(timeout=10)


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _greedy(srv, prompt: list[int]) -> list[int]:
    return _client(srv).completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                           extra_body={"return_token_ids": True}).choices[0].token_ids


PROMPTS = [[random.Random(i).randrange(3, 1000) for _ in range(n)] for i, n in enumerate((5, 23, 41))]


def test_thirty_percent_resident_equals_all_resident_colocated_and_pd(nodes) -> None:
    for p in PROMPTS:
        want = _greedy(nodes["C"], p)
        assert _greedy(nodes["K"], p) == want, f"cold colocated diverged on a {len(p)}-token prompt"
        assert _greedy(nodes["D"], p) == want, f"cold P/D diverged on a {len(p)}-token prompt"
    for name in ("K", "P", "D"):
        m = nodes[name].metrics()
        assert m.get("moed_expert_weight_misses_total", 0) > 0, name
        assert m.get("moed_expert_weight_hits_total", 0) > 0, name
        assert 0 < m['moed_expert_weight_resident_bytes{tier="resident"}'] <= nodes["_budget"], name
    on = [r for r in nodes["K"].log_records() if r.get("event") == "cold_experts_on"]
    assert on and on[0]["resident_bytes"] <= nodes["_budget"]
    assert nodes["P"].metrics().get("moed_transfer_bytes_total", 0.0) > 0


def test_failed_disk_read_fails_the_request_cleanly_and_the_node_serves_on(nodes) -> None:
    k, ck = nodes["K"], nodes["_ck"]
    (shard,) = sorted(ck.glob("*.safetensors"))
    whole = shard.read_bytes()
    want = [_greedy(nodes["C"], p) for p in PROMPTS]
    with open(shard, "r+b") as f:
        f.truncate(4096)
    errors = 0
    try:
        for i in range(6):          # enough distinct prompts that some step misses
            p = [random.Random(100 + i).randrange(3, 1000) for _ in range(30)]
            try:
                _greedy(k, p)
            except openai.InternalServerError as e:
                errors += 1
                assert str(ck) not in str(e) and "Traceback" not in str(e)
        assert errors > 0
        assert k.alive
        assert k.metrics().get('moed_expert_weight_read_failures_total{kind="miss"}', 0) > 0
    finally:
        with open(shard, "r+b") as f:
            f.write(whole)
    assert [_greedy(k, p) for p in PROMPTS] == want
