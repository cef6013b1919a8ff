"""Text-marker helpers shared by the output parsers (reasoning, tool calls): hold back a possible marker.

A marker such as ``</think>`` or ``<tool_call>`` can arrive split over several text deltas (``"</th"`` then
``"ink>"``); text that may still become a marker is held back, as ``output_processor.StopChecker`` holds back
a possible stop string, so no part of a marker ever leaks into a field.

The parsers run on the api's event loop, once per text delta of every choice, so each is linear in the output:
a delta's work is proportional to the delta plus a bounded look-back (the longest marker), never a rescan of
the text so far. What a parser holds back undecided is bounded by ``MAX_HELD_CHARS`` (the
``OUTPUT_PARSER_MAX_HELD_CHARS`` setting, ``inference.shared.config``); each parser's docstring says what it does past
the bound. A text that grows with the output is a ``TextBuffer``.
"""

from __future__ import annotations

from inference.shared.config import SETTINGS

MAX_HELD_CHARS = SETTINGS.output_parser_max_held_chars
"""Characters an output parser may hold back undecided (default 262144 = 256 Ki). A tool call's markup and
JSON longer than this is not read as a call but released as content, and leading whitespace held longer than
this is released: a tool call's arguments come from the model's output, and 256 Ki characters (some 64k tokens
at ~4 characters a token) is more than any call a client would act on, e.g. a whole source file passed to a
``write_file`` tool, while it keeps what one choice holds to about 1 MiB."""

if MAX_HELD_CHARS < 1:
    raise ValueError(f"OUTPUT_PARSER_MAX_HELD_CHARS must be at least 1, got {MAX_HELD_CHARS}")


class TextBuffer:
    """A text that grows by appends, in O(total length): ``self.text += delta`` on an attribute copies everything
    so far at every delta (O(length²): CPython extends a string in place only when it is a local variable).

    Pieces are joined ``BATCH`` at a time into chunks as they come, so a long text is a list of chunks of a few
    hundred characters or more, not one string object (about 50 bytes of overhead) per delta; every character is
    copied at most twice (into its chunk, then by ``text()``). ``text()`` joins once and keeps the result, so a
    second read costs nothing until more is appended. ``len()`` is the length in characters.
    """

    BATCH = 256
    __slots__ = ("_chunks", "_recent", "_len")

    def __init__(self, text: str = "") -> None:
        self._chunks: list[str] = [text] if text else []
        self._recent: list[str] = []
        self._len = len(text)

    def append(self, piece: str) -> None:
        """Add ``piece`` at the end (amortized O(len(piece)))."""
        if not piece:
            return
        self._recent.append(piece)
        self._len += len(piece)
        if len(self._recent) >= self.BATCH:
            self._chunks.append("".join(self._recent))
            self._recent.clear()

    def text(self) -> str:
        """The whole text (O(its length) the first time after an append, then free)."""
        if self._recent:
            self._chunks.append("".join(self._recent))
            self._recent.clear()
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def __len__(self) -> int:
        return self._len


def partial_marker_len(text: str, marker: str, start: int = 0) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper, non-empty prefix of ``marker`` (0 when
    none): the characters to hold back because the next delta may complete the marker. O(len(marker)²)."""
    for k in range(min(len(text) - start, len(marker) - 1), 0, -1):
        if text.endswith(marker[:k], start):
            return k
    return 0


def split_at_marker(text: str, marker: str) -> tuple[str, str | None, str]:
    """``(before, marker_or_None, after)``: ``before`` is safe to emit; when ``marker`` occurs in ``text``
    ``after`` is what follows its first occurrence, else ``after`` is the held-back tail (a possible start
    of the marker). O(len(text)): call it on a delta plus a held tail shorter than the marker, not on the text
    so far."""
    i = text.find(marker)
    if i >= 0:
        return text[:i], marker, text[i + len(marker):]
    hold = partial_marker_len(text, marker)
    return text[:len(text) - hold], None, text[len(text) - hold:]
