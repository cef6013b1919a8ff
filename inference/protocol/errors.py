"""The OpenAI error envelope and its vocabulary: the one writer of ``{"error": {"message", "type", "param",
"code"}}`` for every surface (gateway, REST API, Django error pages, body-limit middleware) and the enums of its
``type`` and ``code`` values. Django-free."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any


class ErrorType(StrEnum):
    """OpenAI's error ``type`` values."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    PERMISSION = "permission_error"
    NOT_FOUND = "not_found_error"
    RATE_LIMIT = "rate_limit_error"
    SERVER = "server_error"
    API = "api_error"


class ErrorCode(StrEnum):
    """Every ``code`` the gateway answers (public: clients match on them; never rename one)."""

    INVALID_API_KEY = "invalid_api_key"
    PERMISSION_DENIED = "permission_denied"
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_NOT_EMBEDDING = "model_not_embedding"
    MODEL_NOT_GENERATIVE = "model_not_generative"
    UNKNOWN_ROUTE = "unknown_route"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    REQUEST_TOO_LARGE = "request_too_large"
    REQUEST_TIMEOUT = "request_timeout"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    CHAT_TEMPLATE_NOT_ALLOWED = "chat_template_not_allowed"
    NO_CHAT_TEMPLATE = "no_chat_template"
    TEMPLATE_TIMEOUT = "template_timeout"
    TEMPLATE_SECURITY = "template_security"
    TEMPLATE_LIMIT = "template_limit"
    INVALID_PROMPT = "invalid_prompt"
    INVALID_IMAGE = "invalid_image"
    IMAGE_TIMEOUT = "image_timeout"
    IMAGES_NOT_SUPPORTED = "images_not_supported"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    CONCURRENCY_LIMIT_EXCEEDED = "concurrency_limit_exceeded"
    INSUFFICIENT_QUOTA = "insufficient_quota"
    IMAGE_CONCURRENCY_EXCEEDED = "image_concurrency_exceeded"
    SERVER_OVERLOADED = "server_overloaded"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    UPSTREAM_FAILED = "upstream_failed"  # the front api's relay to the multimodal api failed (gateway/handoff.py)
    ENGINE_ERROR = "engine_error"
    STRUCTURED_OUTPUT_FAILED = "structured_output_failed"
    STRUCTURED_OUTPUTS_UNAVAILABLE = "structured_outputs_unavailable"
    RENDER_UNAVAILABLE = "render_unavailable"
    RENDER_INTERNAL_ERROR = "render_internal_error"
    MM_UNAVAILABLE = "mm_unavailable"
    MM_INTERNAL_ERROR = "mm_internal_error"
    DATABASE_UNAVAILABLE = "database_unavailable"
    SERVICE_UNAVAILABLE = "service_unavailable"
    INTERNAL_ERROR = "internal_error"


INTERNAL_ERROR_MESSAGE = "The server had an error while processing your request."


def error_dict(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope ``{"error": {"message", "type", "param", "code"}}`` (plain ``str`` values)."""
    return {"error": {"message": message, "type": str(type_), "param": param,
                      "code": None if code is None else str(code)}}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    """``error_dict`` serialised as JSON bytes."""
    return json.dumps(error_dict(message, type_, param, code)).encode()
