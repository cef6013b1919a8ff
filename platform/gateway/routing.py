"""ASGI URL routes of the OpenAI-compatible surface (served by Channels consumers, not Django views)."""

from __future__ import annotations

from django.urls import path, re_path

from gateway.endpoints.chat import ChatCompletionsConsumer
from gateway.endpoints.completions import CompletionsConsumer
from gateway.endpoints.embeddings import EmbeddingsConsumer
from gateway.endpoints.generate import AbortRequestsConsumer, GenerateConsumer
from gateway.endpoints.health import HealthConsumer, NotFoundConsumer
from gateway.endpoints.messages import CountTokensConsumer, MessagesConsumer
from gateway.endpoints.metrics import MetricsConsumer
from gateway.endpoints.models_api import ModelsConsumer
from gateway.endpoints.openapi import OPENAPI_PATH, OpenApiConsumer
from gateway.endpoints.render import ChatRenderConsumer, CompletionRenderConsumer
from gateway.endpoints.responses import (CancelConsumer, InputItemsConsumer, InputTokensConsumer, ResponseConsumer,
                                         ResponsesConsumer)
from gateway.endpoints.tokenize import DetokenizeConsumer, TokenizeConsumer

http_urlpatterns = [
    path("health", HealthConsumer.as_asgi()),
    path("metrics", MetricsConsumer.as_asgi()),
    path("v1/chat/completions", ChatCompletionsConsumer.as_asgi()),
    path("v1/chat/completions/render", ChatRenderConsumer.as_asgi()),
    path("v1/completions/render", CompletionRenderConsumer.as_asgi()),
    path("tokenize", TokenizeConsumer.as_asgi()),
    path("v1/messages", MessagesConsumer.as_asgi()),  # Anthropic's Messages API
    path("v1/messages/count_tokens", CountTokensConsumer.as_asgi()),
    path("detokenize", DetokenizeConsumer.as_asgi()),
    path("inference/v1/generate", GenerateConsumer.as_asgi()),
    path("inference/v1/abort_requests", AbortRequestsConsumer.as_asgi()),
    path("v1/completions", CompletionsConsumer.as_asgi()),
    path("v1/embeddings", EmbeddingsConsumer.as_asgi()),
    path("v1/models", ModelsConsumer.as_asgi()),
    path(OPENAPI_PATH.lstrip("/"), OpenApiConsumer.as_asgi()),  # public (D-176)
    path("v1/responses", ResponsesConsumer.as_asgi()),  # OpenAI's Responses API
    path("v1/responses/input_tokens", InputTokensConsumer.as_asgi()),
    re_path(r"^v1/responses/(?P<response_id>[^/]+)$", ResponseConsumer.as_asgi()),
    re_path(r"^v1/responses/(?P<response_id>[^/]+)/cancel$", CancelConsumer.as_asgi()),
    re_path(r"^v1/responses/(?P<response_id>[^/]+)/input_items$", InputItemsConsumer.as_asgi()),
    re_path(r"^v1/models/(?P<model>[^/]+)$", ModelsConsumer.as_asgi()),
    re_path(r"", NotFoundConsumer.as_asgi()),  # anything else under GATEWAY_PREFIXES: JSON 404
]

# Route prefixes handled above; everything else goes to Django (admin, REST control API, dashboards).
GATEWAY_PREFIXES = ("/health", "/v1/", "/tokenize", "/detokenize", "/inference/", "/metrics")
