"""``llama3_json``: Llama 3.1/3.2/3.3's JSON tool calls, vLLM's ``Llama3JsonToolParser``.

The answer is one or more ``{"name": ..., "parameters": {...}}`` objects (``"arguments"`` is accepted too),
separated by ``;``, optionally after ``<|python_tag|>`` (a special token, usually already dropped by
``skip_special_tokens``; as text when the tokenizer lacks it), with whitespace around. Only an answer that
*starts* (after whitespace) with ``{`` or ``<|python_tag|>`` is read as calls, as vLLM does; any other answer is
content. Each object is taken as a call once its closing brace arrives (a small JSON scanner tracks depth and
strings). The first object that is not a call, or text after a call that is neither whitespace, ``;`` nor
another object, turns the rest of the answer into content from that point (the calls before it stand); an
object still open at the end is content.

Bounded hold: the parser holds back at most ``max_held_chars`` characters (``inference.shared.markers.MAX_HELD_CHARS``
by default) of undecided text: the answer's start (whitespace and the tag) together with its first object, a
later object, or the whitespace and ``;`` between calls. Text that would grow past that turns, with the rest of
the answer, into content, as an object that is not a call does (so an object longer than the bound is content).
The result does not depend on the chunking.

Cost: each ``push`` is O(len(text)): the scanner jumps between the characters that matter (quotes, escapes,
brackets) with regular expressions, the held text is a ``TextBuffer``, and a closed object is joined and parsed
once.
"""

from __future__ import annotations

import json
import re

from inference.shared.markers import MAX_HELD_CHARS, TextBuffer
from inference.tool_parsers.base import ParsedToolCall, ToolParseDelta, ToolParser, call_from_obj, register_tool_parser

PYTHON_TAG = "<|python_tag|>"
_START, _OBJECT, _BETWEEN, _TEXT = "start", "object", "between", "text"
_WS = re.compile(r"\s*")  # a whitespace run (``\s`` is ``str.isspace``'s set)
_STRUCTURE = re.compile(r'["{}\[\]]')  # outside strings: what changes the depth or opens a string
_IN_STRING = re.compile(r'["\\]')  # inside strings: what ends the string or escapes


def _ws_end(text: str, pos: int, end: int) -> int:
    """The end of the whitespace run at ``text[pos:end]`` (``pos`` when there is none)."""
    m = _WS.match(text, pos, end)
    return m.end() if m else pos


@register_tool_parser
class Llama3JsonToolParser(ToolParser):
    """See the module docstring.

    Args:
        max_held_chars: the most characters held back undecided (default ``MAX_HELD_CHARS``).
    """

    name = "llama3_json"

    def __init__(self, *, max_held_chars: int | None = None) -> None:
        self.max_held_chars = MAX_HELD_CHARS if max_held_chars is None else max_held_chars
        self._mode = _START
        self._held = TextBuffer()  # received text not yet emitted or consumed (the start, an object, a separator)
        self._tag_part = ""  # _START: the non-whitespace text so far, a proper prefix of the tag
        self._tag_seen = False
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._seen_sep = False
        self._obj_start = 0  # where the current object starts in the held text

    def _to_text(self, content: list[str]) -> None:
        content.append(self._held.text())
        self._held, self._mode = TextBuffer(), _TEXT

    def push(self, text: str) -> ToolParseDelta:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        pos, n = 0, len(text)
        while pos < n:
            if self._mode == _TEXT:
                content.append(text[pos:])
                break
            room = self.max_held_chars - len(self._held)
            if room <= 0:
                self._to_text(content)  # the held text would grow past the bound
                continue
            end = min(n, pos + room)
            if self._mode == _START:
                pos = self._start(text, pos, end, content)
            elif self._mode == _BETWEEN:
                pos = self._between(text, pos, end, content)
            else:
                pos = self._object(text, pos, end, content, calls)
        return ToolParseDelta("".join(content), calls)

    def _start(self, text: str, pos: int, end: int, content: list[str]) -> int:
        """The answer's start: whitespace, at most one tag, then ``{`` (an object) or anything else (content).
        Reads ``text[pos:end]``; returns where it stopped (on a change of mode, or ``end``)."""
        while pos < end:
            if not self._tag_part:
                ws_end = _ws_end(text, pos, end)
                if ws_end > pos:
                    self._held.append(text[pos:ws_end])
                    pos = ws_end
                    continue
                if text[pos] == "{":
                    self._obj_start = len(self._held)
                    self._held.append("{")
                    self._mode, self._depth = _OBJECT, 1
                    return pos + 1
            part = self._tag_part + text[pos]
            self._held.append(text[pos])
            pos += 1
            if part == PYTHON_TAG and not self._tag_seen:
                self._tag_part, self._tag_seen = "", True
            elif len(part) < len(PYTHON_TAG) and PYTHON_TAG.startswith(part):
                self._tag_part = part
            else:
                self._to_text(content)
                return pos
        return pos

    def _between(self, text: str, pos: int, end: int, content: list[str]) -> int:
        """After a call: whitespace and one ``;`` (dropped), then ``{`` (the next object) or content."""
        while pos < end:
            ws_end = _ws_end(text, pos, end)
            if ws_end > pos:
                self._held.append(text[pos:ws_end])
                pos = ws_end
                continue
            ch = text[pos]
            if ch == ";" and not self._seen_sep:
                self._seen_sep = True
                self._held.append(ch)
                pos += 1
                continue
            if ch == "{":
                self._held, self._obj_start = TextBuffer("{"), 0
                self._mode, self._depth = _OBJECT, 1
                return pos + 1
            self._to_text(content)
            return pos
        return pos

    def _object(self, text: str, pos: int, end: int, content: list[str], calls: list[ParsedToolCall]) -> int:
        """Scan JSON in ``text[pos:end]`` until the object closes (then read it) or ``end``."""
        start = pos
        while pos < end:
            if self._in_string:
                if self._escape:
                    self._escape = False
                    pos += 1
                    continue
                m = _IN_STRING.search(text, pos, end)
                if m is None:
                    pos = end
                    break
                pos = m.end()
                if m.group() == "\\":
                    self._escape = True
                else:
                    self._in_string = False
                continue
            m = _STRUCTURE.search(text, pos, end)
            if m is None:
                pos = end
                break
            pos = m.end()
            ch = m.group()
            if ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self._held.append(text[start:pos])
                    self._close_object(content, calls)
                    return pos
        self._held.append(text[start:pos])
        return pos

    def _close_object(self, content: list[str], calls: list[ParsedToolCall]) -> None:
        raw = self._held.text()
        try:
            obj = json.loads(raw[self._obj_start:])
        except (ValueError, RecursionError):
            obj = None
        call = call_from_obj(obj, args_keys=("parameters", "arguments"), args_required=True)
        if call is None:
            self._to_text(content)
            return
        calls.append(call)
        self._held, self._mode, self._seen_sep = TextBuffer(), _BETWEEN, False

    def flush(self) -> ToolParseDelta:
        content: list[str] = []
        if self._mode == _BETWEEN:
            self._held = TextBuffer()  # whitespace and a ';' after the last call: markup
        self._to_text(content)
        return ToolParseDelta("".join(content))
