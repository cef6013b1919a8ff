"""Issue 14, gateway part, on the shared live platform (``shared_live``: Redis, Celery render worker, uvicorn) with a
model of this module's own that no engine serves (the routes that need one answer 503 after they took the key's
limits, which is all these tests need), and a second api process with short body deadlines:

* a keyed route answers 401 from the headers, without waiting for the body;
* a body that stalls, or trickles past the total deadline, gets 408 and the connection is closed;
* the hand-off header sent by a client over TCP changes no Redis counter;
* every keyed route takes its key's RPM before any work (rpm_limit=1: the second request is a 429), and an
  over-limit key's request publishes no render task (the workers' own task counter);
* limits taken are given back on every exit (max_concurrent_requests=1: sequential requests never see 429).
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from inference.workers.tasks import render_tasks_counter_key
from harness.assets import MODEL_DIR
from tests.support.live import ensure_model, limited_key, stop_child

MODEL = "gw-no-engine"  # the demo model's directory, registered for this module: no engine serves it
EMBED_MODEL = "tiny-embed"  # the demo model's directory registered for pooling: no engine serves it either


@pytest.fixture(scope="module")
def live(shared_live):
    ensure_model(shared_live, MODEL, MODEL_DIR, "--max-model-len", "512")
    ensure_model(shared_live, EMBED_MODEL, MODEL_DIR, "--task", "embed", "--max-model-len", "256")
    try:
        # a second api process with short body deadlines, stopped again with the module
        _child, shared_live.extra["slow_body_url"] = shared_live.start_api(
            "api-deadlines", env_extra={"REQUEST_BODY_IDLE_TIMEOUT_S": "1", "REQUEST_BODY_TIMEOUT_S": "3"})
        yield shared_live
    finally:
        stop_child(shared_live, "api-deadlines")
        shared_live.extra.pop("slow_body_url", None)


def raw_request(base_url: str, head: bytes, body: bytes, timeout: float = 20.0):
    """Send ``head`` + ``body`` on a fresh TCP connection and read until the server closes it (or ``timeout``):
    returns ``(status, headers_text, body_bytes, closed)``."""
    host, port = base_url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        sock.sendall(head + body)
        data, closed = b"", False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                closed = True
                break
            data += chunk
    finally:
        sock.close()
    head_text, _, payload = data.partition(b"\r\n\r\n")
    status = int(head_text.split(b" ")[1]) if head_text else None
    return status, head_text.decode("latin-1").lower(), payload, closed


def post_head(path: str, length: int, key: str | None, extra: str = "") -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {length}\r\n{extra}\r\n").encode()


# ------------------------------------------------------------------------------------------- 401 before the body
@pytest.mark.parametrize("key", [None, "sk-not-a-real-key"])
def test_bad_key_gets_401_without_the_body(live, key):
    # 10 MB announced, 20 bytes sent: the 401 must come from the headers alone, and the connection is closed
    status, head, payload, closed = raw_request(live.base_url, post_head("/v1/chat/completions", 10_000_000, key),
                                                b'{"model": "tiny-qw', timeout=20)
    assert status == 401, (head, payload)
    assert json.loads(payload)["error"]["type"] == "authentication_error"
    assert "connection: close" in head
    assert closed


# ------------------------------------------------------------------------------------------------------ 408
def test_stalled_body_gets_408_and_the_connection_closes(live):
    status, head, payload, closed = raw_request(live.extra["slow_body_url"],
                                                post_head("/tokenize", 1000, live.api_key), b'{"model": ', 20)
    assert status == 408, (head, payload)
    err = json.loads(payload)["error"]
    assert err["code"] == "request_timeout" and err["message"]
    assert closed


def test_trickling_body_gets_408_at_the_total_deadline(live):
    host, port = live.extra["slow_body_url"].removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=20)
    sock.sendall(post_head("/tokenize", 1000, live.api_key))
    answer = b""
    try:
        for _ in range(60):  # one byte every 0.4 s: never idle for 1 s, but past the 3 s total deadline
            try:
                sock.sendall(b" ")
            except OSError:
                break
            sock.settimeout(0.4)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            answer += chunk
            if not chunk or b"\r\n\r\n" in answer:
                break
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


def test_complete_bodies_are_served_under_the_deadlines(live):
    r = httpx.post(live.extra["slow_body_url"] + "/tokenize", headers={"Authorization": f"Bearer {live.api_key}"},
                   json={"model": MODEL, "prompt": "hello"}, timeout=60)
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------------------------- hand-off header
def test_handoff_header_over_tcp_changes_no_counter(live):
    key = f"{live.prefix}:handoff"
    before = live.redis.hgetall(key)
    r = httpx.post(live.base_url + "/tokenize", headers={"Authorization": f"Bearer {live.api_key}",
                                                          "X-LLMP-Handed-Off": "1"},
                   json={"model": MODEL, "prompt": "hello"}, timeout=60)
    assert r.status_code == 200, r.text
    unauth = httpx.post(live.base_url + "/tokenize", headers={"X-LLMP-Handed-Off": "1"},
                        json={"model": MODEL, "prompt": "hello"}, timeout=60)
    assert unauth.status_code == 401
    assert live.redis.hgetall(key) == before


# ------------------------------------------------------------------------------------------------ key limits
CHAT = [{"role": "user", "content": "hi"}]
ROUTES = {
    "tokenize": ("/tokenize", {"model": MODEL, "prompt": "hello"}),
    "tokenize-chat": ("/tokenize", {"model": MODEL, "messages": CHAT}),
    "detokenize": ("/detokenize", {"model": MODEL, "tokens": [1, 2, 3]}),
    "chat-render": ("/v1/chat/completions/render", {"model": MODEL, "messages": CHAT, "max_tokens": 2}),
    "completions-render": ("/v1/completions/render", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    "abort": ("/inference/v1/abort_requests", {"request_ids": ["x"]}),
    "generate": ("/inference/v1/generate", {"model": MODEL, "token_ids": [1, 2, 3],
                                            "sampling_params": {"max_tokens": 2}}),
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    "embeddings": ("/v1/embeddings", {"model": EMBED_MODEL, "input": "hello"}),
}


def post(live, key: str, route: str) -> httpx.Response:
    path, body = ROUTES[route]
    return httpx.post(live.base_url + path, headers={"Authorization": f"Bearer {key}"}, json=body, timeout=60)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_rpm_limit_applies_to_every_keyed_route(live, route):
    key = limited_key(live, rpm_limit=1)
    first = post(live, key, route)
    assert first.status_code != 429, first.text
    second = post(live, key, route)
    assert second.status_code == 429, second.text
    err = second.json()["error"]
    assert err["type"] == "rate_limit_error" and int(second.headers["retry-after"]) >= 1


def render_tasks(live) -> int:
    return int(live.redis.get(render_tasks_counter_key(live.prefix)) or 0)


def test_over_limit_key_publishes_no_render_task(live):
    key = limited_key(live, rpm_limit=1)
    before = render_tasks(live)
    assert post(live, key, "chat-render").status_code == 200
    assert render_tasks(live) == before + 1  # the worker counts the task it answered
    refused = [post(live, key, r) for r in ("chat-render", "chat", "tokenize-chat", "chat-render", "chat")]
    # a body the renderer would refuse (400) is refused by the limit first (429), without a render task
    bad = httpx.post(live.base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                           "chat_template": "{{ messages }}"}, timeout=60)  # not allowed for this model: 400
    assert [r.status_code for r in refused] == [429] * 5, [r.text for r in refused]
    assert bad.status_code == 429, bad.text
    time.sleep(2)  # a task published by mistake would be answered (and counted) by now
    assert render_tasks(live) == before + 1


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_limits_are_given_back_on_every_exit(live, route):
    key = limited_key(live, max_concurrent_requests=1)
    codes = [post(live, key, route).status_code for _ in range(3)]
    assert 429 not in codes, codes
