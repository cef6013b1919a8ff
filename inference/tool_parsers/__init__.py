"""Tool-call parsers (``base``: interface and registry; ``hermes``, ``llama3_json``: formats; ``forced``:
``tool_choice`` required/named through a JSON schema)."""

from inference.tool_parsers.base import (TOOL_PARSERS, ParsedToolCall, ToolParseDelta, ToolParser, get_tool_parser,
                                         register_tool_parser)
from inference.tool_parsers.hermes import HermesToolParser
from inference.tool_parsers.llama3_json import Llama3JsonToolParser


def default_tool_parser(chat_template: str | None) -> str | None:
    """The ``"auto"`` choice from a chat template: ``hermes`` when it renders ``<tool_call>``, ``llama3_json``
    when it renders Llama 3.1's ``<|python_tag|>`` or its ``ipython`` role, else ``None`` (no parsing)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HermesToolParser.name
    if "<|python_tag|>" in chat_template or "ipython" in chat_template:
        return Llama3JsonToolParser.name
    return None


__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "ParsedToolCall", "ToolParseDelta",
           "ToolParser", "default_tool_parser", "get_tool_parser", "register_tool_parser"]
