"""``llama3_json``: Llama 3.1/3.2/3.3's JSON tool calls, vLLM's ``Llama3JsonToolParser``.

The answer is one or more ``{"name": ..., "parameters": {...}}`` objects (``"arguments"`` is accepted too),
separated by ``;``, optionally after ``<|python_tag|>`` (a special token, usually already dropped by
``skip_special_tokens``; as text when the tokenizer lacks it), with whitespace around. Only an answer that
*starts* (after whitespace) with ``{`` or ``<|python_tag|>`` is read as calls, as vLLM does; any other answer is
content. Each object is taken as a call once its closing brace arrives (a small JSON scanner tracks depth and
strings). The first object that is not a call, or text after a call that is neither whitespace, ``;`` nor
another object, turns the rest of the answer into content from that point (the calls before it stand); an
object still open at the end is content.
"""

from __future__ import annotations

import json

from inference.tool_parsers.base import ToolParseDelta, ToolParser, call_from_obj, register_tool_parser

PYTHON_TAG = "<|python_tag|>"
_START, _OBJECT, _BETWEEN, _TEXT = "start", "object", "between", "text"


@register_tool_parser
class Llama3JsonToolParser(ToolParser):
    """See the module docstring."""

    name = "llama3_json"

    def __init__(self) -> None:
        self._mode = _START
        self._raw = ""  # received text not yet emitted or consumed (the current object, a separator, the start)
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._seen_sep = False
        self._obj_start = 0  # where the current object starts in _raw

    def _to_text(self, out: ToolParseDelta) -> None:
        out.content += self._raw
        self._raw, self._mode = "", _TEXT

    def push(self, text: str) -> ToolParseDelta:
        out = ToolParseDelta()
        for ch in text:
            self._step(ch, out)
        return out

    def _step(self, ch: str, out: ToolParseDelta) -> None:
        if self._mode == _TEXT:
            out.content += ch
            return
        self._raw += ch
        if self._mode == _START:
            body = self._raw.lstrip()
            if body.startswith(PYTHON_TAG):
                body = body[len(PYTHON_TAG):].lstrip()
            if not body or (len(body) < len(PYTHON_TAG) and PYTHON_TAG.startswith(body)):
                return
            if body.startswith("{") and len(body) == 1:
                self._mode, self._depth = _OBJECT, 1
                self._obj_start = len(self._raw) - 1
                return
            self._to_text(out)
            return
        if self._mode == _BETWEEN:
            if ch.isspace():
                return
            if ch == ";" and not self._seen_sep:
                self._seen_sep = True
                return
            if ch == "{":
                self._raw, self._mode, self._depth = "{", _OBJECT, 1
                self._obj_start = 0
                return
            self._to_text(out)
            return
        # _OBJECT: scan JSON until the object closes
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
            return
        if ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._close_object(out)

    def _close_object(self, out: ToolParseDelta) -> None:
        try:
            obj = json.loads(self._raw[self._obj_start:])
        except ValueError:
            obj = None
        call = call_from_obj(obj, args_keys=("parameters", "arguments"), args_required=True)
        if call is None:
            self._to_text(out)
            return
        out.calls.append(call)
        self._raw, self._mode, self._seen_sep = "", _BETWEEN, False

    def flush(self) -> ToolParseDelta:
        out = ToolParseDelta()
        if self._mode == _BETWEEN:
            self._raw = ""  # whitespace and a ';' after the last call: markup
        self._to_text(out)
        return out
