"""Per-choice chat output: reasoning, answer text and tool calls out of the detokenized text (issue 16).

One ``ChatOutputParser`` per choice runs the text deltas of ``output_processor`` (after stop strings) through
the served model's reasoning parser (``inference.reasoning``), then the answer part through a tool-call parser
(``inference.tool_parsers``: the model's format for ``tool_choice`` ``auto``, the forced readers for
``required``/named), and gives per delta the stream's delta objects (OpenAI's ``chat.completion.chunk`` delta
shape) and at the end the non-streamed ``message``. Both are built from the same deltas, so a stream's deltas
reassemble to exactly the non-streamed message; a parser's output does not depend on how the text is chunked.

Fields (OpenAI, vLLM 0.33): ``reasoning`` and ``reasoning_content`` (the same text: vLLM's current name and
DeepSeek's older one) only when a reasoning parser runs for the request; ``content`` the answer text outside any
call, ``null`` when it is empty and the choice made calls or wrote reasoning (leading whitespace before
calls is held back in a stream and dropped when calls follow, D-122); ``tool_calls`` one entry per call
``{"id": "chatcmpl-tool-<16 hex>", "type": "function", "function": {"name", "arguments"}}``. A stream sends a
call as two deltas: ``{index, id, type, function: {name, arguments: ""}}``, then ``{index, function:
{arguments}}``.

It runs on the api's event loop for every delta of every choice: each ``push`` is O(len(text)) (the parsers are
linear, ``inference.shared.markers``; the message's texts are ``TextBuffer`` s, joined once when read), and the
leading whitespace held before calls is bounded by ``inference.shared.markers.MAX_HELD_CHARS``: past it, it is released
as content (then kept even when calls follow).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from inference.shared.markers import MAX_HELD_CHARS, TextBuffer
from inference.protocol.engine import FINISH_STOP
from inference.reasoning import REASONING_PARSERS, ReasoningParser, default_reasoning_parser, get_reasoning_parser
from inference.reasoning.base import TokenizerLike
from inference.tool_parsers import TOOL_PARSERS, ParsedToolCall, ToolParser, default_tool_parser, get_tool_parser
from inference.tool_parsers.forced import NamedToolParser, RequiredToolParser, forced_tool_name

AUTO = "auto"
NONE_VALUES = ("", "none")
FINISH_TOOL_CALLS = "tool_calls"


def new_tool_call_id() -> str:
    """``chatcmpl-tool-<16 hex>``, vLLM's default tool call id (``vllm/renderers/chat_utils/tool_call.py``)."""
    return f"chatcmpl-tool-{secrets.token_hex(8)}"


def resolve_parser_name(setting: str | None, chat_template: str | None, *, kind: str) -> str | None:
    """The parser a served model uses: ``setting`` from its registry row (``"auto"``: derived from
    ``chat_template``, ``""``/``"none"``: none, else a registered name); ``kind`` is ``"reasoning"`` or ``"tool"``.
    An unknown name (a parser removed since the row was saved) is ``None``: no parsing rather than a 500."""
    value = (setting or "").strip()
    if value in NONE_VALUES:
        return None
    if value == AUTO:
        return default_reasoning_parser(chat_template) if kind == "reasoning" else default_tool_parser(chat_template)
    return value if value in (REASONING_PARSERS if kind == "reasoning" else TOOL_PARSERS) else None


@dataclass
class ToolCallOut:
    """A call as it is sent: its position in ``tool_calls``, id and parsed call."""

    index: int
    id: str
    call: ParsedToolCall

    def message_entry(self) -> dict[str, Any]:
        """The non-streamed ``message.tool_calls[i]``."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.call.name, "arguments": self.call.arguments}}

    def stream_deltas(self) -> list[dict[str, Any]]:
        """The stream's two deltas of this call (module docstring)."""
        return [{"tool_calls": [{"index": self.index, "id": self.id, "type": "function",
                                 "function": {"name": self.call.name, "arguments": ""}}]},
                {"tool_calls": [{"index": self.index, "function": {"arguments": self.call.arguments}}]}]


@dataclass
class ChatDelta:
    """What one text delta produced: new ``reasoning`` and ``content`` text and the calls it completed."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallOut] = field(default_factory=list)

    def stream_deltas(self, *, with_reasoning: bool) -> list[dict[str, Any]]:
        """The ``delta`` objects of the stream chunks for this delta, in order (empty: nothing to send)."""
        out: list[dict[str, Any]] = []
        first: dict[str, Any] = {}
        if with_reasoning and self.reasoning:
            first["reasoning"] = first["reasoning_content"] = self.reasoning
        if self.content:
            first["content"] = self.content
        if first:
            out.append(first)
        for call in self.calls:
            out.extend(call.stream_deltas())
        return out


class ChatOutputParser:
    """One choice's reasoning / content / tool-call split (module docstring).

    Args:
        reasoning: the request's reasoning parser, or ``None``.
        tools: the request's tool parser, or ``None`` (no tools, ``tool_choice: "none"``, or no parser).
        parallel_tool_calls: ``False`` keeps only the first call (OpenAI, vLLM).
        named_tool: the request forced one named function (its finish reason stays ``stop``, vLLM/OpenAI).
        max_held_chars: the most leading whitespace held back before calls (default ``MAX_HELD_CHARS``).
    """

    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None, *,
                 parallel_tool_calls: bool = True, named_tool: bool = False, max_held_chars: int | None = None):
        self.reasoning = reasoning
        self.tools = tools
        self.parallel_tool_calls = parallel_tool_calls
        self.named_tool = named_tool
        self.max_held_chars = MAX_HELD_CHARS if max_held_chars is None else max_held_chars
        self.calls: list[ToolCallOut] = []
        self._reasoning = TextBuffer()
        self._content = TextBuffer()
        self._content_started = tools is None  # without tools, content flows as it comes
        self._held_ws = TextBuffer()
        self.finished = False

    @property
    def reasoning_text(self) -> str:
        """The reasoning text so far (joined on read: O(its length); read it at the end, not per delta)."""
        return self._reasoning.text()

    @property
    def content_text(self) -> str:
        """The content text so far (joined on read: O(its length); read it at the end, not per delta)."""
        return self._content.text()

    def push(self, text: str) -> ChatDelta:
        """Feed the choice's next text delta."""
        if self.reasoning is None:
            return self._answer(text, final=False)
        rd = self.reasoning.push(text)
        return self._merge(rd.reasoning, self._answer(rd.content, final=False))

    def finish(self) -> ChatDelta:
        """End of the choice: everything held back (call once, after the last ``push``)."""
        self.finished = True
        if self.reasoning is None:
            return self._answer("", final=True)
        rd = self.reasoning.flush()
        return self._merge(rd.reasoning, self._answer(rd.content, final=True))

    def _merge(self, reasoning: str, delta: ChatDelta) -> ChatDelta:
        self._reasoning.append(reasoning)
        delta.reasoning = reasoning
        return delta

    def _answer(self, text: str, *, final: bool) -> ChatDelta:
        if self.tools is None:
            self._content.append(text)
            return ChatDelta(content=text)
        td = self.tools.push(text) if text else None
        content = td.content if td else ""
        new_calls = list(td.calls) if td else []
        if final:
            tail = self.tools.flush()
            content += tail.content
            new_calls += tail.calls
        out = ChatDelta(content=self._gate(content, final=final, calls=bool(self.calls or new_calls)))
        for call in new_calls:
            if not self.parallel_tool_calls and self.calls:
                break
            entry = ToolCallOut(len(self.calls), new_tool_call_id(), call)
            self.calls.append(entry)
            out.calls.append(entry)
        return out

    def _gate(self, content: str, *, final: bool, calls: bool) -> str:
        """Hold leading whitespace until real content comes; drop it at the end when calls were made. Whitespace
        held past ``max_held_chars`` is released (content starts there)."""
        if not self._content_started:
            if content and not content.isspace():
                content, self._content_started = self._held_ws.text() + content, True
                self._held_ws = TextBuffer()
            else:
                self._held_ws.append(content)
                content = ""
                over = len(self._held_ws) > self.max_held_chars
                if over or (final and not calls):
                    content, self._content_started = self._held_ws.text(), over
                    self._held_ws = TextBuffer()
        self._content.append(content)
        return content

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """``tool_calls`` when calls were made, the engine stopped by itself (not ``length``) and no function
        was named (vLLM's ``resolve_finish_reason``); else the engine's reason."""
        if engine_reason == FINISH_STOP and self.calls and not self.named_tool:
            return FINISH_TOOL_CALLS
        return engine_reason

    def message_fields(self, echo: str = "") -> dict[str, Any]:
        """The non-streamed ``message`` fields (``content``, ``tool_calls``; the reasoning fields with a
        reasoning parser). ``echo``: text put before the content (chat ``echo``). Call after ``finish``."""
        empty_is_null = bool(self.calls) or bool(self.reasoning_text)
        content = None if (empty_is_null and not self.content_text) else self.content_text
        fields: dict[str, Any] = {"content": echo + (content or "") if echo else content}
        if self.reasoning is not None:
            reasoning = self.reasoning_text or None
            fields["reasoning"] = fields["reasoning_content"] = reasoning
        fields["tool_calls"] = [c.message_entry() for c in self.calls]
        return fields

    def reasoning_tokens(self, output_token_ids: list[int]) -> int | None:
        """Reasoning tokens of the finished choice; ``None`` without a reasoning parser."""
        return self.reasoning.reasoning_tokens(output_token_ids) if self.reasoning is not None else None


@dataclass(frozen=True)
class ChatOutputSpec:
    """How a request's choices are parsed: the resolved parser names and the request's tool settings. Build
    one per request (``for_request``), then ``parser()`` per choice."""

    tokenizer: Any
    prompt_token_ids: list[int]
    reasoning_parser: str | None
    tool_parser: str | None
    tool_choice: Any
    has_tools: bool
    parallel_tool_calls: bool
    chat_template_kwargs: dict[str, Any] | None

    @classmethod
    def for_request(cls, req: Any, *, tokenizer: TokenizerLike, prompt_token_ids: list[int],
                    reasoning_parser: str | None, tool_parser: str | None) -> ChatOutputSpec:
        """From a validated ``ChatCompletionRequest`` and the model's resolved parser names."""
        return cls(tokenizer=tokenizer, prompt_token_ids=prompt_token_ids, reasoning_parser=reasoning_parser,
                   tool_parser=tool_parser, tool_choice=req.tool_choice, has_tools=bool(req.tools),
                   parallel_tool_calls=req.parallel_tool_calls is not False,
                   chat_template_kwargs=req.chat_template_kwargs)

    def reasoning(self) -> ReasoningParser | None:
        """A fresh reasoning parser for one choice, or ``None``."""
        if self.reasoning_parser is None:
            return None
        return get_reasoning_parser(self.reasoning_parser)(self.tokenizer, self.prompt_token_ids,
                                                           self.chat_template_kwargs)

    def tools(self) -> ToolParser | None:
        """A fresh tool parser for one choice (module docstring), or ``None``."""
        if not self.has_tools or self.tool_choice == "none":
            return None
        if self.tool_choice == "required":
            return RequiredToolParser()
        name = forced_tool_name(self.tool_choice)
        if name is not None:
            return NamedToolParser(name)
        return get_tool_parser(self.tool_parser)() if self.tool_parser is not None else None

    def parser(self) -> ChatOutputParser:
        """A ``ChatOutputParser`` for one choice."""
        return ChatOutputParser(self.reasoning(), self.tools(), parallel_tool_calls=self.parallel_tool_calls,
                                named_tool=forced_tool_name(self.tool_choice) is not None)
