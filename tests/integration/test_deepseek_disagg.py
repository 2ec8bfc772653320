"""DeepSeek-V3 across processes. P/D: one prefill and one decode process over real NIXL (UCX)
serve a DeepSeek-V3 checkpoint token-for-token equal to a colocated server, and what travels
is the latent cache: per token and layer (kv_lora_rank + qk_rope_head_dim) x dtype bytes, once
(asserted from the prefill node's moed_transfer_bytes_total). EP: an EP=2 group (gloo on
127.0.0.1) answers as one process does; the routed experts shard (each rank ~1/2 of the expert
bytes), the shared experts stay on every rank."""
from __future__ import annotations

import json
import random
import time

import openai
import pytest

from ep_group import complete, launch_group, wait_ready
from moed_server import _wait_ready, free_port, start_server

pytestmark = pytest.mark.timeout(240)

BLOCK = 4
COMMON = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
          "MOED_ENGINE_BLOCK_SIZE": str(BLOCK), "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "16",
          "MOED_MODEL_SERVED_NAME": "tiny"}
SHAPE = dict(hidden_size=128, num_layers=3, num_heads=4, num_experts=12, top_k=3, moe_intermediate_size=48,
             q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
             n_group=4, topk_group=2, first_k_dense_replace=1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from moed.dev.checkpoint import init_checkpoint

    return init_checkpoint("deepseek_v3", tmp_path_factory.mktemp("dsv3") / "m", preset="tiny", seed=4, **SHAPE)


def test_deepseek_ep2_equals_one_process(moed_server, model) -> None:
    args = ["--kv-cache-memory", "8", "--served-model-name", "m", "--dtype", "float32"]
    groups = {n: launch_group(moed_server, model, n, args=args) for n in (1, 2)}
    wait_ready([srv for g in groups.values() for srv in g], ready_timeout=150)
    prompts = ["the quick brown fox", "hello world, this is a longer prompt about", "1 2 3"]

    def outputs(ranks):
        out = []
        for i, p in enumerate(prompts):
            status, body = complete(ranks[i % len(ranks)], p, 6)
            assert status == 200, body
            out.append(body["choices"][0]["text"])
        return out

    assert outputs(groups[2]) == outputs(groups[1])
    total = groups[1][0].metrics()["moed_ep_resident_expert_bytes"]
    for srv in groups[2]:
        held = srv.metrics()["moed_ep_resident_expert_bytes"]
        assert abs(held - total / 2) <= 0.02 * total / 2, (held, total)
        assert srv.metrics()["moed_ep_tokens_received_total"] > 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model):
    p_port = free_port()
    specs = {"C": ("colocated", None, {}), "P": ("prefill", p_port, {}),
             "D": ("decode", None, {"MOED_TRANSFER_PREFILL_PEERS": f"http://127.0.0.1:{p_port}",
                                    "MOED_TRANSFER_PREFILL_TIMEOUT_S": "30"})}
    log_dir = tmp_path_factory.mktemp("dsv3-disagg")
    servers: dict = {}
    try:
        for name, (role, port, env) in specs.items():
            servers[name] = start_server(model=model, role=role, port=port, env={**COMMON, **env},
                                         log_dir=log_dir, wait=None)
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 150)
        yield {**servers, "_cfg": json.loads((model / "config.json").read_text())}
    finally:
        for s in servers.values():
            s.stop(timeout=10)


def _greedy(srv, prompt: list[int]):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    return c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                extra_body={"return_token_ids": True}).choices[0]


def test_deepseek_pd_parity_and_latent_bytes(cluster) -> None:
    cfg = cluster["_cfg"]
    per_token_layer = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4          # fp32
    metric = "moed_transfer_bytes_total"
    before = cluster["P"].metrics().get(metric, 0.0)
    blocks = 0
    for i, n in enumerate((3, 37, 64)):
        rnd = random.Random(100 + i)
        p = [rnd.randrange(3, 1000) for _ in range(n)]
        want, got = _greedy(cluster["C"], p), _greedy(cluster["D"], p)
        assert got.token_ids == want.token_ids, f"prompt of {n} tokens diverged"
        assert got.finish_reason == want.finish_reason == "length"
        blocks += -(-n // BLOCK)
    moved = cluster["P"].metrics().get(metric, 0.0) - before
    # whole blocks of the prompt, every layer, the latent entry only (a GQA cache of the same
    # heads would be 2 x heads x head_dim per token: 2 x 4 x 24 x 4 = 768 bytes, not 160)
    assert moved == blocks * BLOCK * cfg["num_hidden_layers"] * per_token_layer
    assert cluster["D"].metrics().get(metric, 0.0) == 0
