"""Incremental detokenization and stop strings for streamed engine output (DESIGN.md §4, §2 step 10).

Importable without Django and torch. Two pieces, used per request (per choice) in the api process:

* ``IncrementalDetokenizer`` turns new token ids into newly complete text. It follows vLLM's
  offset scheme (``vllm/transformers_utils/detokenizer_utils.py::detokenize_incrementally``):
  it keeps ``prefix_offset``/``read_offset`` into prompt+output ids and, per token, decodes only
  the window ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]``; the new text is the
  difference. Text whose decoding ends in U+FFFD (a UTF-8 character split across byte-level
  tokens) is held back until the character completes. Decoding a window that starts a few tokens
  back (initially the last 5 prompt tokens) gives SentencePiece tokenizers their correct leading
  spaces. Cost per token: two decodes of a window of a few tokens, so O(new tokens) per ``push``.
* ``StopChecker`` holds back text that may still become a stop string, finds stop strings split
  across pushes, and truncates at the earliest match (keeping the stop string only when
  ``include_stop_str_in_output``).

Both give the same total output whether tokens are pushed one by one or all at once.
"""

from __future__ import annotations

from typing import Iterable

from inference.renderer.tokenizer_cache import LoadedTokenizer

INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5  # vLLM's value
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decode a growing output token sequence into text, incrementally.

    Args:
        tokenizer: the model's ``LoadedTokenizer``.
        prompt_token_ids: the prompt ids (only the last few are used, as decoding context).
        skip_special_tokens: drop special tokens from the text (vLLM/OpenAI default True).

    ``push(ids)`` returns the newly complete text (possibly ``""``); ``flush()`` returns what was
    held back (an incomplete trailing character decodes to U+FFFD). ``output_token_ids`` and
    ``output_text`` (everything returned so far) are kept for final responses.
    Raises ``TokenIdError`` from ``push`` for ids outside the vocabulary.
    """

    def __init__(self, tokenizer: LoadedTokenizer, prompt_token_ids: Iterable[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids)[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:]
        if skip_special_tokens:
            # Special tokens decode to nothing; dropping them keeps the window meaningful.
            context = [t for t in context if t not in tokenizer.skip_ids]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_token_ids: list[int] = []
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode_unchecked(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self.skip_special_tokens and token_id in self.tokenizer.skip_ids:
            # Decodes to nothing; keep it out of the offsets so it never splits a window.
            self._ids.pop()
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            # Trim the id list so it never grows with the output.
            if self._prefix_offset > 64:
                del self._ids[: self._prefix_offset]
                self._read_offset -= self._prefix_offset
                self._prefix_offset = 0
            return delta
        return ""

    def push(self, new_token_ids: Iterable[int]) -> str:
        """Append generated ids; return the newly complete text (never half a character)."""
        ids = list(new_token_ids)
        self.tokenizer.check_ids(ids)
        self.output_token_ids.extend(ids)
        out = "".join(self._step(t) for t in ids)
        self.output_text += out
        return out

    def flush(self) -> str:
        """End of stream: return any held-back text (an incomplete character becomes U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        out = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.output_text += out
        return out


class StopChecker:
    """Stop-string handling over incremental text.

    Args:
        stop: stop strings (non-empty strings; OpenAI allows up to 4, vLLM's default limit).
        include_stop_str_in_output: keep the matched stop string at the end of the output.

    ``push(text)`` returns ``(text_safe_to_emit, matched_stop_or_None)``. Once a stop string
    matched, the output ends there: later pushes return ``("", matched)``. ``flush()`` ends the
    stream and returns ``(held_back_text, matched_stop_or_None)`` (a stop can still be decided at
    flush, see below).

    Semantics (whole-text, so independent of how the text is chunked): the output is cut at the
    earliest occurrence of any stop string; when two stop strings start at the same position the
    shorter wins (it completes first). A complete match is only final once no other stop string
    could still complete at an earlier start; until then the text from that earlier start is
    held. vLLM instead checks the stop strings in list order over the newly added text
    (``vllm/v1/engine/detokenizer.py::check_stop_strings``); the two agree except when different
    stop strings overlap.
    Without ``include_stop_str_in_output`` a tail that is a proper prefix of a stop string is held
    back; with it, text before any possible stop is emitted at once.
    Cost per push: O((len(text) + longest stop) x number of stops).
    """

    def __init__(self, stop: list[str] | None, include_stop_str_in_output: bool = False):
        stops = list(stop or [])
        for s in stops:
            if not isinstance(s, str) or s == "":
                raise ValueError("stop strings must be non-empty strings")
        self.stop = stops
        self.include = include_stop_str_in_output
        self._max_len = max((len(s) for s in stops), default=0)
        self._pending = ""  # received, not yet emitted
        self._tail = ""  # last (max_len - 1) characters already emitted
        self.matched: str | None = None

    @property
    def finished(self) -> bool:
        """True once a stop string matched."""
        return self.matched is not None

    def _earliest_match(self, window: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = window.find(s)
            if i != -1 and (best is None or i < best[0] or (i == best[0] and len(s) < len(best[1]))):
                best = (i, s)
        return best

    def _earliest_partial(self, window: str, before: int) -> int | None:
        """Smallest j < ``before`` where ``window[j:]`` is a proper prefix of some stop string."""
        for j in range(max(0, len(window) - self._max_len + 1), min(before, len(window))):
            suffix = window[j:]
            for s in self.stop:
                if len(s) > len(suffix) and s.startswith(suffix):
                    return j
        return None

    def _finish(self, window: str, base: int, match: tuple[int, str]) -> str:
        start, s = match
        end = start + len(s) if self.include else start
        self.matched = s
        self._pending = ""
        return window[base:end] if end > base else ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Feed newly decoded text; returns (text to emit now, matched stop string or None)."""
        if self.matched is not None:
            return "", self.matched
        if not self.stop:
            return text, None
        window = self._tail + self._pending + text
        base = len(self._tail)  # window[base:] has not been emitted
        match = self._earliest_match(window)
        if match is not None:
            j = self._earliest_partial(window, match[0])
            if j is None:
                return self._finish(window, base, match), self.matched
            cut = max(base, j)
        elif self.include:
            cut = len(window)
        else:
            j = self._earliest_partial(window, len(window))
            cut = len(window) if j is None else max(base, j)
        emit = window[base:cut]
        self._pending = window[cut:]
        emitted = window[:cut]
        self._tail = emitted[-(self._max_len - 1) :] if self._max_len > 1 else ""
        return emit, None

    def flush(self) -> tuple[str, str | None]:
        """End of stream: returns (held-back text, matched stop or None)."""
        if self.matched is not None:
            return "", self.matched
        window = self._tail + self._pending
        base = len(self._tail)
        match = self._earliest_match(window) if self.stop else None
        if match is not None:
            return self._finish(window, base, match), self.matched
        out, self._pending = self._pending, ""
        return out, None
