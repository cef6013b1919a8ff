"""Embeddings request handling that needs no Django (``/v1/embeddings``, gateway/endpoints/embeddings.py): the request
schema, input normalization, tokenizing with truncation, pooling engine requests, and response vectors."""

from __future__ import annotations

import base64
import functools
import json
import secrets
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from inference.protocol.engine import EngineCoreRequest, SamplingParams
from inference.protocol.openai import ModelName, RequestId, RequestValidationError, validate_request
from inference.protocol.errors import ErrorCode
from inference.renderer.tokenizer_cache import LoadedTokenizer

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


def tokenize_inputs(tokenizer: LoadedTokenizer, inputs: list[str | list[int]], *, add_special_tokens: bool,
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
        name = f"input[{i}]" if len(inputs) > 1 else "input"  # the message and the param name the same field
        if isinstance(v, str):
            ids = encoded[i]
        else:
            ids = list(v[:truncate]) if truncate is not None else list(v)
            tokenizer.check_ids(ids, param=name)
        if not ids:
            raise RequestValidationError(f"{name} has no tokens after truncation", name)
        if len(ids) > max_model_len:
            raise RequestValidationError(
                f"{name} has {len(ids)} tokens, more than this model's maximum of {max_model_len}; "
                "shorten it or set 'truncate_prompt_tokens'", name, ErrorCode.CONTEXT_LENGTH_EXCEEDED)
        out.append(ids)
    return out


def pooling_requests(external_id: str, token_ids: list[list[int]], client_id: str, arrival: float,
                     ) -> list[EngineCoreRequest]:
    """One pooling ``EngineCoreRequest`` per input; ids ``<external_id>-<i>-<8 hex>`` (``external_id`` is at
    most ``MAX_REQUEST_ID_LEN`` + 5 characters, so 2,048 inputs add well under 1 MB of ids)."""
    return [EngineCoreRequest(
        request_id=f"{external_id}-{i}-{secrets.token_hex(4)}", external_req_id=external_id,
        prompt_token_ids=ids, sampling_params=SamplingParams(max_tokens=1), client_id=client_id,
        arrival_time=arrival, pooling=True) for i, ids in enumerate(token_ids)]


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


def validate_embeddings(data: dict[str, Any]) -> tuple[EmbeddingRequest, list[str | list[int]]]:
    """The validated request and its normalized inputs (raises ``RequestValidationError``)."""
    req = validate_request(EmbeddingRequest, data)
    return req, normalize_input(req.input)
