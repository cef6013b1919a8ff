"""``hermes``: the ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` format of Hermes and Qwen
(Qwen2.5/Qwen3 templates), vLLM's ``Hermes2ProToolParser``.

Text outside ``<tool_call>…</tool_call>`` blocks is content; a possible ``<tool_call>`` prefix at the end of the
text is held back. A block whose body is not ``{"name": str, "arguments": object}`` JSON (``arguments`` may be
missing: ``{}``) stays content, markup included. A block still open at the end of the output (``</tool_call>``
never came: a stop string, ``max_tokens``) is a call when its body parses, else content (vLLM's regex also
takes an unclosed last block).

Bounded hold: a block whose body (the text between the markers) is longer than ``max_held_chars`` characters
(``inference.shared.markers.MAX_HELD_CHARS`` by default) is not a call but content, markup included, like a body that
does not parse: once the open block's body is so long that ``</tool_call>`` can no longer end it within the
bound, the parser releases the block as content and streams the rest of it, up to and including its
``</tool_call>``, as content as it comes (then reads calls again). So it holds at most ``max_held_chars`` plus
the two markers' lengths, and the result still does not depend on the chunking.

Cost: each ``push`` is O(len(text)) plus a look-back of one marker length (the block's body is kept in a
``TextBuffer`` and searched only where the delta may complete ``</tool_call>``); a closed block is joined and
parsed once.
"""

from __future__ import annotations

from inference.shared.markers import MAX_HELD_CHARS, TextBuffer, partial_marker_len
from inference.tool_parsers.base import (ParsedToolCall, ToolParseDelta, ToolParser, call_from_json,
                                         register_tool_parser)

_OUT, _IN, _RELEASED = "out", "in", "released"


@register_tool_parser
class HermesToolParser(ToolParser):
    """See the module docstring.

    Args:
        max_held_chars: the longest block body read as a call, in characters (default ``MAX_HELD_CHARS``).
    """

    name = "hermes"
    open_marker = "<tool_call>"
    close_marker = "</tool_call>"

    def __init__(self, *, max_held_chars: int | None = None) -> None:
        self.max_held_chars = MAX_HELD_CHARS if max_held_chars is None else max_held_chars
        self._mode = _OUT
        self._pending = ""  # _OUT: a possible start of the open marker (shorter than it)
        self._body = TextBuffer()  # _IN: the open block's body so far
        self._tail = ""  # _IN, _RELEASED: the block's last characters, fewer than the close marker (look-back)

    def push(self, text: str) -> ToolParseDelta:
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        if self._pending:
            text, self._pending = self._pending + text, ""
        pos, n = 0, len(text)
        while pos < n:
            if self._mode != _OUT:
                pos = self._in_block(text, pos, content, calls)
                continue
            i = text.find(self.open_marker, pos)
            if i < 0:
                hold = partial_marker_len(text, self.open_marker, pos)
                content.append(text[pos:n - hold])
                self._pending = text[n - hold:]
                break
            content.append(text[pos:i])
            pos = i + len(self.open_marker)
            self._mode = _IN
        return ToolParseDelta("".join(content), calls)

    def _in_block(self, text: str, pos: int, content: list[str], calls: list[ParsedToolCall]) -> int:
        """Read ``text[pos:]`` inside a block; returns where reading stopped (just past ``</tool_call>``, else
        the end of ``text``)."""
        close = self.close_marker
        look = len(close) - 1
        rel: int | None = None  # where the close marker starts, relative to pos (negative: in the tail)
        if self._tail:
            k = (self._tail + text[pos:pos + look]).find(close)
            if k >= 0:
                rel = k - len(self._tail)
        if rel is None:
            j = text.find(close, pos)
            if j >= 0:
                rel = j - pos
        if rel is None:
            seg = text[pos:]
            self._tail = seg[-look:] if len(seg) >= look else (self._tail + seg)[-look:]
            if self._mode == _RELEASED:
                content.append(seg)
            else:
                self._body.append(seg)
                if len(self._body) >= self.max_held_chars + len(close):
                    # any close marker now starts past the bound: the block is content
                    content.extend((self.open_marker, self._body.text()))
                    self._body, self._mode = TextBuffer(), _RELEASED
            return len(text)
        after = pos + rel + len(close)
        if self._mode == _RELEASED:
            content.append(text[pos:after])
        else:
            if rel >= 0:
                self._body.append(text[pos:pos + rel])
                body = self._body.text()
            else:  # the marker started in the tail
                body = self._body.text()[:len(self._body) + rel]
            self._block(body, True, content, calls)
        self._body, self._tail, self._mode = TextBuffer(), "", _OUT
        return after

    def _block(self, body: str, closed: bool, content: list[str], calls: list[ParsedToolCall]) -> None:
        call = call_from_json(body.strip(), args_keys=("arguments", "parameters")) \
            if len(body) <= self.max_held_chars else None
        if call is not None:
            calls.append(call)
            return
        content.extend((self.open_marker, body, self.close_marker if closed else ""))

    def flush(self) -> ToolParseDelta:
        content: list[str] = [self._pending]
        calls: list[ParsedToolCall] = []
        if self._mode == _IN:
            self._block(self._body.text(), False, content, calls)
        self._pending, self._body, self._tail, self._mode = "", TextBuffer(), "", _OUT
        return ToolParseDelta("".join(content), calls)
