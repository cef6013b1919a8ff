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


def _failure(s: str) -> list[int]:
    """KMP failure function: ``fail[q]`` is the length of the longest proper border (a prefix that is also a
    suffix) of ``s[:q]``, for q in 0..len(s)."""
    fail = [0] * (len(s) + 1)
    k = 0
    for q in range(1, len(s)):
        while k and s[q] != s[k]:
            k = fail[k]
        if s[q] == s[k]:
            k += 1
        fail[q + 1] = k
    return fail


class StopChecker:
    """Stop-string handling over incremental text.

    Args:
        stop: stop strings (non-empty strings; OpenAI allows up to 4, vLLM's default limit; the request
            schemas cap each at ``MAX_STOP_STRING_LEN`` characters).
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

    Algorithm: one Knuth-Morris-Pratt automaton per stop string, its state (the length of the longest
    suffix of all text so far that is a proper prefix of that stop string) carried across pushes, so each
    character is examined once per stop string whatever the chunking. Cost per push: O(len(text) x number
    of stops) amortized, plus O(held-back text) to cut it; building the automata is O(total stop length).
    Held-back text is at most the longest stop string.
    """

    def __init__(self, stop: list[str] | None, include_stop_str_in_output: bool = False):
        stops = list(stop or [])
        for s in stops:
            if not isinstance(s, str) or s == "":
                raise ValueError("stop strings must be non-empty strings")
        self.stop = stops
        self.include = include_stop_str_in_output
        self._fail = [_failure(s) for s in stops]
        self._state = [0] * len(stops)  # per stop: longest suffix of the text that is a proper prefix of it
        self._first: list[int | None] = [None] * len(stops)  # per stop: start of its first occurrence
        self._emitted = 0  # characters emitted so far (absolute position where _pending starts)
        self._pending = ""  # received, not yet emitted
        self.matched: str | None = None

    @property
    def finished(self) -> bool:
        """True once a stop string matched."""
        return self.matched is not None

    def _scan(self, text: str, offset: int) -> None:
        """Advance every automaton over ``text``, which starts at absolute position ``offset``."""
        for k, s in enumerate(self.stop):
            fail, q, n = self._fail[k], self._state[k], len(s)
            first = self._first[k]
            for i, ch in enumerate(text):
                while q and s[q] != ch:
                    q = fail[q]
                if s[q] == ch:
                    q += 1
                if q == n:
                    if first is None:
                        first = offset + i + 1 - n
                    q = fail[n]
            self._state[k], self._first[k] = q, first

    def _earliest_match(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s, i in zip(self.stop, self._first):
            if i is not None and (best is None or i < best[0] or (i == best[0] and len(s) < len(best[1]))):
                best = (i, s)
        return best

    def _earliest_partial(self, end: int) -> int | None:
        """Smallest start j where the text from j to ``end`` (its end) is a proper prefix of a stop string."""
        longest = max(self._state, default=0)
        return end - longest if longest else None

    def _finish(self, match: tuple[int, str]) -> str:
        start, s = match
        end = start + len(s) if self.include else start
        out = self._pending[: end - self._emitted] if end > self._emitted else ""
        self.matched = s
        self._pending = ""
        return out

    def push(self, text: str) -> tuple[str, str | None]:
        """Feed newly decoded text; returns (text to emit now, matched stop string or None)."""
        if self.matched is not None:
            return "", self.matched
        if not self.stop:
            return text, None
        base = self._emitted
        end = base + len(self._pending) + len(text)
        self._scan(text, end - len(text))
        self._pending += text
        match = self._earliest_match()
        if match is not None:
            j = self._earliest_partial(end)
            if j is None or j >= match[0]:
                return self._finish(match), self.matched
            cut = max(base, j)
        elif self.include:
            cut = end
        else:
            j = self._earliest_partial(end)
            cut = end if j is None else max(base, j)
        emit = self._pending[: cut - base]
        self._pending = self._pending[cut - base :]
        self._emitted = cut
        return emit, None

    def flush(self) -> tuple[str, str | None]:
        """End of stream: returns (held-back text, matched stop or None)."""
        if self.matched is not None:
            return "", self.matched
        match = self._earliest_match() if self.stop else None
        if match is not None:
            return self._finish(match), self.matched
        out, self._pending = self._pending, ""
        self._emitted += len(out)
        return out, None
