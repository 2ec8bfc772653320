"""Penalties, logit_bias and refused fields through the official openai client, against a real
colocated `moed serve` (tiny Qwen3-MoE)."""
from __future__ import annotations

from collections import Counter

import openai
import pytest

from moed_server import serve_process

KEY = "sk-test-sampling"
N = 30


@pytest.fixture(scope="module")
def client(tiny_qwen3, tmp_path_factory):
    env = {"MOED_SERVER_API_KEYS_ENV": "TEST_KEYS", "TEST_KEYS": KEY,
           "MOED_ENGINE_KV_CACHE_MEMORY_MB": "16", "MOED_MODEL_MAX_MODEL_LEN": "256",
           "MOED_MODEL_SERVED_NAME": "tiny"}
    with serve_process(model=tiny_qwen3, env=env,
                       log_dir=tmp_path_factory.mktemp("srv")) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _greedy(client, **extra) -> tuple[list[int], list[int]]:
    """-> (prompt token ids, the N greedy output token ids)."""
    kw = {k: extra.pop(k) for k in ("frequency_penalty", "presence_penalty", "logit_bias")
          if k in extra}
    r = client.completions.create(model="tiny", prompt="The cat sat on the", max_tokens=N,
                                  temperature=0.0, **kw,
                                  extra_body={"return_token_ids": True, "ignore_eos": True,
                                              **extra})
    ch = r.choices[0]
    assert len(ch.token_ids) == N
    return list(ch.prompt_token_ids), list(ch.token_ids)


def _repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


def test_frequency_penalty_changes_greedy_output_and_repeats_less(client):
    _, plain = _greedy(client)
    _, again = _greedy(client)
    assert plain == again                               # greedy is deterministic
    _, pen = _greedy(client, frequency_penalty=2.0)
    assert pen != plain
    assert _repeats(pen) < _repeats(plain)
    assert max(Counter(pen).values()) <= max(Counter(plain).values())


def test_repetition_penalty_is_applied(client):
    _, plain = _greedy(client)
    _, pen = _greedy(client, repetition_penalty=2.0)
    assert pen != plain and _repeats(pen) <= _repeats(plain)


def test_logit_bias_forces_and_removes_tokens(client):
    prompt, plain = _greedy(client)
    t = next(x for x in prompt if x not in plain)
    _, forced = _greedy(client, logit_bias={str(t): 100})
    assert forced == [t] * N
    first = plain[0]
    _, banned = _greedy(client, logit_bias={str(first): -100})
    assert first not in banned


@pytest.mark.parametrize("chat,extra,param", [
    (False, {"suffix": "tail"}, "suffix"),
    (False, {"best_of": 2}, "best_of"),
    # structured outputs are applied (tests/integration/test_structured_outputs.py); what the
    # grammar engine cannot compile, or a malformed constraint, is refused with its reason:
    (False, {"guided_regex": "(a"}, "guided_regex"),
    (False, {"guided_grammar": "root ::= 'a'"}, "guided_grammar"),     # GBNF wants "a"
    # tools and the chat-template fields are applied (tests/integration/test_tool_calling.py);
    # what is still refused:
    (True, {"chat_template_kwargs": {"not_in_the_template": 1}}, "chat_template_kwargs"),
    (True, {"continue_final_message": True}, "continue_final_message"),   # + generation prompt
    (True, {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    (True, {"tool_choice": "required"}, "tool_choice"),                   # without tools
    (True, {"functions": [{"name": "f"}]}, "functions"),
    (True, {"response_format": {"type": "xml"}}, "response_format.type"),
    (True, {"guided_json": "{not json"}, "guided_json"),
    (True, {"guided_choice": []}, "guided_choice"),
    (True, {"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),   # two constraints
    (False, {"frequency_penalty": 2.5}, "frequency_penalty"),
    (False, {"presence_penalty": -2.5}, "presence_penalty"),
    (False, {"repetition_penalty": 0}, "repetition_penalty"),
    (False, {"min_p": 1.5}, "min_p"),
    (False, {"logit_bias": {"10000000": 1}}, "logit_bias"),
    (False, {"logit_bias": {"5": 200}}, "logit_bias"),
])
def test_refused_fields_answer_400_naming_them(client, chat, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        if chat:
            client.chat.completions.create(model="tiny", max_tokens=2,
                                           messages=[{"role": "user", "content": "hi"}],
                                           extra_body=extra)
        else:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=extra)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body


def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_and_detokenize_agree_with_serving(client):
    """/tokenize gives the ids the completion was served with; /detokenize reverses them
    (the real checkpoint tokenizer, through the real server and its API key)."""
    prompt_ids, _ = _greedy(client)
    base = str(client.base_url).rstrip("/").removesuffix("/v1")
    auth = {"Authorization": f"Bearer {KEY}"}
    status, body = _post(base + "/tokenize", {"model": "tiny", "prompt": "The cat sat on the"},
                         auth)
    assert status == 200 and body["tokens"] == prompt_ids and body["max_model_len"] == 256
    status, body = _post(base + "/detokenize", {"tokens": prompt_ids}, auth)
    assert status == 200 and body["prompt"].endswith("The cat sat on the")
    assert _post(base + "/tokenize", {"prompt": "x"})[0] == 401
