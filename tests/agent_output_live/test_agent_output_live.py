"""Tool calls and reasoning end to end (issue 16): a live platform (Redis, render worker, engine, uvicorn) and the
official ``openai`` client. The demo model has random weights: ``structured_outputs.regex`` (vLLM's request
extension, fixture ``forced``) makes it write exactly the markup a real Qwen3 would, token by token through the
real engine, detokenizer and parsers; ``tool_choice`` required/named are held by the engine's grammar."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.agent_output_live.conftest import MODEL

MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "unit": {"type": "string", "enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'


def lit(text: str) -> str:
    return re.escape(text)


def assemble(chunks) -> dict:
    """A stream's deltas reassembled as OpenAI's SDKs do (content, reasoning, tool calls by index)."""
    msg: dict = {"content": None, "reasoning": None, "reasoning_content": None, "tool_calls": {}, "finish": None}
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta.model_dump(exclude_none=True)
        for key in ("content", "reasoning", "reasoning_content"):
            if delta.get(key):
                msg[key] = (msg[key] or "") + delta[key]
        for tc in delta.get("tool_calls") or []:
            entry = msg["tool_calls"].setdefault(tc["index"], {"name": None, "arguments": "", "first": None})
            if entry["first"] is None:
                entry["first"] = tc  # the call's first delta
            entry["name"] = entry["name"] or (tc.get("function") or {}).get("name")
            entry["arguments"] += (tc.get("function") or {}).get("arguments") or ""
        if choice.finish_reason:
            msg["finish"] = choice.finish_reason
    return msg


def as_plain(resp) -> dict:
    m = resp.choices[0].message
    extra = m.model_extra or {}
    return {"content": m.content, "reasoning": extra.get("reasoning"),
            "reasoning_content": extra.get("reasoning_content"),
            "tool_calls": {i: (c.function.name, c.function.arguments) for i, c in enumerate(m.tool_calls or [])},
            "finish": resp.choices[0].finish_reason}


def check_stream_equals(forced_create, regex: str, **kw) -> tuple[object, dict]:
    full = forced_create(regex, messages=MSGS, max_tokens=120, temperature=1.0, seed=7, **kw)
    chunks = list(forced_create(regex, messages=MSGS, max_tokens=120, temperature=1.0, seed=7, stream=True, **kw))
    got = assemble(chunks)
    for index, entry in got["tool_calls"].items():
        first = entry["first"]
        assert first["index"] == index and first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
        assert first["function"] == {"name": entry["name"], "arguments": ""}
    plain = as_plain(full)
    assert {**got, "tool_calls": {i: (e["name"], e["arguments"]) for i, e in got["tool_calls"].items()}} == plain
    return full, got


# ------------------------------------------------------------------------------------------ without the extension
def test_history_arguments_that_are_not_a_json_object_are_a_400_naming_the_field(client):
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{bad json"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=2)
    assert exc.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_enable_thinking_false_gives_content_only_and_zero_reasoning_tokens(client):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=16, temperature=0, extra_body={
        "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    full = client.chat.completions.create(**kw)
    extra = full.choices[0].message.model_extra or {}
    assert extra.get("reasoning") is None and extra.get("reasoning_content") is None
    assert full.usage.completion_tokens_details.reasoning_tokens == 0
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 0


# ------------------------------------------------------------------------------------------ reasoning (forced text)
def test_reasoning_split_into_both_fields_streamed_and_not(forced):
    full, got = check_stream_equals(forced, lit("<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny."))
    plain = as_plain(full)
    assert plain["reasoning"] == plain["reasoning_content"] == "\nThe user asks about Paris.\n"
    assert plain["content"] == "\n\nIt is sunny." and plain["finish"] == "stop"
    # the reasoning tokens: up to and including </think>; fewer than all completion tokens
    details = full.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < full.usage.completion_tokens


def test_reasoning_then_tool_call(forced):
    full, _ = check_stream_equals(forced, lit("<think>\nNeed weather.\n</think>\n\n" + CALL), tools=[WEATHER])
    plain = as_plain(full)
    assert plain["reasoning"] == "\nNeed weather.\n" and plain["content"] is None
    assert plain["tool_calls"] == {0: ("get_weather", '{"city": "Paris", "unit": "c"}')}
    assert plain["finish"] == "tool_calls"


# ------------------------------------------------------------------------------------------ tool calls, auto
def test_auto_tool_calls_with_text_before(forced):
    full, _ = check_stream_equals(forced, lit("Let me check.\n" + CALL + "\n" + CALL2), tools=[WEATHER, TIME])
    plain = as_plain(full)
    assert plain["content"] == "Let me check.\n\n" and plain["finish"] == "tool_calls"
    assert plain["tool_calls"] == {0: ("get_weather", '{"city": "Paris", "unit": "c"}'),
                                   1: ("get_time", '{"tz": "UTC"}')}
    assert full.choices[0].message.tool_calls[0].id.startswith("chatcmpl-tool-")
    assert full.choices[0].message.tool_calls[0].type == "function"


def test_parallel_tool_calls_false_keeps_the_first(forced):
    full, _ = check_stream_equals(forced, lit(CALL + "\n" + CALL2), tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert as_plain(full)["tool_calls"] == {0: ("get_weather", '{"city": "Paris", "unit": "c"}')}


def test_a_call_whose_json_does_not_parse_stays_content(forced):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {city}}\n</tool_call>'
    full, _ = check_stream_equals(forced, lit(bad), tools=[WEATHER])
    plain = as_plain(full)
    assert plain["content"] == bad and plain["tool_calls"] == {} and plain["finish"] == "stop"


def test_markup_without_tools_or_with_tool_choice_none_is_content(forced):
    for kw in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        full, _ = check_stream_equals(forced, lit(CALL), **kw)
        assert as_plain(full)["content"] == CALL and as_plain(full)["tool_calls"] == {}


# ------------------------------------------------------------------------------------------ required / named (grammar)
@pytest.mark.usefixtures("forced")
@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_gives_valid_calls(client, stream):
    for seed in range(3):
        kw = dict(model=MODEL, messages=MSGS, tools=[WEATHER, TIME], tool_choice="required", max_tokens=200,
                  temperature=1.0, seed=seed)
        if stream:
            got = assemble(client.chat.completions.create(**kw, stream=True))
            calls = [(e["name"], e["arguments"]) for e in got["tool_calls"].values()]
            finish = got["finish"]
        else:
            resp = client.chat.completions.create(**kw)
            calls = [(c.function.name, c.function.arguments) for c in resp.choices[0].message.tool_calls]
            finish = resp.choices[0].finish_reason
        assert finish == "tool_calls" and calls
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        for name, args in calls:
            jsonschema.validate(json.loads(args), schemas[name])


@pytest.mark.usefixtures("forced")
def test_named_tool_choice_gives_that_call_with_finish_stop(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=[WEATHER, TIME], max_tokens=200, temperature=1.0, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = resp.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_time"
    jsonschema.validate(json.loads(calls[0].function.arguments), TIME["function"]["parameters"])
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.content is None


class GetWeather(pydantic.BaseModel):
    city: Literal["Paris", "Rome"]
    unit: Literal["c", "f"]


@pytest.mark.usefixtures("forced")
def test_sdk_pydantic_function_tool_and_parse_work_unmodified(client):
    tool = openai.pydantic_function_tool(GetWeather)
    for choice in ("required", {"type": "function", "function": {"name": "GetWeather"}}):
        resp = client.chat.completions.parse(model=MODEL, messages=MSGS, tools=[tool], tool_choice=choice,
                                             max_tokens=200, temperature=1.0, seed=1)
        parsed = resp.choices[0].message.tool_calls[0].function.parsed_arguments
        assert isinstance(parsed, GetWeather)


def test_required_with_response_format_is_refused(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], tool_choice="required",
                                       response_format={"type": "json_object"}, max_tokens=4)
    assert exc.value.body["param"] in ("tool_choice", "response_format")
