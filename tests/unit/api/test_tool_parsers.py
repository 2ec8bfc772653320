"""Tool-call parsers (moed.api.tool_parsers): both families, whole responses and streams split
at every position, malformed calls, the family choice."""
from __future__ import annotations

import json

import pytest

from moed.api import tool_parsers as tp

QWEN = tp.FAMILIES["qwen"]
MISTRAL = tp.FAMILIES["mistral"]


def _stream(fam: tp.Family, pieces: list[str], max_calls: int | None = None):
    """-> (content, [(name, arguments)], ids): the deltas of a stream put back together."""
    st = tp.ToolStream(fam, max_calls)
    content, calls, ids = [], {}, {}
    for piece in [*pieces, None]:
        text, deltas = st.feed(piece) if piece is not None else st.finish()
        content.append(text)
        for d in deltas:
            if d.id is not None:           # a call's first delta: id and name, once
                assert d.index not in calls and d.index == len(calls) and d.name
                calls[d.index], ids[d.index] = [d.name, d.arguments], d.id
            else:
                assert d.name is None and d.index in calls
                calls[d.index][1] += d.arguments
    return "".join(content), [tuple(calls[i]) for i in sorted(calls)], [ids[i] for i in sorted(ids)]


def _whole(fam: tp.Family, text: str, max_calls: int | None = None):
    content, calls = tp.parse(fam, text, max_calls)
    return content, [(c.name, c.arguments) for c in calls]


def _canon(calls):
    return [(n, json.loads(a)) for n, a in calls]


VALID = [
    (QWEN, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
           '"days": [1, {"x": "}]\\"{"}]}}\n</tool_call>\n<tool_call>\n{"name": "now", '
           '"arguments": {}}\n</tool_call>',
     "Let me look.\n\n", [("get_weather", {"city": "Paris", "days": [1, {"x": '}]"{'}]}),
                          ("now", {})]),
    (QWEN, '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call> done',
     " done", [("f", {"a": 1})]),                              # other key order: read whole
    (QWEN, 'plain text with <b>tags</b> and <tool_ but no call', 
     "plain text with <b>tags</b> and <tool_ but no call", []),
    (QWEN, '<tool_call>{"name": "f", "arguments": {"q": "日本"}}', "", [("f", {"q": "日本"})]),
    (MISTRAL, 'Sure [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "x", "arguments": {"a": [1, 2]}}]',
     "Sure ", [("get_weather", {"city": "Paris"}), ("x", {"a": [1, 2]})]),
    (MISTRAL, '[TOOL_CALLS] {"name": "one", "arguments": {"k": true}}', "", [("one", {"k": True})]),
    (MISTRAL, 'no [TOOL_ marker here', "no [TOOL_ marker here", []),
]


@pytest.mark.parametrize("fam,text,content,calls", VALID)
def test_whole_response(fam, text, content, calls):
    got_content, got_calls = _whole(fam, text)
    assert got_content == content and _canon(got_calls) == calls


@pytest.mark.parametrize("fam,text,content,calls", VALID)
def test_stream_equals_whole_at_every_split(fam, text, content, calls):
    for cut in range(len(text) + 1):
        got_content, got_calls, _ = _stream(fam, [text[:cut], text[cut:]])
        assert got_content == content, cut
        assert _canon(got_calls) == calls, cut
    for size in (1, 2, 3, 7):                          # many small deltas
        got_content, got_calls, _ = _stream(fam, [text[i:i + size]
                                                  for i in range(0, len(text), size)])
        assert (got_content, _canon(got_calls)) == (content, calls), size


def test_stream_sends_name_once_then_argument_fragments():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    st = tp.ToolStream(QWEN)
    seen = []
    for c in text:
        seen += st.feed(c)[1]
    first, rest = seen[0], seen[1:]
    assert first.name == "get_weather" and first.id.startswith("call_") and first.arguments == ""
    assert len(rest) > 5 and all(d.id is None and d.name is None for d in rest)
    assert "".join(d.arguments for d in rest) == '{"city": "Paris"}'
    assert st.called


MALFORMED = [
    (QWEN, '<tool_call>\n{"name": get_weather}\n</tool_call>'),        # not JSON
    (QWEN, '<tool_call>\nhello</tool_call>'),                          # no body
    (QWEN, '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'),  # name not a string
    (QWEN, '<tool_call>\n{"arguments": [1], "name": "f"}\n</tool_call>'),
    (QWEN, '<tool_call>\n{"name": "f", "argu'),                        # cut short in the header
    (MISTRAL, '[TOOL_CALLS] hello'),
    (MISTRAL, '[TOOL_CALLS] [{"name": }]'),
]


@pytest.mark.parametrize("fam,text", MALFORMED)
def test_malformed_call_is_content_not_a_crash(fam, text):
    assert _whole(fam, text) == (text, [])
    for cut in range(len(text) + 1):
        assert _stream(fam, [text[:cut], text[cut:]])[:2] == (text, []), cut


def test_malformed_call_then_a_valid_one():
    bad = '<tool_call>\n{"name": f}\n</tool_call> '
    text = bad + '<tool_call>\n{"name": "g", "arguments": {"a": 1}}\n</tool_call>'
    assert _whole(QWEN, text) == (bad, [("g", '{"a": 1}')])
    for cut in range(len(text) + 1):
        content, calls, _ = _stream(QWEN, [text[:cut], text[cut:]])
        assert (content, _canon(calls)) == (bad, [("g", {"a": 1})]), cut


def test_arguments_cut_short_are_the_call_as_far_as_written_both_ways():
    """max_tokens cut the call: fragments already streamed cannot be taken back, so the whole
    response gives the same call with the same partial arguments (OpenAI's answer too)."""
    text = 'Checking.\n<tool_call>\n{"name": "f", "arguments": {"city": "Par'
    assert _whole(QWEN, text) == ("Checking.\n", [("f", '{"city": "Par')])
    assert _stream(QWEN, [text])[:2] == ("Checking.\n", [("f", '{"city": "Par')])
    done = '<tool_call>\n{"name": "f", "arguments": {"a": 1}'        # only the "}" missing
    assert _whole(QWEN, done) == _stream(QWEN, [done])[:2] == ("", [("f", '{"a": 1}')])
    m = '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": '
    assert _whole(MISTRAL, m) == _stream(MISTRAL, [m])[:2] == (
        "", [("a", "{}"), ("b", '{"x": ')])


def _same(calls):
    """Arguments compared as JSON where they are JSON (parse re-serializes a whole body; the
    stream sends the text as written), as text where cut short."""
    out = []
    for name, args in calls:
        try:
            out.append((name, json.loads(args)))
        except ValueError:
            out.append((name, args))
    return out


@pytest.mark.parametrize("fam,text,content,calls", VALID)
def test_every_truncation_streams_to_what_the_whole_response_gives(fam, text, content, calls):
    """Cut anywhere (max_tokens), split anywhere: the stream and the whole response agree."""
    for end in range(len(text) + 1):
        cut = text[:end]
        want_content, want_calls = _whole(fam, cut)
        for size in (1, 3, len(cut) or 1):
            got_content, got_calls, _ = _stream(fam, [cut[i:i + size]
                                                     for i in range(0, len(cut), size)])
            assert (got_content, _same(got_calls)) == (want_content, _same(want_calls)), (
                end, size)


def test_max_calls_keeps_the_first():
    text = ('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
            '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call> tail')
    assert _whole(QWEN, text, max_calls=1) == ("", [("a", "{}")])
    assert _stream(QWEN, [text], max_calls=1)[:2] == ("", [("a", "{}")])
    m = '[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    assert _whole(MISTRAL, m, max_calls=1) == ("", [("a", "{}")])
    assert _stream(MISTRAL, [m], max_calls=1)[:2] == ("", [("a", "{}")])


def test_ids_have_each_familys_shape():
    _, _, qids = _stream(QWEN, ['<tool_call>{"name": "f", "arguments": {}}</tool_call>'])
    _, _, mids = _stream(MISTRAL, ['[TOOL_CALLS] [{"name": "f", "arguments": {}}]'])
    assert qids[0].startswith("call_") and len(qids[0]) == 29
    assert len(mids[0]) == 9 and mids[0].isalnum()      # Mistral templates require 9 alnum
    assert tp.parse(MISTRAL, '[TOOL_CALLS] [{"name": "f", "arguments": {}}]')[1][0].id.isalnum()


def test_arguments_written_as_a_json_string_are_read():
    text = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert _whole(QWEN, text) == ("", [("f", '{"a": 1}')])


def test_family_choice():
    assert tp.choose("auto", "... <tool_call> ...", None) is QWEN
    assert tp.choose("auto", "... [TOOL_CALLS] ...", "qwen3_moe") is MISTRAL   # template first
    assert tp.choose("auto", "plain", "mixtral") is MISTRAL
    assert tp.choose("auto", None, "qwen3_moe") is QWEN
    assert tp.choose("auto", "plain", "llama") is None
    assert tp.choose("mistral", "<tool_call>", "qwen3") is MISTRAL            # config wins
    assert tp.choose("none", "<tool_call>", "qwen3") is None
    with pytest.raises(ValueError, match="tool parser"):
        tp.choose("hermes", None, None)


def test_config_lists_the_parser_settings():
    from moed import config
    assert config.TOOL_PARSERS == tp.PARSER_SETTINGS
    assert config.ModelConfig().tool_parser == "auto"
    with pytest.raises(config.ConfigError, match="model.tool_parser"):
        config.ModelConfig(tool_parser="hermes")
