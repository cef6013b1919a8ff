"""Scheduler: the native engine's scheduling of a replica's requests over its ``runner.ModelRunner``.

One step (``Scheduler.step``):

1. spend the step's token budget (``max_num_batched_tokens``, less one token per running sequence) on prompts: the
   next chunk of prompts being prefilled a chunk at a time (chunked prefill), then waiting requests that fit
   (``max_num_seqs``) -- whole prompts in one batched forward, and the first one that does not fit in the budget left
   starts a chunk at a time (a prompt whose prefix K/V is cached runs on its own from there: ``prefix_cache.py``);
   waiting requests go in priority order (``base_scheduler.enqueue_by_priority``), and those whose grammar still
   compiles stay waiting;
2. hand out the first tokens this gave (the first part of the step's outputs), when a decode follows;
3. run one decode step for every sequence that was running when the step began;
4. sample (batched, under the structured-output masks: ``structured.py``), apply the stop rules, and hand out the
   rest of the step's outputs.

So a long prompt never stalls the running decodes for more than one chunk's forward, and a newcomer's first token
does not wait for the running batch's decode.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from inference.protocol.engine import (
    FINISH_ABORT,
    ERROR_STRUCTURED_OUTPUT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    STRUCTURED_KINDS,
    EngineCoreOutput,
    EngineStats,
)

from .base_scheduler import BaseScheduler, Outputs, ema
from .runner import ModelRunner, RequestError, now
from .sequence import Sequence
from inference.shared.structured_probe import matcher_error_reason

from .structured import GrammarCompiler, GrammarMask, GrammarMasker, SequenceGrammar

if TYPE_CHECKING:
    import torch

log = logging.getLogger("inference.engine")

GRAMMAR_WAIT_S = 0.005  # with nothing to run but requests whose grammar compiles, wait this long for one

_MaskAhead = concurrent.futures.Future[GrammarMask | None]


class Scheduler(BaseScheduler):
    """Priority admission, whole and chunked prefill, decode, stop and grammar checks over a ``ModelRunner``.

    Args:
        runner: a loaded ``ModelRunner`` (or ``vl_runner.VLModelRunner``).
        engine_id, stats, max_num_seqs: as ``BaseScheduler``.
        max_num_batched_tokens: tokens one step computes at most (vLLM's name): one per running decode, the
            rest for prompt chunks. Without chunked prefill it bounds the prompt tokens of a step's prefill
            group (a single longer prompt still runs whole).
        enable_chunked_prefill: prefill long prompts a chunk at a time between decode steps (on by default;
            runners that cannot, the VL runner, prefill whole prompts).
    Raises ``ValueError`` when ``max_num_batched_tokens < max_num_seqs``.
    """

    def __init__(self, runner: ModelRunner, engine_id: str, stats: EngineStats, *, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512, enable_chunked_prefill: bool = True):
        super().__init__(engine_id, stats, max_num_seqs, runner.max_model_len)
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every running sequence decodes one token per step")
        self.runner = runner
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill and runner.supports_chunked_prefill
        self.running: list[Sequence] = []  # decoding: prompt in the KV cache, a KV slot each
        self.prefilling: list[Sequence] = []  # prompts being prefilled a chunk at a time (a KV slot each)
        self._grammars: GrammarCompiler | None = None
        self._masker: GrammarMasker | None = None

    # ------------------------------------------------------------------ structured outputs
    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler (``structured.py``), created on first use (its tokenizer builds in its pool)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.runner.model_dir, list(self.runner.eos_token_ids))
        return self._grammars

    @property
    def masker(self) -> GrammarMasker:
        """The per-step mask builder (``structured.py``)."""
        if self._masker is None:
            self._masker = GrammarMasker(self.grammars)
        return self._masker

    def _grammar_of(self, seq: Sequence) -> SequenceGrammar | None:
        """Start compiling ``seq``'s constraint (or take it from the cache); None when it has none. Raises
        ``RequestError`` for an unknown kind."""
        sp = seq.params
        if sp.structured_kind is None:
            return None
        if sp.structured_kind not in STRUCTURED_KINDS:
            raise RequestError(f"unknown structured_kind {sp.structured_kind!r}")
        eos = seq.eos_ids or frozenset(self.runner.eos_token_ids)
        return SequenceGrammar(self.grammars.compile(sp.structured_kind, sp.structured_spec,
                                                     scope=seq.request.cache_salt or ""),
                               sp.structured_after_token_ids, eos)

    def start(self) -> None:
        """Build the grammar tokenizer before serving: llguidance holds the GIL for part of its ~1-2 s (up to seconds
        on a loaded machine), which would stall the step loop and the heartbeat if it ran later. A failure is
        logged; constrained requests then finish with its error."""
        try:
            _ = self.grammars.tokenizer
        except Exception:  # logged; the engine serves unconstrained requests without it
            log.exception("structured outputs unavailable: the grammar tokenizer did not load")

    def shutdown(self) -> None:
        """Stop the grammar compiler's and the masker's thread pools."""
        if self._masker is not None:
            self._masker.shutdown()
        if self._grammars is not None:
            self._grammars.shutdown()

    def wait_if_blocked(self) -> None:
        """With nothing running and every waiting request's grammar still compiling, wait a little for one
        (instead of spinning on Redis)."""
        pending = [s.grammar.future for s in self.waiting if s.grammar is not None and not s.grammar.ready()]
        if self.running or len(pending) != len(self.waiting):
            return
        concurrent.futures.wait(pending, timeout=GRAMMAR_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)

    # ------------------------------------------------------------------ requests
    def _prepare(self, seq: Sequence) -> None:
        if seq.request.pooling:
            raise RequestError("this engine serves a generative model; it cannot compute embeddings")
        self.runner.prepare(seq)
        seq.grammar = self._grammar_of(seq)

    def active(self) -> list[Sequence]:
        return [*self.running, *self.prefilling]

    def _abort_active(self, ids: set[str]) -> None:
        for held_list in (self.running, self.prefilling):
            gone = [s for s in held_list if s.request_id in ids]
            for seq in gone:
                self._finish_out(seq, FINISH_ABORT)
                held_list.remove(seq)
            if gone:
                self.runner.release(gone)

    def _forget_all(self) -> None:
        self.running = []
        self.prefilling = []

    # ------------------------------------------------------------------ stepping
    def step(self) -> Iterator[Outputs]:
        """One engine iteration: prefill prompt tokens within the step's budget (chunks of prompts already started,
        then newcomers), then decode every sequence that was running when the step began, then drop finished ones.

        The budget (``max_num_batched_tokens``) is what the step's decodes leave; only the order of the two forwards
        is prefill first. When the prefills produced outputs and decodes follow, those outputs are yielded first,
        before the decode forward runs, so a newcomer's first token goes out before the running batch's decode
        instead of after it: its time to first token no longer includes a decode step of everyone else, and the
        running sequences' tokens go out when they did before (end of the step). vLLM's V1 scheduler runs both in
        one forward, so its newcomers wait for the whole step. The rest of the outputs are yielded at the end."""
        # the running batch at the step's start (slot order: the runner's rows); prefilled newcomers join next step
        decode_seqs = sorted(self.running, key=lambda s: s.slot if s.slot is not None else -1)
        self._prefill_step(self.max_num_batched_tokens - len(decode_seqs))
        # a failed sampling of the prefills fails the whole running batch (_prefilled): nothing of it to decode then
        decode_seqs = [s for s in decode_seqs if s.finish_reason is None]
        if decode_seqs:
            if self._out:
                yield self._take()
            self._decode(decode_seqs)
        finished = [s for s in self.running if s.finish_reason is not None]
        if finished:
            self.runner.release(finished)
            self.running = [s for s in self.running if s.finish_reason is None]
        yield self._take()

    def _prefill_step(self, budget: int) -> None:
        """Spend ``budget`` prompt tokens: the next chunks of prompts prefilled a chunk at a time, oldest first,
        then the newcomers that fit (``_admit``)."""
        for seq in list(self.prefilling):
            if budget <= 0:
                break
            budget -= self._prefill_chunk(seq, budget)
        group, partial = self._admit(budget)
        ts = now()
        for s in group + ([partial] if partial is not None else []):
            s.scheduled_ts = ts
        if group:
            # prompts with a cached prefix run on their own, after the batched ones (prefix_cache.py)
            for sub in self.runner.prefill_groups(group):
                self._prefill(sub)
            budget -= sum(len(s.request.prompt_token_ids) for s in group)
        if partial is not None:
            self.runner.prefill_groups([partial])  # its cached prefix, if any
            self.prefilling.append(partial)
            self._prefill_chunk(partial, max(budget, 1))

    def _admit(self, budget: int) -> tuple[list[Sequence], Sequence | None]:
        """Take waiting requests in order while KV slots (``max_num_seqs``) and the token ``budget`` allow: the
        whole prompts that fit, then -- with chunked prefill -- the first one that does not (it starts a chunk at
        a time). Without chunked prefill, a prompt longer than the budget runs whole when it is the first of the
        group (as before chunking existed). Requests whose grammar is still compiling stay waiting, in order."""
        group: list[Sequence] = []
        partial: Sequence | None = None
        compiling: list[Sequence] = []
        while self.waiting and len(self.running) + len(self.prefilling) + len(group) < self.max_num_seqs:
            head = self.waiting[0]
            if head.grammar is not None:
                if not head.grammar.ready():
                    compiling.append(self.waiting.popleft())
                    continue
                try:
                    head.grammar.start()
                except Exception as exc:  # noqa: BLE001 - a constraint that does not compile fails its request only
                    self.waiting.popleft()
                    self._forget_grammar(head)
                    self._finish_out(head, FINISH_ERROR, f"structured output constraint {exc}",
                                     ERROR_STRUCTURED_OUTPUT)
                    continue
            n = len(head.request.prompt_token_ids)
            if n <= budget or (not group and not self.enable_chunked_prefill):
                group.append(self.waiting.popleft())
                budget -= n
                continue
            if self.enable_chunked_prefill and budget > 0:
                partial = self.waiting.popleft()
            break
        self.waiting.extendleft(reversed(compiling))
        return group, partial

    def _prefill(self, group: list[Sequence]) -> None:
        """Prefill the whole prompts of ``group`` in one runner call, add it to the running batch and sample its
        first tokens; a failed forward fails only this group."""
        t0 = time.perf_counter()
        ahead = self._mask_ahead(group)
        try:
            logits = self.runner.prefill(group)
        except Exception as exc:  # fail this group only
            _settle(ahead)
            log.exception("prefill failed")
            # the runner gives the group's KV slots back on an error; the running batch is intact
            for s in group:
                self._finish_out(s, FINISH_ERROR, f"prefill failed: {exc}")
            return
        self._prefilled(group, logits, ahead, t0,
                        sum(len(s.request.prompt_token_ids) - s.num_cached_tokens for s in group))

    def _prefill_chunk(self, seq: Sequence, budget: int) -> int:
        """Prefill the next chunk (at most ``budget`` tokens) of ``seq``'s prompt; when it completes the prompt,
        ``seq`` moves from ``prefilling`` to the running batch with its first token. A failed forward fails only
        ``seq`` (its KV slot is given back). Returns the prompt tokens computed (0 on a failure)."""
        before = max(seq.num_computed, seq.num_cached_tokens)
        t0 = time.perf_counter()
        done = len(seq.request.prompt_token_ids) - before <= budget  # else no token is sampled this step
        ahead = self._mask_ahead([seq]) if done else None
        try:
            logits = self.runner.prefill_chunk(seq, budget)
        except Exception as exc:
            _settle(ahead)
            log.exception("prefill failed")
            self.prefilling.remove(seq)
            self.runner.release([seq])
            self._finish_out(seq, FINISH_ERROR, f"prefill failed: {exc}")
            return 0
        ntok = seq.num_computed - before
        if logits is None:
            _settle(ahead)
            return ntok
        self.prefilling.remove(seq)
        self._prefilled([seq], logits, ahead, t0, ntok)
        return ntok

    def _prefilled(self, group: list[Sequence], logits: torch.Tensor, ahead: _MaskAhead | None, t0: float,
                   ntok: int) -> None:
        """``group``'s prompts are in the KV cache: it joins the running batch and its first tokens are sampled."""
        self.running.extend(group)
        for s in group:
            self.stats.prompt_tokens += len(s.request.prompt_token_ids)
            self.stats.prefix_hit_tokens += s.num_cached_tokens
        dt = time.perf_counter() - t0
        self.stats.prefill_tokens_per_s = ema(self.stats.prefill_tokens_per_s, ntok / max(dt, 1e-9))
        try:
            self._apply(group, logits, ahead)
        except Exception as exc:
            log.exception("sampling failed")
            self._fail_all_running(f"sampling failed: {exc}")

    def _decode(self, seqs: list[Sequence]) -> None:
        """One decode forward of ``seqs`` (running, in slot order) and the sampling of their next tokens; a failure
        fails the whole running batch."""
        t0 = time.perf_counter()
        ahead = self._mask_ahead(seqs)
        try:
            logits = self.runner.decode(seqs)
            for s in seqs:
                s.num_computed += 1
            self._apply(seqs, logits, ahead)
        except Exception as exc:
            _settle(ahead)
            log.exception("decode step failed")
            self._fail_all_running(f"engine step failed: {exc}")
        else:
            dt = time.perf_counter() - t0
            self.stats.decode_tokens_per_s = ema(self.stats.decode_tokens_per_s, len(seqs) / max(dt, 1e-9))

    def _fail_all_running(self, message: str) -> None:
        for s in self.running:
            if s.finish_reason is None:
                s.finish_reason = FINISH_ERROR
                self._finish_out(s, FINISH_ERROR, message)
        self.runner.release(self.running)
        self.running = []

    # ------------------------------------------------------------------ sampling and stops
    def _mask_ahead(self, seqs: list[Sequence]) -> _MaskAhead | None:
        """Start computing the grammar mask of ``seqs`` (the rows of the forward about to run) in the masker's
        thread, so that it overlaps the forward (vLLM computes its bitmask while the model runs); None when no row
        is constrained. The matchers' state is that of the mask: nothing advances them until ``_apply``."""
        constrained = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None and s.grammar.constraining]
        if not constrained:
            return None
        return self.masker.submit(constrained, len(seqs), self.runner.vocab_size, self.runner.device)

    def _apply(self, seqs: list[Sequence], logits: torch.Tensor, ahead: _MaskAhead | None = None) -> None:
        """Sample one token per row of ``logits`` ``[len(seqs), vocab]`` under the grammar mask (``ahead``'s, computed
        while the forward ran, or computed now), advance the grammars and emit the tokens."""
        mask = ahead.result() if ahead is not None else None
        if mask is not None and tuple(mask.bias.shape) != tuple(logits.shape):
            mask = None  # computed for another width (not expected: the runner's head is its vocabulary)
        if mask is None:
            constrained = [(i, s.grammar) for i, s in enumerate(seqs) if s.grammar is not None]
            mask = (self.masker.mask(constrained, logits.shape[0], logits.shape[1], logits.device)
                    if constrained else None)
        tokens, lps = self.runner.sample(logits, seqs, mask)
        ts = now()
        failed = mask.failed if mask is not None else {}
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            if i in failed:  # the library gave up on this row's grammar: its mask allowed nothing it could stand by
                self._grammar_failed(seq, failed[i])
                self._finish_out(seq, FINISH_ERROR, seq.error, seq.error_code)
                continue
            seq.output_token_ids.append(tok)
            first = seq.first_token_ts is None
            if first:
                seq.first_token_ts = ts
            self._check_stop(seq, tok)
            if seq.grammar is not None:
                self._advance_grammar(seq, seq.grammar, tok)
            self._emit(seq.request.client_id, EngineCoreOutput(
                request_id=seq.request_id, new_token_ids=[tok],
                new_logprobs=[lps[i]] if lps is not None and lps[i] is not None else None,
                prompt_logprobs=seq.prompt_logprobs if first else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, error=seq.error,
                error_code=seq.error_code, num_cached_tokens=seq.num_cached_tokens if first else 0,
                scheduled_ts=seq.scheduled_ts if first else None,
                first_token_ts=ts if first else None, engine_id=self.engine_id))

    def _check_stop(self, seq: Sequence, token: int) -> None:
        sp = seq.params
        n = len(seq.output_token_ids)
        if n >= sp.min_tokens:
            if not sp.ignore_eos and token in seq.eos_ids:
                seq.finish_reason = FINISH_STOP
                return
            if token in seq.stop_ids:
                seq.finish_reason, seq.stop_reason = FINISH_STOP, token
                return
        if n >= sp.max_tokens or len(seq.request.prompt_token_ids) + n >= self.runner.max_model_len:
            seq.finish_reason = FINISH_LENGTH

    def _advance_grammar(self, seq: Sequence, grammar: SequenceGrammar, tok: int) -> None:
        """Feed ``tok`` to ``seq``'s matcher. An EOS the grammar allowed ends the output with ``stop`` even under
        ``ignore_eos`` or ``min_tokens`` (the structure is complete; nothing else may follow); a refused token
        (impossible with the mask) finishes the request with an error."""
        try:
            if grammar.advance(tok) and seq.finish_reason in (None, FINISH_LENGTH):
                seq.finish_reason, seq.stop_reason = FINISH_STOP, None
        except Exception as exc:  # noqa: BLE001 - one request's grammar must not stop the engine (logged)
            log.warning("grammar of %s failed: %s", seq.request_id, exc)
            self._grammar_failed(seq, str(exc))

    def _grammar_failed(self, seq: Sequence, message: str) -> None:
        """``seq``'s grammar failed while generating (a library limit, a refused token): the request finishes with
        ``error`` and ``ERROR_STRUCTURED_OUTPUT``, and the compiled grammar leaves the cache (its shared lexer state
        may hold what the failure built: ~180 MB for ``(a{1000}){1000}``, and a copy taken from it after the failure
        allowed only EOS)."""
        seq.finish_reason, seq.error = FINISH_ERROR, f"structured output failed: the constraint {matcher_error_reason(message)}"
        seq.error_code = ERROR_STRUCTURED_OUTPUT
        self._forget_grammar(seq)

    def _forget_grammar(self, seq: Sequence) -> None:
        sp = seq.params
        if sp.structured_kind is not None:
            self.grammars.evict(sp.structured_kind, sp.structured_spec, seq.request.cache_salt or "")


def _settle(ahead: _MaskAhead | None) -> None:
    """Wait for a mask computed ahead that a failed step will not use (its matchers stay as they were; a later
    step's advance must not race it), dropping its result or error."""
    if ahead is not None:
        concurrent.futures.wait([ahead])
