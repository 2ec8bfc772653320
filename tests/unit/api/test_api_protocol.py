"""Request parsing (pure): types, ranges, defaults, unknown fields ignored, context limits."""
from __future__ import annotations

import pytest

from moed.api.errors import APIError
from moed.api.protocol import parse_request, resolve_max_tokens


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
    assert resolve_max_tokens(comp, 10, 100) == 16        # legacy completions default
    assert resolve_max_tokens(chat, 10, 100) == 90        # chat: the rest of the context
    with pytest.raises(APIError) as e:
        resolve_max_tokens(comp, 100, 100)
    assert "100" in e.value.message and e.value.code == "context_length_exceeded"
    big = parse_request({"prompt": "x", "max_tokens": 95}, chat=False)
    with pytest.raises(APIError) as e:
        resolve_max_tokens(big, 10, 100)
    assert e.value.param == "max_tokens" and "105" in e.value.message
