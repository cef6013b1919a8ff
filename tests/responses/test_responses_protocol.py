"""The Responses API request schema (inference/protocol/responses.py): every item type and its malformed forms, the
metadata limits, the refused hosted tools, each a 400 naming the field as OpenAI names it."""

from __future__ import annotations

import pytest

from inference.protocol.openai import RequestValidationError
from inference.protocol.responses import (FunctionCallItem, FunctionCallOutputItem, ItemReference, MessageItem,
                                          ReasoningItem, TextFormatJsonSchema, ToolChoiceFunction,
                                          validate_responses_request)


def _bad(body: dict, param: str) -> str:
    with pytest.raises(RequestValidationError) as err:
        validate_responses_request({"model": "m", **body})
    assert err.value.param == param, err.value.message
    return err.value.message


def test_string_input_is_one_user_message() -> None:
    req = validate_responses_request({"model": "m", "input": "hello"})
    assert req.input_items == [MessageItem(role="user", content="hello")]
    assert req.store is True and req.background is False and req.truncation == "disabled"


def test_every_item_type_parses() -> None:
    req = validate_responses_request({"model": "m", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                     {"type": "input_image", "image_url": "https://x/y.png", "detail": "low"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}],
         "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "ok", "annotations": [], "logprobs": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "f", "arguments": "{}",
         "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
        {"type": "item_reference", "id": "msg_0"},
    ]})
    kinds = [type(i) for i in req.input_items]
    assert kinds == [MessageItem, ReasoningItem, MessageItem, FunctionCallItem, FunctionCallOutputItem, ItemReference]


@pytest.mark.parametrize("item, param", [
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[1].call_id"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1, 2]"}, "input[1].arguments"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}, "input[1].arguments"),
    ({"type": "function_call", "call_id": "c", "arguments": "{}"}, "input[1].name"),
    ({"type": "function_call_output", "output": "x"}, "input[1].call_id"),
    ({"type": "function_call_output", "call_id": "c", "output": 42}, "input[1].output"),
    ({"type": "function_call_output", "call_id": "c", "output": []}, "input[1].output"),
    ({"type": "reasoning", "summary": [{"type": "summary_text"}]}, "input[1].summary[0].text"),
    ({"type": "reasoning", "summary": "x"}, "input[1].summary"),
    ({"type": "item_reference"}, "input[1].id"),
    ({"type": "item_reference", "id": ""}, "input[1].id"),
    ({"type": "message", "role": "robot", "content": "x"}, "input[1].role"),
    ({"type": "message", "role": "user"}, "input[1].content"),
    ({"role": "user", "content": [{"type": "input_text", "text": 3}]}, "input[1].content[0].text"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[1].content[0].type"),
    ({"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}, "input[1].content[0].image_url"),
    ({"role": "user", "content": [{"type": "output_text", "text": "x"}]}, "input[1].content[0].type"),
    ({"role": "assistant", "content": [{"type": "input_text", "text": "x"}]}, "input[1].content[0].type"),
    ({"type": "computer_call", "call_id": "c"}, "input[1].type"),
    ({"content": "no role, no type"}, "input[1].type"),
    ("just a string", "input[1]"),
])
def test_malformed_items_name_the_field(item, param) -> None:
    _bad({"input": [{"role": "user", "content": "first"}, item]}, param)


@pytest.mark.parametrize("metadata, param", [
    ({f"k{i}": "v" for i in range(17)}, "metadata"),
    ({"k" * 65: "v"}, "metadata"),
    ({"key": "v" * 513}, "metadata.key"),
    ({"key": 1}, "metadata.key"),
    ("not an object", "metadata"),
])
def test_metadata_limits(metadata, param) -> None:
    _bad({"input": "x", "metadata": metadata}, param)


def test_metadata_at_the_limits_is_accepted() -> None:
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    assert validate_responses_request({"model": "m", "input": "x", "metadata": metadata}).metadata == metadata


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "f"}]}, "tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice.name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "g"}]}},
     "tool_choice.tools[0]"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "bad name", "schema": {}}}},
     "text.format.name"),
    ({"input": "x", "temperature": "0.5"}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "truncation": "middle"}, "truncation"),
    ({"input": "x", "include": ["everything"]}, "include[0]"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "previous_response_id": "chatcmpl-1"}, "previous_response_id"),
    ({}, "input"),
    ({"input": []}, "input"),
])
def test_bad_parameters_name_the_field(body, param) -> None:
    _bad(body, param)


def test_flat_tools_format_and_choice() -> None:
    req = validate_responses_request({
        "model": "m", "input": "x", "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"},
                                               "strict": True}],
        "tool_choice": {"type": "function", "name": "get"},
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}}})
    assert isinstance(req.tool_choice, ToolChoiceFunction)
    assert req.text is not None and isinstance(req.text.format, TextFormatJsonSchema)


def test_follow_up_without_new_input_is_accepted() -> None:
    req = validate_responses_request({"model": "m", "previous_response_id": "resp_abc"})
    assert req.input_items == []
