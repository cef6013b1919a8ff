"""Issue 4 fields and endpoints against the live platform (real Redis, Celery worker, engine, uvicorn)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from inference.renderer.chat_template import render_chat_text
from inference.renderer.tokenizer_cache import get_tokenizer
from inference.workers.tasks import segment_cache_counter_key
from tests.engine_tap import EngineTap, assert_engine_aborted
from harness.assets import MODEL_DIR

M = "tiny-qwen3"
IM_START = 151644  # "<|im_start|>": a special token that is not an EOS id of the demo model
MSGS = [{"role": "user", "content": "Tell me about the sea."}]


def sse(text: str) -> list[dict]:
    data = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", text[-300:]
    return [json.loads(d) for d in data[:-1]]


def err_of(resp, status=400):
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def chat(http, **body):
    resp = http.post("/v1/chat/completions", json={"model": M, "messages": MSGS, **body})
    assert resp.status_code == 200, resp.text
    return resp.json()


def greedy_ids(http, n_tokens=12, **extra):
    out = chat(http, max_tokens=n_tokens, temperature=0, ignore_eos=True, return_token_ids=True, **extra)
    return out["choices"][0]["token_ids"], out["choices"][0]["message"]["content"]


# ------------------------------------------------------------------ /tokenize, /detokenize, routes
CHAT_BODIES = [
    {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "héllo 👋🏽 中文"}]},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue is"}],
     "add_generation_prompt": False, "continue_final_message": True},
]


def test_tokenize_celery_and_inline_routes_agree(http, http_inline):
    for body in CHAT_BODIES + [{"prompt": "plain prompt ✓ with emoji 🚀"}, {"prompt": "x", "add_special_tokens": False}]:
        a = http.post("/tokenize", json={"model": M, **body, "return_token_strs": True})
        b = http_inline.post("/tokenize", json={"model": M, **body, "return_token_strs": True})
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        assert a.content == b.content
        out = a.json()
        assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) and out["max_model_len"] == 512
        da = http.post("/detokenize", json={"model": M, "tokens": out["tokens"]})
        db = http_inline.post("/detokenize", json={"model": M, "tokens": out["tokens"]})
        assert da.status_code == 200 and da.content == db.content
    # errors are the same on both routes too
    bad = {"model": M, "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": 1}}
    assert http.post("/tokenize", json=bad).content == http_inline.post("/tokenize", json=bad).content
    assert http.post("/detokenize", json={"model": M, "tokens": [10**9]}).content == \
        http_inline.post("/detokenize", json={"model": M, "tokens": [10**9]}).content


def test_small_plain_prompts_tokenize_in_process_long_ones_on_the_workers(http, live):
    """On the Celery route a template-free prompt of at most RENDER_INLINE_MAX_CHARS (4096) characters is tokenized
    by the api process itself (no render task is sent); a longer one goes to the workers; chats always do. The
    token ids are the same either way."""
    from inference.workers.tasks import render_tasks_counter_key

    def tasks_done() -> int:
        return int(live.redis.get(render_tasks_counter_key(live.prefix)) or 0)

    unit = "plain prompt ✓ with emoji 🚀 "
    small, long = unit * (4096 // len(unit)), unit * (4096 // len(unit) + 1)
    before = tasks_done()
    a = http.post("/tokenize", json={"model": M, "prompt": small})
    assert a.status_code == 200 and tasks_done() == before
    b = http.post("/tokenize", json={"model": M, "prompt": long})
    assert b.status_code == 200 and tasks_done() == before + 1
    assert b.json()["tokens"][:len(a.json()["tokens"]) - 8] == a.json()["tokens"][:-8]
    c = http.post("/tokenize", json={"model": M, "messages": [{"role": "user", "content": "hi"}]})
    assert c.status_code == 200 and tasks_done() == before + 2


def test_multi_turn_tokenize_reuses_cached_segments_with_the_same_ids(http, http_inline, live):
    """A growing conversation tokenized turn by turn on both routes: the ids equal the tokenizer's whole-prompt
    encoding of the rendered text, and the history's segments come from the segment cache (inline: one api
    process, so every later turn hits), counted in the shared counters that /metrics shows."""
    def counts() -> tuple[int, int]:
        h = live.redis.hgetall(segment_cache_counter_key(live.prefix))
        return int(h.get(b"hits", 0)), int(h.get(b"misses", 0))

    tok = get_tokenizer(str(MODEL_DIR))
    hits0, misses0 = counts()
    msgs = [{"role": "system", "content": "You answer questions about the sea, briefly and kindly. " * 3}]
    for turn in range(3):
        msgs.append({"role": "user", "content": f"Turn {turn}: why is the sea salty, and why are waves? " * 4})
        expected = tok.tokenizer.encode(render_chat_text(str(MODEL_DIR), msgs), add_special_tokens=False).ids
        for client in (http_inline, http):
            out = client.post("/tokenize", json={"model": M, "messages": msgs})
            assert out.status_code == 200, out.text
            assert out.json()["tokens"] == expected
        msgs.append({"role": "assistant", "content": f"Answer {turn}: the rivers carry salt, the wind makes them. " * 4})
    deadline = time.monotonic() + 10  # the inline route adds its tallies in the background
    while counts()[0] - hits0 < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    hits, misses = counts()
    assert hits - hits0 >= 3 and misses - misses0 >= 3
    ops = live.new_key(tenant="ops-segcache", scopes="operator")
    text = httpx.get(f"{live.base_url}/metrics", headers={"Authorization": f"Bearer {ops}"}).text
    line = next(x for x in text.splitlines() if x.startswith("render_segment_cache_hits_total "))
    assert float(line.split()[1]) >= hits
    assert "render_segment_cache_misses_total " in text


def test_render_workers_share_long_segments_through_redis(http, live):
    """A conversation that grows by a long turn per request, tokenized on the Celery route: its turns reach both
    render workers (each waits on the queue in turn), so a worker meets the turn the other one encoded and reads it
    from the shared tier instead of encoding it (D-303): counted as shared hits in /metrics, the ids always equal to
    the tokenizer's whole-prompt encoding, and every shared entry has a lifetime."""
    def shared_hits() -> int:
        return int(live.redis.hget(segment_cache_counter_key(live.prefix), "shared_hits") or 0)

    tok = get_tokenizer(str(MODEL_DIR))
    msgs = [{"role": "system", "content": "You answer questions about lighthouses, in detail. " * 30}]
    before = shared_hits()
    # kombu's Redis consumer is not always waiting on the queue (it re-arms its BRPOP between polls), so the worker
    # that has just replied may take several turns in a row: go on, with pauses, until the other one takes one
    deadline = time.monotonic() + 60
    for turn in range(24):
        msgs.append({"role": "user", "content": f"Question {turn}: how far can a lighthouse be seen, and why? " * 20})
        expected = tok.tokenizer.encode(render_chat_text(str(MODEL_DIR), msgs), add_special_tokens=False).ids
        out = http.post("/tokenize", json={"model": M, "messages": msgs})
        assert out.status_code == 200, out.text
        assert out.json()["tokens"] == expected
        if shared_hits() > before or time.monotonic() > deadline:
            break
        msgs.append({"role": "assistant", "content": f"Answer {turn}: it depends on the lamp's height. " * 3})
        time.sleep(0.3)
    assert shared_hits() > before  # an earlier turn read from Redis by the worker that had not seen it
    keys = list(live.redis.scan_iter(match=f"{live.prefix}:segcache:*", count=1000))
    assert keys and all(live.redis.ttl(k) != -1 for k in keys)  # each has a lifetime (-2: it just expired)
    counted = shared_hits()
    ops = live.new_key(tenant="ops-segshared", scopes="operator")
    text = httpx.get(f"{live.base_url}/metrics", headers={"Authorization": f"Bearer {ops}"}).text
    line = next(x for x in text.splitlines() if x.startswith("render_segment_cache_shared_hits_total "))
    assert float(line.split()[1]) >= counted  # what the workers counted, as /metrics shows it


@pytest.mark.parametrize("route", ["celery", "inline"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_segment_cache_is_shared_only_within_a_tenant(http, http_inline, live, route, kind):
    """Two tenants tokenize the same long text: the second tenant's render reads none of the first one's segments
    (the keys carry the tenant's cache scope, as the prefix cache's do), so how fast its prompt is tokenized tells it
    nothing about the other's; the first tenant's next request hits its own (Celery: on either worker, through the
    shared tier for chats; inline: the api's own cache, whose tallies are added in the background). Completion
    prompts go to Celery past ``RENDER_INLINE_MAX_CHARS`` (4,096) characters."""
    def counts() -> tuple[int, int]:
        h = live.redis.hgetall(segment_cache_counter_key(live.prefix))
        return int(h.get(b"hits", 0)), int(h.get(b"misses", 0))

    def settled() -> tuple[int, int]:  # the inline route counts after answering
        last, deadline = counts(), time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = counts()
            if now == last:
                return now
            last = now
        return last

    mine = http if route == "celery" else http_inline
    url = live.base_url if route == "celery" else live.extra["inline_url"]
    other = httpx.Client(base_url=url, timeout=60,
                         headers={"Authorization": f"Bearer {live.new_key(tenant=f'segscope-{route}-{kind}')}"})
    text = f"A confidential brief, number {time.time_ns()}, about harbour tolls and their history. " * 60
    body = ({"model": M, "messages": [{"role": "user", "content": text}]} if kind == "chat"
            else {"model": M, "prompt": text})
    hits0, misses0 = settled()
    first = mine.post("/tokenize", json=body)
    assert first.status_code == 200, first.text
    hits1, misses1 = settled()
    assert misses1 > misses0 and hits1 == hits0
    second = other.post("/tokenize", json=body)
    assert second.status_code == 200 and second.json()["tokens"] == first.json()["tokens"]
    hits2, misses2 = settled()
    assert hits2 == hits1 and misses2 > misses1  # nothing of the first tenant's served the second
    if route == "celery" and kind == "completion":
        other.close()
        return  # no shared tier for completion prompts, and the next request may reach the other worker
    third = mine.post("/tokenize", json=body)
    assert third.status_code == 200 and third.json()["tokens"] == first.json()["tokens"]
    assert settled()[0] > hits2
    other.close()


def test_tokenize_chat_equals_chat_prompt_tokens(http):
    out = http.post("/tokenize", json={"model": M, "messages": MSGS}).json()
    assert chat(http, max_tokens=1)["usage"]["prompt_tokens"] == out["count"]
    text = http.post("/detokenize", json={"model": M, "tokens": out["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n")


def test_tokenize_and_detokenize_validation(http, live):
    with httpx.Client(base_url=live.base_url) as anon:
        assert anon.post("/tokenize", json={"model": M, "prompt": "x"}).status_code == 401
        assert anon.post("/detokenize", json={"model": M, "tokens": [1]}).status_code == 401
    assert err_of(http.post("/detokenize", json={"model": M, "tokens": ["1"]}))["param"].startswith("tokens")
    assert "151669" in err_of(http.post("/detokenize", json={"model": M, "tokens": [5, 151669]}))["message"]
    assert err_of(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)
    assert err_of(http.post("/tokenize", json={"model": M, "prompt": 5}))["param"] == "prompt"
    e = err_of(http.post("/tokenize", json={"model": M, "messages": MSGS, "chat_template": "{{ 1 }}"}))
    assert e["param"] == "chat_template"


# ------------------------------------------------------------------ sampling fields
def test_logit_bias_forces_and_forbids(http):
    ids, _ = greedy_ids(http, 6, logit_bias={"11": 100})
    assert ids == [11] * 6
    base, _ = greedy_ids(http, 1)
    banned, _ = greedy_ids(http, 1, logit_bias={str(base[0]): -100})
    assert banned[0] != base[0]


def test_min_tokens_masks_stop_ids(http):
    base, _ = greedy_ids(http, 8)
    out = chat(http, max_tokens=8, temperature=0, stop_token_ids=[base[0]], return_token_ids=True)
    assert out["choices"][0]["finish_reason"] == "stop" and len(out["choices"][0]["token_ids"]) == 1
    out = chat(http, max_tokens=8, temperature=0, stop_token_ids=[base[0]], min_tokens=3, return_token_ids=True)
    assert len(out["choices"][0]["token_ids"]) >= 3
    assert err_of(http.post("/v1/chat/completions", json={"model": M, "messages": MSGS, "max_tokens": 2,
                                                            "min_tokens": 3}))["param"] == "min_tokens"


def test_penalties_and_min_p_change_greedy_output(http):
    base, _ = greedy_ids(http, 24)
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 5.0}):
        ids, _ = greedy_ids(http, 24, **extra)
        if len(set(base)) < len(base):  # the greedy output repeats itself: a penalty must change it
            assert ids != base, extra
    # min_p 1.0 keeps only the most likely token: sampling at temperature 1 equals greedy
    out = chat(http, max_tokens=12, temperature=1.0, min_p=1.0, ignore_eos=True, seed=3, return_token_ids=True)
    assert out["choices"][0]["token_ids"] == greedy_ids(http, 12)[0]
    assert err_of(http.post("/v1/chat/completions", json={"model": M, "messages": MSGS, "min_p": 1.5}))["param"] == "min_p"


def test_stop_strings_include_and_limits(http):
    _, text = greedy_ids(http, 24)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    if not stop.strip():
        pytest.skip("greedy text has no usable stop substring")
    cut = text.index(stop)
    a = chat(http, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])["choices"][0]
    assert a["message"]["content"] == text[:cut] and a["finish_reason"] == "stop" and a["stop_reason"] == stop
    b = chat(http, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert b["choices"][0]["message"]["content"] == text[:cut] + stop
    assert err_of(http.post("/v1/chat/completions", json={"model": M, "messages": MSGS, "stop": list("abcde")}))["param"] == "stop"
    assert err_of(http.post("/v1/chat/completions", json={"model": M, "messages": MSGS, "stop": [""]}))["param"] == "stop"


def test_skip_special_tokens(http):
    body = dict(max_tokens=3, temperature=0, ignore_eos=True, logit_bias={str(IM_START): 100})
    shown = chat(http, skip_special_tokens=False, **body)["choices"][0]["message"]["content"]
    hidden = chat(http, **body)["choices"][0]["message"]["content"]
    assert shown == "<|im_start|>" * 3 and hidden == ""


# ------------------------------------------------------------------ logprobs and echo
def test_chat_logprobs(http):
    out = chat(http, max_tokens=4, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=20, return_token_ids=True)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert len(entry["top_logprobs"]) == 20
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"], abs=1e-4)  # greedy = top 1
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
    joined = "".join(e["token"] for e in content)
    assert joined == out["choices"][0]["message"]["content"] or "\ufffd" in joined
    out = chat(http, max_tokens=2, logprobs=True)
    assert all(e["top_logprobs"] == [] for e in out["choices"][0]["logprobs"]["content"])
    stream = http.post("/v1/chat/completions", json={"model": M, "messages": MSGS, "max_tokens": 3, "stream": True,
                                                      "ignore_eos": True, "logprobs": True, "top_logprobs": 2})
    entries = [e for c in sse(stream.text) for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert len(entries) == 3 and all(len(e["top_logprobs"]) == 2 for e in entries)


def test_completion_logprobs_and_echo(http):
    body = {"model": M, "prompt": "The sea is", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    out = http.post("/v1/completions", json={**body, "logprobs": 2}).json()["choices"][0]
    lp = out["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 3
    assert all(1 <= len(t) <= 3 for t in lp["top_logprobs"])
    assert "".join(lp["tokens"]) == out["text"]
    assert lp["text_offset"][0] == 0
    echo = http.post("/v1/completions", json={**body, "echo": True, "logprobs": 1}).json()["choices"][0]
    assert echo["text"] == "The sea is" + out["text"]
    elp = echo["logprobs"]  # issue 16: the echoed prompt is covered too, its first token null (OpenAI)
    assert "".join(elp["tokens"]) == echo["text"] and elp["text_offset"][0] == 0
    assert elp["token_logprobs"][0] is None and elp["top_logprobs"][0] is None
    assert elp["tokens"][-3:] == lp["tokens"] and elp["text_offset"][-3] == len("The sea is")
    assert elp["token_logprobs"][-3:] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    stream = http.post("/v1/completions", json={**body, "echo": True, "stream": True})
    assert "".join(ch["text"] for c in sse(stream.text) for ch in c["choices"]) == echo["text"]
    assert err_of(http.post("/v1/completions", json={**body, "logprobs": 6}))["param"] == "logprobs"


# ------------------------------------------------------------------ n > 1
def test_n_streaming_shape_and_usage(http):
    resp = http.post("/v1/chat/completions", json={"model": M, "messages": MSGS, "n": 3, "max_tokens": 5, "seed": 7,
                                                    "ignore_eos": True, "stream": True,
                                                    "stream_options": {"include_usage": True}})
    chunks = sse(resp.text)
    roles = [ch["index"] for c in chunks for ch in c["choices"] if ch["delta"].get("role") == "assistant"]
    finishes = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"] is not None]
    assert sorted(roles) == [0, 1, 2] and sorted(finishes) == [0, 1, 2]
    assert all(len(c["choices"]) <= 1 for c in chunks)
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 15
    single = chat(http, max_tokens=5, ignore_eos=True)
    assert usage["prompt_tokens"] == single["usage"]["prompt_tokens"]
    # seeds seed + i: child 1 of seed 7 == child 0 of seed 8
    a = chat(http, n=2, seed=7, max_tokens=8, ignore_eos=True, return_token_ids=True)
    b = chat(http, n=1, seed=8, max_tokens=8, ignore_eos=True, return_token_ids=True)
    assert a["choices"][1]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["usage"]["completion_tokens"] == 16
    e = err_of(http.post("/v1/chat/completions", json={"model": M, "messages": MSGS, "n": 2, "temperature": 0}))
    assert e["param"] == "n"


# ------------------------------------------------------------------ tools, documents, templates
def test_tools_validation_and_rendering(http):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
    base = {"model": M, "messages": MSGS, "max_tokens": 2}
    assert err_of(http.post("/v1/chat/completions", json={**base, "tool_choice": "auto"}))["param"] == "tool_choice"
    assert err_of(http.post("/v1/chat/completions", json={**base, "tools": [tool], "tool_choice": {
        "type": "function", "function": {"name": "other"}}}))["param"] == "tool_choice"
    assert err_of(http.post("/v1/chat/completions", json={**base, "tools": [tool], "tool_choice": "sometimes"}))["param"] == "tool_choice"
    assert err_of(http.post("/v1/chat/completions", json={**base, "tools": []}))["param"] == "tools"
    assert err_of(http.post("/v1/chat/completions", json={**base, "tools": [tool, tool]}))["param"] == "tools"
    for choice in ("auto", "none", None):
        assert http.post("/v1/chat/completions", json={**base, "tools": [tool], "tool_choice": choice}).status_code == 200
    ids = http.post("/tokenize", json={"model": M, "messages": MSGS, "tools": [tool]}).json()["tokens"]
    text = http.post("/detokenize", json={"model": M, "tokens": ids}).json()["prompt"]
    assert "<tools>" in text and "get_weather" in text


def test_chat_template_kwargs_reach_template(http):
    def text(kwargs):
        ids = http.post("/tokenize", json={"model": M, "messages": MSGS, "chat_template_kwargs": kwargs}).json()["tokens"]
        return http.post("/detokenize", json={"model": M, "tokens": ids}).json()["prompt"]
    assert text({"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in text({"enable_thinking": True})


def test_request_chat_template_only_where_allowed(http):
    tpl = ("{% for d in documents %}[{{ d.text }}]{% endfor %}{{ greeting }}"
           "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}")
    body = {"messages": MSGS, "chat_template": tpl, "documents": [{"text": "DOC-A"}],
            "chat_template_kwargs": {"greeting": "HELLO"}}
    e = err_of(http.post("/tokenize", json={"model": M, **body}))
    assert e["param"] == "chat_template"
    err_of(http.post("/v1/chat/completions", json={"model": M, **body, "max_tokens": 2}))
    resp = http.post("/tokenize", json={"model": "tiny-qwen3-trusted", **body})
    assert resp.status_code == 200, resp.text
    text = http.post("/detokenize", json={"model": M, "tokens": resp.json()["tokens"]}).json()["prompt"]
    assert text == "[DOC-A]HELLOuser:Tell me about the sea.;"
    # a request template that tries to escape the sandbox: 400, nothing done
    evil = {"messages": MSGS, "chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}
    e = err_of(http.post("/tokenize", json={"model": "tiny-qwen3-trusted", **evil}))
    assert "__subclasses__" not in e["message"] or "security" in e["message"].lower() or "unsafe" in e["message"].lower()


# ------------------------------------------------------------------ request ids
def test_x_request_id(http):
    resp = http.post("/v1/chat/completions", json={"model": M, "messages": MSGS, "max_tokens": 1},
                     headers={"X-Request-Id": "my-id-42"})
    assert resp.headers["x-request-id"] == "my-id-42" and resp.json()["id"] == "chatcmpl-my-id-42"
    resp = http.post("/v1/completions", json={"model": M, "prompt": "a", "max_tokens": 1},
                     headers={"X-Request-Id": "cid"})
    assert resp.headers["x-request-id"] == "cid" and resp.json()["id"] == "cmpl-cid"
    resp = http.post("/v1/chat/completions", json={"model": M, "messages": MSGS, "max_tokens": 1})
    assert len(resp.headers["x-request-id"]) == 16
    e = err_of(http.post("/v1/chat/completions", json={"model": M, "messages": MSGS, "max_tokens": 1},
                         headers={"X-Request-Id": "a" * 129}))
    assert "128" in e["message"]


# ------------------------------------------------------------------ render split, generate, abort
def test_render_then_generate_equals_chat(http):
    body = {"model": M, "messages": MSGS, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    rendered = http.post("/v1/chat/completions/render", json=body)
    assert rendered.status_code == 200, rendered.text
    r = rendered.json()
    assert set(r) >= {"request_id", "token_ids", "sampling_params", "model"}
    assert r["request_id"].startswith("chatcmpl-") and r["model"] == M
    assert r["sampling_params"]["max_tokens"] == 10 and r["sampling_params"]["temperature"] == 0.0
    assert r["token_ids"] == http.post("/tokenize", json={"model": M, "messages": MSGS}).json()["tokens"]
    omitted = http.post("/v1/chat/completions/render", json={"model": M, "messages": MSGS}).json()
    assert omitted["sampling_params"]["max_tokens"] == 64  # generation_config max_new_tokens caps the room left
    ref = chat(http, max_tokens=10, temperature=0, ignore_eos=True, return_token_ids=True)["choices"][0]["token_ids"]
    gen = http.post("/inference/v1/generate", json=r)
    assert gen.status_code == 200, gen.text
    g = gen.json()
    assert g["request_id"] == r["request_id"] and g["choices"][0]["token_ids"] == ref
    assert g["choices"][0]["finish_reason"] == "length" and g["usage"]["completion_tokens"] == 10
    stream = http.post("/inference/v1/generate", json={**r, "stream": True, "stream_options": {"include_usage": True}})
    events = sse(stream.text)
    assert [t for e in events for ch in e["choices"] for t in ch["token_ids"]] == ref
    assert events[-1]["usage"]["completion_tokens"] == 10
    comp = http.post("/v1/completions/render", json={"model": M, "prompt": "Hello", "seed": 5, "n": 2}).json()
    assert isinstance(comp, list) and comp[0]["sampling_params"]["max_tokens"] == 16 and comp[0]["sampling_params"]["n"] == 2
    g = http.post("/inference/v1/generate", json=comp[0]).json()
    assert len(g["choices"]) == 2


def test_generate_validation(http):
    base = {"model": M, "token_ids": [1, 2, 3]}
    assert err_of(http.post("/inference/v1/generate", json={**base, "token_ids": []}))["param"] == "token_ids"
    assert "151669" in err_of(http.post("/inference/v1/generate", json={**base, "token_ids": [151669]}))["message"]
    assert err_of(http.post("/inference/v1/generate", json={**base, "sampling_params": {"max_tokens": 600}}))[
        "param"] == "sampling_params.max_tokens"
    assert err_of(http.post("/inference/v1/generate", json={**base, "sampling_params": {"temperature": "1"}}))[
        "param"] == "sampling_params.temperature"
    assert err_of(http.post("/inference/v1/generate", json={**base, "sampling_params": {"logit_bias": {"999999": 1}}}))[
        "param"] == "sampling_params.logit_bias"
    assert err_of(http.post("/inference/v1/abort_requests", json={}))["param"] == "request_ids"


def test_abort_requests(http, live):
    """An abort by request id reaches the engine: the engine itself ends the stream with ``abort`` before the
    ``max_tokens`` it could otherwise produce (read off the engine link), whatever the machine's speed."""
    rid = f"gen-abort-{time.monotonic_ns()}"
    max_tokens = live.max_model_len - 8  # ignore_eos: only the abort can end it before this many tokens
    body = {"model": M, "request_id": rid, "token_ids": [1, 2, 3], "stream": True,
            "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True}}
    result: dict = {"lines": []}
    streaming = threading.Event()

    def run():
        with httpx.Client(base_url=live.base_url, timeout=120,
                          headers={"Authorization": f"Bearer {live.api_key}"}) as c:
            with c.stream("POST", "/inference/v1/generate", json=body) as resp:
                result["status"] = resp.status_code
                for line in resp.iter_lines():
                    result["lines"].append(line)
                    if line.startswith("data: {") and any(ch.get("token_ids") for ch in
                                                          json.loads(line[6:]).get("choices", [])):
                        streaming.set()
        streaming.set()

    with EngineTap(live.redis_url, live.prefix) as tap:
        t = threading.Thread(target=run)
        t.start()
        assert streaming.wait(60), "no token streamed"  # the request is running in the engine now
        other = http.post("/inference/v1/abort_requests", json={"request_ids": ["unknown-id"]})
        assert other.status_code == 200
        resp = http.post("/inference/v1/abort_requests", json={"request_ids": [rid]})
        assert resp.status_code == 200 and resp.json() == {}
        t.join(120)
        assert not t.is_alive()
        assert_engine_aborted(tap, rid, max_tokens)
    assert result["status"] == 200
    events = sse("\n".join(result["lines"]) + "\n")
    finishes = [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]]
    produced = sum(len(ch["token_ids"]) for e in events for ch in e["choices"])
    assert finishes == ["abort"] and produced < max_tokens


# ------------------------------------------------------------------ plain bodies for HTTP/1.0 clients
@pytest.mark.parametrize("path,body,status", [
    ("/tokenize", {"model": M, "prompt": "hello"}, 200),
    ("/v1/chat/completions", {"model": M, "messages": MSGS, "max_tokens": 2}, 200),
    ("/v1/chat/completions", {"model": M, "messages": "not a list"}, 400),
])
def test_http_1_0_clients_get_a_content_length_body(live, path, body, status):
    """Whole JSON answers and errors carry ``Content-Length``: an HTTP/1.0 client (or proxy) cannot read a
    chunked body."""
    import socket

    raw = json.dumps(body).encode()
    port = int(live.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        conn.sendall(f"POST {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     f"Authorization: Bearer {live.api_key}\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").lower().split("\r\n")
    assert lines[0].split()[1] == str(status), reply[:300]
    assert "transfer-encoding: chunked" not in lines
    assert f"content-length: {len(payload)}" in lines
    assert json.loads(payload)
