"""``<think>…</think>`` reasoning parsers: Qwen3 (``qwen3``) and DeepSeek-R1 style (``deepseek_r1``).

Where the output starts is read from the rendered prompt's last think markers (ids of the template's own markup:
request text never holds them as control ids, D-064):

* the prompt ends inside an open think block (DeepSeek-R1's and Qwen3-Thinking-2507's templates put ``<think>\\n``
  in the generation prompt) → the output starts in the reasoning; a repeated ``<think>`` at its start is dropped;
* the prompt closes the think block at its end (Qwen3 with ``chat_template_kwargs.enable_thinking: false`` renders
  ``<think>\\n\\n</think>\\n\\n``), or the request says ``enable_thinking: false`` and the prompt opens none
  → no reasoning: the whole output is content;
* otherwise the output decides: one that starts with ``<think>`` (leading whitespace allowed) is reasoning up
  to ``</think>``; one that does not is content (``qwen3``) or reasoning anyway up to ``</think>``
  (``deepseek_r1``: R1 models may omit the opening tag, vLLM's ``DeepSeekR1ReasoningParser``).

Reasoning that never ends (``max_tokens`` reached inside it) stays reasoning. The text between the markers is kept
as the model wrote it (vLLM does not strip it either); the text after ``</think>`` is the content. ``answer_start``
(where stop strings start to apply) is 0 for an output that is content from its start, else the end of
``</think>`` once the block closed.

Bounded hold and cost: reasoning and content flow as they come (only a possible start of ``</think>`` is held
back), so the one thing held is the output's leading whitespace while it is undecided whether a ``<think>``
follows; whitespace longer than ``max_held_chars`` (``inference.shared.markers.MAX_HELD_CHARS`` by default) decides it:
the output then does not start with a think block (the rule above for an output without ``<think>``). Each
``push`` is O(len(text)) plus a look-back of one marker length.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from inference.shared.markers import MAX_HELD_CHARS, TextBuffer, split_at_marker
from inference.reasoning.base import ReasoningDelta, ReasoningParser, TokenizerLike, register_reasoning_parser

_START, _REASONING, _CONTENT = "start", "reasoning", "content"
_NON_WS = re.compile(r"\S")  # ``\s`` is ``str.isspace``'s set, the whitespace ``str.lstrip`` drops


class ThinkTagReasoningParser(ReasoningParser):
    """Reasoning between ``start_marker`` and ``end_marker`` (module docstring for where it starts).

    ``implicit_start``: without an opening marker in the output (and none open in the prompt), the output is
    reasoning up to ``end_marker`` (True, R1) or content (False, Qwen3).

    ``max_held_chars``: the longest leading whitespace held while the start is undecided (default
    ``MAX_HELD_CHARS``; module docstring).
    """

    start_marker: ClassVar[str] = "<think>"
    end_marker: ClassVar[str] = "</think>"
    implicit_start: ClassVar[bool] = False

    def __init__(self, tokenizer: TokenizerLike, prompt_token_ids: list[int],
                 chat_template_kwargs: dict[str, Any] | None = None, *, max_held_chars: int | None = None):
        super().__init__(tokenizer, prompt_token_ids, chat_template_kwargs)
        self.max_held_chars = MAX_HELD_CHARS if max_held_chars is None else max_held_chars
        self._start_id = tokenizer.token_to_id(self.start_marker)
        self._end_id = tokenizer.token_to_id(self.end_marker)
        prompt_state = self._prompt_state()
        disabled = self.chat_template_kwargs.get("enable_thinking") is False
        if prompt_state == "open":
            self._mode, self._fallback = _START, _REASONING
        elif prompt_state == "closed" or disabled:
            self._mode, self._fallback = _CONTENT, _CONTENT
        else:
            self._mode, self._fallback = _START, (_REASONING if self.implicit_start else _CONTENT)
        self._thinking = self._mode != _CONTENT
        # the output surely starts in the reasoning (the prompt opened it, or R1's implicit start)
        self._starts_in_reasoning = self._fallback == _REASONING
        # _START: the text after the leading whitespace (a proper prefix of start_marker); _REASONING: a possible
        # start of end_marker
        self._pending = ""
        self._ws = TextBuffer()  # _START: the leading whitespace
        self._had_reasoning = False  # the output entered the think block
        self._pushed = 0  # characters pushed so far
        self._answer_start: int | None = 0 if self._mode == _CONTENT else None

    def _prompt_state(self) -> str:
        """``"open"``, ``"closed"`` (closed with only whitespace after) or ``"none"``: the think block at the
        end of the prompt, from the marker ids (the markers must be single tokens of the vocabulary)."""
        if self._start_id is None or self._end_id is None:
            return "none"
        ids = self.prompt_token_ids
        last_start = last_end = -1
        for i in range(len(ids) - 1, -1, -1):
            if ids[i] == self._start_id and last_start < 0:
                last_start = i
            elif ids[i] == self._end_id and last_end < 0:
                last_end = i
            if last_start >= 0 and last_end >= 0:
                break
        if last_start > last_end:
            return "open"
        if last_end >= 0 and not self.tokenizer.decode(list(ids[last_end + 1:])).strip():
            return "closed"
        return "none"

    @property
    def thinking(self) -> bool:
        return self._thinking

    @property
    def end_token_ids(self) -> list[int]:
        """The end marker's id when the output surely starts in the reasoning; ``[]`` otherwise, also for Qwen3
        without an open block in the prompt (the model may answer without thinking: an output constraint waiting
        for ``</think>`` would then never start, so it applies from the first token, D-125)."""
        return [self._end_id] if self._starts_in_reasoning and self._end_id is not None else []

    @property
    def answer_start(self) -> int | None:
        """0 when the output is content from its start, the end of ``end_marker`` once the reasoning closed,
        ``None`` before."""
        return self._answer_start

    @property
    def deciding(self) -> bool:
        """While the output's start is undecided (leading whitespace, a possible start of ``start_marker``)."""
        return self._mode == _START

    def push(self, text: str) -> ReasoningDelta:
        self._pushed += len(text)
        if self._mode == _START:
            started = self._start(text)
            if started is None:
                return ReasoningDelta()
            text = started
        if self._mode == _REASONING:
            before, marker, rest = split_at_marker(self._pending + text, self.end_marker)
            if marker is None:
                self._pending = rest
                return ReasoningDelta(reasoning=before)
            self._pending, self._mode = "", _CONTENT
            self._answer_start = self._pushed - len(rest)  # the marker ends in this push: ``rest`` is its tail
            return ReasoningDelta(reasoning=before, content=rest)
        return ReasoningDelta(content=text)

    def _start(self, text: str) -> str | None:
        """Decide where the output starts; returns the text to read in the mode decided (the leading whitespace
        dropped before a start marker), ``None`` while it is still undecided (all of ``text`` held)."""
        if not self._pending:
            m = _NON_WS.search(text)
            ws = text if m is None else text[:m.start()]
            self._ws.append(ws)
            if len(self._ws) > self.max_held_chars:
                return self._fallback_start(text[len(ws):])
            if m is None:
                return None
            text = text[len(ws):]
        body = self._pending + text
        if body.startswith(self.start_marker):
            self._pending, self._ws = "", TextBuffer()
            self._mode, self._had_reasoning = _REASONING, True
            return body[len(self.start_marker):]
        if self.start_marker.startswith(body):
            self._pending = body  # a proper prefix of the marker: wait for more
            return None
        self._pending = ""
        return self._fallback_start(body)

    def _fallback_start(self, rest: str) -> str:
        """No start marker: the fallback mode; returns the held whitespace and ``rest``, to read in it."""
        held = self._ws.text() + rest
        self._ws = TextBuffer()
        self._mode = self._fallback
        self._had_reasoning = self._mode == _REASONING
        if self._mode == _CONTENT:
            self._answer_start = 0  # the undecided start was the output's: all of it is content
        return held

    def flush(self) -> ReasoningDelta:
        held, self._pending = self._pending, ""
        if self._mode == _START:
            held = self._fallback_start(held)
        if self._mode == _REASONING:
            return ReasoningDelta(reasoning=held)
        return ReasoningDelta(content=held)

    def reasoning_tokens(self, output_token_ids: list[int]) -> int:
        """Output tokens up to and including the first end marker (the markers count: they are hidden thinking
        tokens, as OpenAI counts every hidden token), all of them when the reasoning never ended; 0 when the
        output held no reasoning. By id when the end marker is one token, else by re-encoding the text. Call it
        after ``flush``."""
        if not self._had_reasoning:
            return 0
        if self._end_id is not None:
            try:
                return output_token_ids.index(self._end_id) + 1
            except ValueError:
                return len(output_token_ids)
        text = self.tokenizer.decode(output_token_ids)
        end = text.find(self.end_marker)
        if end < 0:
            return len(output_token_ids)
        return min(len(output_token_ids),
                   len(self.tokenizer.encode(text[:end + len(self.end_marker)], add_special_tokens=False)))


@register_reasoning_parser
class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Qwen3 (and QwQ, Qwen3-Thinking): ``<think>`` in the prompt or the output; none → content."""

    name = "qwen3"


@register_reasoning_parser
class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-R1 style: the output is reasoning until ``</think>`` even without an opening ``<think>``."""

    name = "deepseek_r1"
    implicit_start = True


def default_reasoning_parser(chat_template: str | None) -> str | None:
    """The ``"auto"`` choice from a chat template: ``deepseek_r1`` when it renders ``<think>`` and DeepSeek's
    ``<｜Assistant｜>``, ``qwen3`` when it renders ``<think>``, else ``None`` (no reasoning parsing)."""
    if not chat_template or "<think>" not in chat_template:
        return None
    return "deepseek_r1" if "<｜Assistant｜>" in chat_template else "qwen3"
