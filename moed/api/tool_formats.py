"""Tool-call formats: the model families, their markers and the call types (pure); the pieces
moed/api/tool_parsers.py (a whole response) and tool_stream.py (a stream) share.

Glossary: a *body* is one call's JSON object; its *header* is the body up to the arguments
value (`{"name": "f", "arguments":`); the *start* marker opens calls; qwen's *end* marker
closes each body.
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Callable

WS = " \t\n\r"


@dataclass(frozen=True)
class Family:
    name: str
    start: str                  # marker before a call (qwen) or before the array (mistral)
    end: str | None             # after each body (qwen); None: bodies in a JSON array
    separator: str              # between calls in the forced-choice grammar
    new_id: Callable[[], str]   # call ids in the family's own shape


def _openai_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _mistral_id() -> str:
    # Mistral templates require 9 alphanumeric characters in the history's tool_call ids
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


FAMILIES: dict[str, Family] = {
    "qwen": Family("qwen", "<tool_call>", "</tool_call>", "\n", _openai_id),
    "mistral": Family("mistral", "[TOOL_CALLS]", None, ", ", _mistral_id),
}
PARSER_SETTINGS = ("auto", "none", *FAMILIES)       # model.tool_parser
# config.json model_type → family, when the template does not show its markers
_MODEL_TYPES = {"qwen2": "qwen", "qwen2_moe": "qwen", "qwen3": "qwen", "qwen3_moe": "qwen",
                "mistral": "mistral", "mixtral": "mistral"}


def choose(setting: str, chat_template: str | None, model_type: str | None) -> Family | None:
    """The family for a checkpoint: the configured one, else the markers its chat template
    writes (the template defines the format), else its model_type; None: no known format."""
    if setting in FAMILIES:
        return FAMILIES[setting]
    if setting == "none":
        return None
    if setting != "auto":
        raise ValueError(f"tool parser must be one of {', '.join(PARSER_SETTINGS)}")
    for fam in FAMILIES.values():
        if chat_template and fam.start in chat_template:
            return fam
    name = _MODEL_TYPES.get(model_type or "")
    return FAMILIES[name] if name else None


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str              # JSON text of an object


@dataclass(frozen=True)
class CallDelta:
    """One streamed piece of call `index`: id and name on its first delta, then arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


def call_of(obj: object) -> tuple[str, str] | None:
    """(name, arguments JSON) of a valid body, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):           # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


_decoder = json.JSONDecoder()


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WS:
        i += 1
    return i


def bodies(fam: Family, text: str, i: int) -> tuple[list[tuple[str, str]], int] | None:
    """The calls that start at text[i] (just after the start marker) and where they end."""
    try:
        j = skip_ws(text, i)
        if fam.end is not None:
            obj, j = _decoder.raw_decode(text, j)
            call = call_of(obj)
            j = skip_ws(text, j)
            if call is None:
                return None
            if text.startswith(fam.end, j):
                return [call], j + len(fam.end)
            return ([call], j) if j == len(text) else None   # end of text closes it too
        obj, j = _decoder.raw_decode(text, j)
        items = obj if isinstance(obj, list) else [obj]
        calls = [call_of(o) for o in items]
        if not calls or any(c is None for c in calls):
            return None
        return calls, j                                       # type: ignore[return-value]
    except ValueError:
        return None
