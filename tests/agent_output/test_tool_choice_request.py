"""tool_choice required/named → the JSON-schema constraint on SamplingParams; history arguments checks (issue 16).
Real request validation (pydantic schemas), real input processing, the real Qwen3 tokenizer."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import pytest

from inference.api.chat_output import ChatOutputSpec
from inference.api.input_processor import GenerationDefaults, process_inputs
from inference.protocol.openai import ChatCompletionRequest, RequestValidationError, validate_request
from inference.renderer.tokenizer_cache import get_tokenizer
from inference.shared.structured import check
from inference.tool_parsers.forced import tool_choice_constraint
from tests.renderer.tokdirs import tok_dir

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
MSGS = [{"role": "user", "content": "hi"}]


def req(**kw):
    return validate_request(ChatCompletionRequest, {"model": "m", "messages": MSGS, **kw})


def processed(r, end_ids=()):
    c = tool_choice_constraint(r)
    if c is not None:
        c = replace(c, after_token_ids=tuple(end_ids))
    return process_inputs(r, external_id="chatcmpl-x", prompt_token_ids=[1, 2, 3], prompt_param="messages",
                          max_model_len=64, vocab_size=1000, defaults=GenerationDefaults(), client_id="c",
                          constraint=c).requests[0].sampling_params


def test_required_schema_accepts_only_calls_of_the_tools():
    sp = processed(req(tools=[WEATHER, TIME], tool_choice="required"))
    assert sp.structured_kind == "json" and sp.structured_after_token_ids == []
    schema = json.loads(sp.structured_spec)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}], {}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(processed(req(tools=[WEATHER, TIME], tool_choice="required",
                                      parallel_tool_calls=False)).structured_spec)
    assert single["maxItems"] == 1 and single["minItems"] == 1


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_tool_without_parameters_admits_only_the_empty_object(choice):
    """OpenAI reads an omitted ``parameters`` as no arguments: the forced constraint admits ``{}`` and nothing else
    (an open object let a model write keys until ``max_tokens``, never finishing the call)."""
    schema = json.loads(processed(req(tools=[TIME], tool_choice=choice)).structured_spec)
    wrap = (lambda args: [{"name": "get_time", "parameters": args}]) if choice == "required" else (lambda args: args)
    jsonschema.validate(wrap({}), schema)
    for bad in ({"x": 1}, {"tz": "UTC"}, [], "x"):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrap(bad), schema)


def test_named_schema_is_the_tools_parameters_and_auto_has_none():
    named = req(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(processed(named).structured_spec) == WEATHER["function"]["parameters"]
    empty = req(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(processed(empty).structured_spec) == {"type": "object", "properties": {},
                                                            "additionalProperties": False}
    for choice in ("auto", "none", None):
        assert processed(req(tools=[WEATHER], tool_choice=choice)).structured_kind is None


def test_reasoning_model_constrains_after_the_end_of_thinking():
    tok = get_tokenizer(tok_dir("qwen3"))
    prompt = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    r = req(tools=[WEATHER], tool_choice="required")
    spec = ChatOutputSpec.for_request(r, tokenizer=tok, prompt_token_ids=prompt, reasoning_parser="qwen3",
                                      tool_parser="hermes")
    reasoning = spec.reasoning()
    assert reasoning is not None
    assert processed(r, reasoning.end_token_ids).structured_after_token_ids == [tok.token_to_id("</think>")]
    closed = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    off = ChatOutputSpec.for_request(r, tokenizer=tok, prompt_token_ids=closed, reasoning_parser="qwen3",
                                     tool_parser="hermes").reasoning()
    assert off is not None and off.end_token_ids == []
    # Qwen3 without an open block (the model may answer without thinking): constrained from the first token
    plain = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    auto = ChatOutputSpec.for_request(r, tokenizer=tok, prompt_token_ids=plain, reasoning_parser="qwen3",
                                      tool_parser="hermes").reasoning()
    assert auto is not None and auto.thinking and auto.end_token_ids == []
    r1 = ChatOutputSpec.for_request(r, tokenizer=tok, prompt_token_ids=plain, reasoning_parser="deepseek_r1",
                                    tool_parser="hermes").reasoning()
    assert r1 is not None and r1.end_token_ids == [tok.token_to_id("</think>")]


def test_required_and_named_are_no_longer_refused():
    req(tools=[WEATHER], tool_choice="required")
    req(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    with pytest.raises(RequestValidationError) as exc:
        req(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    assert exc.value.param == "tool_choice"


@pytest.mark.parametrize("bad", ["null", "[]", "{oops", "1", '"{}"'])
def test_history_arguments_must_be_a_json_object_string(bad):
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": bad}}]},
            {"role": "tool", "tool_call_id": "b", "content": "x"}]
    with pytest.raises(RequestValidationError) as exc:
        validate_request(ChatCompletionRequest, {"model": "m", "messages": msgs})
    assert exc.value.param == "messages[1].tool_calls[1].function.arguments"
    msgs[1]["tool_calls"][1]["function"]["arguments"] = '{"city": "Paris"}'
    validate_request(ChatCompletionRequest, {"model": "m", "messages": msgs})


def test_required_keeps_a_tools_defs_reachable():
    """A tool whose parameters use ``$defs`` (pydantic writes them) under ``tool_choice: "required"``: its local
    ``$ref`` s are rebased to where the parameters sit in the array schema (vLLM leaves them pointing at the root,
    where no ``$defs`` are: "Pointer '/$defs/Addr' does not exist")."""
    params = {"type": "object", "properties": {"addr": {"$ref": "#/$defs/Addr"}, "more": {"type": "array",
                                                                                      "items": {"$ref": "#"}}},
              "required": ["addr"], "$defs": {"Addr": {"type": "object", "properties": {
                  "city": {"type": "string", "maxLength": 5}}, "required": ["city"]}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    sp = processed(req(tools=[WEATHER, tool], tool_choice="required"))
    check("json", sp.structured_spec)
    schema = json.loads(sp.structured_spec)
    jsonschema.validate([{"name": "f", "parameters": {"addr": {"city": "Rome"}, "more": [{"addr": {"city": "Ur"}}]}}],
                        schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "f", "parameters": {"addr": {"city": "Toronto"}}}], schema)
    assert params["properties"]["addr"]["$ref"] == "#/$defs/Addr"  # the request's own schema is left as it was
