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

from moed.api.tool_formats import (FAMILIES, PARSER_SETTINGS, CallDelta, Family, ToolCall, bodies,
                                   choose)
from moed.api.tool_stream import ToolStream

__all__ = ["FAMILIES", "PARSER_SETTINGS", "CallDelta", "Family", "ToolCall", "ToolStream", "choose",
           "parse"]


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
        found = bodies(fam, text, i + len(fam.start))
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
