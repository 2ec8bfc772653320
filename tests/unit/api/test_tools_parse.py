"""Tool calling and the chat-template fields (moed.api.tools): parsing and refusals, binding to
a real checkpoint's tokenizer, the forced-choice grammar (checked with llguidance itself), the
template rendering and the output message/deltas."""
from __future__ import annotations

import json

import llguidance as llg
import pytest

from moed.api.errors import APIError
from moed.api.protocol import parse_request
from moed.api.tools import ChatOutput, bind, tool_grammar, template_args
from moed.api import tool_parsers as tp
from moed.model.tokenizer import Tokenizer
from moed.types import GrammarSpec

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "now"}}


def _chat(**kw):
    return parse_request({"messages": kw.pop("messages", USER), **kw}, chat=True)


def _refused(param: str, **kw) -> str:
    with pytest.raises(APIError) as e:
        _chat(**kw)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    return e.value.message


# ---- parsing ---------------------------------------------------------------------------------

def test_tools_and_choices_parse():
    r = _chat(tools=[WEATHER, TIME])
    assert r.tools.choice == "auto" and [t["function"]["name"] for t in r.tools.tools] == \
        ["get_weather", "now"]
    assert _chat(tools=[WEATHER], tool_choice="none").tools.choice == "none"
    assert _chat(tools=[WEATHER], tool_choice="required").tools.forced
    named = _chat(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                      "function": {"name": "now"}}).tools
    assert (named.choice, named.name, named.max_calls) == ("function", "now", 1)
    assert _chat(tools=[WEATHER], parallel_tool_calls=False).tools.max_calls == 1
    assert _chat(tools=[WEATHER]).tools.max_calls is None
    assert _chat().tools is None and _chat(tool_choice="none").tools is None
    assert _chat(tools=[]).tools is None


@pytest.mark.parametrize("kw,param,says", [
    ({"tools": {"a": 1}}, "tools", "list"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "name"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools",
     "parameters"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice", "not in 'tools'"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools",
     "strict"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
    ({"function_call": "auto"}, "function_call", "tools"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "object"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "tools"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt", "boolean"),
])
def test_refusals_name_the_field(kw, param, says):
    assert says in _refused(param, **kw)


def test_strict_is_accepted_where_a_grammar_enforces_it():
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    assert _chat(tools=[strict], tool_choice="required").tools.tools[0]["function"]["strict"]


def test_tool_fields_on_completions_are_refused():
    for field, value in (("tools", [WEATHER]), ("tool_choice", "required"),
                         ("chat_template_kwargs", {"enable_thinking": False})):
        with pytest.raises(APIError) as e:
            parse_request({"prompt": "x", field: value}, chat=False)
        assert e.value.param == field and "chat" in e.value.message


def test_history_tool_calls_and_tool_messages():
    msgs = [*USER,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22C", "name": "get_weather"}]
    r = _chat(messages=msgs)
    assert r.messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert r.messages[2] == {"role": "tool", "content": "22C", "tool_call_id": "call_1",
                             "name": "get_weather"}
    bad_args = [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    assert "arguments" in _refused("messages", messages=bad_args)
    assert "tool_call_id" in _refused("messages", messages=[*USER, {"role": "tool",
                                                                    "content": "x"}])
    assert "assistant" in _refused("messages", messages=[{"role": "user", "content": "x",
                                                          "tool_calls": []}])
    only_calls = [{"role": "assistant", "content": None, "tool_calls": msgs[1]["tool_calls"]}]
    assert _chat(messages=only_calls).messages[0]["tool_calls"]    # calls count as content


# ---- binding and the template ----------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_tok(tiny_qwen3):
    return Tokenizer.from_dir(tiny_qwen3)


@pytest.fixture(scope="module")
def mistral_tok(tiny_mixtral):
    return Tokenizer.from_dir(tiny_mixtral)


def _render(tok, req) -> str:
    return tok.apply_chat_template(list(req.messages), **template_args(req))


def test_bind_chooses_the_family_and_leaves_auto_unconstrained(qwen_tok, mistral_tok):
    assert bind(_chat(tools=[WEATHER]), qwen_tok, "auto").tools.family == "qwen"
    assert bind(_chat(tools=[WEATHER]), mistral_tok, "auto").tools.family == "mistral"
    assert bind(_chat(tools=[WEATHER]), qwen_tok, "auto").grammar is None
    assert bind(_chat(tools=[WEATHER], tool_choice="none"), qwen_tok, "auto").tools.family == ""
    with pytest.raises(APIError, match="model.tool_parser") as e:
        bind(_chat(tools=[WEATHER]), qwen_tok, "none")
    assert e.value.param == "tools"
    # "none" needs no parser: the tools are only rendered
    assert bind(_chat(tools=[WEATHER], tool_choice="none"), qwen_tok, "none").tools is not None


def test_bind_refuses_forced_choice_with_structured_output(qwen_tok):
    from dataclasses import replace
    req = replace(_chat(tools=[WEATHER], tool_choice="required"),
                  grammar=GrammarSpec("json_object"))
    with pytest.raises(APIError) as e:
        bind(req, qwen_tok, "auto")
    assert e.value.param == "tool_choice" and "response_format" in e.value.message


def test_template_kwargs_must_be_template_variables(qwen_tok, mistral_tok):
    on = _render(qwen_tok, bind(_chat(chat_template_kwargs={"enable_thinking": False}),
                                qwen_tok, "auto"))
    assert on.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert _render(qwen_tok, _chat()).endswith("<|im_start|>assistant\n")
    with pytest.raises(APIError) as e:     # Mixtral's template has no enable_thinking
        bind(_chat(chat_template_kwargs={"enable_thinking": False}), mistral_tok, "auto")
    assert e.value.param == "chat_template_kwargs" and "enable_thinking" in e.value.message


def test_tools_reach_the_template(qwen_tok, mistral_tok):
    for tok, marker in ((qwen_tok, "<tools>"), (mistral_tok, "[AVAILABLE_TOOLS]")):
        plain, with_tools = _render(tok, _chat()), _render(tok, _chat(tools=[WEATHER]))
        assert marker not in plain and marker in with_tools
        assert '"get_weather"' in with_tools and '"enum": ["Paris", "Rome"]' in with_tools
        assert len(tok.encode(with_tools)) > len(tok.encode(plain))


def test_a_tool_round_trip_renders(qwen_tok, mistral_tok):
    msgs = [*USER,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "abcdefghi", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "abcdefghi", "content": "22C"}]
    q = _render(qwen_tok, _chat(messages=msgs, tools=[WEATHER]))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        '<|im_end|>\n<|im_start|>user\n<tool_response>\n22C\n</tool_response><|im_end|>\n' \
        '<|im_start|>assistant\n' in q
    m = _render(mistral_tok, _chat(messages=msgs, tools=[WEATHER]))
    assert '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": ' \
        '"abcdefghi"}]</s>[TOOL_RESULTS] {"content": "22C", "call_id": "abcdefghi"}' \
        '[/TOOL_RESULTS]' in m


def test_continue_final_message_and_add_generation_prompt(qwen_tok):
    msgs = [*USER, {"role": "assistant", "content": "It is sunny and"}]
    cont = _render(qwen_tok, _chat(messages=msgs, continue_final_message=True,
                                   add_generation_prompt=False))
    assert cont.endswith("<|im_start|>assistant\nIt is sunny and")
    closed = _render(qwen_tok, _chat(messages=msgs, add_generation_prompt=False))
    assert closed.endswith("It is sunny and<|im_end|>\n")
    assert _render(qwen_tok, _chat(messages=msgs)).endswith("<|im_start|>assistant\n")


# ---- the forced-choice grammar, checked by llguidance ----------------------------------------

def _accepts(tok_dir, grammar: GrammarSpec, text: str) -> bool:
    tok = llg.LLTokenizer(str(tok_dir / "tokenizer.json"))
    g = llg.LLMatcher.grammar_from_lark(grammar.source)
    is_err, msgs = llg.LLMatcher.validate_grammar_with_warnings(g, tok)
    assert not is_err, msgs
    m = llg.LLMatcher(tok, g)
    ids = tok.tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_tool_grammar_qwen(tiny_qwen3):
    required = tool_grammar(tp.FAMILIES["qwen"], _chat(tools=[WEATHER, TIME],
                                                         tool_choice="required").tools)
    assert required.kind == "lark"
    w = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    t = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert _accepts(tiny_qwen3, required, w)
    assert _accepts(tiny_qwen3, required, t + "\n" + w)                   # parallel calls
    assert not _accepts(tiny_qwen3, required, w.replace("Paris", "Berlin"))   # the schema
    assert not _accepts(tiny_qwen3, required, w.replace("get_weather", "get_time"))
    assert not _accepts(tiny_qwen3, required, "I will not call anything.")
    assert not _accepts(tiny_qwen3, required, w.replace('", "', '","'))   # the family's shape
    named = tool_grammar(tp.FAMILIES["qwen"], _chat(
        tools=[WEATHER, TIME], tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}}).tools)
    assert _accepts(tiny_qwen3, named, w)
    assert not _accepts(tiny_qwen3, named, t)
    assert not _accepts(tiny_qwen3, named, w + "\n" + w)                  # exactly one call


def test_tool_grammar_mistral(tiny_mixtral):
    g = tool_grammar(tp.FAMILIES["mistral"], _chat(tools=[WEATHER, TIME],
                                                     tool_choice="required").tools)
    one = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert _accepts(tiny_mixtral, g, f"[TOOL_CALLS] [{one}]")
    assert _accepts(tiny_mixtral, g, f'[TOOL_CALLS] [{one}, {{"name": "now", "arguments": {{}}}}]')
    assert not _accepts(tiny_mixtral, g, f"[TOOL_CALLS] {one}")
    assert not _accepts(tiny_mixtral, g, "no calls")


def test_tool_grammar_hoists_schema_definitions(tiny_qwen3):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"u": {"$ref": "#/$defs/unit"}}, "required": ["u"],
        "additionalProperties": False, "$defs": {"unit": {"enum": ["C", "F"]}}}}}
    g = tool_grammar(tp.FAMILIES["qwen"], _chat(tools=[tool], tool_choice="required").tools)
    ok = '<tool_call>\n{"name": "f", "arguments": {"u": "C"}}\n</tool_call>'
    assert _accepts(tiny_qwen3, g, ok) and not _accepts(tiny_qwen3, g, ok.replace('"C"', '"K"'))


# ---- output ------------------------------------------------------------------------------------

def _bound(**kw):
    from dataclasses import replace
    req = _chat(**kw)
    return replace(req, tools=replace(req.tools, family="qwen")) if req.tools else req


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_message_with_calls():
    out = ChatOutput(_bound(tools=[WEATHER]))
    msg, called = out.message(CALL)
    assert called and msg["content"] is None and msg["role"] == "assistant"
    (c,) = msg["tool_calls"]
    assert c["type"] == "function" and c["id"].startswith("call_")
    assert c["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert out.finish_reason("stop", called) == "tool_calls"
    assert out.finish_reason("length", called) == "length"
    assert ChatOutput(_bound(tools=[WEATHER])).message("no call") == (
        {"role": "assistant", "content": "no call"}, False)


def test_tool_choice_none_does_not_parse():
    out = ChatOutput(_chat(tools=[WEATHER], tool_choice="none"))
    assert out.message(CALL) == ({"role": "assistant", "content": CALL}, False)


def test_stream_deltas_in_openai_shape():
    out = ChatOutput(_bound(tools=[WEATHER]))
    pieces = ["Sure.", "\n<tool_", "call>\n{\"name\": \"get_weather\", ", "\"arguments\": {\"ci",
              "ty\": \"Paris\"}}\n</tool_call>"]
    deltas = [out.delta(p, i == 0, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert deltas[0] == {"role": "assistant", "content": "Sure."}
    assert deltas[1] == {"content": "\n"}                   # "<tool_" held back
    head = deltas[3]["tool_calls"][0]
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
    assert head["function"]["name"] == "get_weather" and "content" not in deltas[3]
    args = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []))
    assert json.loads(args) == {"city": "Paris"}
    assert out.finish_reason("stop") == "tool_calls"


def test_chat_echo_prepends_the_assistant_message():
    msgs = [*USER, {"role": "assistant", "content": "It is"}]
    req = _chat(messages=msgs, echo=True, continue_final_message=True,
                add_generation_prompt=False)
    assert ChatOutput(req).message(" sunny")[0]["content"] == "It is sunny"
    out = ChatOutput(req)
    assert out.delta(" sunny", True, False) == {"role": "assistant", "content": "It is sunny"}
    assert out.delta(".", False, True) == {"content": "."}
    # echo with a last message that is not the assistant's adds nothing (as vLLM)
    assert ChatOutput(_chat(echo=True)).message("x")[0]["content"] == "x"


def test_parallel_tool_calls_false_keeps_one_call(tiny_qwen3):
    two = CALL + "\n" + CALL.replace("Paris", "Rome")
    assert len(ChatOutput(_bound(tools=[WEATHER])).message(two)[0]["tool_calls"]) == 2
    one = ChatOutput(_bound(tools=[WEATHER], parallel_tool_calls=False)).message(two)[0]
    assert [json.loads(c["function"]["arguments"]) for c in one["tool_calls"]] == \
        [{"city": "Paris"}]
    g = tool_grammar(tp.FAMILIES["qwen"], _chat(tools=[WEATHER], tool_choice="required",
                                                  parallel_tool_calls=False).tools)
    assert _accepts(tiny_qwen3, g, CALL) and not _accepts(tiny_qwen3, g, two)


def test_a_schema_the_engine_cannot_compile_is_a_400_naming_tools(qwen_tok):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"d": {"type": "string", "format": "no-such-format"}}}}}
    from moed.api.structured import compile_checked

    spec = bind(_chat(tools=[bad], tool_choice="required"), qwen_tok, "auto").grammar
    assert spec.param == "tools"        # compiled (and refused) on the grammar pool
    with pytest.raises(APIError) as e:
        compile_checked(qwen_tok, spec)
    assert e.value.param == "tools" and "grammar engine" in e.value.message
    assert bind(_chat(tools=[bad]), qwen_tok, "auto").tools.family == "qwen"   # auto: no grammar


def test_markers_that_are_tokens_are_forced_as_those_tokens(tiny_qwen3, tmp_path):
    """Qwen3's vocabulary holds <tool_call> and </tool_call> as added tokens, which llguidance
    never matches by their text: the grammar names them by id."""
    from tokenizers import AddedToken, Tokenizer as HF
    hf = HF.from_file(str(tiny_qwen3 / "tokenizer.json"))
    hf.add_tokens([AddedToken(m, special=False, normalized=False)
                   for m in ("<tool_call>", "</tool_call>")])
    (tmp_path / "tokenizer.json").write_text(hf.to_str())
    req = _chat(tools=[WEATHER], tool_choice="required").tools
    g = tool_grammar(tp.FAMILIES["qwen"], req, hf.token_to_id)
    assert f"<[{hf.token_to_id('<tool_call>')}]>" in g.source
    assert _accepts(tmp_path, g, CALL)
    assert not _accepts(tmp_path, tool_grammar(tp.FAMILIES["qwen"], req), CALL)   # by text


STRICT = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


def test_strict_functions_under_auto_constrain_calls_not_text(tiny_qwen3, tiny_mixtral,
                                                              tmp_path):
    req = _chat(tools=[STRICT, TIME]).tools
    assert req.choice == "auto" and req.constrained and not req.forced
    g = tool_grammar(tp.FAMILIES["qwen"], req)
    now = '<tool_call>\n{"name": "now", "arguments": {"any": [1]}}\n</tool_call>'   # not strict
    for ok in ("Just text, no call.", "", "Let me check.\n" + CALL, CALL + "\n" + now):
        assert _accepts(tiny_qwen3, g, ok), ok
    for bad in ("Let me check.\n" + CALL.replace("Paris", "Berlin"),     # the strict schema
                "x <tool_call>\nnot json\n</tool_call>", CALL + " and more text"):
        assert not _accepts(tiny_qwen3, g, bad), bad
    m = tool_grammar(tp.FAMILIES["mistral"], req)
    one = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    assert _accepts(tiny_mixtral, m, "Sure. " + one) and _accepts(tiny_mixtral, m, "plain")
    assert not _accepts(tiny_mixtral, m, "Sure. " + one.replace("Rome", "Oslo"))
    # markers that are tokens: the text before them is free, the call still strict
    from tokenizers import AddedToken, Tokenizer as HF
    hf = HF.from_file(str(tiny_qwen3 / "tokenizer.json"))
    hf.add_tokens([AddedToken(x, special=False, normalized=False)
                   for x in ("<tool_call>", "</tool_call>")])
    (tmp_path / "tokenizer.json").write_text(hf.to_str())
    gt = tool_grammar(tp.FAMILIES["qwen"], req, hf.token_to_id)
    assert _accepts(tmp_path, gt, "Let me check.\n" + CALL) and _accepts(tmp_path, gt, "text")
    assert not _accepts(tmp_path, gt, "Let me check.\n" + CALL.replace("Paris", "Berlin"))


def test_strict_with_structured_output_is_refused(qwen_tok):
    from dataclasses import replace
    req = replace(_chat(tools=[STRICT]), grammar=GrammarSpec("json_object"))
    with pytest.raises(APIError) as e:
        bind(req, qwen_tok, "auto")
    assert e.value.param == "tools" and "strict" in e.value.message
    assert bind(_chat(tools=[STRICT]), qwen_tok, "auto").grammar.kind == "lark"


def test_a_marker_that_is_a_special_token_turns_skip_special_tokens_off(tiny_mixtral, tmp_path):
    """Real Mistral tokenizers make [TOOL_CALLS] a special token, which the output text drops by
    default: bind keeps special tokens in the text so the calls can be read (as vLLM does);
    tests/unit/api/test_skip_special.py has the rest."""
    import shutil
    from tokenizers import AddedToken, Tokenizer as HF
    for f in tiny_mixtral.iterdir():
        if f.is_file() and f.suffix == ".json":
            shutil.copy(f, tmp_path / f.name)
    hf = HF.from_file(str(tmp_path / "tokenizer.json"))
    hf.add_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    (tmp_path / "tokenizer.json").write_text(hf.to_str())
    tok = Tokenizer.from_dir(tmp_path)
    r = bind(_chat(tools=[WEATHER]), tok, "auto")
    assert r.tools.family == "mistral" and r.skip_special_tokens is False
    assert r.sampling_params(8, 0).skip_special_tokens is False
    none = bind(_chat(tools=[WEATHER], tool_choice="none"), tok, "auto")   # not parsed
    assert none.tools is not None and none.sampling_params(8, 0).skip_special_tokens
