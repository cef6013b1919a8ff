"""Responses input → the internal chat request (inference/api/responses_input.py): every item kind, a stored chain,
tools, text.format, sampling; the rendered prompt equals the same conversation's as Chat Completions takes it; and
truncation ``auto``."""

from __future__ import annotations

from pathlib import Path

import pytest

from inference.api.responses_input import (INSTRUCTIONS, chat_param_to_input, drop_oldest, items_to_messages,
                                           stored_input_item,
                                           resolve_references, stored_items, to_chat_request, turns, turns_to_drop)
from inference.protocol.openai import RequestValidationError
from inference.protocol.responses import validate_responses_request
from inference.renderer.chat_template import render_chat

QWEN3 = Path(__file__).resolve().parents[2] / ".cache" / "tokenizers" / "qwen3"
TOOLS = [{"type": "function", "name": "get_weather", "description": "weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]

# one conversation, as a chain's stored items (turn 1 input + output, turn 2 input + output) and as chat messages
TURN1_IN = [{"type": "message", "role": "user", "content": "Weather in Paris and Rome?", "id": "in_1"}]
TURN1_OUT = [
    {"id": "rs_1", "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "two calls"}],
     "status": "completed"},
    {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed",
     "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
    {"id": "fc_1", "type": "function_call", "call_id": "call_a", "name": "get_weather",
     "arguments": '{"city": "Paris"}', "status": "completed"},
    {"id": "fc_2", "type": "function_call", "call_id": "call_b", "name": "get_weather",
     "arguments": '{"city": "Rome"}', "status": "completed"},
]
TURN2_IN = [{"type": "function_call_output", "call_id": "call_a", "output": "sunny", "id": "in_2"},
            {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "rain"}],
             "id": "in_3"}]
TURN2_OUT = [{"id": "msg_2", "type": "message", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Paris sunny, Rome rain.", "annotations": []}]}]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "Checking.", "reasoning": "two calls", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "rain"},
    {"role": "assistant", "content": "Paris sunny, Rome rain."},
    {"role": "user", "content": "Thanks! And Oslo?"},
]


def _turn3() -> tuple:
    req = validate_responses_request({"model": "m", "instructions": "Be brief.", "previous_response_id": "resp_2",
                                      "input": "Thanks! And Oslo?", "tools": TOOLS})
    chain = stored_items(TURN1_IN + TURN1_OUT + TURN2_IN + TURN2_OUT)
    return req, items_to_messages(chain + req.input_items, req.instructions)


def test_chain_items_become_the_chat_conversation() -> None:
    _req, conv = _turn3()
    assert conv.messages == CHAT
    assert conv.origins == [INSTRUCTIONS, 0, 2, 5, 6, 7, 8]


def test_chain_renders_the_same_prompt_ids_as_chat() -> None:
    req, conv = _turn3()
    chat = to_chat_request(req, conv)
    assert chat.tools is not None
    ours = render_chat(str(QWEN3), [m.model_dump(exclude_none=True) for m in chat.messages],
                       tools=[t.model_dump(exclude_none=True) for t in chat.tools])
    theirs = render_chat(str(QWEN3), CHAT, tools=CHAT_TOOLS)
    assert ours.prompt_token_ids == theirs.prompt_token_ids
    assert "sunny" in ours.prompt_text and "get_weather" in ours.prompt_text


def test_instructions_of_earlier_turns_are_not_carried() -> None:
    req = validate_responses_request({"model": "m", "previous_response_id": "resp_1", "input": "next"})
    conv = items_to_messages(stored_items(TURN1_IN + TURN1_OUT) + req.input_items, req.instructions)
    assert conv.messages[0] == {"role": "user", "content": "Weather in Paris and Rome?"}
    assert all(m["role"] != "system" for m in conv.messages)


def test_call_after_a_tool_output_starts_a_new_assistant_message() -> None:
    items = stored_items(TURN1_IN + TURN1_OUT[2:3] + TURN2_IN[:1] + TURN1_OUT[3:4])
    conv = items_to_messages(items, None)
    assert [m["role"] for m in conv.messages] == ["user", "assistant", "tool", "assistant"]
    assert conv.messages[3]["content"] is None and conv.messages[3]["tool_calls"][0]["id"] == "call_b"


def test_images_and_text_parts() -> None:
    req = validate_responses_request({"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "high"}]}]})
    conv = items_to_messages(req.input_items, None)
    assert conv.messages[0]["content"] == [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}}]


def test_item_references_resolve_to_stored_items_only() -> None:
    req = validate_responses_request({"model": "m", "input": [{"type": "item_reference", "id": "msg_1"},
                                                              {"type": "item_reference", "id": "msg_x"}]})
    with pytest.raises(RequestValidationError) as err:
        resolve_references(req.input_items, {"msg_1": TURN1_OUT[1]})
    assert err.value.param == "input[1].id"
    items = resolve_references(req.input_items[:1], {"msg_1": TURN1_OUT[1]})
    assert items_to_messages(items, None).messages == [{"role": "assistant", "content": "Checking."}]


def test_parameters_map_to_the_chat_request() -> None:
    req = validate_responses_request({
        "model": "m", "input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False, "max_output_tokens": 33, "temperature": 0.2, "top_p": 0.9, "seed": 7,
        "reasoning": {"effort": "none"}, "include": ["message.output_text.logprobs"], "top_logprobs": 3,
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}}})
    chat = to_chat_request(req, items_to_messages(req.input_items, None))
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False and chat.max_completion_tokens == 33
    assert (chat.temperature, chat.top_p, chat.seed) == (0.2, 0.9, 7)
    assert chat.chat_template_kwargs == {"reasoning_effort": "none", "enable_thinking": False}
    assert chat.logprobs is True and chat.top_logprobs == 3
    assert chat.response_format is None  # the forced call is this turn's output; the format is the answer's
    assert chat.n == 1
    auto = to_chat_request(req.model_copy(update={"tool_choice": "auto"}), items_to_messages(req.input_items, None))
    assert auto.response_format is not None and auto.response_format.json_schema is not None
    assert auto.response_format.json_schema.json_schema == {"type": "object"}


def test_allowed_tools_cut_the_tool_list() -> None:
    tools = TOOLS + [{"type": "function", "name": "other", "parameters": {"type": "object"}}]
    req = validate_responses_request({"model": "m", "input": "x", "tools": tools, "tool_choice": {
        "type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "other"}]}})
    chat = to_chat_request(req, items_to_messages(req.input_items, None))
    assert chat.tools is not None and [t.function.name for t in chat.tools] == ["other"]
    assert chat.tool_choice == "required"


def test_chat_fields_are_named_as_responses_fields() -> None:
    _req, conv = _turn3()
    assert chat_param_to_input("messages.3.content", conv) == "input[5]"
    assert chat_param_to_input("messages[0].content", conv) == "instructions"
    assert chat_param_to_input("messages", conv) == "input"
    assert chat_param_to_input("response_format.json_schema", conv) == "text.format"
    assert chat_param_to_input("max_completion_tokens", conv) == "max_output_tokens"


def test_truncation_drops_the_oldest_turns_keeping_calls_with_their_outputs() -> None:
    _req, conv = _turn3()
    assert turns(conv.messages) == [(1, 2), (2, 5), (5, 6)]  # the newest input is never dropped
    assert turns_to_drop(conv.messages, 100, 100) == 0
    assert turns_to_drop(conv.messages, 101, 100) == 1
    assert turns_to_drop(conv.messages, 1000, 100) == 3
    two = drop_oldest(conv, 2)
    assert two is not None
    assert [m["role"] for m in two.messages] == ["system", "assistant", "user"]
    assert drop_oldest(conv, 4) is None


def test_stored_input_items_read_back_as_the_same_items() -> None:
    req = validate_responses_request({"model": "m", "input": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "42", "id": "mine"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]}]})
    counter = iter(range(100))
    stored = [stored_input_item(i, lambda prefix: f"{prefix}_{next(counter)}") for i in req.input_items]
    assert [s["id"] for s in stored] == ["msg_0", "msg_1", "fc_2", "mine", "rs_3"]
    assert stored[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert stored[1]["content"] == [{"type": "output_text", "text": "hello", "annotations": []}]
    again = stored_items(stored)
    assert items_to_messages(again, None).messages == items_to_messages(req.input_items, None).messages
