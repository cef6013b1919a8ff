"""Issue 14, request caps through a live platform (api + engine + Redis): over-cap values are a 400 in the
OpenAI envelope naming the field, before anything starts; values that end up in a response header cannot
carry control characters; ``n`` children sent as one request-stream entry still run as ``n`` choices."""

from __future__ import annotations

import httpx
import openai
import pytest

MSGS = [{"role": "user", "content": "hi"}]
MODEL = "tiny-qwen3"


@pytest.fixture(scope="module")
def live(shared_live):
    """The shared live platform (tests/conftest.py)."""
    return shared_live


def post(live, path, body=None, *, headers=None, content=None):
    h = {"Authorization": f"Bearer {live.api_key}", "Content-Type": "application/json", **(headers or {})}
    return httpx.post(live.base_url + path, json=body if content is None else None, content=content, headers=h,
                      timeout=60)


def assert_400(resp, param):
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err


OVER_CAP = [
    ({"stop": ["s" * 1025]}, "stop"),
    ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"model": "tiny qwen3"}, "model"),
    ({"model": "m" * 129}, "model"),
    ({"messages": MSGS * 2049}, "messages"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"documents": [{"text": "d"}] * 257}, "documents"),
    ({"request_id": "a\nb"}, "request_id"),
]


@pytest.mark.parametrize("extra,param", OVER_CAP, ids=[p for _, p in OVER_CAP])
def test_over_cap_chat_is_400(live, extra, param):
    err = assert_400(post(live, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 1,
                                                         **extra}), param)
    if param == "messages":  # refused by the cap, not because the prompt outgrew the context
        assert "2048" in err["message"], err


def test_large_over_cap_body_is_400_naming_the_field(live):
    """A body over the off-loop threshold (256 KB) is validated in a worker thread, same answer."""
    msgs = [{"role": "user", "content": "x" * 200}] * 2049
    err = assert_400(post(live, "/v1/chat/completions", {"model": MODEL, "messages": msgs}), "messages")
    assert "2048" in err["message"], err


def test_too_many_json_containers_is_400(live):
    err = assert_400(post(live, "/v1/chat/completions",
                          {"model": MODEL, "messages": MSGS, "ignored": [[]] * 60_000}), None)
    assert "50000" in err["message"]


def test_generate_request_id_with_control_characters_is_400(live):
    """It used to go into the X-Request-Id response header as is: the connection was dropped."""
    assert_400(post(live, "/inference/v1/generate", {"model": MODEL, "token_ids": [1, 2, 3],
                                                     "request_id": "abc\r\nX-Evil: 1",
                                                     "sampling_params": {"max_tokens": 1}}), "request_id")


def test_x_request_id_with_control_characters_is_400(live):
    assert_400(post(live, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 1},
                    headers={"X-Request-Id": "abc\tdef"}), "X-Request-Id")


def test_embeddings_request_id_is_capped(live):
    assert_400(post(live, "/v1/embeddings", {"model": MODEL, "input": ["a"] * 2048, "request_id": "r" * 129}),
               "request_id")


def test_openai_client_sees_the_param(live):
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=MSGS, stop=["s" * 1025])
    assert exc.value.body["param"] == "stop"


def test_n_children_and_caps_at_the_limit_work(live):
    """n=3 with 256 stop ids, 300 logit_bias entries and stop strings at the cap: one request-stream entry,
    three choices, each a full answer."""
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0)
    resp = client.chat.completions.create(
        model=MODEL, messages=MSGS, n=3, max_tokens=4, seed=1, stop=["\x00" * 1024, "\x01" * 1024],
        extra_body={"stop_token_ids": list(range(140_000, 140_256)) * 2, "ignore_eos": True},
        logit_bias={str(i): 0.5 for i in range(100, 400)})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert resp.usage.completion_tokens == 12
