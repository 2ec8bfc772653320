"""A decode node speculates after a remote prefill: greedy completions through prefill +
decode equal a colocated node without speculation, token for token, and the decode node's
drafts are accepted and rejected. Prompt lookup (ngram) needs nothing from the prefill node:
the decode node's n-gram index is built from the prompt it holds and the tokens it emits. The
MTP layer (mtp) needs its KV over the prompt: a prefill node with `method = "mtp"` computes it
and sends it with the rest (one more layer per block) and the first draft; a prefill node
without the layer refuses the job (409 incompatible_mtp) and the decode node retries on one
that has it."""
from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from moed_server import free_port, started_together

pytestmark = pytest.mark.timeout(240)

COMMON = {"MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "8",
          "MOED_ENGINE_BLOCK_SIZE": "4", "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "16",
          "MOED_MODEL_SERVED_NAME": "tiny"}
# the per-step switch off: every step may draft (this test is about the decode node's drafts;
# with the switch, a random model whose drafts lose stops drafting after its warm-up)
SPEC = {"MOED_SPECULATIVE_METHOD": "ngram", "MOED_SPECULATIVE_NUM_SPECULATIVE_TOKENS": "3",
        "MOED_SPECULATIVE_PROMPT_LOOKUP_MIN": "1", "MOED_SPECULATIVE_PROMPT_LOOKUP_MAX": "3",
        "MOED_SPECULATIVE_ADAPTIVE": "false"}


def test_decode_node_speculates_after_remote_prefill(tiny_qwen3, tmp_path_factory):
    p = free_port()
    specs = {"C": ("colocated", None, {}), "P": ("prefill", p, {}),
             "D": ("decode", None, {"MOED_TRANSFER_PREFILL_PEERS": f"http://127.0.0.1:{p}",
                                    "MOED_TRANSFER_LOCAL_PREFILL_MAX_TOKENS": "0", **SPEC})}
    rnd = random.Random(3)
    prompts = []    # 50: repetitive (prompt lookup finds its n-grams), most past a 16-token
    for n in [3, 5, 8, 12, 20, 30] * 7:     # chunk, the last 8 repeated (prefix hits)
        base = [rnd.randrange(3, 400) for _ in range(n)]
        prompts.append(base + base + base[:3])
    prompts += prompts[:8]
    with started_together(specs, tiny_qwen3, tmp_path_factory.mktemp("specpd"), COMMON) as s:
        c, d = (openai.OpenAI(base_url=s[k].url + "/v1", api_key="x", max_retries=0, timeout=60)
                for k in ("C", "D"))

        def run(client, prompt):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24,
                                          temperature=0, extra_body={"return_token_ids": True,
                                                                     "ignore_eos": True})
            return r.choices[0].token_ids, r.choices[0].finish_reason

        with ThreadPoolExecutor(8) as pool:
            want = list(pool.map(lambda q: run(c, q), prompts))
            got = list(pool.map(lambda q: run(d, q), prompts))
        assert got == want
        m = s["D"].metrics()
        jobs = s["P"].metrics().get('moed_transfer_jobs_total{result="done",role="prefill"}', 0)
    drafts = m.get("moed_spec_decode_num_draft_tokens_total", 0)
    assert jobs >= len(prompts)
    assert 0 < m.get("moed_spec_decode_num_accepted_tokens_total", 0) < drafts


DEMO = Path(__file__).resolve().parents[2] / "models" / "stdlib-ds3-tiny"
MTP = {"MOED_SPECULATIVE_METHOD": "mtp", "MOED_SPECULATIVE_NUM_SPECULATIVE_TOKENS": "1"}
CODE = ["def {a}(x, y):\n    return x + y\n\n\ndef {b}(x, y):\n    return x - y\n\n\ndef",
        "import {a}\nimport {b}\nimport {a}\nimport", "{a} = [1, 2, 3]\n{b} = [1, 2, 3]\n{a} =",
        "for {a} in range(10):\n    print({a})\nfor {b} in range(10):\n    print("]
NAMES = ["os", "sys", "re", "json", "path", "item", "value", "key", "x", "y", "z", "n", "m"]


def test_decode_node_drafts_with_the_mtp_layer_after_remote_prefill(tmp_path_factory):
    """The trained demo model (fp32): 50 prompts (most longer than the 16-token chunk, 10
    repeated: prefix hits on both nodes), 8 at a time, through a prefill node with the MTP
    layer; the KV written is every layer's, the MTP layer's included; drafts mostly accepted.
    The first prefill peer (X, first by name) has no MTP layer: it refuses, the job goes on."""
    p, x = sorted((free_port(), free_port()), key=lambda q: f"http://127.0.0.1:{q}")[::-1]
    peers = f"http://127.0.0.1:{x},http://127.0.0.1:{p}"
    specs = {"C": ("colocated", None, {}), "P": ("prefill", p, MTP), "X": ("prefill", x, {}),
             "D": ("decode", None, {"MOED_TRANSFER_PREFILL_PEERS": peers,
                                    "MOED_TRANSFER_LOCAL_PREFILL_MAX_TOKENS": "0",
                                    "MOED_SPECULATIVE_ADAPTIVE": "false", **MTP})}
    prompts = [t.format(a=NAMES[i % 13], b=NAMES[(i + 5) % 13]) for i, t in enumerate(CODE * 10)]
    prompts += prompts[:10]
    rnd = random.Random(7)
    fresh = [[rnd.randrange(3, 4000) for _ in range(n)] for n in (5, 18, 33)]   # no prefix hit
    cfg = json.loads((DEMO / "config.json").read_text())
    layer_bytes = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4      # fp32, per token
    with started_together(specs, DEMO, tmp_path_factory.mktemp("specpd-mtp"), COMMON) as s:
        c, d = (openai.OpenAI(base_url=s[k].url + "/v1", api_key="x", max_retries=0, timeout=60)
                for k in ("C", "D"))

        def run(client, prompt):
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=16,
                                          temperature=0, extra_body={"return_token_ids": True,
                                                                     "ignore_eos": True})
            return r.choices[0].token_ids, r.choices[0].finish_reason

        moved0 = s["P"].metrics().get("moed_transfer_bytes_total", 0)
        for prompt in fresh:
            assert run(d, prompt) == run(c, prompt)
        moved = s["P"].metrics().get("moed_transfer_bytes_total", 0) - moved0
        with ThreadPoolExecutor(8) as pool:
            want = list(pool.map(lambda q: run(c, q), prompts))
            got = list(pool.map(lambda q: run(d, q), prompts))
        m, mp, mx = s["D"].metrics(), s["P"].metrics(), s["X"].metrics()
        said = [r for r in s["D"].log_records() if r.get("event") == "remote_prefill_attempt_failed"]
    assert got == want
    # whole prompt blocks, the model's layers and the MTP layer's
    blocks = sum(-(-len(q) // 4) for q in fresh)
    assert moved == blocks * 4 * (cfg["num_hidden_layers"] + 1) * layer_bytes
    drafts = m.get("moed_spec_decode_num_draft_tokens_total", 0)
    assert drafts > 0 and drafts / 2 < m.get("moed_spec_decode_num_accepted_tokens_total", 0)
    assert mp.get('moed_transfer_jobs_total{result="done",role="prefill"}', 0) \
        >= len(fresh) + len(prompts)
    assert mx.get('moed_transfer_failures_total{kind="incompatible_mtp"}', 0) >= 1
    assert said and all("this prefill node has no MTP layer" in r["error"] for r in said)
