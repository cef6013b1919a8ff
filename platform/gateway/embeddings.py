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

Path (same machinery as generation, DESIGN.md §2): API key → validate → model (must have task ``embed``)
→ admission pre-check → tokenize (the process-wide tokenizer cache, on a thread: the inputs are plain
text, no template) → exact admission (an embedding request's tokens are its prompt tokens) → one
``EngineCoreRequest`` (``pooling=True``) per input on the engine link, answered by the pooling replica's
batched forward → response → usage record (prompt tokens, completion 0), exactly once.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import math
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from gateway import auth
from gateway.errors import ApiError, bad_request, unavailable
from gateway.generation import (
    admission,
    admission_precheck,
    key_limits_acquire_tokens,
    client_request_id,
    validated_body,
    link,
    load_tokenizer,
    overloaded,
    request_scope,
    resolve_model,
    to_request_error,
)
from gateway.http import GatewayConsumer
from inference.admission import AdmissionRefused, estimate_prompt_tokens
from inference.engine_client import EngineUnavailableError
from inference.input_processor import new_internal_id
from inference.protocol.engine import FINISH_STOP, EngineCoreRequest, SamplingParams
from inference.protocol.openai import ModelName, RequestId, RequestValidationError, validate_request

MAX_EMBEDDING_INPUTS = 2048


class EmbeddingRequest(BaseModel):
    """Scalar fields of an embeddings request; ``input`` is checked by ``normalize_input``."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
    model: ModelName = None
    input: Any = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    request_id: RequestId = None


def normalize_input(value: Any) -> list[str | list[int]]:
    """The request's inputs as a list of strings or token-id lists.

    Raises ``RequestValidationError`` (param ``input`` or ``input[i]``) for a missing, empty or mixed input,
    an element of the wrong type, a negative or non-integer token id, or more than
    ``MAX_EMBEDDING_INPUTS`` inputs.
    """
    if value is None:
        raise RequestValidationError("'input' is required", "input")
    if isinstance(value, str):
        if value == "":
            raise RequestValidationError("'input' must not be an empty string", "input")
        return [value]
    if not isinstance(value, list):
        raise RequestValidationError("'input' must be a string, a list of strings, a list of token ids or "
                                     "a list of token-id lists", "input")
    if not value:
        raise RequestValidationError("'input' must not be an empty list", "input")
    if all(type(v) is int for v in value):  # one token-id input
        if any(v < 0 for v in value):
            raise RequestValidationError("token ids must be >= 0", "input")
        return [list(value)]
    if len(value) > MAX_EMBEDDING_INPUTS:
        raise RequestValidationError(f"'input' may hold at most {MAX_EMBEDDING_INPUTS} items", "input")
    kinds = {str if isinstance(v, str) else list if isinstance(v, list) else type(v) for v in value}
    if len(kinds) != 1 or kinds - {str, list}:
        raise RequestValidationError("'input' must be all strings or all token-id lists (no mixing)", "input")
    out: list[str | list[int]] = []
    for i, v in enumerate(value):
        if isinstance(v, str):
            if v == "":
                raise RequestValidationError(f"input[{i}] must not be an empty string", f"input[{i}]")
        else:
            if not v:
                raise RequestValidationError(f"input[{i}] must not be an empty list", f"input[{i}]")
            if any(type(t) is not int or t < 0 for t in v):
                raise RequestValidationError(f"input[{i}] must be a list of token ids (integers >= 0)",
                                             f"input[{i}]")
        out.append(v)
    return out


def tokenize_inputs(tokenizer, inputs: list[str | list[int]], *, add_special_tokens: bool,
                    truncate: int | None, max_model_len: int) -> list[list[int]]:
    """Token ids per input (blocking: call off the event loop).

    ``truncate``: keep at most this many tokens (already resolved, ``None`` = no truncation: an input over
    ``max_model_len`` raises ``RequestValidationError`` naming it). Token ids must be in the vocabulary.
    """
    tok = tokenizer.tokenizer  # loaded without padding/truncation (inference.renderer.tokenizer_cache)
    n_special = tok.num_special_tokens_to_add(False) if add_special_tokens else 0
    texts = [(i, v) for i, v in enumerate(inputs) if isinstance(v, str)]
    encoded: dict[int, list[int]] = {}
    if texts:
        encs = tok.encode_batch([t for _, t in texts], add_special_tokens=False)
        for (i, _), enc in zip(texts, encs):
            if truncate is not None and len(enc.ids) + n_special > truncate:
                enc.truncate(max(truncate - n_special, 0))
            if add_special_tokens:
                enc = tok.post_process(enc, None, True)
            encoded[i] = list(enc.ids)
    out = []
    for i, v in enumerate(inputs):
        if isinstance(v, str):
            ids = encoded[i]
        else:
            ids = list(v[:truncate]) if truncate is not None else list(v)
            tokenizer.check_ids(ids, param=f"input[{i}]" if len(inputs) > 1 else "input")
        if not ids:
            raise RequestValidationError(f"input[{i}] has no tokens after truncation", f"input[{i}]")
        if len(ids) > max_model_len:
            raise RequestValidationError(
                f"input[{i}] has {len(ids)} tokens, more than this model's maximum of {max_model_len}; "
                "shorten it or set 'truncate_prompt_tokens'", "input" if len(inputs) == 1 else f"input[{i}]")
        out.append(ids)
    return out


@dataclass
class EmbeddingRun:
    """What ``UsageRecorder`` reads from a finished embeddings request (prompt tokens only)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None


def pooling_requests(external_id: str, token_ids: list[list[int]], client_id: str, arrival: float,
                     ) -> list[EngineCoreRequest]:
    """One pooling ``EngineCoreRequest`` per input; ids ``<external_id>-<i>-<8 hex>`` (``external_id`` is at
    most ``MAX_REQUEST_ID_LEN`` + 5 characters, so 2,048 inputs add well under 1 MB of ids)."""
    return [EngineCoreRequest(
        request_id=f"{external_id}-{i}-{secrets.token_hex(4)}", external_req_id=external_id,
        prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=1), client_id=client_id,
        arrival_time=arrival, pooling=True) for i, ids in enumerate(token_ids)]


async def run_pooling(model: dict, external_id: str, token_ids: list[list[int]], arrival: float,
                      ) -> list[np.ndarray]:
    """Send one pooling request per input to ``model``'s replicas and return the vectors in input order.

    Raises ``ApiError`` 503 when no replica is alive or a replica failed the request; 400 when the engine
    refused an input (e.g. a token id beyond the model's vocabulary).
    """
    lk = link()
    queue: asyncio.Queue = asyncio.Queue()
    reqs = pooling_requests(external_id, token_ids, lk.client_id, arrival)
    index = {r.request_id: i for i, r in enumerate(reqs)}
    vectors: list[np.ndarray | None] = [None] * len(reqs)
    try:
        await lk.add_requests(model["served_model_name"], reqs, queue)
    except EngineUnavailableError as exc:
        raise unavailable(str(exc), 2, "engine_unavailable") from None
    remaining = set(index)
    try:
        while remaining:
            out = await queue.get()
            if out.request_id not in remaining or out.finish_reason is None:
                continue
            remaining.discard(out.request_id)
            if out.finish_reason != FINISH_STOP or out.pooled is None:
                msg = out.error or "the engine did not return an embedding"
                if "out of range" in msg or "max_model_len" in msg:
                    raise bad_request(msg, "input")
                raise ApiError(503, msg, "server_error", None, "engine_error", [("retry-after", "1")])
            vectors[index[out.request_id]] = np.frombuffer(out.pooled, dtype="<f4")
    finally:
        if remaining:
            await asyncio.shield(lk.abort(model["served_model_name"], list(remaining)))
        for r in reqs:
            lk.release(r.request_id)
    return vectors  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def model_hidden_size(model_dir: str) -> int | None:
    """The pooled vector size of an encoder directory: ``word_embedding_dimension`` of its
    sentence-transformers pooling config, else ``hidden_size`` of ``config.json``; ``None`` if unknown."""
    d = Path(model_dir)
    try:
        pooled = d / "1_Pooling" / "config.json"
        if pooled.is_file():
            return int(json.loads(pooled.read_text())["word_embedding_dimension"])
        return int(json.loads((d / "config.json").read_text())["hidden_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def encode_vector(vec: np.ndarray, encoding_format: str) -> np.ndarray | str:
    """A vector as OpenAI returns it: base64 of its float32 little-endian bytes, or (``float``) the float32
    array itself, which ``send_json_fast`` writes as a JSON list of the shortest decimals that read back to
    the same float32 values (``0.006286511``, not the double expansion ``0.006286511197686195``)."""
    if encoding_format == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode()
    return np.ascontiguousarray(vec, dtype=np.float32)


def _validate_embeddings(data: dict) -> tuple[EmbeddingRequest, list[str | list[int]]]:
    """The validated request and its normalized inputs (raises ``RequestValidationError``)."""
    req = validate_request(EmbeddingRequest, data)
    return req, normalize_input(req.input)


class EmbeddingsConsumer(GatewayConsumer):
    """``POST /v1/embeddings``: validate, tokenize, admit, pool on the engine, answer, record usage."""

    async def handle_request(self, body: bytes) -> None:
        arrival = time.time()
        ctx = await auth.authenticate(self.scope["headers"])
        auth.require_scope(ctx, "inference")
        try:
            req, inputs = await validated_body(body, _validate_embeddings)
        except RequestValidationError as exc:
            raise to_request_error(exc) from None
        base_id = client_request_id(self.header(b"x-request-id"), req.request_id)
        external_id = "embd-" + base_id
        self.extra_headers.append((b"x-request-id", base_id.encode()))
        async with request_scope("embeddings", new_internal_id(external_id), arrival, ctx, req.model,
                                 len(inputs)) as scope:
            run = scope.run = EmbeddingRun()
            model = await resolve_model(ctx, req.model)
            if model.get("task") != "embed":
                raise bad_request(f"The model '{model['served_model_name']}' does not support embeddings "
                                  "(its task is 'generate')", "model", "model_not_embedding")
            max_len = int(model["max_model_len"])
            truncate = req.truncate_prompt_tokens
            if truncate is not None:
                if truncate == -1:
                    truncate = max_len
                elif truncate < 1:
                    raise bad_request("'truncate_prompt_tokens' must be -1 or >= 1", "truncate_prompt_tokens")
                elif truncate > max_len:
                    raise bad_request(f"'truncate_prompt_tokens' ({truncate}) is greater than this model's "
                                      f"max_model_len ({max_len})", "truncate_prompt_tokens")
            native = model_hidden_size(model["model_dir"])
            if req.dimensions is not None and req.dimensions != native:
                raise bad_request(f"This model does not support 'dimensions' other than its own size ({native}); "
                                  "it has no Matryoshka representation", "dimensions")
            # the key's limits before any work (tokenizing): each input bounded as the admission pre-check
            # bounds a prompt; settled on the real count (``run.prompt_tokens``) when the request ends
            scope.grant = await key_limits_acquire_tokens(self, ctx, sum(
                estimate_prompt_tokens(len(v.encode()) if isinstance(v, str) else len(v), truncate or max_len,
                                       exact=not isinstance(v, str)) for v in inputs))
            size = max(len(v.encode()) if isinstance(v, str) else len(v) for v in inputs)
            scope.reservation = await admission_precheck(model, scope.recorder.request_id, len(inputs), size,
                                                         exact=all(isinstance(v, list) for v in inputs))
            tokenizer = await load_tokenizer(model)
            try:
                token_ids = await asyncio.to_thread(
                    tokenize_inputs, tokenizer, inputs, add_special_tokens=req.add_special_tokens,
                    truncate=truncate, max_model_len=max_len)
            except RequestValidationError as exc:
                raise to_request_error(exc) from None
            except ValueError as exc:  # TokenIdError and friends carry a param
                raise bad_request(str(exc), getattr(exc, "param", "input")) from None
            total = sum(len(t) for t in token_ids)
            run.prompt_tokens = total
            try:  # n inputs × their mean length (rounded up) ≥ the real total
                await admission().reserve(scope.reservation.model, scope.reservation.request_id, len(token_ids),
                                          math.ceil(total / len(token_ids)), reservation=scope.reservation)
            except AdmissionRefused as exc:
                raise overloaded(exc) from None
            vectors = await run_pooling(model, external_id, token_ids, arrival)
            if not all(np.isfinite(v).all() for v in vectors):
                raise ApiError(503, "the engine returned a non-finite embedding", "server_error", None,
                               "engine_error", [("retry-after", "1")])
            run.first_token_time = run.finished_time = time.time()
            scope.recorder.finish_reason = FINISH_STOP
            await self.send_json_fast(200, {
                "object": "list",
                "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
                         for i, v in enumerate(vectors)],
                "model": model["served_model_name"],
                "usage": {"prompt_tokens": total, "total_tokens": total},
                "id": external_id,
                "created": int(arrival),
            })
