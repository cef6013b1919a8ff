"""Parsed chat output → Responses output items, response object and stream events
(inference/api/responses_output.py), checked against the official ``openai`` SDK: every event validates as its
type, the SDK's own stream accumulator takes the sequence and ends with the same response as the non-streamed body,
sequence numbers have no gap."""

from __future__ import annotations

import typing

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from inference.api.chat_output import ChatDelta, ToolCallOut
from inference.api.responses_output import (ResponseBuilder, final_status, request_echo, response_object,
                                            terminal_event_type)
from inference.protocol.responses import (EV_COMPLETED, EV_CREATED, EV_ERROR, EV_FAILED, EV_IN_PROGRESS,
                                          EV_INCOMPLETE, STATUS_FAILED, STATUS_IN_PROGRESS, usage_object,
                                          validate_responses_request)
from inference.tool_parsers.base import ParsedToolCall

EVENT_TYPES = {typing.get_args(c.model_fields["type"].annotation)[0]: c
               for c in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


def _validate(event: dict):
    """``event`` validated strictly as the SDK's class of its ``type``."""
    return EVENT_TYPES[event["type"]].model_validate(event)
REQ = validate_responses_request({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f"}],
                                  "metadata": {"k": "v"}})


def _call(name: str, args: str) -> ToolCallOut:
    return ToolCallOut(0, "chatcmpl-tool-1", ParsedToolCall(name, args))


def _run(deltas: list[ChatDelta], finish_reason: str = "stop") -> tuple[list[dict], dict]:
    b = ResponseBuilder()
    echo = request_echo(REQ)

    def obj(status: str, output: list, usage=None, **kw) -> dict:
        return response_object(response_id="resp_1", created_at=1.0, model="m", status=status, echo=echo,
                               output=output, usage=usage, previous_response_id=None, metadata=REQ.metadata,
                               background=False, store=True, **kw)

    events = [b.lifecycle(EV_CREATED, obj(STATUS_IN_PROGRESS, [])), b.lifecycle(EV_IN_PROGRESS,
                                                                               obj(STATUS_IN_PROGRESS, []))]
    for d in deltas:
        events += b.push(d)
    status, details = final_status(finish_reason)
    events += b.finish(status)
    final = obj(status, b.output, usage_object(10, 5, 3, 1), completed_at=2.0, incomplete_details=details)
    events.append(b.lifecycle(terminal_event_type(status), final))
    return events, final


def _sdk_replay(events: list[dict]) -> Response:
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for ev in events:
        state.handle_event(_validate(ev))
    done = state._completed_response
    assert done is not None
    return done


def test_text_answer_stream_in_the_official_order() -> None:
    events, final = _run([ChatDelta(content="Hel"), ChatDelta(content="lo")])
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert _sdk_replay(events).output_text == "Hello"
    assert Response.model_validate(final).output_text == "Hello"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 3
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 1


def test_reasoning_then_answer_then_calls() -> None:
    events, final = _run([ChatDelta(reasoning="think "), ChatDelta(reasoning="more"),
                          ChatDelta(content="Calling."), ChatDelta(calls=[_call("f", '{"a": 1}'), _call("f", "{}")])])
    types = [o["type"] for o in final["output"]]
    assert types == ["reasoning", "message", "function_call", "function_call"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "think more"}]
    assert final["output"][2]["arguments"] == '{"a": 1}' and final["output"][2]["call_id"].startswith("call_")
    kinds = [e["type"] for e in events]
    assert kinds.count("response.reasoning_text.delta") == 2 and "response.reasoning_text.done" in kinds
    assert kinds.count("response.function_call_arguments.delta") == 2
    assert kinds.count("response.function_call_arguments.done") == 2
    replayed = _sdk_replay(events)
    assert [o.type for o in replayed.output] == types
    body = Response.model_validate(final)
    assert [(o.id, getattr(o, "arguments", None)) for o in replayed.output] == \
        [(o.id, getattr(o, "arguments", None)) for o in body.output]
    assert replayed.output_text == body.output_text == "Calling."


def test_text_after_a_call_opens_a_new_message() -> None:
    _events, final = _run([ChatDelta(content="a"), ChatDelta(calls=[_call("f", "{}")]), ChatDelta(content="b")])
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "message"]


def test_nothing_written_is_one_empty_message() -> None:
    events, final = _run([])
    assert [o["type"] for o in final["output"]] == ["message"]
    assert final["output"][0]["content"][0]["text"] == ""
    _sdk_replay(events)


def test_cut_by_the_output_cap_is_incomplete() -> None:
    events, final = _run([ChatDelta(content="partial")], finish_reason="length")
    assert events[-1]["type"] == EV_INCOMPLETE
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"
    _validate(events[-1])


def test_failure_after_the_start_is_an_error_event_then_failed() -> None:
    b = ResponseBuilder(seq=5)
    events = b.push(ChatDelta(content="x"))
    events.append(b.error("The engine failed", "engine_error"))
    events += b.finish(STATUS_FAILED)
    events.append(b.lifecycle(EV_FAILED, {"id": "resp_1"}))
    assert [e["sequence_number"] for e in events] == list(range(5, 5 + len(events)))
    err = [e for e in events if e["type"] == EV_ERROR][0]
    _validate(err)
    assert err["message"] == "The engine failed"


@pytest.mark.parametrize("reason, status", [("stop", "completed"), ("tool_calls", "completed"),
                                            ("length", "incomplete")])
def test_final_status(reason, status) -> None:
    assert final_status(reason)[0] == status
    assert terminal_event_type(status) in (EV_COMPLETED, EV_INCOMPLETE)


def test_echo_of_the_request() -> None:
    echo = request_echo(REQ)
    assert echo["tool_choice"] == "auto" and echo["text"] == {"format": {"type": "text"}}
    assert echo["tools"] == [{"type": "function", "name": "f"}]
    assert echo["truncation"] == "disabled" and echo["parallel_tool_calls"] is True
