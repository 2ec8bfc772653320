"""Tool calling and the chat-template fields through the official openai client, against a real
colocated `moed serve` (tiny Qwen3-MoE; one Mixtral check). The random-weight model writes
garbage, so a forced choice is valid only because the grammar makes it so."""
from __future__ import annotations

import json

import openai
import pytest

from moed_server import serve_process

KEY = "sk-test-tools"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                  "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The time"}}
ENV = {"MOED_SERVER_API_KEYS_ENV": "TEST_KEYS", "TEST_KEYS": KEY,
       "MOED_ENGINE_KV_CACHE_MEMORY_MB": "16", "MOED_MODEL_MAX_MODEL_LEN": "1024",
       "MOED_MODEL_SERVED_NAME": "tiny"}


@pytest.fixture(scope="module")
def client(tiny_qwen3, tmp_path_factory):
    with serve_process(model=tiny_qwen3, env=ENV, log_dir=tmp_path_factory.mktemp("srv")) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(client, **kw):
    kw.setdefault("messages", USER)
    return client.chat.completions.create(model="tiny", max_tokens=kw.pop("max_tokens", 4), **kw)


def _valid_call(call, names=("get_weather", "now")) -> dict:
    assert call.type == "function" and call.id and call.function.name in names
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Rome") and args["unit"] in ("C", "F")
    else:
        assert args == {}
    return args


def test_tools_reach_the_template(client):
    plain = _chat(client).usage.prompt_tokens
    with_tools = _chat(client, tools=[WEATHER]).usage.prompt_tokens
    assert with_tools > plain + 30      # the <tools> system block
    thinking_off = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking_off.usage.prompt_tokens > plain


def test_required_always_yields_a_parsable_call(client):
    for seed in range(6):
        r = _chat(client, tools=[WEATHER, CLOCK], tool_choice="required", temperature=1.0,
                  seed=seed, max_tokens=200, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", (seed, ch)
        assert len(ch.message.tool_calls) == 1
        _valid_call(ch.message.tool_calls[0])


def test_named_choice_streamed(client):
    stream = _chat(client, tools=[WEATHER, CLOCK], stream=True, temperature=1.0, seed=3,
                   max_tokens=200, tool_choice={"type": "function",
                                                "function": {"name": "get_weather"}})
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            if tc.id is not None:        # first delta of a call: id, type, name once
                assert tc.index not in calls and tc.type == "function"
                calls[tc.index] = {"name": tc.function.name, "args": tc.function.arguments or ""}
            else:
                assert tc.function.name is None
                calls[tc.index]["args"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    args = json.loads(calls[0]["args"])
    assert args["city"] in ("Paris", "Rome")


def _streamed(client, **kw) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of a streamed chat, deltas put together."""
    content, calls, finish = "", {}, None
    for chunk in _chat(client, stream=True, **kw):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.id is not None:
                calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
            else:
                calls[tc.index][1] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def test_a_call_cut_by_max_tokens_is_the_same_streamed_or_not(client):
    """max_tokens inside <tool_call>: both ways the call with its arguments as far as written
    (OpenAI's answer: tool_calls, finish_reason "length"), never the raw marker text in one and
    tool_calls deltas in the other (docs/api.md, "Tool calls"). Cut before the call's name,
    there is no call to give: the text, both ways."""
    cut_in_arguments = 0
    for max_tokens in range(2, 40, 3):
        kw = dict(tools=[WEATHER], tool_choice="required", temperature=0.0,
                  max_tokens=max_tokens, parallel_tool_calls=False)
        ch = _chat(client, **kw).choices[0]
        whole = (ch.message.content or "",
                 [(c.function.name, c.function.arguments) for c in ch.message.tool_calls or []],
                 ch.finish_reason)
        assert _streamed(client, **kw) == whole, max_tokens
        if whole[1]:                  # (cut before the name was written: text both ways)
            assert "<tool_call>" not in whole[0], max_tokens
        if whole[2] == "length" and whole[1] and whole[1][0][1]:
            with pytest.raises(ValueError):          # cut short: not JSON yet
                json.loads(whole[1][0][1])
            assert whole[1][0][0] == "get_weather"
            cut_in_arguments += 1
    assert cut_in_arguments >= 2          # the sweep did cut inside the arguments


def test_round_trip_call_then_tool_message_then_answer(client):
    r = _chat(client, tools=[WEATHER], tool_choice="required", max_tokens=200, seed=1)
    call = r.choices[0].message.tool_calls[0]
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function",
                    "function": {"name": call.function.name,
                                 "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"}]
    answer = _chat(client, messages=history, tools=[WEATHER], max_tokens=8)
    before = _chat(client, messages=history[:2], tools=[WEATHER])
    ch = answer.choices[0]
    assert ch.finish_reason in ("stop", "length") and ch.message.role == "assistant"
    # the tool response was rendered into the prompt
    assert answer.usage.prompt_tokens > before.usage.prompt_tokens + 5


def test_auto_answers_with_content_or_valid_calls(client):
    r = _chat(client, tools=[WEATHER], max_tokens=16, seed=0)
    m = r.choices[0].message
    assert m.content is not None or m.tool_calls
    for c in m.tool_calls or []:
        json.loads(c.function.arguments)


def test_auto_with_strict_functions_runs_under_the_grammar(client):
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    for seed in range(3):
        r = _chat(client, tools=[strict], max_tokens=24, seed=seed, temperature=1.0)
        ch = r.choices[0]
        assert ch.finish_reason in ("stop", "length", "tool_calls")
        if ch.finish_reason != "length":    # (a cut could end inside a call)
            assert "<tool_call>" not in (ch.message.content or "")   # a call, or no marker
        for call in ch.message.tool_calls or []:
            _valid_call(call)


def test_continue_final_message_with_echo(client):
    msgs = [*USER, {"role": "assistant", "content": "The weather in Paris is"}]
    r = _chat(client, messages=msgs, max_tokens=3, temperature=0.0,
              extra_body={"continue_final_message": True, "add_generation_prompt": False,
                          "echo": True})
    assert r.choices[0].message.content.startswith("The weather in Paris is")
    closed = _chat(client, messages=msgs, extra_body={"add_generation_prompt": False})
    # continuing leaves the last message open: fewer prompt tokens than the closed turn
    assert r.usage.prompt_tokens < closed.usage.prompt_tokens


def test_refusals(client):
    for kw, param in (({"functions": [{"name": "f"}]}, "functions"),
                      ({"continue_final_message": True}, "continue_final_message"),
                      ({"chat_template_kwargs": {"not_in_template": 1}}, "chat_template_kwargs"),
                      ({"tools": [WEATHER], "tool_choice": "required",
                        "response_format": {"type": "json_object"}}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(client, extra_body=kw)
        assert e.value.body["param"] == param, e.value.body


def test_mixtral_required(tiny_mixtral, tmp_path):
    with serve_process(model=tiny_mixtral, env=ENV, log_dir=tmp_path) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        plain = _chat(c).usage.prompt_tokens
        r = _chat(c, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=200, seed=2)
        assert r.usage.prompt_tokens > plain + 30        # [AVAILABLE_TOOLS]
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.tool_calls
        for call in ch.message.tool_calls:
            _valid_call(call)
            assert len(call.id) == 9 and call.id.isalnum()
