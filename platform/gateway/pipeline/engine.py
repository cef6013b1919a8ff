"""Steps 9-10 (docs/ARCHITECTURE.md §2): the engine link. Register the request's output queue, hand its children to
a replica, and run the engine outputs through ``inference.api.output_processor`` (detokenize, stop strings, n > 1
reassembly); abort what is unfinished at the end. Pooling (embeddings) requests take the same link."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import numpy as np

from gateway.disconnect import raise_if_client_gone
from gateway.errors import ErrorCode, bad_request, engine_error
from gateway.model_cache import ModelSnapshot
from gateway.pipeline import admission
from gateway.clients import background, link
from gateway.pipeline.failures import api_error_from, pooling_error
from inference.api.admission import Reservation
from inference.api.engine_client import EngineUnavailableError
from inference.api.input_processor import ProcessedInput
from inference.api.output_processor import ChoiceDelta, ChoiceState, OutputProcessor, RequestState
from inference.protocol.engine import ERROR_STRUCTURED_OUTPUT, FINISH_STOP, EngineCoreOutput, EngineCoreRequest
from inference.renderer.tokenizer_cache import LoadedTokenizer

log = logging.getLogger(__name__)


async def _abort(model_name: str, request_ids: list[str]) -> None:
    try:
        await link().abort(model_name, request_ids)
    except Exception:  # the engine finishes them anyway (max_tokens)
        log.exception("abort failed")


async def add_requests(model: ModelSnapshot, requests: list[EngineCoreRequest], queue: asyncio.Queue[EngineCoreOutput]) -> None:
    """Send ``requests`` to a live replica of ``model``, outputs to ``queue``; 503 when none is alive."""
    try:
        await link().add_requests(model.served_model_name, requests, queue)
    except EngineUnavailableError as exc:
        raise api_error_from(exc) from None


class GenerationRun:
    """One API request's engine work: its children (``n``, or ``n`` per prompt of a batch of completions prompts)
    sharing one output queue, their output state in a ``RequestState``. ``start()``, iterate ``deltas()``, and
    ``close()`` in a ``finally`` (idempotent)."""

    def __init__(self, model: ModelSnapshot, processed: ProcessedInput, tokenizer: LoadedTokenizer, *,
                 stop: list[str] | None,
                 include_stop_str_in_output: bool, skip_special_tokens: bool, arrival_time: float,
                 reservation: Reservation | None = None):
        self.model = model
        self.processed = processed
        self.reservation = reservation
        self.state = RequestState(tokenizer, processed.prompt_token_ids,
                                  [r.request_id for r in processed.requests], stop=stop,
                                  include_stop_str_in_output=include_stop_str_in_output,
                                  skip_special_tokens=skip_special_tokens, arrival_time=arrival_time,
                                  batch_prompts=processed.batch_prompts,
                                  # stop strings apply to the answer only, not to the reasoning
                                  reasoning=processed.chat_output.reasoning if processed.chat_output else None)
        self.processor = OutputProcessor(self.state)
        self.queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
        self.engine_id: str | None = None  # the replica that served it (a stored conversation prefers it next)
        self._closed = False

    @property
    def choices(self) -> list[ChoiceState]:
        """The ``ChoiceState`` s, in choice order."""
        return self.state.choices

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the request (every prompt of a batch, counted once)."""
        return self.state.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        """Output tokens of every choice so far."""
        return self.state.completion_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the replicas' prefix caches served."""
        return self.state.num_cached_tokens

    @property
    def first_token_time(self) -> float | None:
        """Unix time of the request's first output token (``None``: none yet)."""
        return self.state.first_token_time

    @property
    def finished_time(self) -> float | None:
        """Unix time the request finished or was closed (``None``: running)."""
        return self.state.finished_time

    @property
    def finish_reason(self) -> str | None:
        """The first choice's finish reason (its usage record's; ``None`` while it runs)."""
        return self.state.choices[0].finish_reason if self.state.choices else None

    async def start(self) -> None:
        """Register the output queue and send every child to the engine (503 when no replica is alive). The
        children of one prompt go to one replica together; each prompt of a batch is routed on its own."""
        requests = self.processed.requests
        per_prompt = max(1, len(requests) // len(self.state.prompts))
        self.state.sent_time = time.time()
        for i in range(0, len(requests), per_prompt):
            await add_requests(self.model, requests[i:i + per_prompt], self.queue)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Yield text deltas as engine outputs arrive, until every choice has finished. A child's first tokens
        release its prefill reservation; a stop string matched before the engine stopped aborts the child."""
        while not self.state.finished:
            raise_if_client_gone()  # a cancellation lost on the way here (gateway/disconnect.py)
            out = await self.queue.get()
            self.engine_id = out.engine_id or self.engine_id
            result = self.processor.process_outputs([out])
            for rid in result.reqs_to_abort:
                background(_abort(self.model.served_model_name, [rid]), f"abort {rid}")
            for index, latency in result.first_tokens:
                await admission.release_prefill(self.reservation, index, latency)
            for delta in result.deltas:
                yield delta

    def error_message(self) -> str | None:
        """The first engine error of any choice."""
        return self.state.error_message()

    def raise_for_engine_error(self, *, retry_after: bool) -> None:
        """``ApiError`` when a choice failed on the engine: 400 ``structured_output_failed`` naming the constraint's
        field when its output constraint failed there (a grammar the library gave up on: the client's to change, so
        not a 503 the ``openai`` client would retry into an empty ``stop``), else 503 ``engine_error``."""
        failed = self.state.failed_choice()
        if failed is None:
            return
        message = failed.error or "The engine failed while generating"
        if failed.error_code == ERROR_STRUCTURED_OUTPUT:
            raise bad_request(message, self.processed.constraint_param, ErrorCode.STRUCTURED_OUTPUT_FAILED)
        raise engine_error(message, retry_after=retry_after)

    async def close(self) -> None:
        """Abort children that have not finished (client gone, error, cancellation) and drop their output routes.
        Idempotent. The admission reservation is not released here: ``RequestScope.release`` owns that (it
        closes the run first)."""
        if self._closed:
            return
        self._closed = True
        unfinished = self.state.abort_unfinished()
        if unfinished:
            await asyncio.shield(_abort(self.model.served_model_name, unfinished))
        for c in self.state.choices:
            link().release(c.request_id)
        if self.state.finished_time is None:
            self.state.finished_time = time.time()


async def run_pooling(model: ModelSnapshot, requests: list[EngineCoreRequest]) -> list[np.ndarray]:
    """Send pooling ``requests`` (one per input) to ``model``'s replicas and return the vectors in input order.

    Raises ``ApiError`` 503 when no replica is alive or a replica failed the request; 400 when the engine
    refused an input (e.g. a token id beyond the model's vocabulary).
    """
    lk = link()
    queue: asyncio.Queue[EngineCoreOutput] = asyncio.Queue()
    index = {r.request_id: i for i, r in enumerate(requests)}
    vectors: list[np.ndarray | None] = [None] * len(requests)
    await add_requests(model, requests, queue)
    remaining = set(index)
    try:
        while remaining:
            raise_if_client_gone()
            out = await queue.get()
            if out.request_id not in remaining or out.finish_reason is None:
                continue
            remaining.discard(out.request_id)
            if out.finish_reason != FINISH_STOP or out.pooled is None:
                raise pooling_error(out.error)
            vectors[index[out.request_id]] = np.frombuffer(out.pooled, dtype="<f4")
    finally:
        if remaining:
            await asyncio.shield(lk.abort(model.served_model_name, list(remaining)))
        for r in requests:
            lk.release(r.request_id)
    return vectors  # type: ignore[return-value]

