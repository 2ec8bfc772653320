"""Tool-call parsers: a model's text → OpenAI tool calls, one parser per model family (pure).

Each family writes calls in the format it was trained on:

  qwen     Qwen2.5 / Qwen3 (Hermes style), one block per call:
               <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
  mistral  Mistral / Mixtral (v3 tokenizer), one JSON array after a marker:
               [TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]

Glossary: a *body* is one call's JSON object; its *header* is the body up to the arguments
value (`{"name": "f", "arguments":`); the *start* marker opens calls; qwen's *end* marker
closes each body.

`parse` (a whole response) is strict: a body that is not valid JSON with a string name and an
object of arguments stays content, verbatim. `ToolStream` (SSE) emits deltas the way OpenAI
streams them: a call's id, type and name once its header is read, then fragments of the
arguments text as they arrive; text outside calls is content. A header the stream cannot read
(other key order, say) is buffered to the body's end and emitted whole if valid, else content,
so valid and header-malformed outputs stream to the same result `parse` gives at any split.
Arguments that turn out malformed after fragments went out cannot be taken back: the stream
keeps them (vLLM's parsers do the same); `parse` would return that text as content.

A response that ends inside a call (max_tokens hit mid-arguments, or the model stopped there)
gives the same result both ways: the call, with its arguments as far as they were written
(not valid JSON then; finish_reason says "length"), which is what OpenAI returns. `parse` reads
such a tail with the stream itself (`_cut_short`), because the stream has sent the call's name
and fragments before it knew the text would end; content would contradict them.
"""
from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable

_WS = " \t\n\r"


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


def _call(obj: object) -> tuple[str, str] | None:
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


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _bodies(fam: Family, text: str, i: int) -> tuple[list[tuple[str, str]], int] | None:
    """The calls that start at text[i] (just after the start marker) and where they end."""
    try:
        j = _skip_ws(text, i)
        if fam.end is not None:
            obj, j = _decoder.raw_decode(text, j)
            call = _call(obj)
            j = _skip_ws(text, j)
            if call is None:
                return None
            if text.startswith(fam.end, j):
                return [call], j + len(fam.end)
            return ([call], j) if j == len(text) else None   # end of text closes it too
        obj, j = _decoder.raw_decode(text, j)
        items = obj if isinstance(obj, list) else [obj]
        calls = [_call(o) for o in items]
        if not calls or any(c is None for c in calls):
            return None
        return calls, j                                       # type: ignore[return-value]
    except ValueError:
        return None


def parse(fam: Family, text: str, max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole response. Calls beyond max_calls are dropped, with the
    text after the last kept one."""
    content: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while max_calls is None or len(calls) < max_calls:
        i = text.find(fam.start, pos)
        if i < 0:
            break
        found = _bodies(fam, text, i + len(fam.start))
        if found is None:
            cut = _cut_short(fam, text[i:], None if max_calls is None else max_calls - len(calls))
            if cut is not None:           # the text ends inside a call: as the stream has it
                content.append(text[pos:i] + cut[0])
                calls += cut[1]
                pos = len(text)
                break
                                          # malformed: the marker is content, look further on
            content.append(text[pos:i + len(fam.start)])
            pos = i + len(fam.start)
            continue
        content.append(text[pos:i])
        room = len(found[0]) if max_calls is None else max_calls - len(calls)
        calls += [ToolCall(fam.new_id(), n, a) for n, a in found[0][:room]]
        pos = found[1]
    if max_calls is None or len(calls) < max_calls:
        content.append(text[pos:])
    return "".join(content), calls


def _cut_short(fam: Family, tail: str, room: int | None) -> tuple[str, list[ToolCall]] | None:
    """(content, calls) of `tail` (from a start marker to the end of the text) when the text
    ends inside a call the stream has begun (its name sent); None otherwise."""
    st = ToolStream(fam, room)
    content, deltas = st.feed(tail)
    if not st.called or st.state in ("text", "done"):
        return None
    rest, _ = st.finish()
    calls: list[ToolCall] = []
    for d in deltas:
        if d.id is not None:
            calls.append(ToolCall(d.id, d.name or "", d.arguments))
        else:
            c = calls[d.index]
            calls[d.index] = ToolCall(c.id, c.name, c.arguments + d.arguments)
    return content + rest, calls


# ---- streaming -------------------------------------------------------------------------------

class _Value:
    """Where a JSON value ends, one character at a time: bracket depth and string state (no
    validation: the stream emits fragments before the value is complete)."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc, self.started, self.done = 0, False, False, False, False
        self.scalar = False

    def feed(self, c: str) -> bool:
        """Consume c; False when c is not part of the value (it ends a bare scalar)."""
        if not self.started:
            self.started = True
            if c in "{[":
                self.depth = 1
            elif c == '"':
                self.in_str = True
            else:
                self.scalar = True
            return True
        if self.scalar:
            if c in _WS + ",}]":
                self.done = True
                return False
            return True
        if self.in_str:
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.in_str = False
                self.done = self.depth == 0
            return True
        if c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            self.done = self.depth == 0
        return True


_HEADER = ("{", '"name"', ":", None, ",", '"arguments"', ":")   # None: the name string


def _header(buf: str) -> tuple[str, int, str] | None:
    """("partial" | "fail", 0, "") or ("match", end, name) for a body that starts buf."""
    i = 0
    for piece in _HEADER:
        i = _skip_ws(buf, i)
        if i == len(buf):
            return "partial", 0, ""
        if piece is None:
            if buf[i] != '"':
                return "fail", 0, ""
            try:
                name, i = json.decoder.scanstring(buf, i + 1)
            except ValueError:          # unterminated (or a bad escape) so far
                return ("fail", 0, "") if "\n" in buf[i:] else ("partial", 0, "")
            if not name:
                return "fail", 0, ""
            header_name = name
            continue
        k = len(piece) if len(buf) - i >= len(piece) else len(buf) - i
        if buf[i:i + k] != piece[:k]:
            return "fail", 0, ""
        if k < len(piece):
            return "partial", 0, ""
        i += k
    return "match", i, header_name


def _marker_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ToolStream:
    """Text deltas in, (content, call deltas) out. States: text → header → args → close
    (→ next body for mistral's array) → text; `whole` buffers a body the header cannot read."""

    def __init__(self, fam: Family, max_calls: int | None = None) -> None:
        self.fam, self.max_calls = fam, max_calls
        self.state = "text"
        self.buf = ""               # text not yet decided (a marker prefix, a header, ...)
        self.raw = ""               # this call's text since its start marker (for content)
        self.calls = 0              # calls started
        self.value = _Value()       # the arguments value (args) or the whole body (whole)
        self.scanned = 0            # whole: characters of buf already fed to self.value
        self.in_array = False

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        out: list[CallDelta] = []
        self.buf += delta
        while self.buf and self._step(content, out):
            pass
        return "".join(content), _merge(out)

    def finish(self) -> tuple[str, list[CallDelta]]:
        """End of output: undecided text is content; a call cut short stays as streamed."""
        content, rest = "", self.buf
        if self.state == "text":
            content = rest
        elif self.state in ("header", "whole", "open"):
            content = self.raw + rest
        self.buf, self.raw, self.state = "", "", "done"
        return content, []

    def _full(self) -> bool:
        return self.max_calls is not None and self.calls >= self.max_calls

    def _to_content(self, content: list[str]) -> None:
        """The open body is not a call: its marker is content and the text after it is read
        as text again (a later marker may open a real call), as `parse` does."""
        content.append(self.raw)
        self.raw, self.state = "", "text"

    def _step(self, content: list[str], out: list[CallDelta]) -> bool:
        """Advance on self.buf; False when more text is needed."""
        st, fam = self.state, self.fam
        if st == "done":
            self.buf = ""
            return False
        if st == "text":
            i = self.buf.find(fam.start)
            if i < 0:
                keep = _marker_tail(self.buf, fam.start)
                content.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return False
            content.append(self.buf[:i])
            self.raw, self.buf = fam.start, self.buf[i + len(fam.start):]
            self.state = "open" if fam.end is None else "header"
            return True
        if st == "open":                # mistral: "[" opens the array, "{" one bare body
            j = _skip_ws(self.buf, 0)
            if j == len(self.buf):
                return False
            if self.buf[j] not in "[{":
                self._to_content(content)
                return True
            self.in_array = self.buf[j] == "["
            j += 1 if self.in_array else 0
            self.raw, self.buf = self.raw + self.buf[:j], self.buf[j:]
            self.state = "header"
            return True
        if st == "header":
            kind, end, name = _header(self.buf)
            if kind == "partial":
                return False
            if kind == "fail":
                if self.buf[_skip_ws(self.buf, 0)] != "{":
                    self._to_content(content)
                else:
                    self.state, self.value, self.scanned = "whole", _Value(), 0
                return True
            self.raw += self.buf[:end]
            self.buf = self.buf[end:]
            out.append(CallDelta(self.calls, "", fam.new_id(), name))
            self.calls += 1
            self.value, self.state = _Value(), "args"
            return True
        if st == "args":
            start = _skip_ws(self.buf, 0) if not self.value.started else 0
            taken = start
            for c in self.buf[start:]:
                if not self.value.feed(c):
                    break
                taken += 1
                if self.value.done:
                    break
            frag = self.buf[start:taken]
            if frag:
                out.append(CallDelta(self.calls - 1, frag))
            self.buf = self.buf[taken:]
            if self.value.done:
                self.state = "close"
                return True
            return False
        if st == "close":               # "}" then the end marker, or "," / "]" in the array
            return self._close(content, need_brace=True)
        if st == "after":               # a whole body was read: only the closing remains
            return self._close(content, need_brace=False)
        if st == "whole":
            return self._whole(content, out)
        raise AssertionError(st)

    def _close(self, content: list[str], need_brace: bool) -> bool:
        j = _skip_ws(self.buf, 0)
        if need_brace:
            if j == len(self.buf):
                return False
            if self.buf[j] != "}":      # more keys after the arguments: not ours to stream
                self.buf, self.state = self.buf[j:], "text"
                return True
            j = _skip_ws(self.buf, j + 1)
        self.buf = self.buf[j:]
        if need_brace:
            self.state = "after"
        if not self.buf:
            return False
        fam = self.fam
        if fam.end is not None:
            k = min(len(fam.end), len(self.buf))
            if self.buf[:k] != fam.end[:k]:
                self.state = "text"     # no end marker: what follows is content
            elif k < len(fam.end):
                return False
            else:
                self.buf = self.buf[k:]
                self.state = "text"
        elif self.in_array and self.buf[0] == ",":
            self.buf, self.raw, self.state = self.buf[1:], "", "header"
        else:
            if self.buf[0] == "]" and self.in_array:
                self.buf = self.buf[1:]
            self.state = "text"
        self.raw = ""
        if self._full():
            self.state = "done"
        return True

    def _whole(self, content: list[str], out: list[CallDelta]) -> bool:
        """Buffer a body until its closing brace (scanning each character once); emit it whole
        if valid, else content."""
        v, i = self.value, self.scanned
        start = _skip_ws(self.buf, 0)
        i = max(i, start)
        while i < len(self.buf) and not v.done:
            v.feed(self.buf[i])
            i += 1
        self.scanned = i
        if not v.done:
            return False
        try:
            call = _call(json.loads(self.buf[start:i]))
        except ValueError:
            call = None
        if call is None:
            self._to_content(content)
            return True
        out.append(CallDelta(self.calls, call[1], self.fam.new_id(), call[0]))
        self.calls += 1
        self.raw += self.buf[:i]
        self.buf, self.state = self.buf[i:], "after"
        return True


def _merge(deltas: Iterable[CallDelta]) -> list[CallDelta]:
    """Adjacent deltas of one call in one chunk become one (the first keeps id and name)."""
    out: list[CallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            p = out[-1]
            out[-1] = CallDelta(p.index, p.arguments + d.arguments, p.id, p.name)
        else:
            out.append(d)
    return out
