"""Anthropic's Messages API through the real platform with the official ``anthropic`` SDK, unmodified (issue 41):
``messages.create``, ``messages.stream`` with ``get_final_message()``, ``messages.count_tokens``, a tool round trip,
both header styles, thinking blocks signed and verified on replay, and bad input answered 4xx in Anthropic's
envelope naming the field.

The demo model has random weights: it writes exact markup only where a constraint or the prompt makes it. A forced
tool (``tool_choice`` ``tool``) is the chat route's JSON-schema constraint; a thinking block comes from a prefill
that opens ``<think>`` on a registration of the demo model whose requests may carry control tokens.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from harness.assets import MODEL_DIR
from tests.support.live import ensure_model, limited_key

THINK_MODEL = "tiny-qwen3-think"  # the demo model again, control tokens allowed in content: a prefill opens <think>
DRAINED_MODEL = "tiny-qwen3-drained"  # an admission limit of 0: every request is shed
MSGS = [{"role": "user", "content": "Tell me a story about the sea."}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                            "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(live):
    """The SDK with its default credential: ``api_key`` (SDK 2.x sends it as ``Authorization: Bearer``)."""
    return anthropic.Anthropic(base_url=live.base_url, api_key=live.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def x_api_key_client(live):
    """The SDK sending the key as ``x-api-key`` (what SDK 1.x and older send), no other credential."""
    return anthropic.Anthropic(base_url=live.base_url, api_key=None, auth_token=None, max_retries=0, timeout=60,
                               default_headers={"x-api-key": live.api_key})


@pytest.fixture(scope="module")
def think_model(live):
    ensure_model(live, THINK_MODEL, MODEL_DIR, "--allow-control-tokens-in-content", "true", engine=True)
    return THINK_MODEL


def _post(live, path: str, body: dict, headers: dict[str, str] | None = None) -> httpx.Response:
    base = {"x-api-key": live.api_key, "anthropic-version": "2023-06-01"}
    return httpx.post(live.base_url + path, json=body, headers={**base, **(headers or {})}, timeout=60)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_with_either_header_style(client, x_api_key_client, live, model_name):
    bearer = anthropic.Anthropic(base_url=live.base_url, auth_token=live.api_key, max_retries=0, timeout=60)
    for sdk in (client, x_api_key_client, bearer):
        raw = sdk.messages.with_raw_response.create(model=model_name, max_tokens=12, messages=MSGS, extra_body={"temperature": 0})
        message = raw.parse()
        assert raw.headers["request-id"].startswith("req_")
        assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
        assert message.model == model_name
        assert message.stop_reason in ("end_turn", "max_tokens")
        assert message.content and message.content[0].type == "text"
        assert message.usage.output_tokens >= 1 and message.usage.input_tokens > 0
        if message.stop_reason == "max_tokens":
            assert message.usage.output_tokens == 12


def test_stream_final_message_equals_create(client, model_name):
    kw = dict(model=model_name, max_tokens=24, messages=MSGS, extra_body={"temperature": 0}, system="You are terse.")
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == _text(final) == _text(whole)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_stream_events_in_order(live, model_name):
    with httpx.stream("POST", live.base_url + "/v1/messages", timeout=60, headers={"x-api-key": live.api_key},
                      json={"model": model_name, "max_tokens": 8, "messages": MSGS, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["request-id"].startswith("req_")
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    names = [n for n in names if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    body = names[1:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}


def test_count_tokens_equals_the_prompt_a_create_reports(client, model_name):
    kw = dict(model=model_name, system=[{"type": "text", "text": "Be brief."}], tools=[WEATHER],
              messages=[{"role": "user", "content": "Weather in Oslo?"},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                           "input": {"city": "Oslo"}}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                      "content": "sunny", "is_error": False},
                                                     {"type": "text", "text": "And tomorrow?"}]}])
    counted = client.messages.count_tokens(**kw).input_tokens
    created = client.messages.create(max_tokens=4, **kw).usage
    assert counted == created.input_tokens + created.cache_read_input_tokens
    assert counted > client.messages.count_tokens(model=model_name, messages=kw["messages"][:1]).input_tokens


def test_tool_round_trip(client, model_name):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    called = client.messages.create(model=model_name, max_tokens=64, messages=ask, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    assert called.stop_reason == "tool_use"
    uses = [b for b in called.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    assert isinstance(uses[0].input.get("city"), str)
    follow = ask + [{"role": "assistant", "content": called.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                  "content": [{"type": "text", "text": "18 C, clear"}]}]}]
    final = client.messages.create(model=model_name, max_tokens=16, messages=follow, tools=[WEATHER],
                                   tool_choice={"type": "none"}, extra_body={"temperature": 0})
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"]


def test_stop_sequence(client, model_name):
    base = _text(client.messages.create(model=model_name, max_tokens=30, messages=MSGS, extra_body={"temperature": 0}))
    words = base.lstrip()
    stop = words[2:5]
    assert len(words) > 5 and stop.strip()
    cut = client.messages.create(model=model_name, max_tokens=30, messages=MSGS, extra_body={"temperature": 0}, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == base[:base.index(stop)]


def test_thinking_is_signed_bounded_and_verified_on_replay(client, think_model, model_name):
    opened = [{"role": "user", "content": "Think first."}, {"role": "assistant", "content": "<think>\n"}]
    message = client.messages.create(model=think_model, max_tokens=40, messages=opened, extra_body={"temperature": 1.0},
                                     thinking={"type": "enabled", "budget_tokens": 6})
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert message.stop_reason == "max_tokens"  # still reasoning at the budget: stopped there
    assert message.usage.output_tokens < 40
    replay = [{"role": "user", "content": "Think first."},
              {"role": "assistant", "content": [{"type": "thinking", "thinking": thinking.thinking,
                                                 "signature": thinking.signature}, {"type": "text", "text": "Done."}]},
              {"role": "user", "content": "And now?"}]
    assert client.messages.create(model=think_model, max_tokens=4, messages=replay).content
    tampered = json.loads(json.dumps(replay))
    tampered[1]["content"][0]["thinking"] += " (edited)"
    for model, messages in ((think_model, tampered), (model_name, replay)):  # altered, or another model's
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(model=model, max_tokens=4, messages=messages)
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert "messages.1.content.0.signature" in err.value.body["error"]["message"]


def test_streamed_thinking_carries_its_signature(client, think_model):
    opened = [{"role": "user", "content": "Think."}, {"role": "assistant", "content": "<think>\n"}]
    with client.messages.stream(model=think_model, max_tokens=40, messages=opened,
                                thinking={"type": "enabled", "budget_tokens": 5}) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].signature
    assert final.stop_reason == "max_tokens"
    again = client.messages.create(model=think_model, max_tokens=4, messages=[
        *opened[:1], {"role": "assistant", "content": [final.content[0].model_dump()]}, {"role": "user", "content": "ok"}])
    assert again.type == "message"


def _envelope(r: httpx.Response, status: int, type_: str, field: str | None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["request-id"].startswith("req_")
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == type_ and body["request_id"] == r.headers["request-id"]
    if field is not None:
        assert field in body["error"]["message"], body
    return body


def _block(block: dict) -> dict:
    return {"max_tokens": 4, "messages": [{"role": "user", "content": [block]}]}


BAD_BODIES = [
    ({"max_tokens": 4}, "messages"),
    ({"messages": MSGS}, "max_tokens"),
    ({"max_tokens": "4", "messages": MSGS}, "max_tokens"),
    ({"max_tokens": 4, "messages": []}, "messages"),
    ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    (_block({"type": "text"}), "messages.0.content.0.text"),
    (_block({"type": "text", "text": 5}), "messages.0.content.0.text"),
    (_block({"type": "image", "source": {"type": "base64", "media_type": "image/png"}}),
     "messages.0.content.0.source.data"),
    (_block({"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "AA=="}}),
     "messages.0.content.0.source.media_type"),
    (_block({"type": "image", "source": {"type": "url"}}), "messages.0.content.0.source.url"),
    (_block({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "not base64!"}}),
     "image"),
    (_block({"type": "tool_use", "name": "f", "input": {}}), "messages.0.content.0.id"),
    (_block({"type": "tool_use", "id": "t", "name": "f", "input": "{}"}), "messages.0.content.0.input"),
    (_block({"type": "tool_result", "content": "x"}), "messages.0.content.0.tool_use_id"),
    (_block({"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}), "messages.0.content.0.is_error"),
    (_block({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "video"}]}),
     "messages.0.content.0.content.0"),
    (_block({"type": "thinking", "thinking": "x"}), "messages.0.content.0.signature"),
    (_block({"type": "redacted_thinking"}), "messages.0.content.0.data"),
    (_block({"type": "document", "source": {}}), "messages.0.content.0"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "x", "signature": "Zm9v"}]}]}, "messages.0.content.0.signature"),
    ({"max_tokens": 4, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "t", "content": "x"}]}]}, "messages.0.content.0"),
    ({"max_tokens": 4, "messages": MSGS, "system": [{"type": "text"}]}, "system.0.text"),
    ({"max_tokens": 4, "messages": MSGS, "tools": [{"name": "f", "input_schema": {"type": "string"}}]},
     "tools.0.input_schema"),
    ({"max_tokens": 4, "messages": MSGS, "tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"max_tokens": 4, "messages": MSGS, "tools": [{"name": "f b", "input_schema": {"type": "object"}}]},
     "tools.0.name"),
    ({"max_tokens": 4, "messages": MSGS, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": MSGS, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    ({"max_tokens": 4, "messages": MSGS, "tools": [WEATHER], "tool_choice": {"type": "sometimes"}}, "tool_choice"),
    ({"max_tokens": 4, "messages": MSGS, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"max_tokens": 4, "messages": MSGS, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 4, "messages": MSGS, "top_k": -1}, "top_k"),
    ({"max_tokens": 4, "messages": MSGS, "metadata": {"user_id": "u" * 300}}, "metadata.user_id"),
    ({"max_tokens": 4, "messages": MSGS, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"max_tokens": 4, "messages": MSGS, "thinking": {"type": "enabled", "budget_tokens": 8}},
     "thinking.budget_tokens"),
    ({"max_tokens": 4, "messages": MSGS, "thinking": {"type": "sometimes"}}, "thinking"),
    ({"max_tokens": 100000, "messages": MSGS}, "max_tokens"),
]


@pytest.mark.parametrize("body,field", BAD_BODIES, ids=[f for _b, f in BAD_BODIES])
def test_bad_input_is_400_naming_the_field(live, model_name, body, field):
    _envelope(_post(live, "/v1/messages", {"model": model_name, **body}), 400, "invalid_request_error", field)


def test_unknown_model_and_bad_json(live, client):
    _envelope(_post(live, "/v1/messages", {"model": "no-such-model", "max_tokens": 4, "messages": MSGS}),
              404, "not_found_error", "no-such-model")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=MSGS)
    r = httpx.post(live.base_url + "/v1/messages", content=b"{not json", timeout=30,
                   headers={"x-api-key": live.api_key, "content-type": "application/json"})
    _envelope(r, 400, "invalid_request_error", None)
    _envelope(_post(live, "/v1/messages/count_tokens", {"model": "no-such-model", "messages": MSGS}),
              404, "not_found_error", "no-such-model")
    _envelope(_post(live, "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": [{"type": "x"}]}]}),
              400, "invalid_request_error", "messages.0.content.0")


def test_header_combinations(live, model_name):
    body = {"model": model_name, "max_tokens": 4, "messages": MSGS}
    other = live.new_key()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        for headers in ({}, {"x-api-key": "sk-nope.nope"}, {"authorization": "Bearer sk-nope.nope"},
                        {"x-api-key": live.api_key, "authorization": f"Bearer {other}"}):
            r = httpx.post(live.base_url + path, json=body, headers=headers, timeout=30)
            _envelope(r, 401, "authentication_error", None)
        same = {"x-api-key": live.api_key, "authorization": f"Bearer {live.api_key}"}
        assert httpx.post(live.base_url + path, json=body, headers=same, timeout=30).status_code == 200
        _envelope(_post(live, path, body, {"anthropic-version": "latest"}), 400, "invalid_request_error",
                  "anthropic-version")
        ok = _post(live, path, body, {"anthropic-beta": "some-beta-2099-01-01", "anthropic-version": "2026-10-21"})
        assert ok.status_code == 200, ok.text
        unversioned = httpx.post(live.base_url + path, json=body, headers={"x-api-key": live.api_key}, timeout=30)
        assert unversioned.status_code == 200


def test_scope_model_and_size_refusals(live, model_name):
    body = {"model": model_name, "max_tokens": 4, "messages": MSGS}
    no_scope = live.new_key(scopes="usage:read")
    _envelope(_post(live, "/v1/messages", body, {"x-api-key": no_scope}), 403, "permission_error", None)
    other_model = live.new_key(models="some-other-model")
    _envelope(_post(live, "/v1/messages", body, {"x-api-key": other_model}), 403, "permission_error", "model")
    huge = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "' + b"a" * (17 << 20) + b'"}]}'
    r = httpx.post(live.base_url + "/v1/messages", content=huge, timeout=60,
                   headers={"x-api-key": live.api_key, "content-type": "application/json"})
    _envelope(r, 413, "request_too_large", None)


def test_key_limits_in_anthropic_names(live, model_name):
    key = limited_key(live, rpm_limit=1)
    sdk = anthropic.Anthropic(base_url=live.base_url, api_key=key, max_retries=0, timeout=60)
    raw = sdk.messages.with_raw_response.create(model=model_name, max_tokens=4, messages=MSGS)
    assert raw.headers["anthropic-ratelimit-requests-limit"] == "1"
    assert raw.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert raw.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert not any(h.startswith("x-ratelimit-") for h in raw.headers)
    with pytest.raises(anthropic.RateLimitError) as err:
        sdk.messages.create(model=model_name, max_tokens=4, messages=MSGS)
    assert err.value.body["error"]["type"] == "rate_limit_error"
    assert int(err.value.response.headers["retry-after"]) >= 1
    broke = limited_key(live, token_budget=1)
    r = httpx.post(live.base_url + "/v1/messages", json={"model": model_name, "max_tokens": 4, "messages": MSGS},
                   headers={"x-api-key": broke}, timeout=30)
    _envelope(r, 402, "billing_error", None)


def test_admission_shed_is_529(live):
    ensure_model(live, DRAINED_MODEL, MODEL_DIR)
    live.manage("admission_policy", DRAINED_MODEL, "--max-num-queued-reqs", "0")
    r = _post(live, "/v1/messages", {"model": DRAINED_MODEL, "max_tokens": 4, "messages": MSGS})
    _envelope(r, 529, "overloaded_error", None)
    assert int(r.headers["retry-after"]) >= 1
    sdk = anthropic.Anthropic(base_url=live.base_url, api_key=live.api_key, max_retries=0, timeout=60)
    with pytest.raises(anthropic.APIStatusError) as err:
        sdk.messages.create(model=DRAINED_MODEL, max_tokens=4, messages=MSGS)
    assert err.value.status_code == 529
