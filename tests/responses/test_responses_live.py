"""The Responses API on the shared live platform, through the official ``openai`` SDK and the OpenAI Agents SDK,
unmodified: create, stream, parse, retrieve, delete, input items, background with cancel and resumed streams, a
tool loop, a chained conversation equal to the same conversation sent whole to Chat Completions, tenant isolation
on every route, and malformed input named by field."""

from __future__ import annotations

import json
import time
import uuid
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel

MODEL = "tiny-qwen3"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                         "required": ["city"],
                         "additionalProperties": False}, "strict": True}]
# a short structured answer: the grammar ends it, so the random demo model's response completes
ANSWER = {"format": {"type": "json_schema", "name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}


class Answer(BaseModel):
    ok: bool


@pytest.fixture(scope="module")
def live(shared_live):
    return shared_live


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def other(live):
    """A client of another tenant."""
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.new_key(tenant="responses-other"),
                         max_retries=0, timeout=60)


def _wait_status(client, rid: str, want: set[str], timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while True:
        resp = client.responses.retrieve(rid)
        if resp.status in want or time.monotonic() > deadline:
            return resp
        time.sleep(0.1)


def test_create_retrieve_delete_and_input_items(client) -> None:
    resp = client.responses.create(model=MODEL, instructions="Be brief.", input="Tell me about the sea.",
                                   max_output_tokens=8, metadata={"case": "crud"})
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 8 and resp.usage.input_tokens > 0
    assert resp.output[0].type == "message" and resp.output_text
    got = client.responses.retrieve(resp.id)
    assert got.model_dump() == resp.model_dump()
    items = client.responses.input_items.list(resp.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Tell me about the sea."
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list(resp.id)


def test_input_items_pages(client) -> None:
    texts = [f"part {i}" for i in range(5)]
    resp = client.responses.create(model=MODEL, input=[{"role": "user", "content": t} for t in texts],
                                   max_output_tokens=1)
    first = client.responses.input_items.list(resp.id, limit=2)  # newest first
    assert [i.content[0].text for i in first.data] == ["part 4", "part 3"] and first.has_more
    rest = client.responses.input_items.list(resp.id, limit=10, after=first.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["part 2", "part 1", "part 0"] and not rest.has_more
    asc = client.responses.input_items.list(resp.id, order="asc")
    assert [i.content[0].text for i in asc.data] == texts
    for query, param in (({"limit": 0}, "limit"), ({"limit": "x"}, "limit"), ({"order": "up"}, "order"),
                         ({"after": "msg_nope"}, "after")):
        with pytest.raises(openai.BadRequestError) as err:
            client.responses.input_items.list(resp.id, extra_query=query)
        assert err.value.body["param"] == param


def test_stream_events_in_order_and_no_done(client, live) -> None:
    with client.responses.stream(model=MODEL, input="Is the sea blue?", text=ANSWER, max_output_tokens=40) as s:
        events = list(s)
        final = s.get_final_response()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert json.loads(final.output_text) in ({"ok": True}, {"ok": False})
    assert client.responses.retrieve(final.id).output_text == final.output_text
    # the wire itself: event lines, the JSON's own type, no [DONE]
    raw = httpx.post(live.base_url + "/v1/responses", headers={"Authorization": f"Bearer {live.api_key}"},
                     json={"model": MODEL, "input": "x", "text": ANSWER, "stream": True, "store": False}, timeout=60)
    blocks = [b for b in raw.text.split("\n\n") if b]
    assert all(b.startswith("event: ") and "\ndata: " in b for b in blocks) and "[DONE]" not in raw.text
    assert all(json.loads(b.split("\ndata: ", 1)[1])["type"] == b.split("\n", 1)[0][len("event: "):] for b in blocks)


def test_parse_with_a_pydantic_model(client) -> None:
    parsed = client.responses.parse(model=MODEL, input="Answer with ok.", text_format=Answer, max_output_tokens=40)
    assert isinstance(parsed.output_parsed, Answer)


def test_store_false_writes_nothing(client) -> None:
    resp = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    assert resp.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="y", max_output_tokens=2, previous_response_id=resp.id)


def _chat_message(resp) -> dict:
    """The assistant message Chat Completions would have returned for ``resp``'s output."""
    msg: dict = {"role": "assistant", "content": None}
    for item in resp.output:
        if item.type == "reasoning":
            msg["reasoning"] = "".join(c.text for c in item.content or [])
        elif item.type == "message":
            msg["content"] = "".join(c.text for c in item.content)
        elif item.type == "function_call":
            msg.setdefault("tool_calls", []).append({"id": item.call_id, "type": "function", "function": {
                "name": item.name, "arguments": item.arguments}})
    return msg


def _usage_rows(live, prefix: str, timeout: float = 20) -> list[dict]:
    """The usage records whose request id starts with ``prefix`` (waits for the usage worker's flush)."""
    code = ("import json; from usage.models import UsageRecord; print(json.dumps(list(UsageRecord.objects.filter("
            f"request_id__startswith='{prefix}').values('prompt_tokens', 'completion_tokens'))))")
    deadline = time.monotonic() + timeout
    while True:
        rows = json.loads(live.manage("shell", "-c", code).strip().splitlines()[-1])
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.5)


def test_three_turn_chain_with_tool_calls_renders_the_chat_prompt(client, live) -> None:
    """Turn 1 makes a forced call, turn 2 feeds its output back, turn 3 follows up: every item kind survives the
    chain (instructions only where sent), and turn 3's prompt ids equal Chat Completions' for the whole
    conversation."""
    t1 = client.responses.create(model=MODEL, instructions="Be brief.", input="Weather in Paris?", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40)
    call = [o for o in t1.output if o.type == "function_call"][0]
    assert json.loads(call.arguments).keys() == {"city"}
    t2 = client.responses.create(model=MODEL, instructions="Be brief.", previous_response_id=t1.id, tools=TOOLS,
                                 tool_choice="none", max_output_tokens=6, input=[
                                     {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    usage_id = f"chain-{uuid.uuid4().hex[:12]}"
    t3 = client.responses.create(model=MODEL, instructions="Be brief.", previous_response_id=t2.id, tools=TOOLS,
                                 input="Thanks!", max_output_tokens=1, extra_body={"return_token_ids": True},
                                 extra_headers={"X-Request-Id": usage_id})
    chat_tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                _chat_message(t1), {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
                _chat_message(t2), {"role": "user", "content": "Thanks!"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=chat_tools, max_tokens=1,
                                          extra_body={"return_token_ids": True})
    assert t3.model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert t3.usage.input_tokens == chat.usage.prompt_tokens
    count = client.responses.input_tokens.count(model=MODEL, instructions="Be brief.", previous_response_id=t2.id,
                                                tools=TOOLS, input="Thanks!")
    assert count.input_tokens == t3.usage.input_tokens
    # the follow-up is billed (and settled against the key's limits) on its whole prompt, the chain included
    assert t3.usage.input_tokens > t2.usage.input_tokens > t1.usage.input_tokens
    rows = _usage_rows(live, f"resp_{usage_id}")
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [(t3.usage.input_tokens, 1)]


def test_background_cancel_bills_what_was_generated(client) -> None:
    with client.responses.stream(model=MODEL, input="Write a long story.", background=True,
                                 max_output_tokens=400) as s:
        seen = []
        for event in s:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) > 8:
                cancelled = client.responses.cancel(seen[0].response.id)
                break
    assert seen[0].type == "response.created" and seen[0].response.status == "queued"
    assert cancelled.status == "cancelled"
    final = _wait_status(client, cancelled.id, {"cancelled"})
    assert final.status == "cancelled"
    done = client.responses.retrieve(cancelled.id)
    assert 0 < done.usage.output_tokens < 400
    with pytest.raises(openai.BadRequestError):  # a foreground response cannot be cancelled
        client.responses.cancel(client.responses.create(model=MODEL, input="x", max_output_tokens=1).id)


def test_background_poll_and_resume_from_a_sequence_number(client) -> None:
    resp = client.responses.create(model=MODEL, input="Is the sea blue?", text=ANSWER, background=True,
                                   max_output_tokens=40)
    assert resp.status == "queued" and resp.background is True
    done = _wait_status(client, resp.id, {"completed", "failed", "incomplete"})
    assert done.status == "completed" and json.loads(done.output_text)
    everything = list(client.responses.retrieve(resp.id, stream=True))
    assert [e.sequence_number for e in everything] == list(range(len(everything)))
    assert everything[-1].type == "response.completed"
    tail = list(client.responses.retrieve(resp.id, stream=True, starting_after=4))
    assert [e.model_dump() for e in tail] == [e.model_dump() for e in everything[5:]]


def test_agents_sdk_tool_loop(live) -> None:
    agents = pytest.importorskip("agents")
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    aclient = openai.AsyncOpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0, timeout=60)
    agents.set_tracing_disabled(True)
    # the answer is structured (output_type): its grammar ends it, so the random demo model completes the turn; the
    # forced call of the first turn is its whole output (the format applies to the answer after it)
    agent = agents.Agent(name="weather", instructions="Use the tool, then answer.", tools=[get_weather],
                         output_type=Answer, model=agents.OpenAIResponsesModel(model=MODEL, openai_client=aclient),
                         model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=40))
    result = agents.Runner.run_sync(agent, "Weather in Paris?", max_turns=4)
    assert len(calls) == 1
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert isinstance(result.final_output, Answer)


def test_another_tenants_ids_are_not_found_on_every_route(client, other, live) -> None:
    mine = client.responses.create(model=MODEL, input="mine", max_output_tokens=1)
    bg = client.responses.create(model=MODEL, input="mine too", background=True, max_output_tokens=1)
    for call in (lambda: other.responses.retrieve(mine.id), lambda: other.responses.delete(mine.id),
                 lambda: other.responses.cancel(bg.id), lambda: other.responses.input_items.list(mine.id),
                 lambda: list(other.responses.retrieve(bg.id, stream=True)),
                 lambda: other.responses.create(model=MODEL, input="x", previous_response_id=mine.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError) as err:
        other.responses.create(model=MODEL, input=[{"type": "item_reference", "id": mine.output[0].id}])
    assert err.value.body["param"] == "input[0].id"
    assert client.responses.retrieve(mine.id).id == mine.id  # untouched


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text"}]}]}, "input[0].summary[0].text"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].image_url"),
    ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata.k"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "previous_response_id": "resp_doesnotexist"}, "previous_response_id"),
])
def test_malformed_input_is_a_400_naming_the_field(live, body, param) -> None:
    r = httpx.post(live.base_url + "/v1/responses", headers={"Authorization": f"Bearer {live.api_key}"},
                   json={"model": MODEL, **body}, timeout=30)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param


def test_truncation_auto_drops_the_oldest_items_disabled_refuses(client, live) -> None:
    long = [{"role": "user", "content": f"turn {i}: " + "the sea is wide and deep " * 12} for i in range(12)]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=long, max_output_tokens=4, store=False)
    assert err.value.body["param"] == "input" and "context length" in err.value.body["message"]
    resp = client.responses.create(model=MODEL, input=long, max_output_tokens=4, truncation="auto", store=False)
    assert resp.status == "incomplete" and resp.truncation == "auto"
    assert resp.usage.input_tokens <= live.max_model_len - 4
    count = client.responses.input_tokens.count(model=MODEL, input=long, truncation="auto",
                                                extra_body={"max_output_tokens": 4})
    assert count.input_tokens == resp.usage.input_tokens


def test_output_logprobs_when_included(client) -> None:
    resp = client.responses.create(model=MODEL, input="x", max_output_tokens=5, top_logprobs=2, store=False,
                                   include=["message.output_text.logprobs"])
    part = resp.output[0].content[0]
    assert len(part.logprobs) == resp.usage.output_tokens == 5
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert "".join(lp.token for lp in part.logprobs) == part.text
