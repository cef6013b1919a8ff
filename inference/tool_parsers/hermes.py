"""``hermes``: the ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` format of Hermes and Qwen
(Qwen2.5/Qwen3 templates), vLLM's ``Hermes2ProToolParser``.

Text outside ``<tool_call>…</tool_call>`` blocks is content; a possible ``<tool_call>`` prefix at the end of the
text is held back. A block whose body is not ``{"name": str, "arguments": object}`` JSON (``arguments`` may be
missing: ``{}``) stays content, markup included. A block still open at the end of the output (``</tool_call>``
never came: a stop string, ``max_tokens``) is a call when its body parses, else content (vLLM's regex also
takes an unclosed last block).
"""

from __future__ import annotations

from inference.markers import split_at_marker
from inference.tool_parsers.base import ToolParseDelta, ToolParser, call_from_json, register_tool_parser


@register_tool_parser
class HermesToolParser(ToolParser):
    """See the module docstring."""

    name = "hermes"
    open_marker = "<tool_call>"
    close_marker = "</tool_call>"

    def __init__(self) -> None:
        self._pending = ""
        self._in_call = False

    def _block(self, body: str, closed: bool) -> ToolParseDelta:
        call = call_from_json(body.strip(), args_keys=("arguments", "parameters"))
        if call is not None:
            return ToolParseDelta(calls=[call])
        return ToolParseDelta(content=self.open_marker + body + (self.close_marker if closed else ""))

    def push(self, text: str) -> ToolParseDelta:
        out = ToolParseDelta()
        self._pending += text
        while True:
            if not self._in_call:
                before, marker, rest = split_at_marker(self._pending, self.open_marker)
                out.content += before
                self._pending = rest
                if marker is None:
                    return out
                self._in_call = True
            else:
                i = self._pending.find(self.close_marker)
                if i < 0:
                    return out  # the whole block is held until it closes
                out.extend(self._block(self._pending[:i], closed=True))
                self._pending = self._pending[i + len(self.close_marker):]
                self._in_call = False

    def flush(self) -> ToolParseDelta:
        held, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            return self._block(held, closed=False)
        return ToolParseDelta(content=held)
