"""A decode node speculates (ngram) after a remote prefill: greedy completions through
prefill + decode equal a colocated node without speculation, token for token, and the decode
node's drafts are accepted and rejected. Prompt lookup needs nothing from the prefill node:
the decode node's n-gram index is built from the prompt it holds and the tokens it emits."""
from __future__ import annotations

import random

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
    prompts = []
    for n in (8, 12, 20, 30):
        base = [rnd.randrange(3, 400) for _ in range(n)]
        prompts.append(base + base + base[:3])
    with started_together(specs, tiny_qwen3, tmp_path_factory.mktemp("specpd"), COMMON) as s:
        c, d = (openai.OpenAI(base_url=s[k].url + "/v1", api_key="x", max_retries=0, timeout=60)
                for k in ("C", "D"))
        for prompt in prompts:
            kw = dict(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                      extra_body={"return_token_ids": True, "ignore_eos": True})
            want = c.completions.create(**kw).choices[0]
            got = d.completions.create(**kw).choices[0]
            assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        m = s["D"].metrics()
        jobs = s["P"].metrics().get('moed_transfer_jobs_total{result="done",role="prefill"}', 0)
    drafts = m.get("moed_spec_decode_num_draft_tokens_total", 0)
    assert jobs >= len(prompts)
    assert 0 < m.get("moed_spec_decode_num_accepted_tokens_total", 0) < drafts
