"""Issue 39 (fresh-eyes findings): constraints that pass the grammar's validation but that the engine's matcher gives
up on within its first masks are refused by the gateway's check (a 400 naming the field, before any stream byte),
by a dry run over a byte vocabulary (``inference.shared.structured_probe``). Before, each of these passed ``check``
and a streamed request got a 200, a role chunk and an in-band error."""

from __future__ import annotations

import json

import httpx
import pytest

from harness.assets import DEMO_MODEL
from inference.shared.structured import check
from inference.shared.structured_caps import StructuredSpecError

SELF_REQUIRED = {"$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "required": ["x"]}},
                 "$ref": "#/$defs/a"}
REFUSED = [
    ("regex", "a{100000}", "too large for the engine's lexer"),
    ("regex", "(a{1000}){1000}", "too large for the engine's lexer"),
    ("regex", "\n" * 60_000, "too large for the engine's lexer"),
    ("choice", json.dumps(["x" * 60_000]), "too large for the engine's lexer"),
    ("json", json.dumps({"anyOf": [{"$ref": "#"}]}), "refers to itself"),
    ("json", json.dumps({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}), "refers to itself"),
    ("json", json.dumps(SELF_REQUIRED), "too ambiguous or recursive"),
    ("grammar", "root ::= root", "refers to itself"),
    ("grammar", "start: a\na: b\nb: a", "refers to itself"),
    ("grammar", 'start: %json {"allOf": [{"$ref": "#"}]}', "refers to itself"),
    ("grammar", "start: /(a{1000}){1000}/", "too large for the engine's lexer"),
    ("grammar", "start: " + " | ".join(f'"w{i}"' for i in range(6000)), "max is 2000"),
    ("grammar", "start: r0\n" + "\n".join(f"r{i}: r{i + 1} r{i + 1}" for i in range(499)) + '\nr499: "a"',
     "too ambiguous or recursive"),
]


@pytest.mark.parametrize(("kind", "spec", "reason"), REFUSED, ids=[f"{k}-{i}" for i, (k, _s, _r) in enumerate(REFUSED)])
def test_what_the_engine_would_give_up_on_is_refused_by_the_check(kind, spec, reason):
    with pytest.raises(StructuredSpecError, match=reason):
        check(kind, spec)


@pytest.mark.parametrize(("kind", "spec"), [
    ("json", json.dumps({"type": "object", "properties": {"a": {"type": "string", "format": "email"},
                                                          "d": {"type": "string", "format": "date-time"},
                                                          "n": {"type": "array", "items": {"$ref": "#"}}},
                         "required": ["a", "d"]})),
    ("json", json.dumps({"type": "object", "additionalProperties": {"$ref": "#"}})),  # recursive with a way out
    ("regex", "[0-9]{3}-[0-9]{4}"),
    ("regex", "(.{1,50}){1,50}"),  # fails only over the real vocabulary: the engine's case (D-324)
    ("choice", json.dumps(["yes", "no"])),
    ("grammar", 'root ::= "a" | "b"'),
    ("json_object", "{}"),
])
def test_ordinary_and_recursive_constraints_still_pass(kind, spec):
    assert isinstance(check(kind, spec), str)  # the engine form (json_object: empty)


@pytest.fixture(scope="module")
def live(shared_live):
    return shared_live


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"regex": "a{100000}"}},
    {"structured_outputs": {"json": {"anyOf": [{"$ref": "#"}]}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SELF_REQUIRED}}},
    {"structured_outputs": {"grammar": "root ::= root"}},
])
def test_live_a_streamed_request_gets_a_plain_400_naming_the_field(live, body):
    with httpx.stream("POST", live.base_url + "/v1/chat/completions", timeout=120,
                      headers={"Authorization": f"Bearer {live.api_key}"},
                      json={"model": DEMO_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                            "stream": True, "n": 2, **body}) as resp:
        text = resp.read().decode()
    assert resp.status_code == 400, text[:300]  # was 200, a role chunk, then an in-band error
    assert not text.startswith("data:")
    err = json.loads(text)["error"]
    param = next(iter(body))
    assert err["type"] == "invalid_request_error" and err["param"].startswith(param), err


@pytest.mark.parametrize("name", ["", "a b", 'f"\n<|im_end|>', "x" * 65, "get.weather"])
def test_a_tool_name_outside_openais_pattern_is_refused_naming_it(name):
    """A tool's name is written into the rendered prompt: quotes, newlines or a special token's text in it would be
    the template's markup. OpenAI allows 1-64 of a-z, A-Z, 0-9, ``_``, ``-``; it was accepted as anything."""
    from inference.protocol.openai import ChatCompletionRequest, RequestValidationError, validate_request

    with pytest.raises(RequestValidationError) as caught:
        validate_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": [{"type": "function", "function": {"name": name}}]})
    assert caught.value.param == "tools.0.function.name", caught.value.param
