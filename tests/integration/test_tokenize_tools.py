"""/tokenize with a chat body that carries tools and the template fields, against a real
colocated `moed serve` (tiny Qwen3-MoE): the count is the chat completion's prompt_tokens for
the same body, and what /tokenize does not apply is refused by name."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from moed_server import serve_process

KEY = "sk-test-tokenize"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ENV = {"MOED_SERVER_API_KEYS_ENV": "TEST_KEYS", "TEST_KEYS": KEY,
       "MOED_ENGINE_KV_CACHE_MEMORY_MB": "16", "MOED_MODEL_MAX_MODEL_LEN": "1024",
       "MOED_MODEL_SERVED_NAME": "tiny"}
CALLED = [*USER, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"}]


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    with serve_process(model=tiny_qwen3, env=ENV, log_dir=tmp_path_factory.mktemp("srv")) as s:
        yield s.url, openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0,
                                   timeout=120)


def _tokenize(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url + "/tokenize", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


BODIES = {
    "plain": {"messages": USER},
    "tools": {"messages": USER, "tools": [WEATHER]},
    "history": {"messages": CALLED, "tools": [WEATHER]},
    "kwargs": {"messages": USER, "tools": [WEATHER],
               "chat_template_kwargs": {"enable_thinking": False}},
    "continue": {"messages": [*USER, {"role": "assistant", "content": "In Paris it is"}],
                 "add_generation_prompt": False, "continue_final_message": True},
}


def test_count_equals_the_chat_completions_prompt_tokens(server):
    url, client = server
    counts = {}
    for name, body in BODIES.items():
        status, tok = _tokenize(url, {"model": "tiny", **body})
        assert status == 200, (name, tok)
        extra = {k: v for k, v in body.items() if k not in ("messages", "tools")}
        r = client.chat.completions.create(model="tiny", messages=body["messages"],
                                           tools=body.get("tools", openai.NOT_GIVEN),
                                           max_tokens=1, extra_body=extra)
        assert tok["count"] == len(tok["tokens"]) == r.usage.prompt_tokens, name
        counts[name] = tok["count"]
    # each field changed the prompt, as its definition predicts
    assert counts["tools"] > counts["plain"] + 30            # the <tools> system block
    assert counts["history"] > counts["tools"]
    assert counts["kwargs"] > counts["tools"]                 # the empty <think> block
    assert counts["continue"] < _tokenize(url, {**BODIES["continue"],
                                                "continue_final_message": False})[1]["count"]


@pytest.mark.parametrize("body,param", [
    ({"messages": USER, "tool_choice": "auto"}, "tool_choice"),      # shapes the output only
    ({"prompt": "x", "tools": [WEATHER]}, "tools"),
    ({"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
    ({"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"messages": USER, "chat_template_kwargs": {"not_read": 1}}, "chat_template_kwargs"),
    ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
])
def test_refusals_name_the_field(server, body, param):
    status, out = _tokenize(server[0], body)
    assert status == 400 and out["error"]["param"] == param, out
