"""``VllmScheduler``: vLLM's v1 engine as the scheduler of a replica, behind the same link and core loop as the
native one (``inference.engine.core.EngineCore`` with ``inference.engine.replica_link.ReplicaLink``).

What every scheduler shares is ``inference.engine.base_scheduler``'s: the acceptance output, the priority order of
the waiting requests, aborts (also ones that overtake their request), the shutdown rules. Only the model half
differs: a request becomes ``LLMEngine.add_request(request_id, TokensPrompt(prompt_token_ids=..., cache_salt=...),
SamplingParams(...))`` (the gateway's per-tenant cache salt salts vLLM's prefix-cache block hashes, as ours), one
``step`` is one ``LLMEngine.step()`` (vLLM's scheduler and model runner, in its own engine-core process), and its
``RequestOutput``s (``RequestOutputKind.DELTA``: the new token ids, logprobs, finish, ``num_cached_tokens``) become
our ``EngineCoreOutput``s. An abort is ``LLMEngine.abort_request``.

Requests wait here until vLLM has room (``max_num_seqs`` running), so the heartbeat's ``num_running`` /
``num_waiting`` and ``scheduled_ts`` mean what they mean on the native engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

from inference.protocol.engine import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineCoreOutput,
    EngineCoreRequest,
    EngineStats,
)

from ..base_scheduler import BaseScheduler, Outputs, ema
from ..runner import RequestError, check_token_ids, now
from ..sequence import Sequence
from .params import (
    UnsupportedRequestError,
    logprob_entries,
    prompt_logprob_entries,
    sampling_kwargs,
    stop_reason_of,
    tokens_prompt,
)
from .runner import VllmRunner

log = logging.getLogger("inference.engine.vllm")

_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}


class _NoRng:
    """``Sequence.rng`` placeholder: vLLM draws the samples (seeded per request)."""


_NO_RNG: Any = _NoRng()


class VllmScheduler(BaseScheduler):
    """The scheduler of a replica whose model half is vLLM's engine (module docstring).

    Args:
        runner: a ``VllmRunner``.
        engine_id, stats, max_num_seqs: as ``BaseScheduler`` (``max_num_seqs``: requests handed to vLLM at once).
    """

    def __init__(self, runner: VllmRunner, engine_id: str, stats: EngineStats, *, max_num_seqs: int = 32):
        super().__init__(engine_id, stats, max_num_seqs, runner.max_model_len)
        self.vllm = runner
        self._by_id: dict[str, Sequence] = {}  # requests handed to vLLM, by request id

    def shutdown(self) -> None:
        """Stop vLLM's engine-core process; a failure is logged (the process exit takes its children with it)."""
        try:
            self.vllm.shutdown()
        except Exception:  # stopping anyway (logged); the process exit takes its children with it
            log.exception("vLLM shutdown failed")

    # ------------------------------------------------------------------ requests
    def _new_sequence(self, req: EngineCoreRequest) -> Sequence:
        return Sequence(request=req, queued_ts=now(), rng=_NO_RNG)

    def _prepare(self, seq: Sequence) -> None:
        try:
            seq.backend_params = self._sampling_params(seq.request)
        except UnsupportedRequestError as exc:
            raise RequestError(str(exc)) from None

    def _sampling_params(self, req: EngineCoreRequest) -> Any:
        """vLLM's ``SamplingParams`` for ``req``; ``RequestError`` with the native engine's message for what it
        refuses too (so clients see the same errors whichever backend serves them), ``UnsupportedRequestError``
        for what only this backend cannot do."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        if req.pooling:
            raise RequestError("this engine serves a generative model; it cannot compute embeddings")
        if req.mm_cache_keys:
            raise UnsupportedRequestError("this engine backend does not take image inputs")
        ids = req.prompt_token_ids
        sp = req.sampling_params
        check_token_ids(ids, self.vllm.vocab_size)
        if len(ids) >= self.vllm.max_model_len:
            raise RequestError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.vllm.max_model_len} (prompt + output)")
        if sp.logit_bias and any(k < 0 or k >= self.vllm.vocab_size for k in sp.logit_bias):
            raise RequestError("logit_bias token id out of range")
        kw = sampling_kwargs(sp, vocab_size=self.vllm.vocab_size)
        if "structured_outputs" in kw:
            kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
        try:
            return VllmSamplingParams(output_kind=RequestOutputKind.DELTA, **kw)
        except ValueError as exc:  # vLLM's own range checks (temperature, top_p, ...)
            raise RequestError(str(exc)) from None

    def active(self) -> list[Sequence]:
        return list(self._by_id.values())

    def _abort_active(self, ids: set[str]) -> None:
        running = [rid for rid in ids if rid in self._by_id]
        if running:
            self.vllm.engine.abort_request(running)
            for rid in running:
                self._finish_out(self._by_id.pop(rid), FINISH_ABORT)

    def _forget_all(self) -> None:
        self._by_id.clear()

    def _fail_all_running(self, message: str) -> None:
        if self._by_id:
            self.vllm.engine.abort_request(list(self._by_id))
        for s in self._by_id.values():
            self._finish_out(s, FINISH_ERROR, message)
        self._by_id.clear()

    # ------------------------------------------------------------------ stepping
    def step(self) -> Iterator[Outputs]:
        """Hand waiting requests to vLLM while it has room, run one vLLM step; yields its outputs in one part
        (vLLM's step is one forward of prefills and decodes together)."""
        self._add_waiting()
        if self._by_id:
            self._run_vllm_step()
        yield self._take()

    def _add_waiting(self) -> None:
        from vllm.inputs import TokensPrompt

        while self.waiting and len(self._by_id) < self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.scheduled_ts = now()
            try:
                self.vllm.engine.add_request(seq.request_id, TokensPrompt(**tokens_prompt(seq.request)),
                                             seq.backend_params, arrival_time=seq.request.arrival_time)
            except Exception as exc:  # noqa: BLE001 - vLLM refused it (its own input checks): fail this request only
                log.warning("vLLM refused request %s: %s", seq.request_id, exc)
                self._finish_out(seq, FINISH_ERROR, f"bad request: {exc}")
                continue
            seq.backend_params = None  # vLLM holds them now
            self._by_id[seq.request_id] = seq

    def _run_vllm_step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.vllm.engine.step()
        except Exception as exc:
            log.exception("vLLM step failed")
            self._fail_all_running(f"engine step failed: {exc}")
            return
        dt = max(time.perf_counter() - t0, 1e-9)
        prefilled = decoded = 0
        ts = now()
        for ro in outputs:
            held = self._by_id.get(ro.request_id)
            if held is None:  # aborted meanwhile
                continue
            first = held.first_token_ts is None
            out = self._output(held, ro, ts)
            if first and out.new_token_ids:
                prefilled += len(held.request.prompt_token_ids) - held.num_cached_tokens
            else:
                decoded += len(out.new_token_ids)
            self._emit(held.request.client_id, out)
            if out.finish_reason is not None:
                del self._by_id[held.request_id]
        if prefilled:
            self.stats.prefill_tokens_per_s = ema(self.stats.prefill_tokens_per_s, prefilled / dt)
        if decoded:
            self.stats.decode_tokens_per_s = ema(self.stats.decode_tokens_per_s, decoded / dt)

    def _output(self, seq: Sequence, ro: Any, ts: float) -> EngineCoreOutput:
        """Our output for one vLLM ``RequestOutput`` (``DELTA``: this step's new tokens)."""
        sp = seq.params
        comp = ro.outputs[0] if ro.outputs else None
        new_ids = list(comp.token_ids) if comp is not None else []
        first = seq.first_token_ts is None and bool(new_ids)
        if first:
            seq.first_token_ts = ts
            seq.num_cached_tokens = int(ro.num_cached_tokens or 0)
        seq.output_token_ids.extend(new_ids)
        finish = stop_reason = None
        if ro.finished and comp is not None:
            finish = _FINISH.get(str(comp.finish_reason), FINISH_STOP)
            stop_reason = stop_reason_of(sp, comp.stop_reason) if finish == FINISH_STOP else None
        return EngineCoreOutput(
            request_id=seq.request_id, new_token_ids=new_ids,
            new_logprobs=logprob_entries(new_ids, comp.logprobs if comp is not None else None, sp.logprobs),
            prompt_logprobs=(prompt_logprob_entries(seq.request.prompt_token_ids, ro.prompt_logprobs, sp.prompt_logprobs)
                             if first else None),
            finish_reason=finish, stop_reason=stop_reason,
            num_cached_tokens=seq.num_cached_tokens if first else 0,
            scheduled_ts=seq.scheduled_ts if first else None, first_token_ts=ts if first else None,
            engine_id=self.engine_id)
