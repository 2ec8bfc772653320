"""Field readers of the OpenAI request parser (moed.api.protocol): one body field to a
validated value, or APIError(400) naming the field in `param`. Every integer has a range;
every string taken must encode as UTF-8 (JSON can carry a lone surrogate, "\ud800", that the
tokenizer and every encoder refuse: a 500 if it got that far).
"""
from __future__ import annotations

import math
from typing import Any

from moed.api.errors import bad_request
from moed.api.tools import history_fields

MAX_STOP_STRINGS = 16
MAX_LOGIT_BIAS = 300     # OpenAI's limit on logit_bias entries
TOKEN_ID_LIMIT = 1 << 31  # token ids without a vocabulary at hand: int32, as every vocabulary
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

Prompt = str | tuple[int, ...]


def read_int(body: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{key}' must be an integer, got {type(v).__name__}", key)
    if not lo <= v <= hi:
        raise bad_request(f"'{key}' must be in [{lo}, {hi}], got {_num(v)}", key)
    return v


def _num(v: int) -> str:
    s = str(v)
    return s if len(s) <= 24 else f"a {len(s)}-digit number"


def check_text(v: str, key: str, where: str | None = None) -> str:
    """`v`, refused if it cannot be encoded as UTF-8 (a lone surrogate)."""
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise bad_request(f"'{where or key}' is not valid Unicode text: lone surrogate "
                              f"U+{ord(v[e.start]):04X} at index {e.start}", key) from None
    return v


def read_float(body: dict[str, Any], key: str, lo: float, hi: float, *,
           lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"'{key}' must be a number, got {v!r}", key)
    if v < lo or (lo_open and v == lo) or v > hi:
        bracket = "(" if lo_open else "["
        raise bad_request(f"'{key}' must be in {bracket}{lo}, {hi}], got {v}", key)
    return float(v)


def read_bool(body: dict[str, Any], key: str) -> bool | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean, got {type(v).__name__}", key)
    return v


def parse_token_ids(v: Any, key: str, vocab_size: int | None) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                          for t in v):
        raise bad_request(f"'{key}' must be a list of integer token ids", key)
    limit = TOKEN_ID_LIMIT if vocab_size is None else vocab_size
    if any(t < 0 or t >= limit for t in v):
        bound = "the vocabulary size" if vocab_size is not None else "2**31"
        raise bad_request(f"'{key}' token ids must be >= 0 and < {bound} ({limit})", key)
    return tuple(v)


def read_stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if len(v) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' may hold at most {MAX_STOP_STRINGS} strings", "stop")
    return tuple(check_text(s, "stop") for s in v if s)


def read_prompts(body: dict[str, Any], vocab_size: int | None) -> tuple[Prompt, ...]:
    if "prompt" not in body or body["prompt"] is None:
        raise bad_request("'prompt' is required", "prompt")
    p = body["prompt"]
    if isinstance(p, str):
        items: list[Any] = [p]
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in p):
        items = [p]                       # one prompt of token ids
    elif isinstance(p, list) and p:
        items = p                         # a batch: strings or token-id lists
    else:
        raise bad_request("'prompt' must be a non-empty string, list of strings, list of token "
                          "ids or list of token-id lists", "prompt")
    out: list[Prompt] = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("'prompt' must not be empty", "prompt")
            out.append(check_text(item, "prompt"))
        elif isinstance(item, list):
            if not item:
                raise bad_request("'prompt' must not be empty", "prompt")
            out.append(parse_token_ids(item, "prompt", vocab_size))
        else:
            raise bad_request("'prompt' items must be strings or lists of token ids", "prompt")
    return tuple(out)


def _content_text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return check_text(content, "messages", f"messages[{i}].content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or \
                    not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}].content: only text parts are supported",
                                  "messages")
            parts.append(check_text(part["text"], "messages", f"messages[{i}].content"))
        return "".join(parts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                      "messages")


def parse_messages(body: dict[str, Any]) -> tuple[dict[str, Any], ...]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}",
                              "messages")
        out.append({"role": role, "content": _content_text(m.get("content"), i),
                    **history_fields(m, i, role)})
    if not any(m["content"] or m.get("tool_calls") for m in out):
        raise bad_request("'messages' must contain some text", "messages")
    return tuple(out)


def read_logit_bias(body: dict[str, Any], vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to biases",
                          "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise bad_request(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries",
                          "logit_bias")
    limit = TOKEN_ID_LIMIT if vocab_size is None else vocab_size
    out: dict[int, float] = {}
    for k, b in v.items():
        ks = str(k)
        if not (ks.isascii() and ks.isdigit()) or int(ks) >= limit:
            raise bad_request(f"'logit_bias' keys must be token ids in [0, {limit}), got "
                              f"{ks[:32]!r}", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) \
                or not -100 <= b <= 100:
            raise bad_request(f"'logit_bias' values must be numbers in [-100, 100], got {b!r} "
                              f"for token {ks}", "logit_bias")
        out[int(ks)] = out.get(int(ks), 0.0) + float(b)   # "01" and "1" are one token
    return tuple(sorted(out.items()))
