"""Reasoning parsers: split a thinking model's output into ``reasoning`` and ``content``, incrementally.

vLLM's reasoning parsers (``vllm/reasoning/``, ``--reasoning-parser``) in the shape this platform needs: one
parser object per choice, fed the detokenized text deltas in order (``push``), closed with ``flush`` at the
end of the choice. Every call returns a ``ReasoningDelta``; the concatenation of all deltas is the same
whatever the chunking (one token at a time or the whole text at once), and no part of a marker is ever
emitted into either field (possible marker prefixes are held back, ``inference.shared.markers``). A parser also
says where the answer begins in the raw text (``answer_start``), so that stop strings apply to the answer only.

Parsers are chosen by name from ``REASONING_PARSERS`` (``register_reasoning_parser`` adds one), per served
model (the registry's ``reasoning_parser`` field; ``"auto"`` derives it from the chat template,
``default_reasoning_parser``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


class TokenizerLike(Protocol):
    """What a reasoning parser needs of the tokenizer (``LoadedTokenizer`` has it)."""

    def token_to_id(self, token: str | None) -> int | None: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


@dataclass
class ReasoningDelta:
    """New text of one choice: ``reasoning`` (inside the think block) and ``content`` (the answer)."""

    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """One choice's reasoning split. Subclasses set ``name`` and implement ``push``/``flush``.

    Args:
        tokenizer: the served model's tokenizer (marker ids, prompt tail decoding).
        prompt_token_ids: the rendered prompt (decides whether the output starts inside a think block).
        chat_template_kwargs: the request's ``chat_template_kwargs`` (``enable_thinking``).
    """

    name: ClassVar[str] = ""

    def __init__(self, tokenizer: TokenizerLike, prompt_token_ids: list[int],
                 chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.chat_template_kwargs = chat_template_kwargs or {}

    @property
    def thinking(self) -> bool:
        """Whether the output can hold reasoning at all (``False``: everything is content)."""
        raise NotImplementedError

    @property
    def end_token_ids(self) -> list[int]:
        """Ids that end the reasoning (a structured-output constraint starts after one), ``[]`` if none."""
        raise NotImplementedError

    def push(self, text: str) -> ReasoningDelta:
        """Feed the next text delta; returns what is now safe to emit."""
        raise NotImplementedError

    def flush(self) -> ReasoningDelta:
        """End of the choice: everything held back."""
        raise NotImplementedError

    def reasoning_tokens(self, output_token_ids: list[int]) -> int:
        """``usage.completion_tokens_details.reasoning_tokens`` of a finished choice."""
        raise NotImplementedError

    @property
    def answer_start(self) -> int | None:
        """Where the answer begins in the text pushed so far (a count of characters of the raw output, the markers
        included), once it has begun; ``None`` while the output is (or may still be) reasoning. Stop strings are
        matched from there only (``inference.api.output_processor.AnswerStopChecker``). The default, ``0``, suits
        a parser that does not track it: stop strings then apply to its whole output."""
        return 0

    @property
    def deciding(self) -> bool:
        """``True`` while the parser holds text it cannot yet place: it may turn out to be reasoning or answer
        (``answer_start`` then stays ``None``). Default ``False``."""
        return False



REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}


def register_reasoning_parser(cls: type[ReasoningParser]) -> type[ReasoningParser]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if not cls.name:
        raise ValueError("a reasoning parser needs a name")
    REASONING_PARSERS[cls.name] = cls
    return cls


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class registered as ``name``; ``KeyError`` when none is."""
    return REASONING_PARSERS[name]
