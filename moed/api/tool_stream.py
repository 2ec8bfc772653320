"""ToolStream: a response's text deltas -> (content, tool-call deltas), as OpenAI streams them.

The format rules (families, markers, bodies) are moed/api/tool_formats.py; what the stream
must give at every split is said in moed/api/tool_parsers.py's docstring.
"""
from __future__ import annotations

import json
from typing import Iterable

from moed.api.tool_formats import WS, CallDelta, Family, call_of, skip_ws

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
            if c in WS + ",}]":
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
        i = skip_ws(buf, i)
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
            j = skip_ws(self.buf, 0)
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
                if self.buf[skip_ws(self.buf, 0)] != "{":
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
            start = skip_ws(self.buf, 0) if not self.value.started else 0
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
        j = skip_ws(self.buf, 0)
        if need_brace:
            if j == len(self.buf):
                return False
            if self.buf[j] != "}":      # more keys after the arguments: not ours to stream
                self.buf, self.state = self.buf[j:], "text"
                return True
            j = skip_ws(self.buf, j + 1)
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
        start = skip_ws(self.buf, 0)
        i = max(i, start)
        while i < len(self.buf) and not v.done:
            v.feed(self.buf[i])
            i += 1
        self.scanned = i
        if not v.done:
            return False
        try:
            call = call_of(json.loads(self.buf[start:i]))
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
