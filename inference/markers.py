"""Text-marker helpers shared by the output parsers (reasoning, tool calls): hold back a possible marker.

A marker such as ``</think>`` or ``<tool_call>`` can arrive split over several text deltas (``"</th"`` then
``"ink>"``); text that may still become a marker is held back, as ``output_processor.StopChecker`` holds back
a possible stop string, so no part of a marker ever leaks into a field.
"""

from __future__ import annotations


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper, non-empty prefix of ``marker`` (0 when
    none): the characters to hold back because the next delta may complete the marker. O(len(marker)²)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def split_at_marker(text: str, marker: str) -> tuple[str, str | None, str]:
    """``(before, marker_or_None, after)``: ``before`` is safe to emit; when ``marker`` occurs in ``text``
    ``after`` is what follows its first occurrence, else ``after`` is the held-back tail (a possible start
    of the marker)."""
    i = text.find(marker)
    if i >= 0:
        return text[:i], marker, text[i + len(marker):]
    hold = partial_marker_len(text, marker)
    return text[:len(text) - hold], None, text[len(text) - hold:]
