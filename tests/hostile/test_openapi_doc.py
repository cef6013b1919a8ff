"""The OpenAPI description of the OpenAI routes (``gateway.endpoints.openapi``): complete, built from the request models,
loadable by schemathesis. The live run against it is ``tests/e2e/test_schemathesis_e2e.py``."""

from __future__ import annotations

import json
import re

import pytest
import schemathesis
from django.urls.resolvers import RoutePattern

from gateway.endpoints.openapi import OPENAPI_PATH, openapi_bytes, openapi_document
from gateway.routing import http_urlpatterns
from inference.protocol.anthropic import MessagesRequest
from inference.protocol.openai import ChatCompletionRequest, GenerateRequest

UNDESCRIBED = {"/health", "/metrics", OPENAPI_PATH}  # operational routes, and the document itself


def _route_paths() -> set[str]:
    paths = set()
    for pattern in http_urlpatterns[:-1]:  # the last one is the catch-all 404
        p = pattern.pattern
        # a regex route's named groups are the document's path parameters: ^v1/models/(?P<model>[^/]+)$
        paths.add("/" + (str(p) if isinstance(p, RoutePattern) else
                         re.sub(r"\(\?P<(\w+)>[^)]*\)", r"{\1}", str(p)).strip("^$")))
    return paths


def test_every_gateway_route_is_described():
    assert set(openapi_document()["paths"]) == _route_paths() - UNDESCRIBED


@pytest.mark.parametrize("model", [ChatCompletionRequest, GenerateRequest, MessagesRequest])
def test_request_bodies_are_the_pydantic_models(model):
    doc = openapi_document()
    component = doc["components"]["schemas"][model.__name__]
    own = model.model_json_schema(ref_template="#/components/schemas/{model}")["properties"]
    assert set(component["properties"]) == set(own)
    for name, prop in own.items():
        if name != "model":  # held to the served-name pattern and required here
            assert component["properties"][name] == prop, name
    assert "model" in component["required"]


def test_every_operation_documents_the_error_envelope_and_loads_in_schemathesis():
    doc = json.loads(openapi_bytes())
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            assert {"200", "401", "405", "429", "500"} <= codes, (method, path)
            if method == "post":
                assert {"400", "408", "413", "503"} <= codes, path
            envelope = "AnthropicError" if path.startswith("/v1/messages") else "Error"  # Anthropic's routes
            for code, response in op["responses"].items():
                if code != "200":
                    assert response["content"]["application/json"]["schema"] == {
                        "$ref": f"#/components/schemas/{envelope}"}, (path, code)
    schema = schemathesis.openapi.from_dict(doc)
    labels = {op.ok().label for op in schema.get_all_operations()}
    assert "POST /v1/chat/completions" in labels and "POST /v1/messages" in labels
    assert len(labels) == sum(len(ops) for ops in doc["paths"].values())
