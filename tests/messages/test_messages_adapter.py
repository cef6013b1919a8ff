"""The Messages API adapter's pure parts (issue 41), no process started: the body → internal chat request conversion
(``inference.api.messages.chat_request``), thinking signatures, the stream's block events, the thinking budget, stop
reasons, Anthropic's error dialect and header names (``gateway.dialects``), and the ping while the first token is
awaited (``gateway.endpoints.messages.MessagesConsumer._first``)."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.dialects import ANTHROPIC, reset_time
from gateway.endpoints import messages as endpoint
from gateway.errors import ApiError, ErrorCode, ErrorType, bad_request, unavailable
from inference.api.chat_output import ChatDelta, ToolCallOut
from inference.api.messages import (
    StreamBlocks,
    ThinkingBudget,
    chat_request,
    signature_matches,
    stop_reason,
    thinking_signature,
)
from inference.protocol.anthropic import MessagesRequest, error_status_type, validate_body
from inference.protocol.openai import RequestValidationError
from inference.tool_parsers.base import ParsedToolCall

KEY = b"k" * 32


def _request(**body) -> MessagesRequest:
    return validate_body(MessagesRequest, {"model": "m", "max_tokens": 16, **body})


def _signed(text: str) -> str:
    return thinking_signature(KEY, "7", "m", text)


def _check(text: str, sig: str) -> bool:
    return signature_matches(KEY, "7", "m", text, sig)


def test_a_conversation_becomes_the_chat_request_it_means():
    req = _request(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Look"}, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AAAA"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "plan", "signature": _signed("plan")},
            {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "Calling."},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "bad", "is_error": True},
                                     {"type": "text", "text": "Go on."}]}],
        tools=[{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, stop_sequences=["END"],
        temperature=0.5, top_k=5, metadata={"user_id": "u1"})
    chat = chat_request(req, _check)
    dumped = [m.model_dump(exclude_unset=True) for m in chat.messages]
    assert dumped == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": [{"type": "text", "text": "Look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
        {"role": "assistant", "content": "Calling.", "reasoning_content": "plan", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: bad"},
        {"role": "user", "content": "Go on."}]
    assert chat.tools[0].function.parameters == {"type": "object"} and chat.tool_choice == "required"
    assert chat.parallel_tool_calls is False and chat.stop == ["END"] and chat.max_tokens == 16
    assert (chat.temperature, chat.top_k, chat.user) == (0.5, 5, "u1")
    assert chat.chat_template_kwargs == {"enable_thinking": False} and chat.add_generation_prompt


def test_prefill_thinking_and_named_tool():
    req = _request(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}],
                   thinking={"type": "enabled", "budget_tokens": 8},
                   tools=[{"name": "f", "input_schema": {"type": "object"}}], tool_choice={"type": "tool", "name": "f"})
    chat = chat_request(req, _check)
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert chat.chat_template_kwargs == {"enable_thinking": True}
    assert chat.tool_choice == {"type": "function", "function": {"name": "f"}}


def test_signatures_bind_tenant_model_and_text():
    sig = _signed("plan")
    assert _check("plan", sig)
    assert not signature_matches(KEY, "8", "m", "plan", sig)  # another tenant
    assert not signature_matches(KEY, "7", "m2", "plan", sig)  # another model
    assert not _check("plan!", sig) and not _check("plan", sig[:-2] + "AA")
    req = _request(messages=[{"role": "assistant", "content": [{"type": "thinking", "thinking": "x", "signature": sig}]}])
    with pytest.raises(RequestValidationError) as err:
        chat_request(req, _check)
    assert err.value.param == "messages.0.content.0.signature"


@pytest.mark.parametrize("blocks,role,param", [
    ([{"type": "tool_use", "id": "t", "name": "f", "input": {}}], "user", "messages.0.content.0"),
    ([{"type": "tool_result", "tool_use_id": "t"}], "assistant", "messages.0.content.0"),
    ([{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}], "assistant", "messages.0.content.0"),
    ([{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}], "user", "messages.0.content.0.content"),
])
def test_blocks_in_the_wrong_turn_are_refused_by_name(blocks, role, param):
    with pytest.raises(RequestValidationError) as err:
        chat_request(_request(messages=[{"role": role, "content": blocks}]), _check)
    assert err.value.param == param and err.value.message.startswith(param)


def test_internal_field_names_become_the_protocol_s():
    with pytest.raises(RequestValidationError) as err:
        chat_request(_request(messages=[{"role": "user", "content": "x"}], stop_sequences=list("abcde")), _check)
    assert err.value.param == "stop_sequences" and err.value.message.startswith("stop_sequences: ")


def _call(name: str, arguments: str) -> ToolCallOut:
    return ToolCallOut(0, "chatcmpl-tool-abcdef", ParsedToolCall(name, arguments))


def test_stream_blocks_open_close_and_sign():
    blocks = StreamBlocks(lambda text: f"sig({text})")
    events = blocks.push(ChatDelta(reasoning="a")) + blocks.push(ChatDelta(reasoning="b"))
    events += blocks.push(ChatDelta(content="hi", calls=[_call("f", '{"x": 1}')])) + blocks.finish()
    shape = [(name, data.get("index"), data.get("delta", data.get("content_block", {})).get("type")) for name, data in events]
    assert shape == [
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None), ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None), ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"), ("content_block_stop", 2, None)]
    assert events[3][1]["delta"]["signature"] == "sig(ab)"
    assert events[8][1]["content_block"] == {"type": "tool_use", "id": "toolu_abcdef", "name": "f", "input": {}}
    assert json.loads(events[9][1]["delta"]["partial_json"]) == {"x": 1}


def test_thinking_budget_stops_reasoning_only():
    budget = ThinkingBudget(3)
    assert not budget.spent(ChatDelta(reasoning="a"), 3)
    assert budget.spent(ChatDelta(reasoning="b"), 4) and budget.over
    answered = ThinkingBudget(3)
    assert not answered.spent(ChatDelta(reasoning="a", content="x"), 2)
    assert not answered.spent(ChatDelta(content="y"), 50) and not answered.over
    assert not ThinkingBudget(None).spent(ChatDelta(reasoning="a"), 10**6)


def test_stop_reasons():
    assert stop_reason("length", None, False, False) == ("max_tokens", None)
    assert stop_reason("stop", None, True, False) == ("tool_use", None)
    assert stop_reason("stop", "END", False, False) == ("stop_sequence", "END")
    assert stop_reason("stop", 151645, False, False) == ("end_turn", None)  # a stop token id: the turn's end
    assert stop_reason(None, None, False, True) == ("max_tokens", None)


def test_error_statuses_and_envelope():
    assert error_status_type(429, ErrorCode.INSUFFICIENT_QUOTA) == (402, "billing_error")
    assert error_status_type(429, ErrorCode.RATE_LIMIT_EXCEEDED) == (429, "rate_limit_error")
    assert error_status_type(503, ErrorCode.SERVER_OVERLOADED) == (529, "overloaded_error")
    assert error_status_type(503, ErrorCode.ENGINE_UNAVAILABLE) == (503, "api_error")
    assert error_status_type(500, ErrorCode.INTERNAL_ERROR) == (500, "api_error")
    assert error_status_type(413, ErrorCode.REQUEST_TOO_LARGE) == (413, "request_too_large")
    reply = ANTHROPIC.reply(bad_request("at most 4 stop sequences", "stop"), "req_1")
    assert reply.status == 400 and json.loads(reply.body) == {"type": "error", "request_id": "req_1", "error": {
        "type": "invalid_request_error", "message": "stop_sequences: at most 4 stop sequences"}}
    shed = ANTHROPIC.reply(unavailable("full", 3), "req_2")
    assert shed.status == 529 and shed.headers == [(b"retry-after", b"3")]
    event = ANTHROPIC.stream_error(ApiError(503, "boom", ErrorType.SERVER, None, ErrorCode.ENGINE_ERROR), "req_3")
    assert event.startswith(b"event: error\ndata: ") and b'"api_error"' in event


def test_rate_limit_headers_take_anthropic_names():
    out = dict(ANTHROPIC.headers([(b"x-ratelimit-limit-requests", b"10"), (b"x-ratelimit-remaining-tokens", b"5"),
                                  (b"x-ratelimit-reset-requests", b"6m0s"), (b"retry-after", b"2")]))
    assert out[b"anthropic-ratelimit-requests-limit"] == b"10"
    assert out[b"anthropic-ratelimit-tokens-remaining"] == b"5"
    assert out[b"anthropic-ratelimit-requests-reset"].endswith(b"Z") and out[b"retry-after"] == b"2"
    assert not any(k.startswith(b"x-ratelimit-") for k in out)
    assert reset_time(b"1m5s", 0.0) == b"1970-01-01T00:01:05Z" and reset_time(b"20ms", 0.0) == b"1970-01-01T00:00:00Z"


async def test_pings_while_the_first_token_is_awaited(monkeypatch):
    monkeypatch.setattr(endpoint, "PING_INTERVAL_S", 0.02)
    sent: list[bytes] = []
    consumer = endpoint.MessagesConsumer()

    async def send_body(body: bytes, *, more_body: bool = False) -> None:
        sent.append(body)

    consumer.send_body = send_body

    async def slow():
        await asyncio.sleep(0.09)
        yield "first"

    assert await consumer._first(slow().__aiter__()) == "first"
    assert len(sent) >= 2 and all(b == b'event: ping\ndata: {"type":"ping"}\n\n' for b in sent)
