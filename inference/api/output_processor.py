"""Incremental detokenization and stop strings for streamed engine output (docs/ARCHITECTURE.md §4, §2 step 10).

Importable without Django and torch. Its pieces, used per request (per choice) in the api process:

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
* ``AnswerStopChecker``, for a request whose output is parsed for reasoning: stop strings apply to the answer
  only, as vLLM and SGLang match them; the reasoning (and its markers) passes through unchecked.

Both give the same total output whether tokens are pushed one by one or all at once. Both run on the api's event
loop per engine output of every choice, so they are linear in the output: the texts they keep
(``output_text``, ``ChoiceState.text``) are ``TextBuffer`` s, joined once when read, never copied per delta.

On top of them, the per-request output state (vLLM's ``vllm/v1/engine/output_processor.py`` shape):

* ``ChoiceState``: one choice (one engine child request): its detokenizer, stop checker, text, ids, logprobs,
  finish.
* ``RequestState``: one API request: its ``n`` choices (n > 1 reassembly: children ``<id>-<i>`` map back to
  choice ``i``), token counts for usage, first-token and finish times.
* ``OutputProcessor.process_outputs(outputs)``: applies engine outputs (``EngineCoreOutput``) to the states
  and returns the new text per choice (``ChoiceDelta``), the child ids to abort (a stop string matched
  before the engine stopped) and the choices whose first tokens arrived (the admission prefill release).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from inference.shared.markers import TextBuffer
from inference.protocol.engine import FINISH_ABORT, FINISH_ERROR, FINISH_STOP, EngineCoreOutput
from inference.reasoning.base import ReasoningParser
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
    ``output_text`` (everything returned so far; joined on read, O(its length)) are kept for final responses.
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
        self._text = TextBuffer()

    @property
    def output_text(self) -> str:
        """Everything returned so far (joined on read: O(its length), then cached until more text comes)."""
        return self._text.text()

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
        self._text.append(out)
        return out

    def flush(self) -> str:
        """End of stream: return any held-back text (an incomplete character becomes U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        out = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self._text.append(out)
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


class AnswerStopChecker:
    """Stop strings over the answer only: the text before ``reasoning.answer_start`` (the reasoning and its
    markers) is emitted unchecked, the rest goes through ``stops``. ``push`` and ``flush`` as ``StopChecker`` 's.

    Args:
        stops: the request's ``StopChecker`` for this choice (it sees the answer's text only).
        reasoning: a fresh reasoning parser of the request, fed the raw output here only to learn where the answer
            starts (the chat parser that splits the fields is another instance, fed the text after stop strings).

    While the parser cannot yet place its held text (``deciding``: an output start that may or may not open a
    think block) that text is held here too; it is then answer (checked from its first character) or reasoning.
    Once the answer has started the parser is dropped and each push costs what ``StopChecker.push`` costs; before,
    one parser push more (O(len(text))). The engine's stop token ids are not affected (they end the sequence on
    the engine, reasoning or not).
    """

    def __init__(self, stops: StopChecker, reasoning: ReasoningParser):
        self.stops = stops
        self._reasoning: ReasoningParser | None = reasoning
        self._held: list[str] = []  # raw text held while the parser decides (bounded by its own hold)
        self._passed = 0  # raw characters already emitted unchecked (the reasoning part)

    def push(self, text: str) -> tuple[str, str | None]:
        """Feed newly decoded text; returns (text to emit now, matched stop string or None)."""
        parser = self._reasoning
        if parser is None:
            return self.stops.push(text)
        parser.push(text)
        return self._route(parser, text)

    def _route(self, parser: ReasoningParser, text: str) -> tuple[str, str | None]:
        self._held.append(text)
        start = parser.answer_start
        if start is None and parser.deciding:
            return "", None
        raw, self._held = "".join(self._held), []
        if start is None:  # reasoning: not checked
            self._passed += len(raw)
            return raw, None
        self._reasoning = None
        cut = max(0, start - self._passed)
        emit, matched = self.stops.push(raw[cut:])
        return raw[:cut] + emit, matched

    def flush(self) -> tuple[str, str | None]:
        """End of stream: returns (held-back text, matched stop or None)."""
        parser = self._reasoning
        if parser is None:
            return self.stops.flush()
        parser.flush()  # decides a start still undecided
        out, matched = self._route(parser, "")
        if matched is not None:
            return out, matched
        tail, matched = self.stops.flush()
        return out + tail, matched


def stop_checker(stop: list[str] | None, include_stop_str_in_output: bool,
                 reasoning: ReasoningParser | None = None) -> StopChecker | AnswerStopChecker:
    """A choice's stop-string checker: an ``AnswerStopChecker`` when the request has stop strings and its output
    may hold reasoning (``reasoning``: a fresh parser, or ``None``), else a plain ``StopChecker``."""
    stops = StopChecker(stop, include_stop_str_in_output)
    if not stops.stop or reasoning is None or reasoning.answer_start == 0:
        return stops
    return AnswerStopChecker(stops, reasoning)


# ----------------------------------------------------------------------------- per-request output state


@dataclass
class ChoiceState:
    """Output state of one choice (one engine child request). ``text`` (the choice's text after stop strings) is
    kept in ``text_buffer``; ``add_text`` appends, reading ``text`` joins it once."""

    index: int
    request_id: str
    detok: IncrementalDetokenizer
    stops: StopChecker | AnswerStopChecker
    text_buffer: TextBuffer = field(default_factory=TextBuffer)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    # the engine's prompt logprob entries (``EngineCoreOutput.prompt_logprobs``), when the request asked
    prompt_logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None  # ``EngineCoreOutput.error_code`` of the failure
    # which of the request's prompts this choice continues (0 but in a batch of completions prompts)
    prompt_index: int = 0
    # the engine's timestamps of this child (Unix seconds on the replica's clock; ``EngineCoreOutput``): when the
    # replica read it (the latest replica, if it was sent again) and when it was first scheduled there
    queued_ts: float | None = None
    scheduled_ts: float | None = None
    first_token_ts: float | None = None

    @property
    def text(self) -> str:
        """The choice's text so far (joined on read: O(its length), then cached until more text comes)."""
        return self.text_buffer.text()

    def add_text(self, text: str) -> None:
        """Append ``text`` to the choice's text (no copy of what came before)."""
        self.text_buffer.append(text)


@dataclass
class ChoiceDelta:
    """New text (and the ids that produced it) of one choice; ``finish_reason`` set on its last delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class FirstTokenLatency:
    """Where a request's time to first token went, in seconds; a phase is ``None`` when not measured.

    * ``ttft_s``: arrival at the api → first token received by it (the whole TTFT, api clock);
    * ``frontend_s``: arrival → hand-off to the engine link (validation, rendering and tokenization, admission;
      api clock);
    * ``queue_s``: the replica read the request → first scheduled (waiting in its queue; vLLM's
      ``request_queue_time_seconds``; replica clock);
    * ``prefill_s``: first scheduled → first token chosen (vLLM's ``request_prefill_time_seconds``; replica clock).

    Each phase is a difference of two times on one clock, so hosts' clocks need not agree; what is left,
    ``ttft_s`` less the three, is the engine link both ways (Redis streams) and the api's own waits.
    """

    ttft_s: float
    frontend_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None

    def phases(self) -> dict[str, float]:
        """``{phase: seconds}`` of the measured phases (``frontend``, ``queue``, ``prefill``), none negative."""
        raw = {"frontend": self.frontend_s, "queue": self.queue_s, "prefill": self.prefill_s}
        return {k: max(0.0, v) for k, v in raw.items() if v is not None}


class RequestState:
    """Output state of one API request: one ``ChoiceState`` per engine child request.

    Args:
        tokenizer: the model's ``LoadedTokenizer``.
        prompt_token_ids: the prompt all children share (decoding context), or with ``batch_prompts`` the first.
        child_request_ids: the engine request ids, in choice order (choice ``i`` ↔ ``child_request_ids[i]``).
        stop / include_stop_str_in_output / skip_special_tokens: the request's text options (OpenAI/vLLM).
        reasoning: makes a fresh reasoning parser per choice (``ChatOutputSpec.reasoning``) when the output is
            parsed for reasoning: stop strings then apply to the answer only (``AnswerStopChecker``).
        arrival_time: ``time.time()`` when the request arrived (seconds).
        batch_prompts: the prompts of a batch of completions prompts (``P`` of them): the children are laid out
            prompt by prompt, ``len(child_request_ids) / P`` each, so choice ``i`` continues prompt ``i // n``.
            Raises ``ValueError`` when the children do not split evenly.
    """

    def __init__(self, tokenizer: LoadedTokenizer, prompt_token_ids: list[int], child_request_ids: list[str], *,
                 stop: list[str] | None, include_stop_str_in_output: bool, skip_special_tokens: bool,
                 arrival_time: float, batch_prompts: list[list[int]] | None = None,
                 reasoning: Callable[[], ReasoningParser | None] | None = None):
        self.prompts = batch_prompts or [prompt_token_ids]
        if len(child_request_ids) % len(self.prompts):
            raise ValueError(f"{len(child_request_ids)} children do not split evenly over {len(self.prompts)} prompts")
        per_prompt = max(1, len(child_request_ids) // len(self.prompts))
        self.prompt_token_ids = self.prompts[0]
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # ``time.time()`` when the children were handed to the engine link (set by the caller)
        self.sent_time: float | None = None
        self.choices = [ChoiceState(
            index=i, request_id=rid, prompt_index=i // per_prompt,
            detok=IncrementalDetokenizer(tokenizer, self.prompts[i // per_prompt],
                                         skip_special_tokens=skip_special_tokens),
            stops=stop_checker(stop, include_stop_str_in_output, reasoning() if reasoning and stop else None))
            for i, rid in enumerate(child_request_ids)]
        self.by_id = {c.request_id: c for c in self.choices}

    def first_token_latency(self, choice: ChoiceState) -> FirstTokenLatency | None:
        """The TTFT of the request and its phases, ``choice`` being the child whose tokens came first (``None``
        before any token)."""
        if self.first_token_time is None:
            return None
        sched = choice.scheduled_ts
        return FirstTokenLatency(
            ttft_s=self.first_token_time - self.arrival_time,
            frontend_s=None if self.sent_time is None else self.sent_time - self.arrival_time,
            queue_s=None if sched is None or choice.queued_ts is None else sched - choice.queued_ts,
            prefill_s=None if sched is None or choice.first_token_ts is None else choice.first_token_ts - sched)

    def prompt_of(self, choice: ChoiceState) -> list[int]:
        """The prompt ids ``choice`` continues."""
        return self.prompts[choice.prompt_index]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens, each prompt counted once however many choices it has (summed over a batch's prompts,
        as OpenAI and vLLM count them)."""
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        """Output tokens of all choices together."""
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache: per prompt the most any of its children reported, summed
        over the prompts."""
        best = [0] * len(self.prompts)
        for c in self.choices:
            best[c.prompt_index] = max(best[c.prompt_index], c.num_cached_tokens)
        return sum(best)

    @property
    def finished(self) -> bool:
        """True when every choice has a finish reason."""
        return all(c.finish_reason is not None for c in self.choices)

    def abort_unfinished(self) -> list[str]:
        """Mark every unfinished choice ``abort``; returns their engine request ids (to abort on the engine)."""
        unfinished = [c.request_id for c in self.choices if c.finish_reason is None]
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = FINISH_ABORT
        return unfinished

    def error_message(self) -> str | None:
        """The first engine error of any choice (``None`` when no choice failed)."""
        failed = self.failed_choice()
        return None if failed is None else failed.error or "The engine failed while generating"

    def failed_choice(self) -> ChoiceState | None:
        """The first choice the engine failed (``None`` when none did)."""
        return next((c for c in self.choices if c.finish_reason == FINISH_ERROR), None)


@dataclass
class OutputProcessorOutput:
    """What one ``process_outputs`` call produced (vLLM's ``OutputProcessorOutput``).

    ``deltas``: new text per choice, in output order. ``reqs_to_abort``: child ids whose stop string matched
    before the engine finished them (abort them on the engine). ``first_tokens``: ``(choice index, latency)``
    for each choice whose first output tokens arrived in this call; ``latency`` (the request's TTFT and where it
    went, ``FirstTokenLatency``) only on the request's very first tokens, else ``None``.
    """

    deltas: list[ChoiceDelta] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)
    first_tokens: list[tuple[int, FirstTokenLatency | None]] = field(default_factory=list)


class OutputProcessor:
    """Turns engine outputs of one request's children into text deltas (detokenize, stop strings, finish).

    ``process_outputs`` is synchronous and pure bookkeeping (no I/O); the caller aborts ``reqs_to_abort`` on the
    engine and releases the prefill reservation of ``first_tokens``. Outputs of unknown or already finished
    children are ignored.
    """

    def __init__(self, state: RequestState):
        self.state = state
        self._seen_first: set[int] = set()

    def process_outputs(self, outputs: Iterable[EngineCoreOutput]) -> OutputProcessorOutput:
        """Apply ``outputs`` in order; see ``OutputProcessorOutput``."""
        result = OutputProcessorOutput()
        for out in outputs:
            choice = self.state.by_id.get(out.request_id)
            if choice is None or choice.finish_reason is not None:
                continue
            first = self.state.first_token_time is None
            delta, abort = self._apply(choice, out)
            if out.new_token_ids and choice.index not in self._seen_first:
                self._seen_first.add(choice.index)
                result.first_tokens.append((choice.index, self.state.first_token_latency(choice) if first else None))
            if abort:
                result.reqs_to_abort.append(choice.request_id)
            if delta is not None:
                result.deltas.append(delta)
        if self.state.finished and self.state.finished_time is None:
            self.state.finished_time = time.time()
        return result

    def _apply(self, state: ChoiceState, out: EngineCoreOutput) -> tuple[ChoiceDelta | None, bool]:
        if out.num_cached_tokens:
            state.num_cached_tokens = out.num_cached_tokens
        if out.queued_ts is not None:  # the latest replica's (a request sent again is read again)
            state.queued_ts = out.queued_ts
        if out.scheduled_ts is not None:
            state.scheduled_ts = out.scheduled_ts
        if out.first_token_ts is not None:
            state.first_token_ts = out.first_token_ts
        new_ids = list(out.new_token_ids)
        if new_ids and self.state.first_token_time is None:
            self.state.first_token_time = time.time()
        state.token_ids.extend(new_ids)
        if out.new_logprobs:
            state.logprobs.extend(out.new_logprobs)
        if out.prompt_logprobs is not None:
            state.prompt_logprobs = out.prompt_logprobs
        text = state.detok.push(new_ids) if new_ids else ""
        finish = out.finish_reason
        if finish is not None:
            text += state.detok.flush()
        emit, matched = state.stops.push(text)
        if matched is not None:
            state.finish_reason, state.stop_reason = FINISH_STOP, matched
            state.add_text(emit)
            return ChoiceDelta(state.index, emit, new_ids, FINISH_STOP, matched), finish is None
        if finish is not None:
            tail, late_match = state.stops.flush()
            emit += tail
            state.finish_reason = FINISH_STOP if late_match is not None else finish
            state.stop_reason = late_match if late_match is not None else out.stop_reason
            state.error, state.error_code = out.error, out.error_code
        state.add_text(emit)
        if not emit and not new_ids and finish is None:
            return None, False
        return ChoiceDelta(state.index, emit, new_ids, state.finish_reason, state.stop_reason), False
