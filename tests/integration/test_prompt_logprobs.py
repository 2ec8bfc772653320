"""Prompt logprobs through a real colocated `moed serve` (tiny Qwen3-MoE, fp32): completions
`echo` + `logprobs` and vLLM's `prompt_logprobs`, checked against transformers (the oracle) on
the same checkpoint; chunked prefill (a 16-token budget), prefix-cache hits (the same prompt
served before), text_offset over the echoed text, streaming, and continuous_usage_stats."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch

from moed_server import serve_process

pytestmark = pytest.mark.timeout(180)

KEY = "sk-test-plp"
PROMPT = ("The quick brown fox jumps over the lazy dog while the cat sat on the mat and "
          "watched the rain fall on the old stone bridge")
TOL = 1e-3


@pytest.fixture(scope="module")
def srv(tiny_qwen3, tmp_path_factory):
    env = {"MOED_SERVER_API_KEYS_ENV": "TEST_KEYS", "TEST_KEYS": KEY,
           "MOED_MODEL_DTYPE": "float32", "MOED_ENGINE_BLOCK_SIZE": "4",
           "MOED_ENGINE_MAX_NUM_BATCHED_TOKENS": "16", "MOED_ENGINE_KV_CACHE_MEMORY_MB": "16",
           "MOED_MODEL_MAX_MODEL_LEN": "256", "MOED_MODEL_SERVED_NAME": "tiny"}
    with serve_process(model=tiny_qwen3, env=env, log_dir=tmp_path_factory.mktemp("srv")) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oracle(tiny_qwen3):
    """prompt ids -> log_softmax of transformers' fp32 logits at every position [P, V]."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32,
                                             experts_implementation="eager",
                                             attn_implementation="eager").eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(m(torch.tensor([ids])).logits[0].float(), dim=-1)
    return run


def _post(srv, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(srv.url + "/v1/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json",
                                                         "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _echo(srv, prompt=PROMPT, **extra) -> dict:
    status, body = _post(srv, {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                               "temperature": 0, "echo": True, "logprobs": 3,
                               "return_token_ids": True, **extra})
    assert status == 200, body
    return body["choices"][0]


def test_echo_logprobs_are_the_oracles_and_cover_the_prompt_first(srv, oracle):
    ch = _echo(srv)
    p_ids, c_ids = ch["prompt_token_ids"], ch["token_ids"]
    assert len(p_ids) > 16                          # several prefill chunks of 16 tokens
    lp = ch["logprobs"]
    n = len(p_ids) + len(c_ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = oracle(p_ids + c_ids)
    for i in range(1, n):           # token i given tokens < i: the oracle's row i - 1
        assert abs(lp["token_logprobs"][i] - want[i - 1, (p_ids + c_ids)[i]].item()) < TOL, i
        assert len(lp["top_logprobs"][i]) >= 1
        best = max(lp["top_logprobs"][i].values())
        assert abs(best - want[i - 1].max().item()) < TOL, i
    assert ch["text"].startswith(PROMPT) and len(ch["text"]) > len(PROMPT)


def test_text_offsets_index_the_returned_text(srv):
    ch = _echo(srv)
    lp, text = ch["logprobs"], ch["text"]
    offs, toks = lp["text_offset"], lp["tokens"]
    p = len(ch["prompt_token_ids"])
    assert offs[0] == 0 and offs == sorted(offs)
    assert offs[p] == len(PROMPT)                   # the completion starts after the echo
    ends = offs[1:] + [len(text)]
    for i, tok in enumerate(toks):                  # ASCII text: each token's own characters
        assert text[offs[i]:ends[i]] == tok, (i, tok)


def test_a_cached_prefix_does_not_change_the_values(srv, oracle):
    prompt = PROMPT + " again and again"
    status, plain = _post(srv, {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert status == 200
    ch = _echo(srv, prompt=prompt)
    p_ids = ch["prompt_token_ids"]
    want = oracle(p_ids)
    got = ch["logprobs"]["token_logprobs"][:len(p_ids)]
    assert all(abs(got[i] - want[i - 1, p_ids[i]].item()) < TOL for i in range(1, len(p_ids)))


def test_vllm_prompt_logprobs_field(srv, oracle):
    status, body = _post(srv, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                               "temperature": 0, "prompt_logprobs": 2,
                               "return_token_ids": True})
    assert status == 200, body
    ch = body["choices"][0]
    p_ids, plp = ch["prompt_token_ids"], ch["prompt_logprobs"]
    assert ch["logprobs"] is None and not ch["text"].startswith(PROMPT)
    assert len(plp) == len(p_ids) and plp[0] is None
    want = oracle(p_ids)
    for i in range(1, len(p_ids)):
        e = plp[i][str(p_ids[i])]
        assert abs(e["logprob"] - want[i - 1, p_ids[i]].item()) < TOL
        v = want[i - 1, p_ids[i]]       # rank: 1 + tokens likelier (ties within TOL either way)
        assert int((want[i - 1] > v + TOL).sum()) + 1 <= e["rank"] <= \
            int((want[i - 1] > v - TOL).sum()) + 1
        assert 2 <= len(plp[i]) <= 3                # the prompt token and the top 2
        assert any(v["rank"] == 1 for v in plp[i].values())


def test_stream_echo_logprobs_equal_the_non_stream_ones(client, srv):
    ref = _echo(srv)["logprobs"]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                            temperature=0, echo=True, logprobs=3, stream=True))
    got = {"tokens": [], "token_logprobs": [], "text_offset": []}
    text = ""
    for c in chunks:
        if not c.choices:
            continue
        text += c.choices[0].text
        lp = c.choices[0].logprobs
        if lp is not None:
            for k in got:
                got[k] += getattr(lp, k)
    assert text.startswith(PROMPT)
    assert got["tokens"] == ref["tokens"] and got["text_offset"] == ref["text_offset"]
    assert got["token_logprobs"][0] is None
    assert all(abs(a - b) < 1e-5 for a, b in zip(got["token_logprobs"][1:],
                                                  ref["token_logprobs"][1:]))


def test_continuous_usage_stats_on_every_chunk(client):
    chunks = list(client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choice = [c for c in chunks if c.choices]
    assert len(with_choice) == 5
    done = [c.usage.completion_tokens for c in with_choice]
    assert done == [1, 2, 3, 4, 5]
    prompt = {c.usage.prompt_tokens for c in chunks}
    assert len(prompt) == 1 and prompt.pop() > 16
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
               for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 2, "stream": True},
                                   {"prompt_logprobs": 21}, {"prompt_logprobs": -1}])
def test_prompt_logprobs_refusals(srv, extra):
    status, body = _post(srv, {"model": "tiny", "prompt": "hi", "max_tokens": 1, **extra})
    assert status == 400 and body["error"]["param"] == "prompt_logprobs", body
