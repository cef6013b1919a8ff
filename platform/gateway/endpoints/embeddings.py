"""``POST /v1/embeddings`` (OpenAI embeddings API) served by pooling-mode engine replicas.

Request (OpenAI, plus vLLM's ``truncate_prompt_tokens`` / ``add_special_tokens``):

* ``input``: a string, a list of strings, a list of token ids (one input) or a list of such lists; at most
  ``MAX_EMBEDDING_INPUTS`` (2048, OpenAI's limit) inputs. An empty string, an empty list, or an empty
  element is a 400 naming the element (OpenAI refuses them too; an empty input has no tokens to pool).
* ``encoding_format``: ``float`` (default: lists of numbers) or ``base64`` (the float32 little-endian
  bytes of each vector, base64-encoded, as the OpenAI SDK decodes them).
* ``dimensions``: only the model's own size is accepted (no Matryoshka truncation is configured); any
  other value is a 400 (vLLM answers the same for non-Matryoshka models).
* ``truncate_prompt_tokens``: ``k >= 1`` keeps at most ``k`` tokens per input (text: the tokenizer's own
  truncation, special tokens kept, like ``tokenizer(..., truncation=True, max_length=k)``; token ids:
  the first ``k``); ``-1`` means ``max_model_len``; ``k > max_model_len`` is a 400. Without it an input
  longer than ``max_model_len`` is a 400 naming the input.
* ``user``, ``request_id``: accepted (the id, at most 128 characters without control characters, is echoed
  as ``X-Request-Id``).

Path (the same pipeline steps as generation, docs/ARCHITECTURE.md §2): API key → validate → model (must have task
``embed``) → admission pre-check → tokenize (the process-wide tokenizer cache, on a thread: the inputs are plain text,
no template) → exact admission (an embedding request's tokens are its prompt tokens) → one ``EngineCoreRequest``
(``pooling=True``) per input on the engine link, answered by the pooling replica's batched forward → response → usage
record (prompt tokens, completion 0), exactly once.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

import numpy as np

from gateway.errors import ErrorCode, bad_request, engine_error
from gateway.http import GatewayConsumer
from gateway.model_cache import ModelSnapshot
from gateway.pipeline import admission, preamble, rendering
from gateway.clients import link
from gateway.pipeline.engine import run_pooling
from gateway.pipeline.failures import api_error_from
from gateway.pipeline.flow import hold_before_render
from gateway.pipeline.scope import record_refusal, request_scope
from inference.api.admission import estimate_prompt_tokens
from inference.api.embeddings import (  # noqa: F401 - EmbeddingRequest, normalize_input: this route's public names
    MAX_EMBEDDING_INPUTS,
    EmbeddingRequest,
    encode_vector,
    model_hidden_size,
    normalize_input,
    pooling_requests,
    tokenize_inputs,
    validate_embeddings,
)
from inference.api.input_processor import new_internal_id
from inference.protocol.engine import FINISH_STOP
from inference.protocol.openai import RequestValidationError


@dataclass
class EmbeddingRun:
    """An embeddings request's engine work as its scope holds it (``gateway.pipeline.scope.Run``): the prompt
    tokens its usage record counts (nothing else), its times; no finish reason of its own (the route sets the
    record's) and nothing to close (``run_pooling`` aborts what it sent itself)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None

    async def close(self) -> None:
        """Nothing to give back (``run_pooling`` ends its requests on the engine itself)."""


def truncation_of(req: EmbeddingRequest, max_len: int) -> int | None:
    """The request's ``truncate_prompt_tokens`` resolved (``-1`` → ``max_len``); 400 when out of range."""
    truncate = req.truncate_prompt_tokens
    if truncate is None or truncate == -1:
        return max_len if truncate == -1 else None
    if truncate < 1:
        raise bad_request("'truncate_prompt_tokens' must be -1 or >= 1", "truncate_prompt_tokens")
    if truncate > max_len:
        raise bad_request(f"'truncate_prompt_tokens' ({truncate}) is greater than this model's "
                          f"max_model_len ({max_len})", "truncate_prompt_tokens")
    return truncate


def check_embedding_model(model: ModelSnapshot, req: EmbeddingRequest) -> None:
    """400 unless ``model`` pools (task ``embed``) and ``dimensions`` is absent or its own size."""
    if model.task != "embed":
        raise bad_request(f"The model '{model.served_model_name}' does not support embeddings "
                          "(its task is 'generate')", "model", ErrorCode.MODEL_NOT_EMBEDDING)
    native = model_hidden_size(model.model_dir)
    if req.dimensions is not None and req.dimensions != native:
        raise bad_request(f"This model does not support 'dimensions' other than its own size ({native}); "
                          "it has no Matryoshka representation", "dimensions")


class EmbeddingsConsumer(GatewayConsumer):
    """``POST /v1/embeddings``: validate, tokenize, admit, pool on the engine, answer, record usage."""

    async def handle_request(self, body: bytes) -> None:
        arrival = time.time()
        pre = await preamble.preamble(self, body, validate_embeddings, "embd-", body_id=lambda r: r[0].request_id,
                                      on_refused=record_refusal("embeddings"))
        ctx, (req, inputs), external_id = pre.ctx, pre.req, pre.external_id
        async with request_scope("embeddings", new_internal_id(external_id), arrival, ctx, req.model,
                                 len(inputs), grant=pre.grant) as scope:
            run = scope.run = EmbeddingRun()
            model = await preamble.resolve_model(ctx, req.model)
            check_embedding_model(model, req)
            max_len = int(model.max_model_len)
            truncate = truncation_of(req, max_len)
            # key limits: each input bounded as the admission pre-check bounds a prompt; settled on the real count
            await hold_before_render(
                self, scope, ctx, model, n=len(inputs), exact=all(isinstance(v, list) for v in inputs),
                size=max(len(v.encode()) if isinstance(v, str) else len(v) for v in inputs),
                tokens=sum(estimate_prompt_tokens(len(v.encode()) if isinstance(v, str) else len(v),
                                                  truncate or max_len, exact=not isinstance(v, str)) for v in inputs))
            tokenizer = await rendering.load_tokenizer(model)
            rendering.check_prompt_chars(model, tokenizer, max((len(v) for v in inputs if isinstance(v, str)),
                                                               default=0), "input", truncating=truncate is not None)
            try:
                token_ids = await asyncio.to_thread(
                    tokenize_inputs, tokenizer, inputs, add_special_tokens=req.add_special_tokens,
                    truncate=truncate, max_model_len=max_len)
            except RequestValidationError as exc:
                raise api_error_from(exc) from None
            except ValueError as exc:  # TokenIdError and friends carry a param
                raise bad_request(str(exc), getattr(exc, "param", "input")) from None
            total = run.prompt_tokens = sum(len(t) for t in token_ids)
            # n inputs × their mean length (rounded up) ≥ the real total
            await admission.reserve(scope.admitted, len(token_ids), math.ceil(total / len(token_ids)))
            requests = pooling_requests(external_id, token_ids, link().client_id, arrival)
            for request in requests:
                request.priority = scope.priority  # the caller's tier (set by hold_before_render)
            vectors = await run_pooling(model, requests)
            if not all(np.isfinite(v).all() for v in vectors):
                raise engine_error("the engine returned a non-finite embedding", retry_after=True)
            run.first_token_time = run.finished_time = time.time()
            scope.recorder.finish_reason = FINISH_STOP
            await self.send_json_fast(200, {
                "object": "list",
                "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
                         for i, v in enumerate(vectors)],
                "model": model.served_model_name,
                "usage": {"prompt_tokens": total, "total_tokens": total},
                "id": external_id,
                "created": int(arrival),
            })
