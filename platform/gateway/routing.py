"""ASGI URL routes of the OpenAI-compatible surface (served by Channels consumers, not Django views)."""

from __future__ import annotations

from django.urls import path, re_path

from gateway.chat import ChatCompletionsConsumer
from gateway.completions import CompletionsConsumer
from gateway.health import HealthConsumer, NotFoundConsumer
from gateway.models_api import ModelsConsumer

http_urlpatterns = [
    path("health", HealthConsumer.as_asgi()),
    path("v1/chat/completions", ChatCompletionsConsumer.as_asgi()),
    path("v1/completions", CompletionsConsumer.as_asgi()),
    path("v1/models", ModelsConsumer.as_asgi()),
    re_path(r"^v1/models/(?P<model>[^/]+)$", ModelsConsumer.as_asgi()),
    re_path(r"^v1/", NotFoundConsumer.as_asgi()),
]

# Route prefixes handled above; everything else goes to Django (admin, REST control API, dashboards).
GATEWAY_PREFIXES = ("/health", "/v1/", "/tokenize", "/detokenize", "/inference/", "/metrics")
