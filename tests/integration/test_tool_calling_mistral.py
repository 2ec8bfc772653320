"""Tool calling on a Mistral checkpoint whose [TOOL_CALLS] is a special token (as in real
Mistral tokenizers), through the official openai client against a real colocated `moed serve`,
and skip_special_tokens shown and hidden. moed.dev.checkpoint writes [TOOL_CALLS] as plain text, so
the fixture makes it special: the tiny tokenizer's last merge gives up its id to it (the model's
vocabulary size stays the same)."""
from __future__ import annotations

import json
import shutil

import openai
import pytest

from moed_server import serve_process

KEY = "sk-test-mistral"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time"}}
ENV = {"MOED_SERVER_API_KEYS_ENV": "TEST_KEYS", "TEST_KEYS": KEY,
       "MOED_ENGINE_KV_CACHE_MEMORY_MB": "16", "MOED_MODEL_MAX_MODEL_LEN": "1024",
       "MOED_MODEL_SERVED_NAME": "tiny"}
MARKER = "[TOOL_CALLS]"


def _special_marker_checkpoint(src, dst) -> int:
    """Copy src to dst with MARKER as a special token in place of the last BPE merge's
    product; -> its id."""
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    d = json.loads((dst / "tokenizer.json").read_text())
    model = d["model"]
    last = model["merges"].pop()
    product = "".join(last) if isinstance(last, list) else last.replace(" ", "")
    tid = model["vocab"].pop(product)
    assert not any(product in (m if isinstance(m, list) else m.split(" "))
                   for m in model["merges"])        # no other merge builds on it
    model["vocab"][MARKER] = tid
    d["added_tokens"].append({"id": tid, "content": MARKER, "single_word": False,
                              "lstrip": False, "rstrip": False, "normalized": False,
                              "special": True})
    (dst / "tokenizer.json").write_text(json.dumps(d))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"][str(tid)] = {"content": MARKER, "special": True}
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tid


@pytest.fixture(scope="module")
def server(tiny_mixtral, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("mistral-special")
    tid = _special_marker_checkpoint(tiny_mixtral, ckpt)
    with serve_process(model=ckpt, env=ENV, log_dir=tmp_path_factory.mktemp("srv")) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0,
                            timeout=120), tid


def _chat(client, **kw):
    kw.setdefault("messages", USER)
    return client.chat.completions.create(model="tiny", max_tokens=kw.pop("max_tokens", 4), **kw)


def _valid(call) -> None:
    assert call.type == "function" and len(call.id) == 9 and call.id.isalnum()
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Rome")
    else:
        assert call.function.name == "now" and args == {}


def test_required_yields_parsable_calls(server):
    client, _ = server
    for seed in range(3):
        r = _chat(client, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=200,
                  seed=seed, temperature=1.0, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, (seed, ch)
        assert MARKER not in (ch.message.content or "")
        for call in ch.message.tool_calls:
            _valid(call)


def test_required_streamed(server):
    client, _ = server
    stream = _chat(client, tools=[WEATHER], stream=True, max_tokens=200, seed=4,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args, names, finish, content = "", [], None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.id is not None:
                names.append(tc.function.name)
            args += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and names == ["get_weather"] and MARKER not in content
    assert json.loads(args)["city"] in ("Paris", "Rome")


def test_skip_special_tokens_shows_and_hides_special_tokens(server):
    client, tid = server
    forced = {"logit_bias": {str(tid): 100}, "temperature": 0, "max_tokens": 3}
    hidden = client.completions.create(model="tiny", prompt="Hello", **forced)
    shown = client.completions.create(model="tiny", prompt="Hello", **forced,
                                      extra_body={"skip_special_tokens": False,
                                                  "return_token_ids": True})
    assert shown.choices[0].token_ids == [tid] * 3
    assert hidden.choices[0].text == "" and shown.choices[0].text == MARKER * 3
    chat = _chat(client, **forced, extra_body={"skip_special_tokens": False})
    assert chat.choices[0].message.content == MARKER * 3
    assert _chat(client, **forced).choices[0].message.content == ""


def test_refusals(server):
    client, _ = server
    for kw, param in (({"tools": [WEATHER], "skip_special_tokens": True}, "skip_special_tokens"),
                      ({"skip_special_tokens": False, "spaces_between_special_tokens": False},
                       "spaces_between_special_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, extra_body=kw)
        assert e.value.body["param"] == param, e.value.body
