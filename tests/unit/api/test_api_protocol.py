"""Request parsing (pure): types, ranges, defaults, unknown fields ignored, context limits."""
from __future__ import annotations

import pytest

from moed.api.errors import APIError
from moed.api.protocol import parse_request, resolve_max_tokens
from moed.types import ContextRule


def _err(body, chat=False) -> APIError:
    with pytest.raises(APIError) as e:
        parse_request(body, chat=chat)
    assert e.value.status == 400
    return e.value


def test_completion_prompt_forms():
    assert parse_request({"prompt": "hi"}, chat=False).prompts == ("hi",)
    assert parse_request({"prompt": ["a", "b"]}, chat=False).prompts == ("a", "b")
    assert parse_request({"prompt": [1, 2]}, chat=False).prompts == ((1, 2),)
    assert parse_request({"prompt": [[1], [2, 3]]}, chat=False).prompts == ((1,), (2, 3))
    for bad in ("", [], [""], [[]], [1, "a"], 3, {"a": 1}, [True], [-1]):
        assert _err({"prompt": bad}).param == "prompt"


def test_aiperf_style_body_is_accepted():
    r = parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                       "max_completion_tokens": 9, "max_tokens": 3, "stream": True,
                       "stream_options": {"include_usage": True}, "ignore_eos": True,
                       "min_tokens": 9, "something_new": {"x": 1}}, chat=True)
    assert r.max_tokens == 9 and r.include_usage and r.ignore_eos and r.min_tokens == 9


def test_sampling_fields_and_seed_offsets():
    r = parse_request({"prompt": "x", "temperature": 0, "top_p": 0.5, "top_k": -1, "seed": 10,
                       "stop": "END", "n": 3, "logprobs": 2}, chat=False)
    sp = r.sampling_params(max_tokens=5, choice=2)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.stop) == (0.0, 0.5, 0, 12, ("END",))
    assert sp.logprobs and sp.max_tokens == 5 and r.n == 3


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "3"), ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", True),
    ("temperature", "x"), ("temperature", -1), ("temperature", float("nan")), ("top_p", 0),
    ("top_k", -2), ("n", 0), ("n", 10_000), ("seed", "1"), ("stop", 5), ("stop", ["a", 1]),
    ("logprobs", 99), ("stream", 1), ("ignore_eos", "yes"), ("return_token_ids", 1),
    ("stream_options", "x"), ("model", 3),
])
def test_wrong_types_and_ranges(field, value):
    err = _err({"prompt": "x", field: value})
    assert err.param == field or field == "stream_options"


def test_chat_messages():
    r = parse_request({"messages": [{"role": "system", "content": "s"},
                                    {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}]},
                      chat=True)
    assert r.messages[1] == {"role": "user", "content": "ab"}
    for bad in (None, [], [{"role": "user"}], [{"role": "wizard", "content": "x"}],
                [{"role": "user", "content": [{"type": "image_url"}]}], ["x"]):
        assert _err({"messages": bad}, chat=True).param == "messages"
    assert _err({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                chat=True).param == "top_logprobs"


def test_include_usage_needs_stream():
    assert _err({"prompt": "x", "stream_options": {"include_usage": True}}).param == \
        "stream_options"


def test_resolve_max_tokens_context_limits():
    comp = parse_request({"prompt": "x"}, chat=False)
    chat = parse_request({"messages": [{"role": "user", "content": "x"}]}, chat=True)
    ctx = ContextRule(100)
    assert resolve_max_tokens(comp, 10, ctx) == 16        # legacy completions default
    assert resolve_max_tokens(chat, 10, ctx) == 90        # chat: the rest of the context
    with pytest.raises(APIError) as e:
        resolve_max_tokens(comp, 100, ctx)
    assert "100" in e.value.message and e.value.code == "context_length_exceeded"
    big = parse_request({"prompt": "x", "max_tokens": 95}, chat=False)
    with pytest.raises(APIError) as e:
        resolve_max_tokens(big, 10, ctx)
    assert e.value.param == "max_tokens" and "105" in e.value.message
    # a node whose whole KV cache is smaller than the model's context: the prompt must fit
    # it; max_tokens is still held to the model's context (generation stops at the KV limit)
    small = ContextRule(100, kv_capacity_tokens=40)
    with pytest.raises(APIError) as e:
        resolve_max_tokens(comp, 40, small)
    assert "KV cache holds 40 tokens" in e.value.message
    assert resolve_max_tokens(chat, 39, small) == 61


# ---- hostile input: lone surrogates, integer ranges, seeds ---------------------------------

LONE = "ok \ud800 tail"   # what json.loads makes of "ok \ud800 tail"


@pytest.mark.parametrize("body,chat,param", [
    ({"prompt": LONE}, False, "prompt"),
    ({"prompt": ["fine", LONE]}, False, "prompt"),
    ({"prompt": "x", "stop": LONE}, False, "stop"),
    ({"prompt": "x", "stop": ["a", LONE]}, False, "stop"),
    ({"prompt": "x", "model": "m\udfff"}, False, "model"),
    ({"messages": [{"role": "user", "content": LONE}]}, True, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}, True,
     "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [LONE]}, True, "stop"),
])
def test_lone_surrogates_are_400_naming_the_field(body, chat, param):
    err = _err(body, chat=chat)
    assert err.param == param and "surrogate" in err.message and "U+D" in err.message


def test_valid_non_ascii_text_passes():
    r = parse_request({"prompt": "héllo 😀 \u2028", "stop": ["é"], "model": "modèle"},
                      chat=False)
    assert r.prompts == ("héllo 😀 \u2028",) and r.stop == ("é",)


def test_seed_range_is_int64_and_refusals_blame_seed():
    for ok in (0, -1, 2**63 - 1, -(2**63), 2.0**62):
        assert parse_request({"prompt": "x", "seed": ok}, chat=False).seed == int(ok)
    for bad in (2**63, -(2**63) - 1, 2**64, 10**30, 10**400, 1.5, float("inf")):
        err = _err({"prompt": "x", "seed": bad})
        assert err.param == "seed"
    # out-of-range values are named, not echoed in full
    assert "a 31-digit number" in _err({"prompt": "x", "seed": 10**30}).message
    assert str(2**64) in _err({"prompt": "x", "seed": 2**64}).message


def test_per_choice_seeds_stay_in_range_and_distinct():
    top = parse_request({"prompt": "x", "seed": 2**63 - 1, "n": 16}, chat=False)
    seeds = [top.sampling_params(max_tokens=1, choice=i).seed for i in range(16)]
    assert seeds[0] == 2**63 - 1 and seeds[1] == -(2**63)           # wraps, never 2**63
    assert len(set(seeds)) == 16 and all(-(2**63) <= s < 2**63 for s in seeds)
    low = parse_request({"prompt": "x", "seed": 5}, chat=False)
    assert [low.sampling_params(1, i).seed for i in range(3)] == [5, 6, 7]
    assert parse_request({"prompt": "x"}, chat=False).sampling_params(1, 3).seed is None


@pytest.mark.parametrize("field,bad,ok", [
    ("max_tokens", 2**24 + 1, 2**24), ("max_completion_tokens", 10**30, 5),
    ("min_tokens", 2**24 + 1, 2**24), ("min_tokens", -1, 0), ("top_k", 2**31 + 1, 2**31),
    ("n", 17, 16), ("logprobs", -1, 0), ("logprobs", 21, 20),
])
def test_every_int_field_has_a_range(field, bad, ok):
    assert _err({"prompt": "x", field: bad}).param == field
    parse_request({"prompt": "x", field: ok}, chat=False)


def test_token_ids_are_bounded_without_and_with_a_vocabulary():
    for bad in ([10**30], [2**31], [-1]):
        assert _err({"prompt": "x", "stop_token_ids": bad}).param == "stop_token_ids"
        assert _err({"prompt": bad}).param == "prompt"
    assert parse_request({"prompt": [2**31 - 1], "stop_token_ids": [2**31 - 1]},
                         chat=False).stop_token_ids == (2**31 - 1,)
    with pytest.raises(APIError) as e:
        parse_request({"prompt": "x", "stop_token_ids": [3, 100]}, chat=False, vocab_size=100)
    assert e.value.param == "stop_token_ids" and "vocabulary" in e.value.message
    with pytest.raises(APIError) as e:
        parse_request({"prompt": [[1], [100]]}, chat=False, vocab_size=100)
    assert e.value.param == "prompt"
    assert parse_request({"prompt": [99], "stop_token_ids": [99]}, chat=False,
                         vocab_size=100).prompts == ((99,),)
    with pytest.raises(APIError) as e:
        parse_request({"messages": [{"role": "user", "content": "x"}],
                       "stop_token_ids": [100]}, chat=True, vocab_size=100)
    assert e.value.param == "stop_token_ids"


# ---- penalties, logit_bias, min_p; refused fields -------------------------------------------

def test_penalties_and_min_p_reach_the_sampling_params():
    r = parse_request({"prompt": "x", "presence_penalty": -2, "frequency_penalty": 1.5,
                       "repetition_penalty": 1.2, "min_p": 0.05,
                       "logit_bias": {"7": 100, "3": -0.5, "03": -0.5}}, chat=False)
    sp = r.sampling_params(max_tokens=4, choice=0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p) == \
        (-2.0, 1.5, 1.2, 0.05)
    assert sp.logit_bias == ((3, -1.0), (7, 100.0)) and sp.penalized
    d = parse_request({"prompt": "x"}, chat=False).sampling_params(max_tokens=4, choice=0)
    assert not d.penalized and d.min_p == 0.0 and d.repetition_penalty == 1.0


@pytest.mark.parametrize("field,bad", [
    ("presence_penalty", 2.01), ("presence_penalty", -3), ("presence_penalty", "1"),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.01),
    ("repetition_penalty", 0), ("repetition_penalty", 2.1), ("repetition_penalty", -1),
    ("min_p", -0.1), ("min_p", 1.01),
    ("logit_bias", [1, 2]), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}),
    ("logit_bias", {"5": 101}), ("logit_bias", {"5": -100.5}), ("logit_bias", {"5": "1"}),
    ("logit_bias", {"5": True}), ("logit_bias", {"1000": 1}),
    ("logit_bias", {str(i): 1 for i in range(301)}),
])
def test_penalty_ranges_are_400s_naming_the_field(field, bad):
    with pytest.raises(APIError) as e:
        parse_request({"prompt": "x", field: bad}, chat=False, vocab_size=1000)
    assert e.value.status == 400 and e.value.param == field


def test_logit_bias_bounds():
    ok = parse_request({"prompt": "x", "logit_bias": {"999": -100, "0": 100}}, chat=False,
                       vocab_size=1000)
    assert ok.logit_bias == ((0, 100.0), (999, -100.0))
    assert len(parse_request({"prompt": "x", "logit_bias": {str(i): 1 for i in range(300)}},
                             chat=False).logit_bias) == 300


_CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("chat,field,value,param", [
    (False, "suffix", "tail", "suffix"),
    (False, "best_of", 3, "best_of"),
    (False, "tools", [{"type": "function", "function": {"name": "f"}}], "tools"),
    (False, "chat_template_kwargs", {"enable_thinking": False}, "chat_template_kwargs"),
    # tools and the chat-template fields are implemented: tests/unit/api/test_tools_parse.py
    # structured outputs are implemented: tests/unit/api/test_structured_parse.py
])
def test_unimplemented_fields_are_refused_by_name(chat, field, value, param):
    body = dict(_CHAT) if chat else {"prompt": "x"}
    body.update({field: value, "stream": True})
    with pytest.raises(APIError) as e:
        parse_request(body, chat=chat)
    assert e.value.status == 400 and e.value.param == param and field in e.value.message


def test_neutral_values_of_refused_fields_pass():
    parse_request({**_CHAT, "tool_choice": "none", "response_format": {"type": "text"},
                   "tools": [], "chat_template_kwargs": {}, "continue_final_message": False,
                   "echo": False, "guided_json": None,
                   "stream": True, "stream_options": {"continuous_usage_stats": False}},
                  chat=True)
    r = parse_request({"prompt": "x", "best_of": 2, "n": 2, "suffix": "", "echo": True},
                      chat=False)
    assert r.n == 2 and r.echo
    parse_request({"prompt": "x", "best_of": 1}, chat=False)
