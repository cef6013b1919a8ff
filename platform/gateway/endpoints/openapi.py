"""``GET /v1/openapi.json``: an OpenAPI 3.1 description of the OpenAI-compatible routes this gateway serves.

Request bodies are the gateway's own pydantic models (``inference.protocol.openai``, ``inference.api.embeddings``)
through pydantic's ``models_json_schema``, so the description cannot drift from what is validated; what JSON
Schema cannot say (token ids in the model's vocabulary, chat-template rules, cross-field rules) is still
answered 400 at run time. Responses are written here as the endpoints answer them; every error is the OpenAI
envelope (``inference.protocol.errors.error_dict``) with one of the statuses the gateway can answer (``ApiError``:
400, 401, 403, 404, 405, 408, 413, 429, 500, 503), but on the Messages API routes, whose errors are Anthropic's
envelope (``gateway.dialects.AnthropicDialect``, 402 and 529 besides). Served without a key (DECISIONS D-176): it describes the
public surface only, no tenant's data and no model names, as vLLM's own ``/openapi.json`` is public.
``tests/e2e/test_schemathesis_e2e.py`` runs schemathesis against it.
"""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.http import GatewayConsumer
from inference.api.embeddings import EmbeddingRequest
from inference.protocol.anthropic import CountTokensRequest, MessagesRequest
from inference.protocol.responses import ResponsesRequest
from inference.protocol.openai import (
    SERVED_MODEL_NAME_RE,
    AbortRequestsRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

OPENAPI_PATH = "/v1/openapi.json"
_REF = "#/components/schemas/"

# The request models, by component name; ``model`` is required on every one but the abort route's (the gateway
# answers 400 "'model' is required" without it: ``gateway.pipeline.preamble.resolve_model``).
_REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest, CompletionRequest, EmbeddingRequest, TokenizeCompletionRequest, TokenizeChatRequest,
    DetokenizeRequest, GenerateRequest, AbortRequestsRequest, MessagesRequest, CountTokensRequest, ResponsesRequest)

_STR = {"type": "string"}
_INT = {"type": "integer"}
_NULLABLE_STR = {"type": ["string", "null"]}
_USAGE = {"type": "object", "required": ["prompt_tokens", "total_tokens"], "properties": {
    "prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
    "prompt_tokens_details": {"type": ["object", "null"]}, "completion_tokens_details": {"type": ["object", "null"]},
}}
_TOKEN_IDS = {"type": "array", "items": _INT}

# Response components, as the endpoints write them (gateway/endpoints/chat.py, completions.py, embeddings.py, ...).
_RESPONSES: dict[str, dict[str, Any]] = {
    "Error": {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "description": "The OpenAI error envelope: every non-2xx answer of every route.",
        "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "additionalProperties": False,
            "properties": {"message": _STR, "type": _STR, "param": _NULLABLE_STR, "code": _NULLABLE_STR}}},
    },
    "Usage": _USAGE,
    "ChatCompletion": {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
            "system_fingerprint": _NULLABLE_STR, "usage": {"$ref": _REF + "Usage"},
            "prompt_token_ids": {**_TOKEN_IDS, "type": ["array", "null"]},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "message", "finish_reason"],
                "properties": {
                    "index": _INT, "finish_reason": _NULLABLE_STR, "logprobs": {"type": ["object", "null"]},
                    "stop_reason": {"type": ["string", "integer", "null"]}, "token_ids": _TOKEN_IDS,
                    "message": {"type": "object", "required": ["role"], "properties": {
                        "role": {"const": "assistant"}, "content": _NULLABLE_STR, "reasoning": _NULLABLE_STR,
                        "reasoning_content": _NULLABLE_STR, "tool_calls": {"type": "array"}}}}}},
        },
    },
    "Completion": {
        "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
            "system_fingerprint": _NULLABLE_STR, "usage": {"$ref": _REF + "Usage"},
            "prompt_token_ids": {"type": ["array", "null"]},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "text", "finish_reason"],
                "properties": {"index": _INT, "text": _STR, "finish_reason": _NULLABLE_STR,
                               "logprobs": {"type": ["object", "null"]},
                               "stop_reason": {"type": ["string", "integer", "null"]}, "token_ids": _TOKEN_IDS}}},
        },
    },
    "EmbeddingList": {
        "type": "object", "required": ["object", "data", "model", "usage"],
        "properties": {
            "object": {"const": "list"}, "model": _STR, "id": _STR, "created": _INT, "usage": {"$ref": _REF + "Usage"},
            "data": {"type": "array", "items": {
                "type": "object", "required": ["object", "index", "embedding"],
                "properties": {"object": {"const": "embedding"}, "index": _INT,
                               "embedding": {"oneOf": [{"type": "array", "items": {"type": "number"}},
                                                       {"type": "string", "description": "base64 of float32s"}]}}}},
        },
    },
    "Model": {
        "type": "object", "required": ["id", "object", "created", "owned_by"],
        "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "root": _STR,
                       "parent": _NULLABLE_STR, "max_model_len": _INT},
    },
    "ModelList": {
        "type": "object", "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": {"$ref": _REF + "Model"}}},
    },
    "TokenizeResponse": {
        "type": "object", "required": ["count", "max_model_len", "tokens"],
        "properties": {"count": _INT, "max_model_len": _INT, "tokens": _TOKEN_IDS,
                       "token_strs": {"type": ["array", "null"], "items": _NULLABLE_STR}},
    },
    "DetokenizeResponse": {"type": "object", "required": ["prompt"], "properties": {"prompt": _STR}},
    "TokensInRequest": {
        "type": "object", "required": ["request_id", "token_ids", "sampling_params", "model", "stream"],
        "description": "A rendered request, ready for POST /inference/v1/generate.",
        "properties": {"request_id": _STR, "token_ids": _TOKEN_IDS, "sampling_params": {"type": "object"},
                       "model": _STR, "stream": {"type": "boolean"}},
    },
    "GenerateResponse": {
        "type": "object", "required": ["request_id", "model", "created", "choices"],
        "properties": {
            "request_id": _STR, "model": _STR, "created": _INT, "usage": {"$ref": _REF + "Usage"},
            "choices": {"type": "array", "items": {
                "type": "object", "required": ["index", "token_ids", "finish_reason"],
                "properties": {"index": _INT, "token_ids": _TOKEN_IDS, "finish_reason": _NULLABLE_STR,
                               "stop_reason": {"type": ["string", "integer", "null"]},
                               "logprobs": {"type": ["object", "array", "null"]}}}},
        },
    },
    "AbortResponse": {"type": "object", "description": "Always empty.", "maxProperties": 0},
    "AnthropicError": {
        "type": "object", "required": ["type", "error", "request_id"],
        "description": "Anthropic's error envelope: every non-2xx answer of the Messages API routes (the field the "
                       "error is about starts its message).",
        "properties": {"type": {"const": "error"}, "request_id": _NULLABLE_STR, "error": {
            "type": "object", "required": ["type", "message"], "properties": {"type": _STR, "message": _STR}}},
    },
    "AnthropicMessage": {
        "type": "object", "required": ["id", "type", "role", "model", "content", "stop_reason", "usage"],
        "properties": {
            "id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"}, "model": _STR,
            "content": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["text", "thinking", "tool_use"]}}}},
            "stop_reason": {"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
            "stop_sequence": _NULLABLE_STR,
            "usage": {"type": "object", "required": ["input_tokens", "output_tokens"], "properties": {
                "input_tokens": _INT, "output_tokens": _INT, "cache_read_input_tokens": _INT,
                "cache_creation_input_tokens": _INT}},
        },
    },
    "CountTokensResponse": {"type": "object", "required": ["input_tokens"], "properties": {"input_tokens": _INT}},
    "Response": {
        "type": "object", "description": "A Responses API response (openai/types/responses/response.py).",
        "required": ["id", "object", "created_at", "status", "model", "output"],
        "properties": {
            "id": _STR, "object": {"const": "response"}, "created_at": _INT, "model": _STR,
            "status": {"enum": ["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]},
            "output": {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
                "type": {"enum": ["message", "function_call", "reasoning"]}}}},
            "usage": {"type": ["object", "null"]}, "previous_response_id": _NULLABLE_STR,
            "background": {"type": ["boolean", "null"]}, "error": {"type": ["object", "null"]},
        },
    },
    "ResponseDeleted": {"type": "object", "required": ["id", "object", "deleted"], "properties": {
        "id": _STR, "object": {"const": "response"}, "deleted": {"const": True}}},
    "ResponseItemList": {"type": "object", "required": ["object", "data", "has_more"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {"type": "object"}},
        "has_more": {"type": "boolean"}, "first_id": _NULLABLE_STR, "last_id": _NULLABLE_STR}},
    "ResponseInputTokens": {"type": "object", "required": ["object", "input_tokens"], "properties": {
        "object": {"const": "response.input_tokens"}, "input_tokens": _INT}},
}

# The errors each kind of route can answer (besides 2xx), with what they mean there.
_ERRORS_COMMON = {
    "401": "no, unknown, revoked or expired API key (``WWW-Authenticate: Bearer``)",
    "403": "the key lacks the ``inference`` scope, or may not use this model",
    "405": "another method (``Allow`` names the one served)",
    "429": "the key's request, token, concurrency or budget limit (``Retry-After``)",
    "500": "a defect (logged; the message never carries details)",
}
_ERRORS_BODY = {
    "400": "invalid JSON, a field out of its range, a rule of the model (context length, vocabulary, template)",
    "404": "no such served model",
    "408": "the body did not arrive in time",
    "413": "the body is over the size cap",
    "503": "no capacity now (admission, engine or worker unavailable; ``Retry-After``)",
}
_RESPONSES_SSE = {"text/event-stream": {"schema": {
    "type": "string", "description": "``event: <type>`` and ``data: <JSON>`` pairs with a gap-free ``sequence_number``: "
                                     "``response.created`` ... ``response.completed`` (or ``.incomplete``, or "
                                     "``error`` then ``response.failed``); no ``[DONE]``."}}}
_RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
_STORED_ERRORS = {**_ERRORS_COMMON, "400": "a query parameter out of its range",
                  "404": "no stored response of this id for the key's tenant"}
_SSE = {"text/event-stream": {"schema": {
    "type": "string", "description": "``data: <chunk JSON>`` events, then ``data: [DONE]``; an error after the "
                                     "stream started is one ``data: <error envelope>`` event."}}}
_ANTHROPIC_SSE = {"text/event-stream": {"schema": {
    "type": "string", "description": "``event: <name>`` and ``data: <JSON>`` pairs: ``message_start``, per block "
                                     "``content_block_start``/``_delta``/``_stop``, ``message_delta``, "
                                     "``message_stop``; ``ping`` anywhere; ``event: error`` after the 200."}}}
# The Messages API's errors: the OpenAI routes' statuses, plus 402 (budget) and 529 (admission shed)
_ERRORS_MESSAGES = {**_ERRORS_COMMON, **_ERRORS_BODY, "401": "no, unknown, revoked or expired API key, or "
                    "``x-api-key`` and ``Authorization: Bearer`` naming different keys",
                    "402": "the key's or tenant's token budget is exhausted (``billing_error``)",
                    "429": "the key's request, token or concurrency limit (``rate_limit_error``, ``retry-after``)",
                    "503": "no replica or worker available now (``api_error``, ``retry-after``)",
                    "529": "the model's admission limits shed the request (``overloaded_error``, ``retry-after``)"}


def _json(ref: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": _REF + ref}}}


def _anthropic(operation: dict[str, Any]) -> dict[str, Any]:
    """``operation`` as a Messages API route: its errors in Anthropic's envelope, its stream Anthropic's events,
    the key from ``x-api-key`` or a bearer token."""
    for status, response in operation["responses"].items():
        if status == "200" and "text/event-stream" in response["content"]:
            response["content"] = {**response["content"], **_ANTHROPIC_SSE}
        elif status != "200":
            response["content"] = _json("AnthropicError")
    return {**operation, "security": [{"bearerAuth": []}, {"apiKeyHeader": []}]}


def _operation(summary: str, ok: str, *, request: str | None = None, stream: bool = False,
               request_schema: dict[str, Any] | None = None, errors: dict[str, str] | None = None,
               public: bool = False, description: str = "") -> dict[str, Any]:
    """One operation: 200 with ``ok`` (and SSE when ``stream``), the error statuses, bearer auth."""
    content = _json(ok)
    if stream:
        content = {**content, **_SSE}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    for status, why in sorted((errors if errors is not None else {**_ERRORS_COMMON, **_ERRORS_BODY}).items()):
        responses[status] = {"description": why, "content": _json("Error")}
    op: dict[str, Any] = {"summary": summary, "responses": responses}
    if description:
        op["description"] = description
    if request or request_schema:
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": request_schema or {"$ref": _REF + str(request)}}}}
    if public:
        op["security"] = []
    return op


def _require_model(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (a request component) with ``model`` required and held to the served-name pattern."""
    out = copy.deepcopy(schema)
    props = out.get("properties", {})
    if "model" in props:
        props["model"] = {"type": "string", "pattern": SERVED_MODEL_NAME_RE, "maxLength": 128,
                          "description": "a served model name (GET /v1/models)"}
        out["required"] = sorted({*out.get("required", []), "model"})
    return out


def _responses_paths() -> dict[str, Any]:
    """The Responses API's routes (gateway/endpoints/responses.py)."""
    create = _operation("Create a response (OpenAI's Responses API)", "Response", request="ResponsesRequest",
                        stream=True)
    create["responses"]["200"]["content"] = {**_json("Response"), **_RESPONSES_SSE}
    one = {**_operation("A stored response (``?stream=true&starting_after=N``: a background response's events)",
                        "Response", errors=_STORED_ERRORS), "parameters": _RESPONSE_ID}
    one["responses"]["200"]["content"] = {**_json("Response"), **_RESPONSES_SSE}
    return {
        "/v1/responses": {"post": create},
        "/v1/responses/input_tokens": {"post": _operation(
            "Count a response's input tokens, as a create renders them", "ResponseInputTokens",
            request="ResponsesRequest")},
        "/v1/responses/{response_id}": {
            "get": one,
            "delete": {**_operation("Delete a stored response and its items", "ResponseDeleted",
                                    errors=_STORED_ERRORS), "parameters": _RESPONSE_ID}},
        "/v1/responses/{response_id}/cancel": {"post": {**_operation(
            "Cancel a background response (400: it was not one)", "Response", errors={
                **_STORED_ERRORS, "408": _ERRORS_BODY["408"], "413": _ERRORS_BODY["413"],
                "503": "the platform's database is unreachable"}),
            "parameters": _RESPONSE_ID}},
        "/v1/responses/{response_id}/input_items": {"get": {**_operation(
            "A stored response's input items (cursor page)", "ResponseItemList", errors=_STORED_ERRORS),
            "parameters": _RESPONSE_ID}},
    }


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document (a dict, built once per process)."""
    _keys, defs = models_json_schema([(m, "validation") for m in _REQUEST_MODELS], ref_template=_REF + "{model}")
    components: dict[str, Any] = dict(defs.get("$defs", {}))
    for model in _REQUEST_MODELS:
        if model is not AbortRequestsRequest:
            components[model.__name__] = _require_model(components[model.__name__])
    components.update(_RESPONSES)
    tokenize_body = {"oneOf": [{"$ref": _REF + "TokenizeCompletionRequest"},
                               {"$ref": _REF + "TokenizeChatRequest"}]}
    models_errors = {**_ERRORS_COMMON, "403": "the key lacks the ``inference`` scope"}
    render = _operation("Render a completion request into tokens-in requests, one per prompt (vLLM)",
                        "TokensInRequest", request="CompletionRequest")
    render["responses"]["200"]["content"] = {"application/json": {"schema": {
        "type": "array", "items": {"$ref": _REF + "TokensInRequest"}}}}
    paths = {
        "/v1/chat/completions": {"post": _operation(
            "Chat completion (OpenAI)", "ChatCompletion", request="ChatCompletionRequest", stream=True)},
        "/v1/completions": {"post": _operation(
            "Text completion (OpenAI)", "Completion", request="CompletionRequest", stream=True)},
        "/v1/embeddings": {"post": _operation("Embeddings (OpenAI)", "EmbeddingList", request="EmbeddingRequest")},
        "/v1/models": {"get": _operation("The models this key may use", "ModelList", errors=models_errors)},
        "/v1/models/{model}": {"get": {
            **_operation("One model", "Model", errors={**models_errors, "404": "no such model for this key"}),
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]}},
        "/tokenize": {"post": _operation(
            "Tokenize a prompt or a chat (vLLM)", "TokenizeResponse", request_schema=tokenize_body,
            description="A body with ``messages`` is a chat (its template applied), else ``prompt`` is tokenized; "
                        "both at once: 400.")},
        "/detokenize": {"post": _operation("Token ids to text (vLLM)", "DetokenizeResponse",
                                           request="DetokenizeRequest")},
        "/v1/chat/completions/render": {"post": _operation(
            "Render a chat request into a tokens-in request (vLLM)", "TokensInRequest",
            request="ChatCompletionRequest")},
        "/v1/completions/render": {"post": render},
        "/inference/v1/generate": {"post": _operation(
            "Generate from token ids (vLLM)", "GenerateResponse", request="GenerateRequest", stream=True)},
        "/v1/messages": {"post": _anthropic(_operation(
            "Create a message (Anthropic's Messages API)", "AnthropicMessage", request="MessagesRequest",
            stream=True, errors=_ERRORS_MESSAGES))},
        "/v1/messages/count_tokens": {"post": _anthropic(_operation(
            "Count a message's input tokens, exactly as a create renders them (Anthropic)", "CountTokensResponse",
            request="CountTokensRequest", errors={k: v for k, v in _ERRORS_MESSAGES.items() if k not in ("402", "529")}))},
        **_responses_paths(),
        "/inference/v1/abort_requests": {"post": _operation(
            "Abort the caller's generate requests by request id (vLLM)", "AbortResponse",
            request="AbortRequestsRequest", errors={**_ERRORS_COMMON, **{k: v for k, v in _ERRORS_BODY.items()
                                                                          if k != "404"}})},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "OpenAI-compatible inference API", "version": "1",
                 "description": "The OpenAI and vLLM routes of this platform's gateway. Every error is "
                                "``{\"error\": {message, type, param, code}}``."},
        "paths": paths,
        "components": {"schemas": components, "securitySchemes": {
            "bearerAuth": {"type": "http", "scheme": "bearer", "description": "an API key (sk-...)"},
            "apiKeyHeader": {"type": "apiKey", "in": "header", "name": "x-api-key",
                             "description": "an API key (sk-...), on the Messages API routes"}}},
        "security": [{"bearerAuth": []}],
    }


@lru_cache(maxsize=1)
def openapi_bytes() -> bytes:
    """``openapi_document()`` as compact JSON bytes."""
    return json.dumps(openapi_document(), separators=(",", ":")).encode()


class OpenApiConsumer(GatewayConsumer):
    """``GET /v1/openapi.json``: the document above, without a key (D-176)."""

    methods = ("GET",)

    async def handle_request(self, body: bytes) -> None:
        payload = openapi_bytes()
        await self.send_headers(status=200, headers=[(b"content-type", b"application/json"),
                                                     (b"content-length", str(len(payload)).encode())])
        await self.send_body(payload)
