"""The official openai client against a real `moed serve` process (real engine, tiny Qwen3-MoE)."""
from __future__ import annotations

import json
import random
import re
import time
import urllib.request

import openai
import pytest

from moed_server import serve_process

KEY = "sk-test-123"
MAX_LEN = 256


@pytest.fixture(scope="module")
def srv(tiny_qwen3, tmp_path_factory):
    env = {"MOED_SERVER_API_KEYS_ENV": "TEST_KEYS", "TEST_KEYS": KEY,
           "MOED_ENGINE_KV_CACHE_MEMORY_MB": "16", "MOED_MODEL_MAX_MODEL_LEN": str(MAX_LEN),
           "MOED_MODEL_SERVED_NAME": "tiny"}
    with serve_process(model=tiny_qwen3, env=env,
                       log_dir=tmp_path_factory.mktemp("srv")) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _greedy(**kw):
    return {"model": "tiny", "temperature": 0.0, **kw}


def test_models_and_completion(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.completions.create(**_greedy(prompt="def main():", max_tokens=6),
                                  extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert r.usage.completion_tokens == len(ch.token_ids) == 6
    assert r.usage.prompt_tokens == len(ch.prompt_token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert ch.finish_reason == "length" and ch.text


def test_stream_completion_matches_non_stream_and_usage_last(client):
    full = client.completions.create(**_greedy(prompt="import os", max_tokens=8))
    chunks = list(client.completions.create(**_greedy(prompt="import os", max_tokens=8),
                                            stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_non_stream(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = client.chat.completions.create(**_greedy(messages=msgs, max_completion_tokens=5),
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(r.prompt_token_ids)
    assert len(r.choices[0].token_ids) == r.usage.completion_tokens == 5
    stream = client.chat.completions.create(**_greedy(messages=msgs, max_completion_tokens=5),
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_n_choices_and_seeded_sampling(client):
    kw = dict(model="tiny", prompt="class A:", max_tokens=6, n=3, temperature=1.0, seed=7)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]   # seeded: reproducible
    assert a.usage.completion_tokens == 18
    chunks = list(client.completions.create(**kw, stream=True))
    assert {c.choices[0].index for c in chunks} == {0, 1, 2}


def test_stop_string_cuts_text(client):
    base = client.completions.create(**_greedy(prompt="x = 1", max_tokens=12))
    text = base.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    r = client.completions.create(**_greedy(prompt="x = 1", max_tokens=12, stop=[stop]))
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[:text.index(stop)]


def test_logprobs(client):
    r = client.completions.create(**_greedy(prompt="for i in", max_tokens=4, logprobs=1))
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == 4 and all(v <= 0.0 for v in lp.token_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(**_greedy(messages=[{"role": "user", "content": "a"}],
                                                 max_tokens=3, logprobs=True, top_logprobs=1))
    assert len(c.choices[0].logprobs.content) == 3


def test_top_logprobs(client):
    """N most likely tokens per sampled token, in both OpenAI shapes, streaming and not."""
    r = client.completions.create(**_greedy(prompt="for i in", max_tokens=4, logprobs=3))
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 4
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        vals = list(top.values())
        assert 2 <= len(top) <= 3 and vals == sorted(vals, reverse=True) and vals[0] <= 0.0
        assert top.get(tok) == chosen == vals[0]              # greedy: the chosen is the best
    chunks = list(client.completions.create(**_greedy(prompt="for i in", max_tokens=4,
                                                      logprobs=3), stream=True))
    assert [t for c in chunks if c.choices[0].logprobs
            for t in c.choices[0].logprobs.top_logprobs] == lp.top_logprobs

    msgs = [{"role": "user", "content": "a"}]
    c = client.chat.completions.create(**_greedy(messages=msgs, max_tokens=3, logprobs=True,
                                                 top_logprobs=5))
    content = c.choices[0].logprobs.content
    assert len(content) == 3
    for e in content:
        tops = e.top_logprobs
        assert len(tops) == 5 and [t.logprob for t in tops] == sorted((t.logprob for t in tops),
                                                                       reverse=True)
        assert (tops[0].token, tops[0].logprob) == (e.token, e.logprob)
        assert all(bytes(t.bytes).decode() == t.token for t in tops)
    streamed = [e for ch in client.chat.completions.create(
        **_greedy(messages=msgs, max_tokens=3, logprobs=True, top_logprobs=5), stream=True)
        if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [[(t.token, t.logprob) for t in e.top_logprobs] for e in streamed] == \
        [[(t.token, t.logprob) for t in e.top_logprobs] for e in content]
    for bad in (dict(top_logprobs=21), dict(top_logprobs=-1)):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**_greedy(messages=msgs, max_tokens=2, logprobs=True,
                                                     **bad))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(**_greedy(prompt="x", max_tokens=2, logprobs=21))


def _expert_tokens_per_layer(srv) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, v in srv.metrics().items():
        m = re.fullmatch(r'moed_expert_tokens_total\{(.*)\}', key)
        if m:
            layer = int(re.search(r'layer="(\d+)"', m.group(1)).group(1))
            out[layer] = out.get(layer, 0.0) + v
    return out


def test_expert_load_metrics(client, srv, tiny_qwen3):
    """Every token forwarded reaches each MoE layer's top-k experts: the per-layer sum of
    moed_expert_tokens_total grows by exactly top_k x forwarded tokens; dense layers stay out."""
    from moed.model.hf_config import load_spec

    spec = load_spec(tiny_qwen3)
    moe = [i for i in range(spec.num_layers) if i not in spec.dense_layers]
    before = _expert_tokens_per_layer(srv)
    rnd = random.Random(4242)
    forwarded = 0
    for n in (9, 23, 40):
        r = client.completions.create(**_greedy(prompt=[rnd.randrange(100, 2000) for _ in range(n)],
                                                max_tokens=5))
        forwarded += r.usage.prompt_tokens + r.usage.completion_tokens - 1   # no cache hits
    want = {i: forwarded * spec.top_k for i in moe}
    deadline = time.monotonic() + 5
    while True:
        after = _expert_tokens_per_layer(srv)
        delta = {i: after.get(i, 0.0) - before.get(i, 0.0) for i in range(spec.num_layers)}
        if all(delta[i] >= want[i] for i in moe) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {i: delta[i] for i in moe} == want
    assert all(delta[i] == 0 for i in spec.dense_layers)
    m = srv.metrics()
    for i in moe:
        assert m[f'moed_expert_imbalance{{layer="{i}"}}'] >= 1.0


def test_token_id_prompts(client):
    ids = [[11, 12, 13, 14], [21, 22]]
    r = client.completions.create(**_greedy(prompt=ids, max_tokens=3),
                                  extra_body={"return_token_ids": True})
    assert [c.prompt_token_ids for c in sorted(r.choices, key=lambda c: c.index)] == ids
    assert r.usage.prompt_tokens == 6


def test_greedy_over_http_equals_engine(client, srv, tiny_qwen3):
    """Acceptance 3: the same prompt through HTTP and through Engine.generate, greedy."""
    from moed import config as mconfig
    from moed.engine.engine import Engine
    from moed.types import SamplingParams

    prompt = "The quick brown fox"
    r = client.completions.create(**_greedy(prompt=prompt, max_tokens=16),
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    cfg = mconfig.load(None, environ={}, overrides={
        "model": {"path": str(tiny_qwen3), "max_model_len": MAX_LEN},
        "engine": {"kv_cache_memory_mb": 16, "num_threads": 1}})
    engine = Engine.from_config(cfg)
    ids = engine.tokenizer.encode(prompt)
    assert r.choices[0].prompt_token_ids == ids
    out = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert r.choices[0].token_ids == out[0]


def test_auth_errors(srv):
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as wrong:     # 401, as OpenAI and vLLM
        bad.completions.create(model="tiny", prompt="x", max_tokens=1)
    assert wrong.value.response.headers["WWW-Authenticate"] == "Bearer"
    req = urllib.request.Request(srv.url + "/v1/models")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=5)
    assert e.value.code == 401
    assert json.loads(e.value.read())["error"]["type"] == "authentication_error"
    assert srv.get("/health")[0] == 200 and srv.get("/ready")[0] == 200


def test_request_logs_carry_request_id_role_node(client, srv):
    client.completions.create(model="tiny", prompt="hello", max_tokens=2,
                              extra_headers={"X-Request-Id": "trace-42"})
    recs = [r for r in srv.log_records() if r.get("request_id") == "trace-42"]
    access = [r for r in recs if r["event"] == "access"]
    assert access and access[0]["status"] == 200 and access[0]["completion_tokens"] == 2
    assert access[0]["role"] == "colocated" and access[0]["node"]
