"""Structured outputs: the request fields that constrain the output, parsed into one GrammarSpec.

Accepted, as OpenAI and vLLM define them (pure: no I/O; runs in the parser's offload thread):

- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON
  object), {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (output valid
  for the schema; enforced whether `strict` is true or not — stricter than OpenAI's best effort
  without it, as vLLM does).
- vLLM's `structured_outputs`: exactly one of `json` (a schema), `regex`, `choice` (a list of
  strings), `grammar` (Lark or GBNF), `json_object: true`; with `disable_any_whitespace`,
  `whitespace_pattern`, `disable_additional_properties` and `disable_fallback` (there is no
  fallback backend: always honoured).
- vLLM's older extras: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
  `guided_whitespace_pattern`, `guided_decoding_backend` ("auto" or "guidance" only).

More than one constraint in a request is a 400 naming the second; a grammar the engine
(llguidance) cannot compile is a 400 with its reason, naming the field, and one that does not
compile within the budget (`[structured]`: time and llguidance's limits) a 400
`grammar_too_complex` naming it. What moed does not do (`structural_tag`, the
xgrammar/outlines backends, a schema `description` shown to the model) is a 400 naming it.

Parsing here is O(body) and checks only the fields' shape; the grammar is compiled (and so
validated) later, on the grammar pool (moed.api.grammar_pool): a 90 KB schema takes ~0.2 s to
validate, and the parse pool is shared with tokenization and response formatting.
"""
from __future__ import annotations

import copy
import json
import re
from typing import Any

from dataclasses import replace

from moed.api.errors import APIError, bad_request
from moed.types import GrammarSpec

TOP_LEVEL_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                    "guided_choice", "guided_grammar", "guided_whitespace_pattern",
                    "guided_decoding_backend")
BACKENDS = ("auto", "guidance")         # guided_decoding_backend values that mean llguidance
MAX_CHOICES = 1024
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")    # OpenAI's rule for json_schema.name
_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def parse_structured(body: Any) -> GrammarSpec | None:
    """The one constraint a request body asks for (None: none), naming its field (`param`);
    compiled later (`compile_checked`)."""
    found: list[tuple[str, GrammarSpec]] = []
    rf = _response_format(body.get("response_format"))
    if rf is not None:
        found.append(("response_format", rf))
    so = _structured_outputs(body.get("structured_outputs"))
    if so is not None:
        found.append(("structured_outputs", so))
    found += _guided(body)
    if len(found) > 1:
        raise bad_request(f"only one structured-output constraint per request: got "
                          f"'{found[0][0]}' and '{found[1][0]}'", found[1][0])
    if not found:
        return None
    param, spec = found[0]
    return replace(spec, param=param)


def compile_checked(tokenizer: Any, spec: GrammarSpec) -> None:
    """Compile `spec` for this tokenizer into the grammar cache, under the budget (the
    handler runs this on the grammar pool before the request reaches the engine). Raises
    APIError(400) naming the field: `grammar_too_complex` past the budget, else the engine's
    reason."""
    from moed.model.grammar import GrammarError, compiler_for

    try:
        compiler_for(tokenizer).compile(spec)
    except GrammarError as e:
        raise refusal(spec, e) from None


def refusal(spec: GrammarSpec, e: Exception) -> APIError:
    """The 400 for a grammar the engine refused (`e`: a GrammarError)."""
    from moed.model.grammar import GrammarTooComplex

    what = f"'{spec.param}'" if spec.param else "the output constraint"
    if isinstance(e, GrammarTooComplex):
        return bad_request(f"{what} is too complex for the grammar engine's budget: "
                           f"{_reason(e)}", spec.param, code="grammar_too_complex")
    return bad_request(f"{what}: the grammar engine cannot compile it: {_reason(e)}",
                       spec.param)


def too_complex_in_flight(spec: GrammarSpec | None, reason: str) -> APIError:
    """The 400 for a request whose grammar overran a limit or `mask_timeout_ms` while it
    generated (the engine failed it alone, ErrorKind.GRAMMAR)."""
    param = None if spec is None else spec.param
    what = f"'{param}'" if param else "the output constraint"
    return bad_request(f"{what} became too complex for the grammar engine's budget while "
                       f"generating: {reason[:600]}", param, code="grammar_too_complex")


def _reason(e: Exception) -> str:
    s = str(e).strip()
    return s if len(s) <= 600 else s[:600] + "..."


# ---- response_format (OpenAI) ---------------------------------------------------------------

def _response_format(rf: Any) -> GrammarSpec | None:
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request("'response_format' must be an object with a string 'type'",
                          "response_format")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be one of text, json_object, "
                          f"json_schema; got {kind[:40]!r}", "response_format.type")
    js = rf.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(js, dict):
        raise bad_request(f"'{where}' must be an object with 'name' and 'schema'", where)
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise bad_request(f"'{where}.name' must be 1-64 letters, digits, '_' or '-'",
                          f"{where}.name")
    if js.get("description") not in (None, ""):
        raise bad_request(f"'{where}.description' is not supported by this server (the schema "
                          f"constrains the output; the description would only be shown to "
                          f"the model)", f"{where}.description")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{where}.strict' must be a boolean", f"{where}.strict")
    schema = js.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"'{where}.schema' must be a JSON schema object", f"{where}.schema")
    return GrammarSpec("json_schema", _dumps(schema, f"{where}.schema"))


# ---- structured_outputs (vLLM) --------------------------------------------------------------

def _structured_outputs(so: Any) -> GrammarSpec | None:
    if so is None:
        return None
    p = "structured_outputs"
    if not isinstance(so, dict):
        raise bad_request(f"'{p}' must be an object", p)
    kinds = [k for k in _SO_KINDS if so.get(k) not in (None, False)]
    if not kinds:
        raise bad_request(f"'{p}' must set one of {', '.join(_SO_KINDS[:-1])}", p)
    if len(kinds) > 1:
        raise bad_request(f"'{p}' may set only one of {', '.join(_SO_KINDS[:-1])}; got "
                          f"{' and '.join(kinds)}", f"{p}.{kinds[1]}")
    kind = kinds[0]
    if kind == "structural_tag":
        raise bad_request(f"'{p}.structural_tag' is not supported by this server",
                          f"{p}.structural_tag")
    backend = so.get("_backend")
    if backend is not None and backend not in BACKENDS:
        raise bad_request(f"'{p}._backend' must be one of {', '.join(BACKENDS)} (moed's grammar "
                          f"engine is llguidance)", f"{p}._backend")
    for flag in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if so.get(flag) is not None and not isinstance(so.get(flag), bool):
            raise bad_request(f"'{p}.{flag}' must be a boolean", f"{p}.{flag}")
    ws = _opt_str(so, "whitespace_pattern", f"{p}.whitespace_pattern")
    compact = bool(so.get("disable_any_whitespace"))
    if kind == "json_object":
        if so["json_object"] is not True:
            raise bad_request(f"'{p}.json_object' must be a boolean", f"{p}.json_object")
        if not (compact or ws):
            return GrammarSpec("json_object")
        return _json_spec({"type": "object"}, ws, compact, False, p)
    if kind == "json":
        schema = _schema(so["json"], f"{p}.json")
        return _json_spec(schema, ws, compact, bool(so.get("disable_additional_properties")),
                          f"{p}.json")
    return _non_json(kind, so[kind], f"{p}.{kind}")


# ---- guided_* (vLLM's older extras) ---------------------------------------------------------

def _guided(body: Any) -> list[tuple[str, GrammarSpec]]:
    backend = body.get("guided_decoding_backend")
    if backend is not None and (not isinstance(backend, str) or backend not in BACKENDS):
        raise bad_request(f"'guided_decoding_backend' must be one of {', '.join(BACKENDS)} "
                          f"(moed's grammar engine is llguidance)", "guided_decoding_backend")
    ws = _opt_str(body, "guided_whitespace_pattern", "guided_whitespace_pattern")
    out = []
    if body.get("guided_json") is not None:
        schema = _schema(body.get("guided_json"), "guided_json")
        out.append(("guided_json", _json_spec(schema, ws, False, False, "guided_json")))
    for field, kind in (("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        if body.get(field) is not None:
            out.append((field, _non_json(kind, body.get(field), field)))
    if ws is not None and not any(f == "guided_json" for f, _ in out):
        raise bad_request("'guided_whitespace_pattern' applies only with 'guided_json'",
                          "guided_whitespace_pattern")
    return out


# ---- shared pieces --------------------------------------------------------------------------

def _opt_str(d: Any, key: str, param: str) -> str | None:
    v = d.get(key)
    if v is not None and (not isinstance(v, str) or not v):
        raise bad_request(f"'{param}' must be a non-empty string", param)
    return v


def _schema(v: Any, param: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except (ValueError, RecursionError) as e:
            raise bad_request(f"'{param}' is not valid JSON: {str(e)[:200]}", param) from None
    if not isinstance(v, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param)
    return v


def _json_spec(schema: dict[str, Any], ws: str | None, compact: bool, no_extra: bool,
               param: str) -> GrammarSpec:
    """A json_schema spec; whitespace options travel in the schema's `x-guidance` (llguidance
    reads its options from there), so the GrammarSpec stays (kind, source)."""
    if no_extra:        # vLLM: objects with properties and no additionalProperties get false
        schema = copy.deepcopy(schema)
        _no_additional_properties(schema)
    if compact or ws:
        xg = dict(schema.get("x-guidance") or {})
        if compact:
            xg.pop("whitespace_pattern", None)
            xg["whitespace_flexible"] = False
        else:
            xg["whitespace_pattern"] = ws
        schema = {**schema, "x-guidance": xg}
    return GrammarSpec("json_schema", _dumps(schema, param))


def _no_additional_properties(node: Any) -> None:
    if isinstance(node, dict):
        for v in node.values():
            _no_additional_properties(v)
        if "additionalProperties" not in node and ("properties" in node
                                                   or "patternProperties" in node):
            node["additionalProperties"] = False
    elif isinstance(node, list):
        for v in node:
            _no_additional_properties(v)


def _non_json(kind: str, v: Any, param: str) -> GrammarSpec:
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(s, str) for s in v):
            raise bad_request(f"'{param}' must be a non-empty list of strings", param)
        if len(v) > MAX_CHOICES:
            raise bad_request(f"'{param}' may hold at most {MAX_CHOICES} strings", param)
        return GrammarSpec("choice", _dumps(v, param))
    if not isinstance(v, str) or not v:
        raise bad_request(f"'{param}' must be a non-empty string", param)
    _utf8(v, param)
    return GrammarSpec("regex" if kind == "regex" else "lark", v)


def _dumps(v: Any, param: str) -> str:
    try:
        s = json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    except (ValueError, TypeError, RecursionError) as e:
        raise bad_request(f"'{param}' cannot be encoded as JSON: {str(e)[:200]}", param) from None
    return _utf8(s, param)


def _utf8(s: str, param: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(f"'{param}' is not valid Unicode text (a lone surrogate)",
                          param) from None
    return s


