"""Bad input gets its status and the OpenAI envelope, before any stream starts (issue 2, docs/ARCHITECTURE.md §8)."""

from __future__ import annotations

import httpx
import openai
import pytest

MSGS = [{"role": "user", "content": "hi"}]


def post(live, path, body=None, *, key="default", raw=None, headers=None, stream=False):
    h = {"Content-Type": "application/json"}
    if key == "default":
        h["Authorization"] = f"Bearer {live.api_key}"
    elif key is not None:
        h["Authorization"] = key
    h.update(headers or {})
    content = raw if raw is not None else None
    return httpx.post(live.base_url + path, json=None if raw is not None else body, content=content, headers=h,
                      timeout=60)


def assert_envelope(resp, status, param="__any__", type_=None):
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    if type_:
        assert err["type"] == type_
    return err


@pytest.mark.parametrize("key", [None, "Bearer wrong", "Bearer", "Basic abc", "bearer"])
def test_missing_or_bad_key_401(live, model_name, key):
    resp = post(live, "/v1/chat/completions", {"model": model_name, "messages": MSGS}, key=key)
    assert_envelope(resp, 401, type_="authentication_error")


def test_revoked_key_stops_working(live, model_name):
    secret = live.new_key()
    ok = post(live, "/v1/chat/completions", {"model": model_name, "messages": MSGS, "max_tokens": 1},
              key=f"Bearer {secret}")
    assert ok.status_code == 200
    live.manage("shell", "-c", (
        "from tenancy.models import ApiKey; from tenancy.services import api_key_revoke; "
        "from tenancy.selectors import api_key_authenticate; "
        f"api_key_revoke(api_key=ApiKey.objects.get(pk=api_key_authenticate('{secret}').key_id))"))
    import time
    deadline = time.monotonic() + 30  # the per-process key cache lives at most 1 s
    while True:
        resp = post(live, "/v1/chat/completions", {"model": model_name, "messages": MSGS, "max_tokens": 1},
                    key=f"Bearer {secret}")
        if resp.status_code != 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert_envelope(resp, 401)


def test_unknown_model_404(live):
    err = assert_envelope(post(live, "/v1/chat/completions", {"model": "no-such-model", "messages": MSGS}), 404,
                          param="model")
    assert "no-such-model" in err["message"]


def test_malformed_json_400(live):
    assert_envelope(post(live, "/v1/chat/completions", raw=b"{not json"), 400, type_="invalid_request_error")
    assert_envelope(post(live, "/v1/chat/completions", raw=b'{"model": "x", "temperature": NaN}'), 400)
    assert_envelope(post(live, "/v1/chat/completions", raw=b"[1,2]"), 400)


@pytest.mark.parametrize("field,value", [
    ("max_tokens", -1), ("max_tokens", 0), ("max_tokens", 1.5), ("max_tokens", "10"),
    ("max_completion_tokens", -5), ("temperature", "hot"), ("temperature", 2.5), ("temperature", -0.1),
    ("top_p", 1.5), ("top_p", 0), ("stream", "yes"), ("messages", "hi"), ("messages", []), ("n", 0),
    ("presence_penalty", 3), ("top_k", -2), ("seed", "1"), ("stop", ["a", "b", "c", "d", "e"]), ("stop", [""]),
])
def test_wrong_types_and_ranges_400(live, model_name, field, value):
    body = {"model": model_name, "messages": MSGS, field: value}
    assert_envelope(post(live, "/v1/chat/completions", body), 400, param=field, type_="invalid_request_error")
    # the same with stream=true is still a plain JSON 400 (no SSE)
    if field != "stream":
        assert_envelope(post(live, "/v1/chat/completions", {**body, "stream": True}), 400, param=field)


def test_over_long_prompt_400_with_real_numbers(live, model_name):
    content = "hello " * (live.max_model_len + 50)
    for stream in (False, True):
        resp = post(live, "/v1/chat/completions",
                    {"model": model_name, "messages": [{"role": "user", "content": content}], "stream": stream})
        err = assert_envelope(resp, 400, type_="invalid_request_error")
        assert str(live.max_model_len) in err["message"]
        assert err["param"] != "max_tokens"
        assert "data:" not in resp.text


def test_max_tokens_beyond_context_400(live, model_name):
    resp = post(live, "/v1/chat/completions", {"model": model_name, "messages": MSGS,
                                               "max_tokens": live.max_model_len})
    err = assert_envelope(resp, 400, param="max_tokens")
    assert str(live.max_model_len) in err["message"]


def test_prompt_exactly_max_model_len_rejected(live, model_name):
    ids = [9707] * live.max_model_len
    err = assert_envelope(post(live, "/v1/completions", {"model": model_name, "prompt": ids, "max_tokens": 1}), 400)
    assert "longer" not in err["message"] and str(live.max_model_len) in err["message"]
    ok = post(live, "/v1/completions", {"model": model_name, "prompt": ids[:-1]})
    assert ok.status_code == 200, ok.text
    body = ok.json()
    assert body["usage"]["prompt_tokens"] == live.max_model_len - 1
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"


def test_out_of_vocab_prompt_ids_400(live, model_name):
    err = assert_envelope(post(live, "/v1/completions", {"model": model_name, "prompt": [1, 4294967295],
                                                         "max_tokens": 1}), 400)
    assert "4294967295" in err["message"]


def test_openai_client_raises_typed_errors(live, model_name):
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[], max_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSGS)
    bad = openai.OpenAI(base_url=live.base_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_and_method(live):
    assert_envelope(httpx.get(live.base_url + "/v1/no-such-route", timeout=10), 404)
    resp = httpx.get(live.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {live.api_key}"},
                     timeout=10)
    assert_envelope(resp, 405)


def test_body_too_large_413(live, model_name):
    big = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * (17 * 1024 * 1024) + b'"}]}'
    resp = post(live, "/v1/chat/completions", raw=big)
    assert_envelope(resp, 413)


def test_server_keeps_serving_after_bad_input(live, model_name):
    for _ in range(3):
        post(live, "/v1/chat/completions", raw=b"garbage")
    assert httpx.get(live.base_url + "/health", timeout=5).status_code == 200
    ok = post(live, "/v1/chat/completions", {"model": model_name, "messages": MSGS, "max_tokens": 2})
    assert ok.status_code == 200


def test_model_without_chat_template(live, tmp_path):
    from harness.assets import MODEL_DIR
    from harness import REPO

    gptoss = REPO / ".cache" / "tokenizers" / "gptoss"
    if not (gptoss / "tokenizer.json").is_file():
        import subprocess
        subprocess.run(["bash", str(REPO / "scripts" / "fetch_tokenizers.sh"), "gptoss"], check=True)
    # a model dir whose tokenizer (gpt-oss's, which ships no template) has no chat template
    live.manage("register_model", "no-template", str(MODEL_DIR), "--tokenizer-dir", str(gptoss),
                "--max-model-len", "256")
    live.start_engine(name="engine-no-template", model="no-template")
    resp = post(live, "/v1/chat/completions", {"model": "no-template", "messages": MSGS})
    err = assert_envelope(resp, 400)
    assert "template" in err["message"].lower()
    resp = post(live, "/v1/completions", {"model": "no-template", "prompt": "Hello", "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 2 or resp.json()["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "\\ud800"}]}'),
    ("/v1/completions", b'{"model": "tiny-qwen3", "prompt": "\\ud800 x"}'),
    ("/tokenize", b'{"model": "tiny-qwen3", "prompt": "\\udc00"}'),
    # a surrogate encoded as (invalid) UTF-8 bytes rather than as an escape
    ("/v1/chat/completions", b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "a\xed\xa0\x80"}]}'),
])
def test_lone_surrogates_are_400_not_500(live, path, body):
    err = assert_envelope(post(live, path, raw=body), 400)
    assert "surrogate" in err["message"]


def test_deeply_nested_json_is_400(live):
    body = b'{"model": "tiny-qwen3", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_envelope(post(live, "/v1/chat/completions", raw=body), 400)


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_nesting_that_would_crash_a_render_worker_is_400(live, path):
    # 500 levels parse, but pickling them for a prefork child exhausted the recursion limit and took the
    # whole Celery worker down (found by a fresh-clone user test); refused at the door instead
    deep = b'{"a": ' * 500 + b"1" + b"}" * 500
    body = (b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
            b'"function", "function": {"name": "f", "parameters": ' + deep + b"}}]}")
    err = assert_envelope(post(live, path, raw=body), 400)
    assert "nested too deeply" in err["message"]
    ok = post(live, "/tokenize", {"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200, ok.text


def test_prompt_that_cannot_fit_is_refused_before_rendering(live, model_name):
    from inference.workers.tasks import render_tasks_counter_key

    def rendered() -> int:
        return int(live.redis.get(render_tasks_counter_key(live.prefix)) or 0)

    content = "hello " * 2_000_000  # 12 MB: could never fit max_model_len tokens
    before = rendered()
    err = assert_envelope(post(live, "/v1/chat/completions",
                               {"model": model_name, "messages": [{"role": "user", "content": content}]}), 400,
                          param="messages")
    assert str(live.max_model_len) in err["message"]
    assert rendered() == before  # refused from its size alone: no render task was answered for it


def test_unsupported_features_are_refused_not_ignored(live, model_name):
    assert_envelope(post(live, "/v1/chat/completions", {"model": model_name, "messages": MSGS,
                                                        "response_format": {"type": "json_schema"}}), 400,
                    param="response_format.json_schema")
    assert post(live, "/v1/chat/completions", {"model": model_name, "messages": MSGS, "max_tokens": 1,
                                               "response_format": {"type": "text"}}).status_code == 200
    assert_envelope(post(live, "/v1/completions", {"model": model_name, "prompt": "a", "suffix": "b"}), 400,
                    param="suffix")
    assert_envelope(post(live, "/tokenize", {"model": model_name, "prompt": "a", "messages": MSGS}), 400)


def test_unknown_paths_outside_v1_answer_the_json_envelope(live):
    for path in ("/foo", "/v2/x", "/version"):
        assert_envelope(httpx.get(live.base_url + path, timeout=10), 404)
