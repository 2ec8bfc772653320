"""Structured-output fields → one GrammarSpec (moed.api.structured through parse_request): every
field shape OpenAI and vLLM define, conflicts, refusals, and the engine's reason on a bad one."""
from __future__ import annotations

import json

import pytest

from moed.api.errors import APIError
from moed.api.protocol import parse_request
from moed.types import GrammarSpec

CHAT = {"messages": [{"role": "user", "content": "x"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _grammar(extra: dict, chat: bool = True) -> GrammarSpec | None:
    body = {**CHAT, **extra} if chat else {"prompt": "x", **extra}
    return parse_request(body, chat=chat).grammar


def _refused(extra: dict, param: str, chat: bool = True) -> str:
    body = {**CHAT, **extra} if chat else {"prompt": "x", **extra}
    with pytest.raises(APIError) as e:
        parse_request(body, chat=chat)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value.message


def _schema_of(spec: GrammarSpec) -> dict:
    assert spec.kind == "json_schema"
    return json.loads(spec.source)


@pytest.mark.parametrize("chat", [True, False])
def test_response_format_shapes(chat) -> None:
    assert _grammar({"response_format": {"type": "text"}}, chat) is None
    assert _grammar({}, chat) is None
    assert _grammar({"response_format": {"type": "json_object"}}, chat) == \
        GrammarSpec("json_object")
    for strict in (True, False, None):
        js = {"name": "thing_1", "schema": SCHEMA, **({} if strict is None else {"strict": strict})}
        spec = _grammar({"response_format": {"type": "json_schema", "json_schema": js}}, chat)
        assert _schema_of(spec) == SCHEMA      # enforced whether strict or not (as vLLM)


def test_response_format_refusals_name_the_field() -> None:
    rf = lambda **js: {"response_format": {"type": "json_schema", "json_schema": js}}  # noqa: E731
    _refused({"response_format": "json"}, "response_format")
    _refused({"response_format": {"type": "structural_tag"}}, "response_format.type")
    _refused({"response_format": {"type": "json_schema"}}, "response_format.json_schema")
    _refused(rf(schema=SCHEMA), "response_format.json_schema.name")
    _refused(rf(name="has space", schema=SCHEMA), "response_format.json_schema.name")
    _refused(rf(name="x" * 65, schema=SCHEMA), "response_format.json_schema.name")
    _refused(rf(name="t"), "response_format.json_schema.schema")
    _refused(rf(name="t", schema="{}"), "response_format.json_schema.schema")
    _refused(rf(name="t", schema=SCHEMA, strict="yes"), "response_format.json_schema.strict")
    _refused(rf(name="t", schema=SCHEMA, description="a thing"),
             "response_format.json_schema.description")


def test_structured_outputs_shapes() -> None:
    so = lambda **kw: _grammar({"structured_outputs": kw})  # noqa: E731
    assert _schema_of(so(json=SCHEMA)) == SCHEMA
    assert _schema_of(so(json=json.dumps(SCHEMA))) == SCHEMA          # JSON text works too
    assert so(regex=r"\d{3}") == GrammarSpec("regex", r"\d{3}")
    assert so(choice=["a", "b c"]) == GrammarSpec("choice", '["a","b c"]')
    assert so(grammar='start: "x"') == GrammarSpec("lark", 'start: "x"')
    assert so(grammar='root ::= "x" | "y"') == GrammarSpec("lark", 'root ::= "x" | "y"')  # GBNF
    assert so(json_object=True) == GrammarSpec("json_object")
    assert so(regex="a", disable_fallback=True, _backend="guidance") == GrammarSpec("regex", "a")
    # whitespace options travel in the schema's x-guidance (llguidance's options)
    assert _schema_of(so(json=SCHEMA, disable_any_whitespace=True))["x-guidance"] == \
        {"whitespace_flexible": False}
    assert _schema_of(so(json_object=True, whitespace_pattern=" ?")) == \
        {"type": "object", "x-guidance": {"whitespace_pattern": " ?"}}
    nested = {"type": "object", "properties": {"o": {"type": "object", "properties": {}}},
              "additionalProperties": True}
    got = _schema_of(so(json=nested, disable_additional_properties=True))
    assert got["additionalProperties"] is True                      # set by the user: kept
    assert got["properties"]["o"]["additionalProperties"] is False  # unset: false, as vLLM
    assert "additionalProperties" not in nested["properties"]["o"]  # the body is not mutated


def test_structured_outputs_refusals() -> None:
    p = "structured_outputs"
    _refused({p: "regex"}, p)
    _refused({p: {}}, p)
    _refused({p: {"json_object": False}}, p)
    _refused({p: {"regex": "a", "choice": ["a"]}}, f"{p}.choice")
    _refused({p: {"structural_tag": "{}"}}, f"{p}.structural_tag")
    _refused({p: {"regex": "a", "_backend": "xgrammar"}}, f"{p}._backend")
    _refused({p: {"regex": "a", "disable_any_whitespace": "yes"}}, f"{p}.disable_any_whitespace")
    _refused({p: {"json": "{nope"}}, f"{p}.json")
    _refused({p: {"json": [1]}}, f"{p}.json")
    _refused({p: {"choice": []}}, f"{p}.choice")
    _refused({p: {"choice": ["a", 1]}}, f"{p}.choice")
    _refused({p: {"regex": ""}}, f"{p}.regex")
    _refused({p: {"json_object": True, "whitespace_pattern": 3}}, f"{p}.whitespace_pattern")


def test_guided_extras() -> None:
    assert _schema_of(_grammar({"guided_json": SCHEMA}, chat=False)) == SCHEMA
    assert _schema_of(_grammar({"guided_json": json.dumps(SCHEMA)})) == SCHEMA
    assert _grammar({"guided_regex": "[0-9]+"}) == GrammarSpec("regex", "[0-9]+")
    assert _grammar({"guided_choice": ["x", "y"]}, chat=False) == GrammarSpec("choice", '["x","y"]')
    assert _grammar({"guided_grammar": 'start: "a"+'}) == GrammarSpec("lark", 'start: "a"+')
    assert _schema_of(_grammar({"guided_json": SCHEMA, "guided_whitespace_pattern": " "}))[
        "x-guidance"] == {"whitespace_pattern": " "}
    for backend in ("auto", "guidance"):
        assert _grammar({"guided_regex": "a", "guided_decoding_backend": backend}) is not None
    _refused({"guided_regex": "a", "guided_decoding_backend": "xgrammar"},
             "guided_decoding_backend")
    _refused({"guided_regex": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern")
    _refused({"guided_choice": "x"}, "guided_choice")
    _refused({"guided_regex": 5}, "guided_regex")
    _refused({"guided_json": "not json"}, "guided_json")


def test_more_than_one_constraint_is_refused_naming_the_second() -> None:
    msg = _refused({"response_format": {"type": "json_object"}, "guided_regex": "a"},
                   "guided_regex")
    assert "response_format" in msg
    _refused({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "guided_json")
    _refused({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice")
    # a text response_format is no constraint
    assert _grammar({"response_format": {"type": "text"}, "guided_regex": "a"}) == \
        GrammarSpec("regex", "a")


@pytest.fixture(scope="module")
def tok(tiny_qwen3):
    from moed.model.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_qwen3)


def _not_compiled(tok, extra: dict, param: str) -> APIError:
    """Parsing checks shapes only (O(body), on the parse pool); the grammar engine's refusal
    comes from compiling (on the grammar pool), naming the field."""
    from moed.api.structured import compile_checked

    spec = _grammar(extra)
    assert spec is not None and spec.param == param
    with pytest.raises(APIError) as e:
        compile_checked(tok, spec)
    assert e.value.status == 400 and e.value.param == param, (e.value.param, e.value.message)
    return e.value


def test_a_grammar_the_engine_cannot_compile_is_a_400_with_its_reason(tok) -> None:
    e = _not_compiled(tok, {"guided_regex": "(("}, "guided_regex")
    assert "unclosed group" in e.message and e.code is None
    e = _not_compiled(tok, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
        "response_format")
    assert "cannot compile" in e.message
    e = _not_compiled(tok, {"structured_outputs": {"json": {"type": "florp"}}},
                      "structured_outputs")
    assert "florp" in e.message
    e = _not_compiled(tok, {"guided_grammar": "start: undefined_rule"}, "guided_grammar")
    assert "undefined_rule" in e.message


def test_a_grammar_past_the_budget_is_grammar_too_complex_naming_the_field(tok) -> None:
    e = _not_compiled(tok, {"guided_regex": "a{1000}{1000}"}, "guided_regex")
    assert e.code == "grammar_too_complex" and "too complex" in e.message
    props = {f"p{i}": {"type": "string"} for i in range(600)}
    e = _not_compiled(tok, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "t", "schema": {"type": "object", "properties": props}}}}, "response_format")
    assert e.code == "grammar_too_complex" and "max is 2000" in e.message
