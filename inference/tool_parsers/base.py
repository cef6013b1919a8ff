"""Tool-call parsers: find the calls a model wrote in its answer text, incrementally.

vLLM's tool parsers (``vllm/tool_parsers/``, ``--tool-call-parser``) in this platform's shape: one parser object
per choice, fed the answer text (the content after any reasoning was split off) delta by delta (``push``) and
closed with ``flush``. Each call returns a ``ToolParseDelta``: text that stays content, and the calls completed
by that text. A call is emitted only once its markup is complete and its JSON parsed (D-121): a call whose JSON
does not parse stays content text, markup included, so a client never receives half a call it cannot use. The
concatenation of all deltas does not depend on the chunking.

The parsers run on the api's event loop for every text delta of every choice, so each is linear in the output
(a ``push`` costs O(len(text)) plus a look-back of one marker, never a rescan of what came before) and holds
back at most ``inference.shared.markers.MAX_HELD_CHARS`` characters plus its markup: text held longer than that (a call
too long to be one) is released as content (each parser's docstring says how).

Parsers are chosen by name from ``TOOL_PARSERS`` (``register_tool_parser`` adds one), per served model (the
registry's ``tool_call_parser`` field; ``"auto"`` derives it from the chat template, ``default_tool_parser``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class ParsedToolCall:
    """One complete call: the function ``name`` and its ``arguments`` as a JSON object string (OpenAI's
    ``function.arguments``; ``json.dumps(..., ensure_ascii=False)`` of the parsed object, as vLLM writes it)."""

    name: str
    arguments: str


@dataclass
class ToolParseDelta:
    """What one ``push``/``flush`` produced: ``content`` (text outside calls) and completed ``calls``."""

    content: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)

    def extend(self, other: ToolParseDelta) -> None:
        """Append ``other`` (in order) to this delta (copies ``content``: not for a loop over many deltas)."""
        self.content += other.content
        self.calls.extend(other.calls)


def call_from_json(text: str, *, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedToolCall | None:
    """A ``ParsedToolCall`` from ``{"name": str, "<args key>": {...}}`` text, ``None`` when it is not one (not
    JSON, not an object, no string ``name``, arguments that are not an object, nesting too deep for the JSON
    decoder). A missing arguments key means ``{}`` only when ``args_keys`` allows it (see the parsers)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return call_from_obj(obj, args_keys=args_keys)


def call_from_obj(obj: Any, *, args_keys: tuple[str, ...] = ("arguments", "parameters"),
                  args_required: bool = False) -> ParsedToolCall | None:
    """``call_from_json`` for an already parsed value."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in args_keys if k in obj), None)
    if key is None:
        if args_required:
            return None
        args: Any = {}
    else:
        args = obj[key]
    if not isinstance(args, dict):
        return None
    try:
        arguments = json.dumps(args, ensure_ascii=False)
    except RecursionError:  # nested as deep as the decoder allows, one frame deeper here
        return None
    return ParsedToolCall(obj["name"], arguments)


class ToolParser:
    """One choice's tool-call extraction. Subclasses set ``name`` and implement ``push``/``flush``."""

    name: ClassVar[str] = ""

    def push(self, text: str) -> ToolParseDelta:
        """Feed the next answer-text delta."""
        raise NotImplementedError

    def flush(self) -> ToolParseDelta:
        """End of the choice: held-back text, and a last call that was complete but not closed."""
        raise NotImplementedError


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(cls: type[ToolParser]) -> type[ToolParser]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if not cls.name:
        raise ValueError("a tool parser needs a name")
    TOOL_PARSERS[cls.name] = cls
    return cls


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ``KeyError`` when none is."""
    return TOOL_PARSERS[name]
