"""Quantized weights across P/D: a prefill and a decode process over real NIXL serve a quantized
DeepSeek-V3 checkpoint (fp8 blocks) and a Qwen3-MoE with `model.quantization` int4 (set through
MOED_MODEL_QUANTIZATION on every node) token-for-token equal to a colocated server, whose
greedy tokens equal transformers on the dequantized weights (fp32)."""
from __future__ import annotations

import random
import time

import openai
import pytest
import torch

import quant_ckpt       # tests/quant_ckpt.py
from moed_server import _wait_ready, free_port, start_server

pytestmark = pytest.mark.timeout(300)

BLOCK = 4
COMMON = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
          "MOED_ENGINE_BLOCK_SIZE": str(BLOCK), "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "16",
          "MOED_MODEL_SERVED_NAME": "tiny"}
DEEPSEEK = dict(hidden_size=128, num_layers=3, num_heads=4, num_experts=12, top_k=3, moe_intermediate_size=48,
                q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24,
                n_group=4, topk_group=2, first_k_dense_replace=1)
QWEN = dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, num_experts=6, moe_intermediate_size=96)


@pytest.fixture(scope="module", params=["deepseek-fp8", "qwen-online-int4"])
def cluster(request, tmp_path_factory):
    from moed.dev.checkpoint import init_checkpoint

    d = tmp_path_factory.mktemp("quant-pd")
    env = dict(COMMON)
    if request.param == "deepseek-fp8":
        src = init_checkpoint("deepseek_v3", d / "src", preset="tiny", seed=4, **DEEPSEEK)
        quant_ckpt.make(src, d / "q", d / "oracle", "fp8", block=(128, 128))
        model = d / "q"
    else:
        model = init_checkpoint("qwen3_moe", d / "src", preset="tiny", seed=4, **QWEN)
        quant_ckpt.online_oracle(model, d / "oracle", "int4", 32)
        env.update(MOED_MODEL_QUANTIZATION="int4", MOED_MODEL_QUANTIZATION_GROUP_SIZE="32")
    p_port = free_port()
    specs = {"C": ("colocated", None, {}), "P": ("prefill", p_port, {}),
             "D": ("decode", None, {"MOED_TRANSFER_PREFILL_PEERS": f"http://127.0.0.1:{p_port}",
                                    "MOED_TRANSFER_PREFILL_TIMEOUT_S": "30"})}
    servers: dict = {}
    try:
        for name, (role, port, extra) in specs.items():
            servers[name] = start_server(model=model, role=role, port=port, env={**env, **extra},
                                         log_dir=d, wait=None)
        for s in servers.values():
            _wait_ready(s, "/ready", time.monotonic() + 150)
        yield {**servers, "_oracle": d / "oracle"}
    finally:
        for s in servers.values():
            s.stop(timeout=10)


def _greedy(srv, prompt: list[int]):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    return c.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                extra_body={"return_token_ids": True}).choices[0]


def test_quantized_pd_equals_colocated_equals_oracle(cluster) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(cluster["_oracle"], dtype=torch.float32,
                                               experts_implementation="eager", attn_implementation="eager").eval()
    for i, n in enumerate((3, 37)):
        rnd = random.Random(200 + i)
        p = [rnd.randrange(3, 1000) for _ in range(n)]
        want, got = _greedy(cluster["C"], p), _greedy(cluster["D"], p)
        assert got.token_ids == want.token_ids, f"prompt of {n} tokens diverged over P/D"
        with torch.no_grad():
            gen = ref.generate(torch.tensor([p]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        assert gen[0, n:].tolist() == want.token_ids, f"prompt of {n} tokens: colocated differs from the oracle"
    assert cluster["P"].metrics().get("moed_transfer_bytes_total", 0.0) > 0


def test_structured_output_on_quantized_weights(cluster) -> None:
    """The grammar applies on quantized weights too, colocated and over P/D (token one sampled
    on the prefill node under the grammar): every sample validates against the schema."""
    import json

    import jsonschema

    from test_structured_outputs import MESSAGES, RESPONSE_FORMAT, SCHEMA

    for name in ("C", "D"):
        c = openai.OpenAI(base_url=cluster[name].url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="tiny", messages=MESSAGES, response_format=RESPONSE_FORMAT, n=4,
                                      temperature=1.0, seed=5, max_tokens=400)
        for choice in r.choices:
            assert choice.finish_reason == "stop", (name, choice.message.content[-200:])
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
