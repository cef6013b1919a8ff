"""The front api hands image requests to a multimodal api process over a unix socket (gateway/handoff.py), as
``manage.py serve`` runs them: answers, streams, errors and disconnects behave as if the front had served the
request; a multimodal api that is down is covered by the front; text requests never leave the front."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import httpx
import openai
import pytest

from inference.api import admission as adm
from ops.supervisor import unix_socket_accepts, wait_until
from harness.assets import VL_MODEL
from tests.engine_tap import EngineTap, assert_engine_aborted
from harness.images import data_url, image_bytes
from tests.multimodal.servers import wait_server_read

IMAGE_TOKEN = 151655


def _start_mm_api(live, sock: str):
    if os.path.exists(sock):
        os.unlink(sock)
    child = live.sup.start("api-mm-handoff", [sys.executable, "-m", "uvicorn", "config.asgi:application", "--uds",
                                              sock, "--no-access-log"])
    wait_until(lambda: unix_socket_accepts(sock), 60, "multimodal api socket", live.sup)
    return child


def stop_child(live, child, sig=signal.SIGTERM) -> None:
    """Send ``sig`` to ``child``'s process group and wait (30 s at most) for it to exit; one that does not is
    failed with its stacks (SIGUSR2: faulthandler in every api process) and the end of its log."""
    try:
        os.killpg(child.proc.pid, sig)
    except ProcessLookupError:
        pass
    try:
        child.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        fail_with_stacks(child)
    live.sup.children.remove(child)


def fail_with_stacks(child) -> None:
    """Dump the stacks of ``child``'s process group to its log (SIGUSR2), kill the group and fail the test with
    the end of that log: a process that would not stop shows where it was."""
    try:
        os.killpg(child.proc.pid, signal.SIGUSR2)
        time.sleep(1.0)
        os.killpg(child.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.proc.wait(timeout=10)
    tail = child.log_path.read_text(errors="replace")[-12000:]
    raise AssertionError(f"{child.name} did not exit 30 s after it was told to; the end of its log:\n{tail}")


@pytest.fixture(scope="module")
def split(live_vl, tmp_path_factory):
    """``(front base URL, socket path, holder of the multimodal api child)`` over ``live_vl``'s workers/engines."""
    sock = str(tmp_path_factory.mktemp("mm-sock") / "mm.sock")
    holder = {"mm": _start_mm_api(live_vl, sock)}
    front, base = live_vl.start_api("api-front", env_extra={"MULTIMODAL_API_SOCKET": sock})
    yield base, sock, holder
    stop_child(live_vl, front)
    if holder["mm"] in live_vl.sup.children:
        stop_child(live_vl, holder["mm"])


def handoffs(live) -> dict[str, int]:
    raw = live.redis.hgetall(f"{live.prefix}:handoff")
    return {k.decode(): int(v) for k, v in raw.items()}


def delta(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in ("forwarded", "fallback", "failed")}


def admission_idle(live) -> bool:
    snap = adm.model_snapshot(live.redis, live.prefix, VL_MODEL)
    return (snap["queued_reqs"], snap["queued_tokens"]) == (0, 0)


def engine_idle(live) -> bool:
    return all(s.num_running == 0 and s.num_waiting == 0 for s in live.replicas(VL_MODEL))


LONG = 800  # max_tokens of the long streams (max_model_len 1024): with ignore_eos only an abort ends them sooner


def open_stream_and_read_two_events(http: httpx.Client, base: str, key: str, seed: int, request_id: str = ""):
    """Start a long streamed image chat through ``base`` (``X-Request-Id: request_id`` when given); returns
    ``(response context, line iterator)`` after two events arrived (the caller closes the context)."""
    body = {"model": VL_MODEL, "messages": image_messages(seed), "max_tokens": LONG, "stream": True, "ignore_eos": True}
    ctx = http.stream("POST", base + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {key}", **({"X-Request-Id": request_id} if request_id else {})})
    resp = ctx.__enter__()
    assert resp.status_code == 200
    lines = resp.iter_lines()  # pulled with next(): breaking a for loop would close the stream
    got = 0
    while got < 2:
        got += next(lines).startswith("data: ")
    return ctx, lines


def image_messages(seed: int, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                         {"type": "image_url", "image_url": {"url": data_url(image_bytes(seed=seed))}}]}]


def post(base: str, key: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_image_chat_is_served_by_the_multimodal_api_and_text_stays(live_vl, split):
    base, _sock, _h = split
    client = openai.OpenAI(base_url=base + "/v1", api_key=live_vl.api_key, max_retries=0)
    before = handoffs(live_vl)
    resp = client.chat.completions.create(model=VL_MODEL, messages=image_messages(31), max_tokens=3, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert resp.choices[0].message.content is not None and resp.usage.completion_tokens >= 1
    assert resp.model_extra["prompt_token_ids"].count(IMAGE_TOKEN) == 6
    assert delta(before, handoffs(live_vl)) == {"forwarded": 1, "fallback": 0, "failed": 0}
    # the same image request straight to an api without a multimodal api gives the same prompt
    direct = post(live_vl.base_url, live_vl.api_key, "/v1/chat/completions", {
        "model": VL_MODEL, "messages": image_messages(31), "max_tokens": 1, "return_token_ids": True})
    assert direct.json()["prompt_token_ids"] == resp.model_extra["prompt_token_ids"]
    # text chats and text /tokenize stay on the front api
    before = handoffs(live_vl)
    text = client.chat.completions.create(model=VL_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert text.usage.completion_tokens >= 1
    tok = post(base, live_vl.api_key, "/tokenize", {"model": VL_MODEL, "prompt": "hello"})
    assert tok.status_code == 200
    assert delta(before, handoffs(live_vl)) == {"forwarded": 0, "fallback": 0, "failed": 0}
    # the operator sees the counts in /metrics
    metrics_key = live_vl.new_key(scopes="metrics")
    text_metrics = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {metrics_key}"}).text
    assert f'gateway_handoffs_total{{outcome="forwarded"}} {float(handoffs(live_vl)["forwarded"])}' in text_metrics


def assert_same_answer(live, base: str, path: str, body: dict) -> None:
    """``body`` posted to ``base`` gets the status and JSON (request ids aside) an api serving it itself gives."""
    via_front = post(base, live.api_key, path, body)
    direct = post(live.base_url, live.api_key, path, body)
    assert via_front.status_code == direct.status_code, via_front.text
    a, b = via_front.json(), direct.json()
    if isinstance(a, dict):
        a.pop("request_id", None), b.pop("request_id", None)
    assert a == b


def stream_image_chat(base: str, key: str, messages: list[dict]) -> None:
    """Stream a 5-token image chat through ``base`` with the official client and check the whole stream."""
    with openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0) as client:
        chunks = list(client.chat.completions.create(model=VL_MODEL, messages=messages, max_tokens=5, stream=True,
                                                     stream_options={"include_usage": True},
                                                     extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens > 6


def test_streamed_image_chat_through_the_front(live_vl, split):
    base, _sock, _h = split
    before = handoffs(live_vl)
    stream_image_chat(base, live_vl.api_key, image_messages(32))
    assert delta(before, handoffs(live_vl))["forwarded"] == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/chat/completions/render"])
def test_forwarded_answers_equal_direct_ones(live_vl, split, path):
    """Errors (status, envelope, headers) and results are the multimodal api's, byte for byte."""
    base, _sock, _h = split
    bad = {"model": VL_MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image_bytes("PNG")[:200])}}]}]}
    good = {"model": VL_MODEL, "messages": image_messages(33)}
    for body in (bad, good):
        if path == "/v1/chat/completions" and body is good:
            continue  # generated text and ids differ per request; covered above
        assert_same_answer(live_vl, base, path, body)
    assert post(base, "sk-wrong", path, good).status_code == 401


def test_client_disconnect_aborts_the_forwarded_request(live_vl, split):
    base, _sock, _h = split
    tag = uuid.uuid4().hex[:10]
    with EngineTap(live_vl.redis_url, live_vl.prefix) as tap, httpx.Client(timeout=60) as http:
        ctx, _lines = open_stream_and_read_two_events(http, base, live_vl.api_key, 34, request_id=tag)
        ctx.__exit__(None, None, None)
        # the front closed its connection to the multimodal api, which aborted the engine request: the engine
        # itself ended it with abort before its max_tokens
        assert_engine_aborted(tap, tag, LONG)
    wait_until(lambda: engine_idle(live_vl), 30, "engine idle")
    wait_until(lambda: admission_idle(live_vl), 30, "admission released")


def test_front_serves_images_itself_while_the_multimodal_api_is_down(live_vl, split):
    base, sock, holder = split
    stop_child(live_vl, holder["mm"], signal.SIGKILL)
    before = handoffs(live_vl)
    for seed in (35, 36):
        r = post(base, live_vl.api_key, "/v1/chat/completions", {"model": VL_MODEL, "messages": image_messages(seed),
                                                                  "max_tokens": 1})
        assert r.status_code == 200, r.text
    assert delta(before, handoffs(live_vl)) == {"forwarded": 0, "fallback": 2, "failed": 0}
    holder["mm"] = _start_mm_api(live_vl, sock)
    before = handoffs(live_vl)
    r = post(base, live_vl.api_key, "/v1/chat/completions", {"model": VL_MODEL, "messages": image_messages(37),
                                                              "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert delta(before, handoffs(live_vl)) == {"forwarded": 1, "fallback": 0, "failed": 0}


def test_multimodal_api_killed_mid_stream_ends_the_stream_with_an_error(live_vl, split):
    base, sock, holder = split
    before = handoffs(live_vl)
    with httpx.Client(timeout=60) as http:
        ctx, lines = open_stream_and_read_two_events(http, base, live_vl.api_key, 38)
        try:
            stop_child(live_vl, holder["mm"], signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        finally:
            ctx.__exit__(None, None, None)
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][len("data: "):])
    assert err["error"]["code"] == "upstream_failed", rest[-2]
    assert delta(before, handoffs(live_vl))["failed"] == 1
    # the dead process's engine request does not run on: the engine drops requests of an api that stopped
    # renewing its liveness key; its admission reservation is reaped once the dead process's lease expires
    wait_until(lambda: engine_idle(live_vl), 30, "orphaned engine request dropped")
    wait_until(lambda: admission_idle(live_vl), adm.LEASE_TTL_S + 5, "reservation reaped")
    holder["mm"] = _start_mm_api(live_vl, sock)


def test_oversized_body_is_refused_by_the_front(live_vl, split):
    base, _sock, _h = split
    from gateway.http import MAX_BODY_BYTES

    blob = "A" * (MAX_BODY_BYTES + 10)
    r = httpx.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {live_vl.api_key}",
                                                            "Content-Type": "application/json"},
                   content=('{"model":"' + VL_MODEL + '","messages":[{"role":"user","content":[{"type":"image_url",'
                            '"image_url":{"url":"data:image/png;base64,' + blob + '"}}]}]}').encode(), timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_large_body_streamed_through_the_front(live_vl, split):
    """A 4 MB image body goes on to the multimodal api as it arrives; the answer equals a direct one."""
    base, _sock, _h = split
    body = {"model": VL_MODEL, "max_tokens": 1, "return_token_ids": True, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image_bytes(size=(1200, 900), seed=39))}},
        {"type": "text", "text": "describe"}]}]}
    before = handoffs(live_vl)
    via_front = post(base, live_vl.api_key, "/v1/chat/completions", body)
    assert via_front.status_code == 200, via_front.text
    assert delta(before, handoffs(live_vl))["forwarded"] == 1
    direct = post(live_vl.base_url, live_vl.api_key, "/v1/chat/completions", body)
    assert direct.json()["prompt_token_ids"] == via_front.json()["prompt_token_ids"]


def test_marker_split_across_body_chunks_is_found(live_vl, split):
    """The client's body arrives in three pieces cut inside both ``"image_url"`` of the image part: the request is
    still handed off."""
    base, _sock, _h = split
    raw = json.dumps({"model": VL_MODEL, "max_tokens": 1, "messages": image_messages(40)}).encode()
    first = raw.index(b'"image_url"')
    cuts = [first + 5, raw.index(b'"image_url"', first + 1) + 5]
    assert raw.count(b'"image_url"') == 2
    port = int(base.rsplit(":", 1)[1])
    before = handoffs(live_vl)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + live_vl.api_key.encode() + b"\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw[:cuts[0]])
        wait_server_read(conn)  # the front has read the first piece (a separate ASGI body message)
        conn.sendall(raw[cuts[0]:cuts[1]])
        wait_server_read(conn)
        conn.sendall(raw[cuts[1]:])
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
    assert delta(before, handoffs(live_vl))["forwarded"] == 1


def test_client_leaving_during_the_body_upload_leaves_nothing_behind(live_vl, split):
    base, _sock, _h = split
    raw = json.dumps({"model": VL_MODEL, "max_tokens": 1, "messages": image_messages(41)}).encode()
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + live_vl.api_key.encode() + b"\r\n"
                     b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw[: len(raw) // 2])
        wait_server_read(conn)  # the front holds half a body when the client leaves
    # the front and the multimodal api still answer, and no admission reservation is left
    r = post(base, live_vl.api_key, "/v1/chat/completions", {"model": VL_MODEL, "messages": image_messages(42),
                                                              "max_tokens": 1})
    assert r.status_code == 200, r.text
    wait_until(lambda: admission_idle(live_vl), 5, "admission idle")


def test_handed_off_requests_are_authenticated_by_the_multimodal_api(live_vl, split):
    """On the multimodal api's unix socket the hand-off header is believed (the request counts as forwarded), yet it
    never stands in for a key: a relayed request with a wrong key is refused there with 401, and not counted."""
    _base, sock, _h = split
    body = {"model": VL_MODEL, "messages": image_messages(34)}
    before = handoffs(live_vl)
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=60) as http:
        wrong = http.post("http://mm-api/tokenize", json=body,
                          headers={"Authorization": "Bearer sk-wrong", "X-LLMP-Handed-Off": "1"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        ok = http.post("http://mm-api/tokenize", json=body,
                       headers={"Authorization": f"Bearer {live_vl.api_key}", "X-LLMP-Handed-Off": "1"})
        assert ok.status_code == 200, ok.text
    assert handoffs(live_vl).get("forwarded", 0) - before.get("forwarded", 0) == 1
