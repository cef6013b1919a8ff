"""Structured outputs, request side (issue 16): ``response_format`` / ``structured_outputs`` validation (400 naming
the field, vLLM's rules), their mapping into ``SamplingParams``, the validation cache, and the wire."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from inference.shared import structured
from inference.api.input_processor import GenerationDefaults, process_inputs
from inference.protocol.engine import EngineCoreRequest, pack_requests, unpack_entry
from inference.protocol.openai import (ChatCompletionRequest, CompletionRequest, RequestValidationError,
                                       validate_request)

MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**body):
    return validate_request(ChatCompletionRequest, {"model": "m", "messages": MSGS, **body})


def resolve(req) -> structured.Constraint | None:
    """What the gateway's sandbox does with a request's constraint, in this process: ``check`` → its engine form, or
    the 400 naming the field."""
    constraint = structured.constraint_of(req)
    if constraint is None:
        return None
    try:
        return replace(constraint, spec=structured.check(constraint.kind, constraint.spec))
    except structured.StructuredSpecError as exc:
        raise constraint.refusal(str(exc)) from None


def refused(body: dict, schema=ChatCompletionRequest) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as info:
        req = validate_request(schema, {"model": "m", "messages": MSGS, "prompt": "x", **body})
        resolve(req)
    return info.value


@pytest.mark.parametrize("body, kind, spec", [
    ({"response_format": {"type": "text"}}, None, ""),
    ({"response_format": {"type": "json_object"}}, "json_object", ""),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a-b_1", "schema": SCHEMA, "strict": True,
                                                                  "description": "d"}}}, "json", json.dumps(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, "json", json.dumps(SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", json.dumps(SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, "regex", "[0-9]+"),
    ({"structured_outputs": {"choice": ["a", "b c"]}}, "choice", '["a", "b c"]'),
    # a grammar's engine form is Lark (GBNF converted), headed so that vLLM's format sniffing stops at once
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, "grammar", '%llguidance {}\n\nstart: "x"\n'),
    ({"structured_outputs": {"grammar": 'start: "x"'}}, "grammar", '%llguidance {}\nstart: "x"'),
    ({"structured_outputs": {"json_object": True}}, "json_object", ""),
])
@pytest.mark.parametrize("schema", [ChatCompletionRequest, CompletionRequest])
def test_accepted_forms_map_to_sampling_params(body, kind, spec, schema):
    req = validate_request(schema, {"model": "m", "messages": MSGS, "prompt": "x", **body})
    constraint = resolve(req)
    out = process_inputs(req, external_id="x", prompt_token_ids=[1, 2], prompt_param="prompt", max_model_len=64,
                         vocab_size=1000, defaults=GenerationDefaults(), client_id="c", constraint=constraint)
    sp = out.requests[0].sampling_params
    assert (sp.structured_kind, sp.structured_spec) == (kind, spec)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name", "schema": SCHEMA}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema"),  # a keyword llguidance does not implement: refused, not ignored
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "minimum": 5, "maximum": 1}}}}, "response_format.json_schema.schema"),  # unsatisfiable
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"grammar": " "}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    # caps
    ({"structured_outputs": {"regex": "a" * (structured.MAX_SPEC_BYTES + 1)}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": [str(i) for i in range(structured.MAX_CHOICES + 1)]}},
     "structured_outputs.choice"),
    ({"structured_outputs": {"json": json.loads('{"items":' * 40 + "{}" + "}" * 40)}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "start: " + " | ".join(f'"w{i}" x{i}' for i in range(3000)) + "\n"
                             + "\n".join(f'x{i}: "a" x{i} | "b"' for i in range(3000))}},
     "structured_outputs.grammar"),  # over the byte cap
])
@pytest.mark.parametrize("schema", [ChatCompletionRequest, CompletionRequest])
def test_refused_with_the_field_named(body, param, schema):
    err = refused(body, schema)
    assert err.param == param, err.message
    assert err.message


def test_constraint_survives_the_wire_single_and_grouped():
    req = chat(n=3, seed=5, structured_outputs={"choice": ["a", "b"]})
    processed = process_inputs(req, external_id="x", prompt_token_ids=[1, 2, 3], prompt_param="messages",
                               max_model_len=64, vocab_size=1000, defaults=GenerationDefaults(), client_id="c",
                               constraint=resolve(req))
    for r in processed.requests:
        r.sampling_params.structured_after_token_ids = [7, 8]  # (shared by the children, as a reasoning parser sets)
    entries = pack_requests(processed.requests)
    assert len(entries) == 1 and "g" in entries[0]  # one grouped entry for the 3 children
    back = unpack_entry({k.encode(): v for k, v in entries[0].items()})
    single = EngineCoreRequest.from_wire(processed.requests[0].to_wire())
    for r in [*back, single]:
        sp = r.sampling_params
        assert (sp.structured_kind, sp.structured_spec, sp.structured_after_token_ids) == ("choice", '["a", "b"]',
                                                                                           [7, 8])
    assert [r.sampling_params.seed for r in back] == [5, 6, 7]
