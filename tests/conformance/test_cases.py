"""Every case of ../shared/conformance/cases.jsonl against the live platform (one test per case id).

Placeholders: MAX_MODEL_LEN = the served model's ``max_model_len`` (512 here), VOCAB_SIZE = ``len(tokenizer)``
including added tokens, BOS_ID = id of ``tokenizer_config.bos_token``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import re
import string
import time
import uuid

import httpx
import openai
import pytest

from inference.renderer.tokenizer_cache import get_tokenizer
from tests.conformance.conftest import LLAMA_MODEL
from tests.support.live import engine_paused
from harness import REPO
from harness.assets import TOKENIZER_DIR

M = "tiny-qwen3"
MAX_MODEL_LEN = 512
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def vocab_size() -> int:
    return get_tokenizer(str(TOKENIZER_DIR)).vocab_size


def assert_envelope(resp: httpx.Response, status: int, param: str | None = "__any__", etype: str | None = None):
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param != "__any__":
        assert err["param"] == param, err
    if etype is not None:
        assert err["type"] == etype, err
    return err


def chat(http, body, **kw):
    return http.post("/v1/chat/completions", json={"model": M, **body}, **kw)


def tokenize(http, body, model=M):
    resp = http.post("/tokenize", json={"model": model, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def detokenize(http, tokens, model=M):
    resp = http.post("/detokenize", json={"model": model, "tokens": tokens})
    assert resp.status_code == 200, resp.text
    return resp.json()["prompt"]


def healthy(http):
    assert http.get("/health").status_code == 200
    resp = http.post("/v1/completions", json={"model": M, "prompt": "Hello", "max_tokens": 2})
    assert resp.status_code == 200, resp.text


def sse_events(text: str) -> list:
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-300:]
    return [json.loads(e) for e in events[:-1]]


# ------------------------------------------------------------------------------------------------ C01
def test_c01_single_bos(http):
    tok = get_tokenizer(str(REPO / ".cache" / "tokenizers" / "llama3_1"))
    bos = tok.bos_token_id
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    out = tokenize(http, {"add_generation_prompt": True, "messages": msgs}, model=LLAMA_MODEL)
    assert out["tokens"][0] == bos
    assert out["tokens"].count(bos) == 1
    assert out["count"] == len(out["tokens"])
    resp = http.post("/v1/chat/completions", json={"model": LLAMA_MODEL, "messages": msgs, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == out["count"]
    text = detokenize(http, out["tokens"], model=LLAMA_MODEL)
    assert text.startswith(tok.bos_token)
    resp = http.post("/v1/completions", json={"model": LLAMA_MODEL, "prompt": text, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == out["count"]


# ------------------------------------------------------------------------------------------------ C02
def test_c02_continue_final_message(http):
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite colour is"}]
    resp = chat(http, {"max_tokens": 8, "add_generation_prompt": True, "continue_final_message": True,
                       "messages": msgs})
    err = assert_envelope(resp, 400, etype="invalid_request_error")
    assert "continue_final_message" in err["message"] and "add_generation_prompt" in err["message"]
    resp = chat(http, {"max_tokens": 8, "add_generation_prompt": False, "continue_final_message": True,
                       "messages": msgs})
    assert resp.status_code == 200, resp.text
    out = tokenize(http, {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True})
    text = detokenize(http, out["tokens"])
    assert text.rstrip().endswith("My favourite colour is")
    assert not text.rstrip().endswith("<|im_end|>")
    resp = chat(http, {"max_tokens": 8, "continue_final_message": True,
                       "messages": [{"role": "user", "content": "Name a colour."}]})
    assert_envelope(resp, 400)


# ------------------------------------------------------------------------------------------------ C03
def test_c03_empty_string_content(http):
    msgs = [{"role": "system", "content": ""}, {"role": "user", "content": "A"},
            {"role": "assistant", "content": ""}, {"role": "user", "content": "B"}]
    resp = chat(http, {"max_tokens": 8, "messages": msgs})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"
    text = detokenize(http, tokenize(http, {"messages": msgs})["tokens"])
    # four turns plus the generation prompt's header
    assert text.count("<|im_start|>") == 5, text


# ------------------------------------------------------------------------------------------------ C04
def test_c04_tool_content_as_parts(http):
    def msgs(content):
        return [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
                    "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": content}]
    parts = msgs([{"type": "text", "text": "18 degrees"}])
    resp = chat(http, {"max_tokens": 16, "tools": [WEATHER_TOOL], "messages": parts})
    assert resp.status_code == 200, resp.text
    a = tokenize(http, {"messages": parts, "tools": [WEATHER_TOOL]})
    b = tokenize(http, {"messages": msgs("18 degrees"), "tools": [WEATHER_TOOL]})
    assert a["tokens"] == b["tokens"]
    assert detokenize(http, a["tokens"]).count("18 degrees") == 1


# ------------------------------------------------------------------------------------------------ C05
def test_c05_null_content_with_tool_calls(http):
    def msgs(arguments):
        return [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
                    "name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "call_0", "content": "18 degrees"},
                {"role": "user", "content": "Thanks. And tomorrow?"}]
    resp = chat(http, {"max_tokens": 16, "tools": [WEATHER_TOOL], "messages": msgs("{\"city\": \"Paris\"}")})
    assert resp.status_code == 200, resp.text
    text = detokenize(http, tokenize(http, {"messages": msgs("{\"city\": \"Paris\"}"), "tools": [WEATHER_TOOL]})["tokens"])
    assert "None" not in text
    resp = chat(http, {"max_tokens": 16, "tools": [WEATHER_TOOL], "messages": msgs("null")})
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert "arguments" in (resp.json()["error"]["param"] or "")
        assert "jinja" not in resp.json()["error"]["message"].lower()


# ------------------------------------------------------------------------------------------------ C06
def test_c06_empty_messages(http):
    err = assert_envelope(chat(http, {"messages": []}), 400, etype="invalid_request_error")
    assert err["param"] == "messages" or "messages" in err["message"]
    assert_envelope(chat(http, {"messages": [], "stream": True}), 400)
    resp = chat(http, {"messages": [{"role": "assistant", "content": "Hello"}], "max_tokens": 4})
    assert resp.status_code in (200, 400), resp.text
    assert_envelope(http.post("/tokenize", json={"model": M, "messages": []}), 400)


# ------------------------------------------------------------------------------------------------ C11
def test_c11_out_of_vocab_ids(http):
    V = vocab_size()
    err = assert_envelope(http.post("/v1/completions", json={"model": M, "prompt": [1, 4294967295], "max_tokens": 1}),
                          400, etype="invalid_request_error")
    assert "4294967295" in err["message"]
    err = assert_envelope(http.post("/detokenize", json={"model": M, "tokens": [-1]}), 400)
    assert "-1" in err["message"]
    err = assert_envelope(http.post("/detokenize", json={"model": M, "tokens": [V]}), 400)
    assert str(V) in err["message"]
    err = assert_envelope(http.post("/detokenize", json={"model": M, "tokens": [4294967295]}), 400)
    assert "4294967295" in err["message"]
    msgs = [{"role": "user", "content": "hi"}]
    assert_envelope(chat(http, {"messages": msgs, "max_tokens": 2, "logit_bias": {"999999999": 5}}), 400, "logit_bias")
    assert_envelope(chat(http, {"messages": msgs, "max_tokens": 2, "logit_bias": {"10": 101}}), 400, "logit_bias")
    assert detokenize(http, [V - 1]) is not None  # the last id is valid
    healthy(http)


# ------------------------------------------------------------------------------------------------ C14
def test_c14_max_tokens_domain_and_types(http):
    msgs = [{"role": "user", "content": "Say hello."}]
    for value in (-1, 0, 1.5, "10"):
        assert_envelope(chat(http, {"messages": msgs, "max_tokens": value}), 400, "max_tokens", "invalid_request_error")
    assert_envelope(chat(http, {"messages": msgs, "max_completion_tokens": -5}), 400, "max_completion_tokens")
    assert_envelope(chat(http, {"messages": msgs, "stream": "yes"}), 400, "stream")
    assert_envelope(chat(http, {"messages": "hi"}), 400, "messages")
    assert_envelope(chat(http, {"messages": msgs, "temperature": "0.5"}), 400, "temperature")
    resp = chat(http, {"messages": msgs, "max_tokens": 1})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


# ------------------------------------------------------------------------------------------------ C15
def test_c15_explicit_nulls(http):
    a = http.post("/v1/completions", json={"model": M, "prompt": "test", "temperature": 0, "max_tokens": None})
    assert a.status_code == 200, a.text
    assert a.json()["choices"][0]["finish_reason"] in ("stop", "length")
    b = http.post("/v1/completions", json={"model": M, "prompt": "test", "temperature": 0})
    assert b.json()["choices"][0]["text"] == a.json()["choices"][0]["text"]
    resp = chat(http, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": None,
                       "top_p": None, "n": None, "stop": None, "seed": None, "presence_penalty": None,
                       "frequency_penalty": None, "logprobs": None, "top_logprobs": None, "stream_options": None,
                       "user": None})
    assert resp.status_code == 200, resp.text


# ------------------------------------------------------------------------------------------------ C16
def test_c16_context_overflow_numbers(http):
    resp = chat(http, {"messages": [{"role": "user", "content": "hello " * (MAX_MODEL_LEN + 50)}]})
    err = assert_envelope(resp, 400, etype="invalid_request_error")
    assert str(MAX_MODEL_LEN) in err["message"]
    assert err["param"] != "max_tokens"
    assert not re.search(r"-\d", err["message"]), err["message"]
    msgs = [{"role": "user", "content": "hi"}]
    count = tokenize(http, {"messages": msgs})["count"]
    err = assert_envelope(chat(http, {"messages": msgs, "max_tokens": MAX_MODEL_LEN}), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and str(count) in err["message"]


# ------------------------------------------------------------------------------------------------ C17
def test_c17_prompt_equals_context(http):
    tid = tokenize(http, {"prompt": "hello", "add_special_tokens": False})["tokens"][0]
    resp = http.post("/v1/completions", json={"model": M, "prompt": [tid] * MAX_MODEL_LEN, "max_tokens": 1})
    err = assert_envelope(resp, 400, etype="invalid_request_error")
    assert "longer" not in err["message"] and str(MAX_MODEL_LEN) in err["message"]
    resp = http.post("/v1/completions", json={"model": M, "prompt": [tid] * (MAX_MODEL_LEN - 1), "max_tokens": None,
                                              "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 1
    assert body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["finish_reason"] == "length"
    resp = http.post("/v1/completions", json={"model": M, "prompt": [tid] * (MAX_MODEL_LEN - 1), "max_tokens": 2})
    assert_envelope(resp, 400)


# ------------------------------------------------------------------------------------------------ C18
def test_c18_errors_before_stream_are_http(http):
    resp = chat(http, {"stream": True, "messages": [{"role": "user", "content": "hello " * (MAX_MODEL_LEN + 50)}]})
    assert_envelope(resp, 400)
    assert "data:" not in resp.text


# ------------------------------------------------------------------------------------------------ C20
def test_c20_finish_reason_and_done(http):
    resp = chat(http, {"messages": [{"role": "user", "content": "Write a long paragraph about the sea."}],
                       "max_tokens": 8, "stream": True, "ignore_eos": True})
    assert resp.status_code == 200
    chunks = sse_events(resp.text)
    finishes = []
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        for ch in c["choices"]:
            assert "finish_reason" in ch
            assert ch["finish_reason"] in (None, "stop", "length", "tool_calls", "content_filter")
            if ch["finish_reason"] is not None:
                finishes.append((ch["index"], ch["finish_reason"]))
    assert finishes == [(0, "length")]
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1


# ------------------------------------------------------------------------------------------------ C23
def test_c23_sampling_ranges(http):
    msgs = [{"role": "user", "content": "hi"}]
    err = assert_envelope(chat(http, {"messages": msgs, "temperature": 999999.0, "top_p": -1.0, "max_tokens": 8}), 400)
    assert err["param"] in ("temperature", "top_p")
    V = vocab_size()
    for field, value in (("temperature", -0.1), ("temperature", 2.5), ("top_p", 1.5), ("presence_penalty", 3),
                         ("n", 0), ("n", 1000000), ("top_k", 2147483647), ("repetition_penalty", 0),
                         ("min_p", 1.5), ("frequency_penalty", -3), ("top_k", V + 1)):
        assert_envelope(chat(http, {"messages": msgs, field: value, "max_tokens": 2}), 400, field)
    for raw in (b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
                b'{"model": "tiny-qwen3", "messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}'):
        resp = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert_envelope(resp, 400)
    assert http.get("/health").status_code == 200


# ------------------------------------------------------------------------------------------------ C24
def test_c24_logprobs_bounds(http):
    msgs = [{"role": "user", "content": "Say hello."}]
    for value in (21, -1, True, 2147483648):
        assert_envelope(chat(http, {"messages": msgs, "max_tokens": 1, "logprobs": True, "top_logprobs": value}),
                        400, "top_logprobs")
    assert_envelope(chat(http, {"messages": msgs, "max_tokens": 1, "top_logprobs": 3}), 400, "top_logprobs")
    resp = chat(http, {"messages": msgs, "max_tokens": 1, "logprobs": True, "top_logprobs": 20})
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    resp = http.post("/v1/completions", json={"model": M, "prompt": "hi", "max_tokens": 1, "logprobs": 6})
    assert_envelope(resp, 400, "logprobs")


# ------------------------------------------------------------------------------------------------ C26
def test_c26_empty_prompt(http):
    resp = http.post("/v1/completions", json={"model": M, "prompt": "", "max_tokens": 4})
    assert resp.status_code in (200, 400)
    if resp.status_code == 400:  # Qwen3 adds no BOS: the tokenised prompt is empty
        err = assert_envelope(resp, 400, etype="invalid_request_error")
        assert "empty" in err["message"].lower()
    assert_envelope(http.post("/v1/completions", json={"model": M, "prompt": [], "max_tokens": 4}), 400)
    assert_envelope(http.post("/v1/completions", json={"model": M, "prompt": [""], "max_tokens": 4}), 400)
    healthy(http)


# ------------------------------------------------------------------------------------------------ C28
def test_c28_unused_and_unknown_fields(http):
    body = {"max_tokens": 4, "user": "user-123", "metadata": {"run": "x"}, "parallel_tool_calls": False,
            "store": False, "service_tier": "auto",
            "messages": [{"role": "user", "content": "hello", "name": "user_a"}]}
    assert chat(http, {**body, "some_future_param": True}).status_code == 200  # policy: ignored
    assert chat(http, body).status_code == 200
    assert chat(http, {"max_tokens": 4, "messages": [{"role": "user", "content": "hi", "name": "a"}]}).status_code == 200
    resp = http.post("/v1/completions", json={"model": M, "prompt": "hi", "max_tokens": 2, "some_future_param": 1})
    assert resp.status_code == 200
    assert tokenize(http, {"prompt": "hi", "some_future_param": 1})["count"] >= 1


# ------------------------------------------------------------------------------------------------ C29
def test_c29_error_envelope(http, live):
    assert_envelope(chat(http, {"messages": [{"role": "user", "content": "Say hello."}], "temperature": "hot"}),
                          400, "temperature", "invalid_request_error")
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key=live.api_key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=M, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"temperature": "hot"})
    assert str(info.value)
    assert_envelope(http.post("/v1/chat/completions", json={"model": "no-such-model", "messages": [
        {"role": "user", "content": "x"}]}), 404)
    assert_envelope(http.get("/v1/no-such-route"), 404)
    assert_envelope(http.post("/inference/v1/no-such-route", json={}), 404)


# ------------------------------------------------------------------------------------------------ C31
def test_c31_duplicate_request_ids(http, live):
    body = {"model": M, "messages": [{"role": "user", "content": "Count slowly from 1 to 40."}], "max_tokens": 48,
            "temperature": 0, "stream": True, "ignore_eos": True}

    def run(headers):
        with httpx.Client(base_url=live.base_url, timeout=120) as c:
            resp = c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {live.api_key}", **headers})
        text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in sse_events(resp.text) if ch["choices"])
        return resp, text

    solo, solo_text = run({})
    with cf.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, [{"X-Request-Id": "dup-1"}] * 2))
    for resp, text in results:
        assert resp.status_code == 200
        assert text == solo_text
        assert resp.headers["x-request-id"] == "dup-1"
    resp = chat(http, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
                headers={"X-Request-Id": "x" * 1_000_000})
    assert resp.status_code in (400, 431)
    healthy(http)


# ------------------------------------------------------------------------------------------------ C32
# the documented public list (README's route table): liveness, and the OpenAPI description of the routes (no model
# names or tenant data; vLLM serves its /openapi.json without a key too)
PUBLIC_PATTERNS = ("health", "v1/openapi.json", "")


def _gateway_routes():
    from gateway.routing import http_urlpatterns

    routes = []
    for p in http_urlpatterns:
        pattern = str(p.pattern)
        cls = p.callback.consumer_class if hasattr(p.callback, "consumer_class") else None
        if pattern in PUBLIC_PATTERNS or cls is None or cls.__name__ == "NotFoundConsumer":
            continue
        path = "/" + pattern.replace("^", "").replace("$", "").replace("(?P<model>[^/]+)", M)
        for method in cls.methods:
            routes.append((method, path))
    return routes


def test_c32_every_route_needs_a_key(live):
    routes = _gateway_routes()
    paths = {p for _, p in routes}
    assert {"/tokenize", "/detokenize", "/v1/chat/completions/render", "/inference/v1/generate",
            "/inference/v1/abort_requests", "/v1/models"} <= paths
    body = {"model": M, "prompt": "hello"}
    with httpx.Client(base_url=live.base_url, timeout=30) as c:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {live.api_key}"}):
                resp = c.request(method, path, json=body if method == "POST" else None, headers=headers)
                if path.startswith("/v1/messages"):  # Anthropic's dialect: its own envelope (D-334)
                    assert resp.status_code == 401 and resp.json()["type"] == "error", resp.text
                    assert resp.json()["error"]["type"] == "authentication_error", resp.text
                    continue
                err = assert_envelope(resp, 401)
                assert err is not None
            resp = c.request(method, path + f"?api_key={live.api_key}", json=body if method == "POST" else None)
            assert resp.status_code == 401
            resp = c.request(method, path, json=body if method == "POST" else None,
                             headers={"Authorization": f"Bearer {live.api_key}"})
            assert resp.status_code != 401, (method, path)


# ------------------------------------------------------------------------------------------------ C35
def render_tasks(live) -> int:
    """Render tasks answered by the Celery workers so far (their shared Redis counter)."""
    from inference.workers.tasks import render_tasks_counter_key

    return int(live.redis.get(render_tasks_counter_key(live.prefix)) or 0)


def test_c35_client_chat_template_refused(http, live):
    bomb = "{% for a in range(99999) %}{% for b in range(99999) %}x{% endfor %}{% endfor %}"
    msgs = [{"role": "user", "content": "Say hello."}]
    for body in ({"chat_template_kwargs": {"chat_template": bomb}}, {"chat_template": bomb}):
        rendered = render_tasks(live)
        err = assert_envelope(chat(http, {"max_tokens": 4, "messages": msgs, **body}), 400, etype="invalid_request_error")
        # refused as a parameter, not after a render ran into the time limit: no render task was answered
        assert err["param"] in ("chat_template", "chat_template_kwargs")
        assert render_tasks(live) == rendered
        assert_envelope(http.post("/tokenize", json={"model": M, "messages": msgs, **body}), 400)
    assert_envelope(chat(http, {"max_tokens": 4, "messages": msgs, "chat_template_kwargs": {"enable_thinking": "yes"}}),
                    400, "chat_template_kwargs.enable_thinking")
    # unknown scalar keys are passed to the template, which ignores what it does not reference (documented)
    assert chat(http, {"max_tokens": 2, "messages": msgs, "chat_template_kwargs": {"unknown_key": 1}}).status_code == 200
    assert_envelope(chat(http, {"max_tokens": 2, "messages": msgs, "chat_template_kwargs": {"unknown_key": {"a": 1}}}),
                    400, "chat_template_kwargs.unknown_key")


def test_c35_health_responsive_during_costly_render(http, live):
    """A heavy (server-side) render in flight does not block /health (render runs off the loop)."""
    # 60,000 characters: as heavy as a render gets while still fitting the model (max_model_len 512 x 128, the
    # longest llama3_1 token, = 65,536 characters; longer text is refused before rendering)
    # words never seen before (a fresh seed each run): no segment of the tokenization cache can serve them, so the
    # render costs its full time whatever rendered before (a warm cache made it too quick to overlap a probe)
    rng = random.Random(uuid.uuid4().int)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 8))) for _ in range(500)]
    msgs = [{"role": "user", "content": " ".join(rng.choices(words, k=1000))[:5000]} for _ in range(12)]
    answered_meanwhile = 0
    with cf.ThreadPoolExecutor(1) as pool, httpx.Client(base_url=live.base_url, timeout=30) as probe:
        assert probe.get("/health").status_code == 200  # the probe's connection is open before the render starts
        fut = pool.submit(lambda: http.post("/tokenize", json={"model": M, "messages": msgs}))
        for _ in range(100_000):  # bounded by the render's own duration
            if fut.done():
                break
            assert probe.get("/health").status_code == 200
            answered_meanwhile += not fut.done()
        assert fut.result().status_code == 200
    # /health answered while the render was still in flight (a blocked loop answers it only afterwards)
    assert answered_meanwhile >= 1


# ------------------------------------------------------------------------------------------------ C38
def test_c38_admission_overload(live):
    """MAX_RUNNING + QUEUE_CAPACITY here is the model's max_num_queued_reqs (admitted and not finished),
    set small for the test and restored afterwards."""
    limit = 3
    live.manage("admission_policy", M, "--max-num-queued-reqs", str(limit))
    try:
        body = {"model": M, "messages": [{"role": "user", "content": "Write 200 words about clouds."}],
                "max_tokens": 256, "stream": True, "ignore_eos": True}
        total = limit + 10 + 5

        def one(_):
            with httpx.Client(base_url=live.base_url, timeout=180) as c:
                return c.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {live.api_key}"})

        # the engine is held: the admitted streams cannot finish, so every refusal must come while they still
        # hold their places (answered at once, not after waiting for capacity), and exactly ``limit`` get in
        with cf.ThreadPoolExecutor(total) as pool:
            with engine_paused(live):
                futures = [pool.submit(one, i) for i in range(total)]
                deadline = time.monotonic() + 120
                while time.monotonic() < deadline and sum(f.done() for f in futures) < total - limit:
                    time.sleep(0.05)
                refused_while_held = [f.result() for f in futures if f.done()]
            results = [f.result() for f in futures]
        assert len(refused_while_held) == total - limit
        assert all(r.status_code == 503 for r in refused_while_held), [r.status_code for r in refused_while_held]
        statuses = [r.status_code for r in results]
        assert statuses.count(503) == total - limit, statuses
        assert all(s in (200, 503) for s in statuses), statuses
        for resp in results:
            if resp.status_code == 503:
                err = assert_envelope(resp, 503)
                assert err["type"] == "server_error" and err["code"] == "server_overloaded"
                assert int(resp.headers["retry-after"]) >= 1
                assert "data:" not in resp.text
            else:
                sse_events(resp.text)  # ends with [DONE]
    finally:
        live.manage("admission_policy", M, "--max-num-queued-reqs", "none")
    resp = httpx.post(live.base_url + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {live.api_key}"},
                      json={"model": M, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert resp.status_code == 200, resp.text
