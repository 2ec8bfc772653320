"""Tool calling and the chat-template fields of /v1/chat/completions.

Three steps: `parse_tools` / `parse_template` / `history_fields` read the body (pure, in
moed.api.protocol's parse); `bind` decides what needs the checkpoint (which parser family
reads its calls, the forced-choice grammar, which template variables exist); `ChatOutput`
turns one choice's text into the OpenAI message or stream deltas.

  tools                   [{"type": "function", "function": {name, description, parameters,
                          strict}}]: handed to the chat template as transformers does
  tool_choice             "none" (tools rendered, output not parsed) | "auto" (the default with
                          tools: the output is parsed) | "required" | {"type": "function",
                          "function": {"name": ...}}: the last two are forced by a grammar;
                          strict functions under auto constrain the calls (not the text) too
  parallel_tool_calls     false: at most one call
  chat_template_kwargs    more template variables (enable_thinking, ...); one the template
                          does not read is refused
  add_generation_prompt   (vLLM) default true
  continue_final_message  (vLLM) the last message stays open and the model continues it
  echo                    (vLLM) the last message's content heads the answer when it is the
                          assistant's
  functions, function_call the deprecated forms: refused, pointing at tools

A marker that is a special token of the checkpoint (real Mistral's [TOOL_CALLS]; Qwen3's
<tool_call> is an added token but not special) would be dropped from the output text with the
other special tokens, so `bind` turns skip_special_tokens off for such a request (vLLM's Mistral
parser does the same); an explicit skip_special_tokens: true there is refused.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from moed.api.errors import APIError, bad_request
from moed.api import tool_parsers
from moed.api.tool_parsers import Family, ToolStream
from moed.types import GrammarSpec

MAX_TOOLS = 128                          # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # OpenAI's function-name rule
CHOICES = ("none", "auto", "required", "function")
# set by the request's own fields or by moed: not a chat_template_kwargs name
_RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt",
                              "continue_final_message", "bos_token", "eos_token",
                              "raise_exception", "strftime_now"})


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]    # OpenAI shape, validated
    choice: str = "auto"                 # one of CHOICES; "function": `name`
    name: str = ""
    parallel: bool = True
    family: str = ""                     # set by bind(): the parser family; "": not parsed

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def constrained(self) -> bool:
        """A grammar shapes the output: a forced choice, or strict functions under auto."""
        return self.forced or (self.choice == "auto" and
                               any(x["function"].get("strict") for x in self.tools))

    @property
    def max_calls(self) -> int | None:
        return 1 if self.choice == "function" or not self.parallel else None


@dataclass(frozen=True)
class TemplateArgs:
    kwargs: tuple[tuple[str, Any], ...] = ()     # chat_template_kwargs, in order
    add_generation_prompt: bool = True
    continue_final_message: bool = False


# ---- parsing (pure) --------------------------------------------------------------------------

def _tool(t: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function" or \
            not isinstance(t.get("function"), dict):
        raise bad_request(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}",
                          "tools")
    f = t["function"]
    name = f.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad_request(f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'",
                          "tools")
    out: dict[str, Any] = {"name": name}
    if f.get("description") is not None:
        if not isinstance(f["description"], str):
            raise bad_request(f"'{where}.function.description' must be a string", "tools")
        out["description"] = f["description"]
    if f.get("parameters") is not None:
        if not isinstance(f["parameters"], dict):
            raise bad_request(f"'{where}.function.parameters' must be a JSON schema object",
                              "tools")
        out["parameters"] = f["parameters"]
    strict = f.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{where}.function.strict' must be a boolean", "tools")
    if strict:
        out["strict"] = True
    return {"type": "function", "function": out}


def _choice(v: Any, names: set[str]) -> tuple[str, str]:
    if isinstance(v, str):
        if v not in ("none", "auto", "required"):
            raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                              "tool_choice")
        return v, ""
    fn = v.get("function") if isinstance(v, dict) and v.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                          "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if name not in names:
        raise bad_request(f"'tool_choice' names {name[:64]!r}, which is not in 'tools'",
                          "tool_choice")
    return "function", name


def parse_tools(body: Any) -> ToolRequest | None:
    """tools, tool_choice and parallel_tool_calls of a chat body; None: no tools."""
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise bad_request(f"'{old}' is deprecated and not supported by this server; send "
                              f"'tools' and 'tool_choice'", old)
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'tools' may hold at most {MAX_TOOLS} functions", "tools")
    parsed = tuple(_tool(t, i) for i, t in enumerate(tools))
    names = [t["function"]["name"] for t in parsed]
    if len(set(names)) != len(names):
        raise bad_request("'tools' names a function twice", "tools")
    if not parsed:
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
        return None
    kind, name = _choice("auto" if choice is None else choice, set(names))
    return ToolRequest(parsed, kind, name, parallel is not False)


def parse_template(body: Any) -> TemplateArgs:
    kw = body.get("chat_template_kwargs")
    if kw is not None and not isinstance(kw, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for k in kw or {}:
        if k in _RESERVED_KWARGS:
            raise bad_request(f"'chat_template_kwargs.{k[:64]}' is set by the request itself or "
                              f"by the server; send the field instead", "chat_template_kwargs")
    agp, cont = body.get("add_generation_prompt"), body.get("continue_final_message")
    for name, v in (("add_generation_prompt", agp), ("continue_final_message", cont)):
        if v is not None and not isinstance(v, bool):
            raise bad_request(f"'{name}' must be a boolean", name)
    agp = True if agp is None else agp
    if cont and agp:
        raise bad_request("'continue_final_message' needs 'add_generation_prompt': false (the "
                          "model continues the last message instead of starting a new one)",
                          "continue_final_message")
    return TemplateArgs(tuple((kw or {}).items()), agp, bool(cont))


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
            not isinstance(c.get("id", ""), str):
        raise bad_request(f"'{where}' must be {{\"id\", \"type\": \"function\", \"function\": "
                          f"{{\"name\", \"arguments\"}}}}", "messages")
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise bad_request(f"'{where}.function.arguments' must be the JSON text of an object",
                          "messages")
    # templates read the arguments as an object (transformers' convention, as vLLM passes them)
    return {"id": c.get("id", ""), "type": "function",
            "function": {"name": fn["name"], "arguments": parsed}}


def history_fields(m: dict[str, Any], i: int, role: str) -> dict[str, Any]:
    """The tool fields of history message i: assistant tool_calls, tool's tool_call_id, name."""
    out: dict[str, Any] = {}
    if m.get("name") is not None:
        if not isinstance(m["name"], str):
            raise bad_request(f"'messages[{i}].name' must be a string", "messages")
        out["name"] = m["name"]
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise bad_request(f"'messages[{i}].tool_calls' must be a list, on an assistant "
                              f"message", "messages")
        out["tool_calls"] = [_tool_call(c, f"messages[{i}].tool_calls[{j}]")
                             for j, c in enumerate(calls)]
    if role == "tool":
        tid = m.get("tool_call_id")
        if not isinstance(tid, str) or not tid:
            raise bad_request(f"'messages[{i}].tool_call_id' is required on a tool message",
                              "messages")
        out["tool_call_id"] = tid
    return out


# ---- binding to the checkpoint ---------------------------------------------------------------

def check_template_kwargs(template: TemplateArgs, tok: Any) -> None:
    """400 for a chat_template_kwargs name the checkpoint's template does not read."""
    variables = getattr(tok, "template_variables", None)
    if template.kwargs and variables is not None:
        known = variables()
        for k, _ in template.kwargs:
            if k not in known:
                raise bad_request(f"'chat_template_kwargs.{k[:64]}' is not a variable of this "
                                  f"model's chat template", "chat_template_kwargs")


def bind(req: Any, tok: Any, setting: str) -> Any:
    """req (a chat GenerationRequest) with its parser family, forced-choice grammar and
    skip_special_tokens set; 400 for template kwargs the template does not read or tools this
    model cannot parse."""
    check_template_kwargs(req.template, tok)
    t = req.tools
    if t is None or t.choice == "none":
        return req
    fam = tool_parsers.choose(setting, getattr(tok, "chat_template", None),
                              getattr(tok, "model_type", None))
    if fam is None:
        raise bad_request("this model's tool-call format is not known (its chat template "
                          "writes neither <tool_call> nor [TOOL_CALLS]); set model.tool_parser",
                          "tools")
    special = special_markers(fam, tok)
    if special:             # the text must keep the marker for the calls to be read
        if req.skip_special_tokens:
            raise bad_request(f"'skip_special_tokens': true would drop {special[0]} (a special "
                              f"token of this checkpoint) and with it the tool calls from the "
                              f"output; leave it out or set it false", "skip_special_tokens")
        if not req.spaces_between_special_tokens:
            raise spaces_refused()
        req = replace(req, skip_special_tokens=False)
    grammar = req.grammar
    if t.constrained:
        if grammar is not None:
            what = "'tool_choice' \"required\" or a named function" if t.forced else \
                "'strict' functions"
            raise bad_request(f"{what} cannot be combined with response_format or guided "
                              f"decoding (both constrain the output)",
                              "tool_choice" if t.forced else "tools")
        # compiled (and refused naming 'tools') on the grammar pool, as every constraint is
        grammar = replace(tool_grammar(fam, t, getattr(tok, "token_to_id", None)),
                          param="tools")
    return replace(req, tools=replace(t, family=fam.name), grammar=grammar)


def special_markers(fam: Family, tok: Any) -> list[str]:
    """The family's markers that are special tokens of this vocabulary: one token that decodes
    to nothing when special tokens are skipped (the default)."""
    to_id, decode = getattr(tok, "token_to_id", None), getattr(tok, "decode", None)
    if to_id is None or decode is None:
        return []
    return [m for m in filter(None, (fam.start, fam.end))
            if (tid := to_id(m)) is not None and decode([tid]) == ""]


def spaces_refused() -> APIError:
    """The 400 for spaces_between_special_tokens false where special tokens are shown: the fast
    tokenizer's decode has no such switch (where they are skipped it changes nothing, as in
    vLLM, and is accepted)."""
    return bad_request("'spaces_between_special_tokens': false is not supported by this "
                       "server when special tokens are shown (skip_special_tokens false)",
                       "spaces_between_special_tokens")


def _body_schema(tool: dict[str, Any], strict: bool) -> dict[str, Any]:
    """The JSON schema of one call's body: {"name": const, "arguments": the parameters (any
    object when not strict)}."""
    params = dict(tool["function"].get("parameters") or
                  {"type": "object", "properties": {}, "additionalProperties": False}) \
        if strict else {"type": "object"}
    schema: dict[str, Any] = {
        # one shape (the family's: ", " and ": "): free whitespace lets a weak model ramble
        "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                       "key_separator": ": "},
        "type": "object",
        "properties": {"name": {"const": tool["function"]["name"]}, "arguments": params},
        "required": ["name", "arguments"], "additionalProperties": False}
    for defs in ("$defs", "definitions"):     # "#/$defs/x" refs resolve from the root
        if defs in params:
            schema[defs] = params.pop(defs)
    return schema


def _no(marker: str) -> str:
    """A Lark regex of any text that does not contain `marker`."""
    m = re.escape(marker).replace("/", "\\/")
    return f"/(.|\\n)*/ & ~/(.|\\n)*{m}(.|\\n)*/"


def tool_grammar(fam: Family, t: ToolRequest,
                 token_id: Callable[[str], int | None] | None = None) -> GrammarSpec:
    """A Lark grammar (llguidance's dialect) for a constrained tool choice, one `%json`
    alternative per tool. Forced (required / named): one or more calls in the family's format,
    only the named tool for a named choice. Auto with strict functions: text, or text then
    calls whose arguments follow the strict functions' schemas (others: any object).
    A marker that is one token of the vocabulary (Qwen3's <tool_call>, Mistral's [TOOL_CALLS])
    is that token (`<[id]>`: llguidance never matches an added token by its text)."""
    q = json.dumps
    ids = {m: token_id(m) if token_id is not None else None for m in (fam.start, fam.end) if m}

    def marker(text: str) -> str:
        return f"<[{ids[text]}]>" if ids[text] is not None else q(text)

    tools = [x for x in t.tools if t.choice != "function" or x["function"]["name"] == t.name]
    alts = [f"f{i}" for i in range(len(tools))]
    rules = [f"{a}: %json {q(_body_schema(x, t.forced or bool(x['function'].get('strict'))))}"
             for a, x in zip(alts, tools)]
    body, multi = "(" + " | ".join(alts) + ")", t.max_calls != 1
    if fam.end is not None:     # qwen: after the start marker, a body and the end marker
        one = f'"\\n" {body} "\\n" {marker(fam.end)}'
        after = one + (f' ("\\n" {marker(fam.start)} {one})*' if multi else "")
    else:                       # mistral: after the marker, a JSON array of bodies
        after = f'" [" {body}' + (f" ({q(fam.separator)} {body})*" if multi else "") + ' "]"'
    if t.forced:
        start = [f"start: {marker(fam.start)} after"]
    elif ids[fam.start] is not None:    # text can never hold the marker token
        start = [f"start: TEXT? | TEXT? {marker(fam.start)} after", "TEXT: /(.|\\n)+/"]
    else:                               # text up to the first marker, which opens calls
        start = ["start: TEXT? | pre after", f"TEXT: {_no(fam.start)}",
                 f"pre[suffix={q(fam.start)}]: {_no(fam.start)}"]
    return GrammarSpec("lark", "\n".join([*start, f"after: {after}", *rules]))


def template_args(req: Any) -> dict[str, Any]:
    """apply_chat_template's keyword arguments for a chat request (only those it sets, so a
    plain request renders exactly as before)."""
    out: dict[str, Any] = {"add_generation_prompt": req.template.add_generation_prompt}
    if req.tools is not None:
        out["tools"] = [dict(x) for x in req.tools.tools]
    if req.template.continue_final_message:
        out["continue_final_message"] = True
    out.update(req.template.kwargs)
    return out


# ---- output ----------------------------------------------------------------------------------

class ChatOutput:
    """One chat choice's text as OpenAI content and tool_calls (stream deltas or a message)."""

    def __init__(self, req: Any) -> None:
        last = req.messages[-1] if req.messages else {}
        self.prefix = last.get("content", "") if req.echo and \
            last.get("role") == "assistant" else ""
        t = req.tools
        self.family = tool_parsers.FAMILIES[t.family] if t is not None and t.family else None
        self.max_calls = t.max_calls if t is not None else None
        self.stream = ToolStream(self.family, self.max_calls) if self.family else None

    def delta(self, text: str, first: bool, final: bool) -> dict[str, Any]:
        calls: list[tool_parsers.CallDelta] = []
        if self.stream is not None:
            text, calls = self.stream.feed(text)
            if final:
                rest, _ = self.stream.finish()
                text += rest
        if first:
            text = self.prefix + text
        d: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or not calls:
            d["content"] = text
        if calls:
            d["tool_calls"] = [_delta_json(c) for c in calls]
        return d

    def finish_reason(self, reason: str | None, called: bool | None = None) -> str | None:
        if called is None:
            called = self.stream is not None and self.stream.called
        return "tool_calls" if reason == "stop" and called else reason

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(the assistant message, whether it holds calls)."""
        calls: list[tool_parsers.ToolCall] = []
        if self.family is not None:
            text, calls = tool_parsers.parse(self.family, text, self.max_calls)
        content: str | None = self.prefix + text
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            if not content.strip():
                msg["content"] = None
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
        return msg, bool(calls)


def _delta_json(c: tool_parsers.CallDelta) -> dict[str, Any]:
    if c.id is None:
        return {"index": c.index, "function": {"arguments": c.arguments}}
    return {"index": c.index, "id": c.id, "type": "function",
            "function": {"name": c.name, "arguments": c.arguments}}
